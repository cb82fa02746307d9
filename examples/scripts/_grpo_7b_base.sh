# The flags the 7B GRPO recipes share, in upstream's bash-array layout. Sourced by each recipe (not run on its
# own), after the recipe has set SAVE (and, where its defaults differ, MODEL, DATA or REWARD):
#   source "$(dirname "${BASH_SOURCE[0]}")/_grpo_7b_base.sh"
# Each block is one array; a recipe lists the blocks it takes, in this order, with its own flags between them:
#   args=("${data_args[@]}" "${placement_args[@]}" "${async_args[@]}" <its own> "${grpo_args[@]}"
#         "${deepspeed_args[@]}" "${logging_args[@]}")

MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA=${DATA:-OpenRLHF/prompt-collection-v0.1}
REWARD=${REWARD:-examples/python/reward_func.py}   # your reward_func(queries, prompts, labels)

data_args=(
   # models and data
   --actor.model_name_or_path "$MODEL"
   --data.prompt_dataset "$DATA"
   --data.input_key context_messages
   --data.apply_chat_template
   --reward.remote_url "$REWARD"
)

placement_args=(
   # placement
   --actor.num_nodes 1
   --actor.num_gpus_per_node 4
   --ref.num_nodes 1
   --ref.num_gpus_per_node 4
   --train.colocate_actor_ref
   --vllm.num_engines 4
   --vllm.tensor_parallel_size 1
   --vllm.gpu_memory_utilization 0.85
)

async_args=(
   # async with partial rollouts: generation overlaps training, in-flight samples span versions
   --train.async_enable
   --train.async_queue_size 2
   --train.partial_rollout_enable
)

grpo_args=(
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
)

deepspeed_args=(
   # DeepSpeed
   --ds.zero_stage 3
   --ds.param_dtype bf16
   --ds.attn_implementation flash_attention_2
   --actor.gradient_checkpointing_enable
)

logging_args=(
   # logging and checkpoints
   --ckpt.output_dir "$SAVE"
   --ckpt.path "$SAVE/ckpt"
   --ckpt.save_steps 20
   --logger.tensorboard_dir "$SAVE/tensorboard"
)
