#!/usr/bin/env bash
# The test command (README, CI): set up ./.venv if needed, lint, then the tests (docs/tests.md).
#   bash scripts/test.sh            # the gate CI runs: the default suite and, beside it, the stack tier (docs/tests.md)
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
if [ "${1:-}" = "--default" ]; then
    "${PYTEST[@]}" --durations=25 # the default suite (pytest.ini: not slow, not gpu, not stack); the slowest 25 named
    echo "[test.sh] default suite: $((SECONDS - start)) s, $(($(busy) - was)) busy core-s of $cores cores"
    exit 0
fi
# The stack tier (the real-stack feature runs; CI runs them too) runs beside the default suite, in one process of
# its own (all its tests are real-stack runs, one at a time: a second worker would only repeat the collection's
# imports). One after the other the two tiers left a third of a core idle on average (a run's start-up waits on
# one process at a time); side by side they fill it (docs/tests.md). Its output is printed once it ends. Two Ray
# instances at once share a node as two users' runs do: each run's ports are its own but the dashboard agent's
# HTTP port (52365), which the second instance does without (job submission only; nothing here submits to it).
stack_log=$(mktemp /tmp/openrlhf_ess_stack_tier.XXXXXX)
python -m pytest -ra -p no:xdist -m stack --durations=25 >"$stack_log" 2>&1 &
stack_pid=$!
stop_stack() { # on any exit of this script: the stack tier's session ends its runs (SIGINT: pytest tears down)
    if kill -0 "$stack_pid" 2>/dev/null; then
        kill -INT "$stack_pid" 2>/dev/null || true
        wait "$stack_pid" 2>/dev/null || true
        cat "$stack_log"
    fi
    rm -f "$stack_log"
}
trap stop_stack EXIT
default_rc=0
"${PYTEST[@]}" --durations=25 || default_rc=$? # the default suite (pytest.ini: not slow, not gpu, not stack)
echo "[test.sh] default suite: $((SECONDS - start)) s (the stack tier beside it)"
stack_rc=0
wait "$stack_pid" || stack_rc=$?
echo "[test.sh] ---- the stack tier's output (it ran beside the default suite) ----"
cat "$stack_log"
echo "[test.sh] both tiers: $((SECONDS - start)) s, $(($(busy) - was)) busy core-s of $cores cores"
[ "$default_rc" -eq 0 ] || { echo "[test.sh] the default suite failed (exit $default_rc)"; exit "$default_rc"; }
[ "$stack_rc" -eq 0 ] || { echo "[test.sh] the stack tier failed (exit $stack_rc)"; exit "$stack_rc"; }
