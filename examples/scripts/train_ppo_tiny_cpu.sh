#!/usr/bin/env bash
# The tiny CPU demo: builds the offline tiny world, then trains it with openrlhf-ess through upstream's
# real Ray + DeepSpeed + vLLM (CPU) pipeline. 2 cores, no GPU, no network.
#   bash examples/scripts/train_ppo_tiny_cpu.sh [extra flags...]
# What our users run: asynchronous training (generation runs up to 2 batches ahead of training) with partial
# rollouts (a response can span weight syncs), and the corrections docs/staleness.md recommends at that depth:
# TIS (--algo.tis_cap 2); ESS-LR is on as the staleness monitor (rho = ESS/B logged every step; it lowers the LR
# only when a few samples dominate). Extra flags are passed through, e.g. --train.async_queue_size 8
# --algo.prox_mode snapshot --algo.prox_snapshots 10 for a deep queue (docs/staleness_target.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
source scripts/env_cpu.sh

RUN_DIR=${RUN_DIR:-$ROOT/runs/tiny_cpu}
WORLD=$RUN_DIR/world
source examples/scripts/_tiny_cpu_base.sh
mkdir -p "$RUN_DIR"
python -m openrlhf_ess.tiny.world "$WORLD" --seed 0 --n_prompts ${N_PROMPTS:-64} > "$RUN_DIR/world.json"

args=(
   --actor.model_name_or_path "$WORLD/model"
   --data.prompt_dataset "$WORLD/prompts.jsonl"
   --data.input_key input
   --data.label_key label
   --reward.remote_url "$ROOT/openrlhf_ess/tiny/reward.py"
   --algo.advantage.estimator reinforce_baseline
   --algo.kl.init_coef 0
   --rollout.batch_size 8
   --rollout.n_samples_per_prompt 4
   --rollout.micro_batch_size 8
   --train.batch_size 32
   --train.micro_batch_size 8
   --rollout.max_new_tokens 16
   --data.max_len 64
   --rollout.temperature 1.0
   --train.num_episodes ${EPISODES:-12}
   --actor.adam.lr 1e-3
   --train.seed 42
   --train.async_enable
   --train.partial_rollout_enable
   --train.async_queue_size 2
   --algo.tis_cap 2
   --algo.ess_lr_enable
   --logger.wandb.run_name tiny_cpu
   "${tiny_engine_args[@]}"
   "${tiny_deepspeed_args[@]}"
   "${tiny_output_args[@]}"
)

rm -rf "$RUN_DIR/tensorboard"
python -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@" 2>&1 | tee "$RUN_DIR/train.log"
echo
python -m openrlhf_ess.tools.summary "$RUN_DIR/tensorboard"
python -m openrlhf_ess.tools.plots "$RUN_DIR/tensorboard" "$RUN_DIR/plots"
echo "logs:        $RUN_DIR/train.log"
echo "tensorboard: $RUN_DIR/tensorboard   (tensorboard --logdir $RUN_DIR/tensorboard)"
echo "plots:       $RUN_DIR/plots"
echo "model:       $RUN_DIR/ckpt"
