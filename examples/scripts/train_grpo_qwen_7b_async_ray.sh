#!/usr/bin/env bash
# GPU recipe: GRPO on a 7B model with async training and partial rollouts, through openrlhf-ess.
# One node, 8 GPUs: 4 vLLM engines + 4 actor GPUs.
# The CLI starts its own Ray instance on this node (no `ray start` needed); on a running cluster, add
# --ray.address auto.
# With no openrlhf-ess flag set this is exactly upstream's job; the correction recipes add flags on top.
set -x

SAVE=${SAVE:-./checkpoint/qwen7b-grpo-async}
source "$(dirname "${BASH_SOURCE[0]}")/_grpo_7b_base.sh"

args=(
   "${data_args[@]}"
   "${placement_args[@]}"
   "${async_args[@]}"
   "${grpo_args[@]}"
   "${deepspeed_args[@]}"
   "${logging_args[@]}"
)

python3 -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@"
