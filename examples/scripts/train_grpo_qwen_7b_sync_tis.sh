#!/usr/bin/env bash
# GPU recipe: GRPO on a 7B model, synchronous (generate, then train, then sync weights), with truncated IS.
# One node, 8 GPUs: 4 vLLM engines (TP 1) + 4 actor GPUs (reference model colocated with the actor).
#
# The CLI starts its own Ray instance on this node (no `ray start` needed); on a running cluster, add
# --ray.address auto.
#
# Synchronous training has no staleness: every token is sampled by the weights being trained, so ESS LR
# scaling, a version-lag bound and the off-policy k2 KL have nothing to correct here. What remains is the
# train/inference mismatch: the engines sample in bf16 with vLLM's kernels, the trainer scores with its own.
#   --vllm.dtype bfloat16             the engines' dtype (upstream's default, spelled out): the source of the
#                                     mismatch that TIS corrects; float32 engines would shrink it at 2x memory.
#   --algo.tis_cap 2                  weight each token by min(pi_prox/mu, 2): unbiased up to the cap, bounded
#                                     variance (watch train/tis/clip_frac and train/mismatch/*).
#   --algo.tis_level token            per-token ratio, through upstream's PolicyLoss is_correction clip mode
#                                     (seq would use one geometric-mean weight per response).
# Plots afterwards: python -m openrlhf_ess.tools.plots "$SAVE/tensorboard" "$SAVE/plots"
set -x

SAVE=${SAVE:-./checkpoint/qwen7b-grpo-sync-tis}
source "$(dirname "${BASH_SOURCE[0]}")/_grpo_7b_base.sh"

args=(
   "${data_args[@]}"
   "${placement_args[@]}"
   --vllm.dtype bfloat16
   # train/inference mismatch correction (openrlhf-ess)
   --algo.tis_cap 2
   --algo.tis_level token
   "${grpo_args[@]}"
   "${deepspeed_args[@]}"
   "${logging_args[@]}"
)

python3 -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@"
