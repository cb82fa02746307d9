#!/usr/bin/env bash
# GPU recipe: GRPO on a 7B model, async training with partial rollouts, VCPO in full (arXiv 2602.17616).
# One node, 8 GPUs: 4 vLLM engines (TP 1) + 4 actor GPUs (reference model colocated with the actor).
#
# The CLI starts its own Ray instance on this node (no `ray start` needed); on a running cluster, add
# --ray.address auto.
# The job is train_grpo_qwen_7b_async_ray.sh with VCPO's two halves added (docs/opob.md, docs/ess_lr.md):
#
#   --algo.vcpo_enable               ESS-guided LR (--algo.ess_lr_enable: the actor LR x clamp(sqrt(ESS/B), 0.1, 1)
#                                    once per rollout) and the off-policy optimal baseline (--algo.advantage.baseline
#                                    opob: per prompt group b* = sum w^2 |g|^2 R / sum w^2 |g|^2, |g| the LM head's
#                                    per-sample gradient norm from the old-log-prob forward, no backward).
#   --algo.tis_cap 2                 the IS weight both use, truncated at 2 ...
#   --algo.tis_level seq             ... per sequence: w_i = min(exp(mean_t log pi_prox/mu), 2), as in the paper.
#   --train.async_queue_size 2       two rollouts in flight (lag up to 3 with partial rollouts).
#
# Cost of the baseline: per response of A tokens, A^2 x V multiply-adds in the old-log-prob forward and a few A x A
# fp32 matrices (64 MiB each at A = 4096); the training step is unchanged (docs/opob_cost.md).
# What it bought on our CPU experiments, and when to prefer a shorter queue: docs/staleness.md ("What to turn on").
# Watch train/opob/baseline, train/opob/grad_norm_rel_spread, train/rho_ess and train/lr_scale.
set -x

MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
REWARD=${REWARD:-examples/python/reward_func.py}   # your reward_func(queries, prompts, labels)
SAVE=${SAVE:-./checkpoint/qwen7b-grpo-async-vcpo}

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
   # VCPO (openrlhf-ess): ESS-LR + the off-policy optimal baseline, sequence-level truncated IS
   --algo.vcpo_enable
   --algo.tis_cap 2
   --algo.tis_level seq
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
