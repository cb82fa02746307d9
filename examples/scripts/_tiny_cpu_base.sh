# The flags the tiny CPU scripts share (train_ppo_tiny_cpu.sh, train_rlvr_tiny_cpu.sh), in upstream's bash-array
# layout. Sourced by each script (not run on its own) after it has set RUN_DIR:
#   source "$(dirname "${BASH_SOURCE[0]}")/_tiny_cpu_base.sh"
#   args=(<its model, data, reward and batch flags> "${tiny_engine_args[@]}" "${tiny_deepspeed_args[@]}"
#         "${tiny_output_args[@]}")

tiny_engine_args=(
   # one actor "GPU" and one vLLM engine, both on the CPU
   --actor.num_nodes 1
   --actor.num_gpus_per_node 1
   --vllm.num_engines 1
   --vllm.tensor_parallel_size 1
   # start in seconds, not minutes: an eager engine (vLLM CPU's torch.compile warm-up took ~70 s of the demo's
   # start, for a model this small) and a 64 MiB KV cache (the default 1 GiB took 5-11 s to zero; 64 MiB holds
   # 65,536 tokens, far more than a tiny batch needs). GPU recipes keep vLLM's defaults: compiled CUDA graphs and
   # a KV cache sized by --vllm.gpu_memory_utilization.
   --vllm.enforce_eager
   --vllm.cpu_kv_cache_gb 0.0625
)

# the dtype, trainer and engine: bf16 where this CPU computes it natively, else fp32 (torch emulates bf16 there, 2x
# to 70x slower; openrlhf_ess/runtime/cpu_dtype.py). One line says which and why; OPENRLHF_ESS_CPU_DTYPE=bf16, or
# the flags it names after the script's name, force bf16. The CLI's own default (GPU recipes) stays bf16.
tiny_dtype_flags=$(python -m openrlhf_ess.runtime.cpu_dtype --what "$(basename "$0")" --script "$0")
read -r -a tiny_dtype_args <<< "$tiny_dtype_flags"

tiny_deepspeed_args=(
   --actor.lr_warmup_ratio 0
   --actor.lr_scheduler constant
   --ds.zero_stage 2
   --ds.attn_implementation sdpa
   "${tiny_dtype_args[@]}"
)

tiny_output_args=(
   --ckpt.output_dir "$RUN_DIR/ckpt"
   --ckpt.path "$RUN_DIR/ckpt/checkpoints"
   --logger.tensorboard_dir "$RUN_DIR/tensorboard"
)
