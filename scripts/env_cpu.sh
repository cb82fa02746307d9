# Environment for the CPU stack; sourced by the demo and the test scripts (after bootstrap).
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
bash "$ROOT/scripts/bootstrap_cpu.sh"
source "$ROOT/.venv/bin/activate"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}            # vLLM CPU: 25x faster than the default here
# No VLLM_CPU_KVCACHE_SPACE: vLLM CPU lets it override every engine's own KV size (the CLI's --vllm.cpu_kv_cache_gb,
# default 1 GiB; the tests' in-process engines, 64 MiB). A user's value is still the CLI's default (openrlhf_ess/config/resolve.py).
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}  # DeepSpeed JIT ops, built once
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-offline}
