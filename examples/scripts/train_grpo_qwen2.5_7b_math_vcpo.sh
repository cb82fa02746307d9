#!/usr/bin/env bash
# GPU recipe: VCPO as its reference recipe trains Qwen2.5-7B on MATH at staleness 10 (arXiv 2602.17616; the
# reference script is recipe/fully_async_policy/shell/vcpo/math/vcpo_k=10.sh of mit-han-lab/vcpo).
# One node, 8 GPUs: 2 vLLM engines at TP 2 (4 GPUs, the reference's gen_tp=2) + 4 actor GPUs (ZeRO-3 where the
# reference uses Megatron TP 4).
#
# --algo.vcpo_enable sets (docs/opob.md has the table, reference line by line):
#   trajectory-ratio TIS in the loss   w_i = min(exp(sum_t log pi_old/mu), 8)          (rollout_is=sequence, 8.0)
#   no PPO clip                        --actor.eps_clip_low_high 1 1e9                  (clip_ratio_low/high)
#   ESS-guided LR, product weights     lr x sqrt(ESS/B), w_i = exp(sum_t log pi_old/mu) (ess_scaling, unclipped)
#   the off-policy optimal baseline    b* per prompt group, product weights, GRPO's std (grad_baselining)
#   GRPO, 16 samples per prompt, seq-mean-token-mean, one optimizer step per rollout batch
#   the reference's optimizer          Adam betas 0.9 0.999, weight decay 0.1, constant LR, no warm-up
#   no KL                              --algo.kl.init_coef 0: no reference model is placed
# Validation as the reference's (MATH-500 every 10 steps, 3 samples at temperature 0.8), except top-p: the
# reference samples it at top-p 0.7, but upstream's evaluation reuses the rollout's top-p (1 here, the training
# sampling the corrections assume) and has no flag of its own, so eval accuracies are at top-p 1, not comparable
# to the reference's curves point for point.
# pi_old is the policy at the step's start (recompute), which the reference takes from its training forward:
# with one step per batch the two are the same weights, at the cost here of one forward per sample.
# Watch train/rho_ess, train/lr_scale, train/tis/*, train/opob/*.
set -x

MODEL=${MODEL:-Qwen/Qwen2.5-7B}
DATA=${DATA:-data/math/train.jsonl}          # {"prompt": ..., "label": ...} per line
EVAL=${EVAL:-data/math/math500.jsonl}
REWARD=${REWARD:-examples/python/reward_func.py}   # your reward_func(queries, prompts, labels): 1 if correct
SAVE=${SAVE:-./checkpoint/qwen2.5-7b-math-vcpo}
source "$(dirname "${BASH_SOURCE[0]}")/_grpo_7b_base.sh"   # its DeepSpeed block

args=(
   # models and data (max_prompt_length 1024, max_response_length 2048)
   --actor.model_name_or_path "$MODEL"
   --data.prompt_dataset "$DATA"
   --data.input_key prompt
   --data.label_key label
   --data.apply_chat_template
   --eval.dataset "$EVAL"
   --eval.steps 10
   --eval.temperature 0.8
   --eval.n_samples_per_prompt 3
   --reward.remote_url "$REWARD"
   --rollout.max_new_tokens 2048
   --data.max_len 3072
   # placement: 4 training GPUs, 2 engines x TP 2
   --actor.num_nodes 1
   --actor.num_gpus_per_node 4
   --vllm.num_engines 2
   --vllm.tensor_parallel_size 2
   --vllm.gpu_memory_utilization 0.8
   # fully async with partial rollouts, up to 10 batches ahead (staleness_threshold=10, partial_rollout=True)
   --train.async_enable
   --train.async_queue_size 10
   --train.partial_rollout_enable
   # VCPO as published (openrlhf-ess): the settings listed above
   --algo.vcpo_enable
   # batch: 32 prompts x 16 samples per rollout batch, one optimizer step each
   --rollout.batch_size 32
   --rollout.micro_batch_size 4
   --train.micro_batch_size 1
   --rollout.temperature 1.0
   # the reference's LR and grad clip (the recipe sets the rest of its optimizer)
   --actor.adam.lr 1e-6
   --actor.max_norm 1.0
   "${deepspeed_args[@]}"
   # logging and checkpoints
   --ckpt.output_dir "$SAVE"
   --ckpt.path "$SAVE/ckpt"
   --ckpt.save_steps 50
   --logger.tensorboard_dir "$SAVE/tensorboard"
)

python3 -m openrlhf_ess.cli.train_ppo_ray "${args[@]}" "$@"
