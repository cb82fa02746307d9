#!/usr/bin/env bash
# RLVR on the tiny world (docs/rlvr_task.md): two-digit addition ("47+38=" -> "85"), exact-match reward (1 right,
# 0 wrong), a model warm-started to ~62 % greedy / ~26 % sampled accuracy, and the held-out accuracy at the
# rollout temperature every EVAL_STEPS steps. Synchronous GRPO through the real Ray + DeepSpeed + vLLM (CPU)
# pipeline; 2 cores, no GPU, no network; ~10 minutes.
#   bash examples/scripts/train_rlvr_tiny_cpu.sh [extra flags...]
# SEED picks the warm-started model (built once, ~15 s, then reused); STEPS the number of training steps of
# PROMPTS prompts x SAMPLES samples (200 x 32 x 32: every prompt seen once). N_EVAL, WARM_TARGET and
# WARM_CHECK_EVERY pick the eval set and the warm start (docs/rlvr_task.md). Extra flags are passed through, e.g.
# --train.async_enable --train.async_queue_size 8 --train.partial_rollout_enable --algo.tis_cap 2 to train the
# same task asynchronously (docs/rlvr_grid.md compares the corrections).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
source scripts/env_cpu.sh

SEED=${SEED:-0}
STEPS=${STEPS:-200}
PROMPTS=${PROMPTS:-32}
SAMPLES=${SAMPLES:-32}
EVAL_STEPS=${EVAL_STEPS:-25}
N_EVAL=${N_EVAL:-800}              # held-out unordered pairs, both orders asked (800: 1,589 problems)
WARM_TARGET=${WARM_TARGET:-}       # warm start: stop at this dev greedy accuracy (empty: WarmStart's default)
WARM_CHECK_EVERY=${WARM_CHECK_EVERY:-}  # warm start: steps between dev checks (empty: WarmStart's default)
RUN_DIR=${RUN_DIR:-$ROOT/runs/tiny_rlvr/seed$SEED}
WORLD=${WORLD:-$ROOT/runs/tiny_rlvr/world}
source examples/scripts/_tiny_cpu_base.sh
mkdir -p "$RUN_DIR"
python -m openrlhf_ess.tiny.rlvr "$WORLD" --seed "$SEED" --n_train $((STEPS * PROMPTS)) --n_eval "$N_EVAL" \
    ${WARM_TARGET:+--target_acc "$WARM_TARGET"} ${WARM_CHECK_EVERY:+--check_every "$WARM_CHECK_EVERY"} \
    > "$RUN_DIR/world.json"
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
   --rollout.batch_size "$PROMPTS"
   --rollout.n_samples_per_prompt "$SAMPLES"
   --rollout.micro_batch_size 64
   --train.batch_size $((PROMPTS * SAMPLES))
   --train.micro_batch_size 64
   --rollout.max_new_tokens 6
   --data.max_len 64
   --rollout.temperature 1.0
   --train.num_episodes 1
   --actor.adam.lr ${LR:-2e-4}
   --train.seed 42
   --ckpt.best_metric_key none
   --logger.wandb.run_name tiny_rlvr
   "${tiny_engine_args[@]}"
   "${tiny_deepspeed_args[@]}"
   "${tiny_output_args[@]}"
)

rm -rf "$RUN_DIR/tensorboard"
python -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@" 2>&1 | tee "$RUN_DIR/train.log"
echo
python -c "import json, sys; w = json.loads(sys.argv[1])['warm_start']; print('warm start: greedy eval', \
round(w['eval_greedy_acc'], 3), 'sampled', round(w['eval_sampled_acc'], 3))" "$WORLD_JSON"
python -m openrlhf_ess.tools.summary "$RUN_DIR/tensorboard"
echo "logs:        $RUN_DIR/train.log"
echo "tensorboard: $RUN_DIR/tensorboard"
