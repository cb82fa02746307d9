#!/usr/bin/env bash
# RLVR on the tiny world (docs/rlvr_task.md): two-digit addition ("47+38=" -> "85"), exact-match reward (1 right,
# 0 wrong), a model warm-started to ~15-30 % greedy accuracy, a held-out eval every EVAL_STEPS steps. Synchronous
# GRPO through the real Ray + DeepSpeed + vLLM (CPU) pipeline; 2 cores, no GPU, no network.
#   bash examples/scripts/train_rlvr_tiny_cpu.sh [extra flags...]
# SEED picks the warm-started model (built once, ~10-30 s, then reused); STEPS the number of training steps
# (8 prompts each). Extra flags are passed through, e.g. --train.async_enable --train.async_queue_size 2
# --train.partial_rollout_enable --algo.tis_cap 2 to train the same task asynchronously.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
source scripts/env_cpu.sh

SEED=${SEED:-0}
STEPS=${STEPS:-200}
PROMPTS=${PROMPTS:-32}
EVAL_STEPS=${EVAL_STEPS:-25}
RUN_DIR=${RUN_DIR:-$ROOT/runs/tiny_rlvr/seed$SEED}
WORLD=${WORLD:-$ROOT/runs/tiny_rlvr/world}
mkdir -p "$RUN_DIR"
python -m openrlhf_ess.tiny.rlvr "$WORLD" --seed "$SEED" --n_train $((STEPS * PROMPTS)) > "$RUN_DIR/world.json"
# the build's JSON line (imports may print a log line before it)
WORLD_JSON=$(grep '^{' "$RUN_DIR/world.json" | tail -n 1)
field() { python -c "import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$WORLD_JSON" "$1"; }

args=(
   --actor.model_name_or_path "$(field model)"
   --data.prompt_dataset "$(field prompts)"
   --data.input_key input
   --data.label_key label
   --data.max_samples $((STEPS * PROMPTS))
   --eval.dataset "$(field eval)"
   --eval.steps "$EVAL_STEPS"
   --eval.temperature 1.0
   --eval.n_samples_per_prompt 4
   --reward.remote_url "$(field reward)"
   --algo.advantage.estimator group_norm
   --algo.kl.init_coef 0
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1
   --vllm.num_engines 1
   --vllm.tensor_parallel_size 1
   --vllm.enforce_eager
   --vllm.cpu_kv_cache_gb 0.0625
   --rollout.batch_size "$PROMPTS"
   --rollout.n_samples_per_prompt 8
   --rollout.micro_batch_size 64
   --train.batch_size $((PROMPTS * 8))
   --train.micro_batch_size 64
   --rollout.max_new_tokens 6
   --data.max_len 64
   --rollout.temperature 1.0
   --train.num_episodes 1
   --actor.adam.lr ${LR:-1e-4}
   --actor.lr_warmup_ratio 0
   --actor.lr_scheduler constant
   --ds.zero_stage 2
   --ds.param_dtype bf16
   --ds.attn_implementation sdpa
   --train.seed 42
   --ckpt.best_metric_key none
   --ckpt.output_dir "$RUN_DIR/ckpt"
   --ckpt.path "$RUN_DIR/ckpt/checkpoints"
   --logger.tensorboard_dir "$RUN_DIR/tensorboard"
   --logger.wandb.run_name tiny_rlvr
)

rm -rf "$RUN_DIR/tensorboard"
python -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@" 2>&1 | tee "$RUN_DIR/train.log"
echo
python -c "import json, sys; w = json.loads(sys.argv[1])['warm_start']; print('warm start: greedy eval', \
round(w['eval_greedy_acc'], 3), 'sampled', round(w['eval_sampled_acc'], 3))" "$WORLD_JSON"
python -m openrlhf_ess.tools.summary "$RUN_DIR/tensorboard"
echo "logs:        $RUN_DIR/train.log"
echo "tensorboard: $RUN_DIR/tensorboard"
