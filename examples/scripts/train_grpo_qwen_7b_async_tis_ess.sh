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

MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
REWARD=${REWARD:-examples/python/reward_func.py}   # your reward_func(queries, prompts, labels)
SAVE=${SAVE:-./checkpoint/qwen7b-grpo-async-tis-ess}

args=(
   # models and data
   --actor.model_name_or_path "$MODEL"
   --data.prompt_dataset "$DATA"
   --data.input_key context_messages
   --data.apply_chat_template
   --reward.remote_url "$REWARD"
   # placement
   --actor.num_nodes 1
   --actor.num_gpus_per_node 4
   --ref.num_nodes 1
   --ref.num_gpus_per_node 4
   --train.colocate_actor_ref
   --vllm.num_engines 4
   --vllm.tensor_parallel_size 1
   --vllm.gpu_memory_utilization 0.85
   # async with partial rollouts: generation overlaps training, in-flight samples span versions
   --train.async_enable
   --train.async_queue_size 2
   --train.partial_rollout_enable
   # off-policy corrections (openrlhf-ess)
   --algo.tis_cap 2
   --algo.ess_lr_enable
   --algo.ess_lr_floor 0.1
   --algo.max_version_lag 4
   --algo.kl.off_policy_k2_enable
   # GRPO
   --algo.advantage.estimator group_norm
   --rollout.n_samples_per_prompt 8
   --rollout.batch_size 128
   --rollout.micro_batch_size 8
   --train.batch_size 256
   --train.micro_batch_size 4
   --rollout.max_new_tokens 2048
   --data.max_len 4096
   --rollout.temperature 1.0
   --algo.kl.use_loss
   --algo.kl.estimator k3
   --algo.kl.init_coef 1e-3
   --actor.adam.lr 1e-6
   # DeepSpeed
   --ds.zero_stage 3
   --ds.param_dtype bf16
   --ds.attn_implementation flash_attention_2
   --actor.gradient_checkpointing_enable
   # logging and checkpoints
   --ckpt.output_dir "$SAVE"
   --ckpt.path "$SAVE/ckpt"
   --ckpt.save_steps 20
   --logger.tensorboard_dir "$SAVE/tensorboard"
)

python3 -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@"
