#!/usr/bin/env bash
# GPU recipe: GRPO on a 32B model over 2 nodes x 8 GPUs with Ray, async + partial rollouts + TIS + ESS LR.
# Placement (16 GPUs): actor on 2 x 4 GPUs, ZeRO-3 with Adam states offloaded to host memory; 2 vLLM engines
# with tensor parallel 4 (one node's worth). No reference model: --algo.kl.init_coef 0 (no KL term), which
# frees 8 GPUs' share of 32B weights; add --algo.kl.use_loss, a positive init_coef,
# --algo.kl.off_policy_k2_enable and the --ref.* placement flags to train with a KL loss.
#
# Set-up: every node runs the same environment (dockerfile/Dockerfile) and sees the model, data, reward file
# and $SAVE at the same paths (a shared filesystem). Then:
#   node 1 (head):   ray start --head --node-ip-address "$HEAD" --port 6379 --dashboard-host 0.0.0.0 --num-gpus 8
#   node 2:          ray start --address "$HEAD:6379" --num-gpus 8
#   node 1:          HEAD=<node 1 ip> bash examples/scripts/train_grpo_qwen_32b_multinode_async.sh
# which runs
#   ray job submit --address http://$HEAD:8265 -- python3 -m openrlhf_ess.cli.train_ppo_ray ... --ray.address auto
#
# Why each correction (rollouts are sampled by up to 3 weight versions: queue 2 + partial rollouts):
#   --train.async_enable, --train.async_queue_size 2, --train.partial_rollout_enable
#                                     generation of a 32B model dominates the step; overlapping it with
#                                     training is the point of this layout, and it makes the data off-policy.
#   --algo.tis_cap 2                  weight tokens by min(pi_prox/mu, 2): corrects the vLLM (bf16, TP 4) vs
#                                     trainer mismatch with bounded variance.
#   --algo.ess_lr_enable              shrink the LR by sqrt(ESS/B) when a few stale trajectories dominate a
#   --algo.ess_lr_floor 0.1           rollout; never below 0.1x (watch train/rho_ess and train/lr_scale).
# Keep --rollout.top_p 1 (the default): truncated sampling makes pi_prox/mu systematically < 1.
# Plots afterwards: python -m openrlhf_ess.tools.plots "$SAVE/tensorboard" "$SAVE/plots"
set -x

HEAD=${HEAD:-127.0.0.1}                                  # the head node's address (dashboard on port 8265)
MODEL=${MODEL:-Qwen/Qwen2.5-32B-Instruct}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
REWARD=${REWARD:-$PWD/examples/python/reward_func.py}    # absolute: Ray actors may run on either node
SAVE=${SAVE:-/mnt/shared/checkpoint/qwen32b-grpo-async}  # on the shared filesystem

args=(
   # models and data
   --actor.model_name_or_path "$MODEL"
   --data.prompt_dataset "$DATA"
   --data.input_key context_messages
   --data.apply_chat_template
   --reward.remote_url "$REWARD"
   # cluster: join the Ray cluster the job was submitted to
   --ray.address auto
   # placement: 8 actor GPUs over 2 nodes, 2 engines x TP 4
   --actor.num_nodes 2
   --actor.num_gpus_per_node 4
   --vllm.num_engines 2
   --vllm.tensor_parallel_size 4
   --vllm.gpu_memory_utilization 0.85
   # async with partial rollouts
   --train.async_enable
   --train.async_queue_size 2
   --train.partial_rollout_enable
   # off-policy corrections (openrlhf-ess)
   --algo.tis_cap 2
   --algo.ess_lr_enable
   --algo.ess_lr_floor 0.1
   # GRPO
   --algo.advantage.estimator group_norm
   --algo.kl.init_coef 0
   --rollout.n_samples_per_prompt 8
   --rollout.batch_size 64
   --rollout.micro_batch_size 4
   --train.batch_size 256
   --train.micro_batch_size 1
   --rollout.max_new_tokens 4096
   --data.max_len 6144
   --rollout.temperature 1.0
   --actor.adam.lr 5e-7
   # DeepSpeed
   --ds.zero_stage 3
   --ds.adam_offload
   --ds.param_dtype bf16
   --ds.attn_implementation flash_attention_2
   --actor.gradient_checkpointing_enable
   # logging and checkpoints
   --ckpt.output_dir "$SAVE"
   --ckpt.path "$SAVE/ckpt"
   --ckpt.save_steps 20
   --logger.tensorboard_dir "$SAVE/tensorboard"
)

ray job submit --address "http://$HEAD:8265" -- python3 -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@"
