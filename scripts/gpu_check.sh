#!/usr/bin/env bash
# One command for a single CUDA machine (docs/gpu_check.md): the GPU checks of tests/gpu/ (pytest -m gpu),
# each test PASS / FAIL / SKIP with numbers, a short report at the end, JSON in $OUT/gpu_check.json (else
# ./gpu_check.json) and JUnit XML in gpu_check.xml next to it. Exit code 1 iff a test FAILed. Never touches the
# network. The runner (tests/gpu/runner.py) runs one pytest process per test module, under a time budget.
#
#   bash scripts/gpu_check.sh                     # CUDA: pytest -m gpu tests/gpu
#   bash scripts/gpu_check.sh --device cpu        # the CPU variants (gloo), as the default suite runs them
#   bash scripts/gpu_check.sh --checks 1,2        # arguments pass through to python -m tests.gpu.runner (--help)
#   bash scripts/gpu_check.sh --checks 5,6,7,8    # the start-up self-checks and the mask / scoring maths: torch and
#                                                 # transformers only (no DeepSpeed, OpenRLHF, Ray or vLLM)
#
# Missing packages (DeepSpeed, OpenRLHF and their small pure-python needs) come from a wheel folder, if there is
# one: $GPU_WHEELS, else scripts/gpu_wheels/. They are installed offline (pip --no-index --no-deps) into
# $GPU_CHECK_SITE (default /tmp/gpu_check_site), put first on PYTHONPATH; the image's own packages are untouched.
# pytest itself must be installed (the GPU image's, or a wheel of the folder).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}

# The CPU variant runs in the project's own environment (scripts/env_cpu.sh): no wheels, unless GPU_WHEELS is set.
cpu_run=0
for a in "$@"; do case "$a" in --device=cpu) cpu_run=1 ;; cpu) [ "${prev:-}" = --device ] && cpu_run=1 ;; esac; prev=$a; done
WHEELS=${GPU_WHEELS:-$ROOT/scripts/gpu_wheels}
export GPU_CHECK_WHEELS_DIR=$WHEELS GPU_CHECK_WHEELS_RC="" GPU_CHECK_WHEELS_FILES="" GPU_CHECK_WHEELS_LOG=""
export GPU_CHECK_WHEELS_CPU_RUN=""
wheels=()
if [ $cpu_run -eq 0 ] || [ -n "${GPU_WHEELS:-}" ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
else
  export GPU_CHECK_WHEELS_CPU_RUN=1
fi
if [ ${#wheels[@]} -gt 0 ]; then
  export GPU_CHECK_SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
  GPU_CHECK_WHEELS_LOG=$(mktemp -t gpu_check_pip.XXXXXX)  # $TMPDIR, else /tmp; the runner removes it
  GPU_CHECK_WHEELS_FILES=$(for w in "${wheels[@]}"; do basename "$w"; done | tr '\n' ' ')
  echo "[gpu_check] installing ${#wheels[@]} wheels from $WHEELS into $GPU_CHECK_SITE (offline)"
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps --no-compile \
    --no-cache-dir --disable-pip-version-check --upgrade --target "$GPU_CHECK_SITE" "${wheels[@]}" \
    >"$GPU_CHECK_WHEELS_LOG" 2>&1
  GPU_CHECK_WHEELS_RC=$?
  [ "$GPU_CHECK_WHEELS_RC" -eq 0 ] || tail -n 20 "$GPU_CHECK_WHEELS_LOG"
  export PYTHONPATH="$GPU_CHECK_SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=${WANDB_MODE:-offline} PYTHONUNBUFFERED=1
exec "$PY" -m tests.gpu.runner "$@"
