#!/usr/bin/env bash
# The test command (README, CI): set up ./.venv if needed, then run the default test suite.
#   bash scripts/test.sh            # default suite (fast + real-stack + fault tests, ~51 min after install on 2 cores: docs/tests.md)
#   bash scripts/test.sh -m slow    # the slow real-stack runs as well (pytest args pass through)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env_cpu.sh
ruff check openrlhf_ess tests benchmarks # lint (ruff.toml: upstream's 119 columns)
ruff format --check openrlhf_ess tests benchmarks
exec python -m pytest -ra "$@"
