# Environment for the CPU stack; sourced by the demo and the test scripts (after bootstrap).
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
bash "$ROOT/scripts/bootstrap_cpu.sh"
source "$ROOT/.venv/bin/activate"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}            # vLLM CPU: 25x faster than the default here
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB; vLLM CPU cannot size it itself
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}  # DeepSpeed JIT ops, built once
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-offline}
