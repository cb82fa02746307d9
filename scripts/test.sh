#!/usr/bin/env bash
# The test command (README, CI): set up ./.venv if needed, lint, then the tests (docs/tests.md).
#   bash scripts/test.sh            # the gate CI runs: the default suite, then the stack tier (measured: docs/tests.md)
#   bash scripts/test.sh --fast     # the inner loop: maths, config, pre-flight, units (no Ray, CLI, engine or ranks)
#   bash scripts/test.sh --default  # the default suite only (the fault tests inside)
#   bash scripts/test.sh -m slow    # any pytest arguments: one pytest command with them (e.g. -m slow, -m stack, a file)
# Every command runs on two pytest-xdist workers (--dist loadgroup): the tests that start a Ray instance or the CLI
# run one at a time on one of them (tests/conftest.py, the "real-stack" group), the rest on the other. The stack
# tier, all of it in that group, runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env_cpu.sh
ruff check openrlhf_ess tests benchmarks # lint (ruff.toml: upstream's 119 columns)
ruff format --check openrlhf_ess tests benchmarks
PYTEST=(python -m pytest -ra -n 2 --dist loadgroup)
if [ "${1:-}" = "--fast" ]; then  # markers declared in pytest.ini
    shift
    exec "${PYTEST[@]}" -m "not slow and not gpu and not stack and not real_stack and not engine" "$@"
fi
if [ "$#" -gt 0 ] && [ "$1" != "--default" ]; then
    exec "${PYTEST[@]}" "$@"
fi
busy() { # the machine's busy core-seconds so far (/proc/stat: every core, all but idle and iowait)
    awk -v hz="$(getconf CLK_TCK)" '/^cpu /{print int(($2 + $3 + $4 + $7 + $8 + $9) / hz)}' /proc/stat
}
start=$SECONDS
cores=$(getconf _NPROCESSORS_ONLN) # not nproc, which OMP_NUM_THREADS=1 (env_cpu.sh) turns into 1
was=$(busy)
"${PYTEST[@]}" --durations=25 # the default suite (pytest.ini: not slow, not gpu, not stack); the slowest 25 named
echo "[test.sh] default suite: $((SECONDS - start)) s, $(($(busy) - was)) busy core-s of $cores cores"
if [ "${1:-}" = "--default" ]; then
    exit 0
fi
start=$SECONDS
was=$(busy)
# the real-stack feature runs (CI runs them too), in one process: they are all in the real-stack group, one at a
# time on one worker, so a second worker would only repeat the collection's imports
python -m pytest -ra -p no:xdist -m stack --durations=25
echo "[test.sh] stack tier: $((SECONDS - start)) s, $(($(busy) - was)) busy core-s of $cores cores"
