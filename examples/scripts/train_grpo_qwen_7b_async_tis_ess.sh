#!/usr/bin/env bash
# GPU recipe: GRPO on a 7B model, async training with partial rollouts, plus the openrlhf-ess corrections.
# One node, 8 GPUs: 4 vLLM engines (TP 1) + 4 actor GPUs (reference model colocated with the actor).
#
# The CLI starts its own Ray instance on this node (no `ray start` needed); on a running cluster, add
# --ray.address auto. The job is train_grpo_qwen_7b_async_ray.sh with the flags
# of the "off-policy corrections" block added; docs/off_policy.md, docs/ess_lr.md and docs/prox_modes.md
# give the maths and metrics of each flag.
#
# Why each correction (rollouts here are sampled by up to 3 weight versions: queue 2 + partial rollouts):
#   --train.async_queue_size 2        two rollouts in flight: more overlap of generation and training, more lag.
#   --algo.tis_cap 2                  weight tokens by min(pi_prox/mu, 2): corrects the vLLM-vs-trainer
#                                     mismatch (bf16 kernels) without letting rare tokens blow up the update.
#   --algo.ess_lr_enable              shrink the LR by sqrt(ESS/B) when a few stale trajectories dominate the
#   --algo.ess_lr_floor 0.1           batch; never below 0.1x (watch train/rho_ess and train/lr_scale).
#   --algo.max_version_lag 4          mask tokens more than 4 syncs old. A backstop: at queue 2 + partial
#                                     rollouts the lag is at most 3, so it only bites if you deepen the queue.
#   --algo.kl.off_policy_k2_enable    the KL loss (--algo.kl.use_loss) gets the unbiased reverse-KL gradient
#                                     under off-policy sampling (k2 weighted by the decoupled IS weight);
#                                     the logged kl stays k3.
# Keep --rollout.top_p 1 (the default): truncated sampling makes pi_prox/mu systematically < 1.
# Plots afterwards: python -m openrlhf_ess.tools.plots "$SAVE/tensorboard" "$SAVE/plots"
set -x

SAVE=${SAVE:-./checkpoint/qwen7b-grpo-async-tis-ess}
source "$(dirname "${BASH_SOURCE[0]}")/_grpo_7b_base.sh"

args=(
   "${data_args[@]}"
   "${placement_args[@]}"
   "${async_args[@]}"
   # off-policy corrections (openrlhf-ess)
   --algo.tis_cap 2
   --algo.ess_lr_enable
   --algo.ess_lr_floor 0.1
   --algo.max_version_lag 4
   --algo.kl.off_policy_k2_enable
   "${grpo_args[@]}"
   "${deepspeed_args[@]}"
   "${logging_args[@]}"
)

python3 -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@"
