#!/usr/bin/env bash
# Side by side on the tiny CPU world with the interior-optimum reward (docs/staleness_target.md):
# synchronous training, async training (queue 8, partial rollouts) without corrections, and the same async run
# with the correction that did best there (bypass; with bypass the grid also runs sync + bypass). One seed each,
# about 10 minutes on 2 cores.
#   bash examples/scripts/compare_tiny_cpu.sh
# Writes runs/compare/comparison.png (reward, digit fraction against its optimum, reward against wall-clock)
# and runs/compare/results.md (final reward, overshoot, steps to the optimum, lag, rho, LR scale per run).
# EPISODES=1 makes it a ~4-minute smoke run (8 steps per run: too short to show the overshoot).
# Other corrections: CORRECTED=VCPO (ESS-LR + the off-policy optimal baseline, sequence-level TIS), OPOB,
# "VCPO + snapshot", "TIS + EWMA (Hilton)". None reached the goal at q8 (docs/staleness_target.md, Part 5):
# bypass stays the default, the correction that ended closest to the optimum.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env_cpu.sh

OUT=${OUT:-runs/compare}
CORRECTED=${CORRECTED:-bypass}   # a correction name of benchmarks/staleness.py (bypass: the best at q8 here)
# Every run: the tiny run of tests/helpers/e2e.py (8 prompts x 4 samples per step, 32 steps) plus these
args=(
   --actor.adam.lr 1e-2
   --train.max_epochs 4
)
rm -rf "$OUT"
python -m benchmarks.staleness --task target --seeds 1 --prompts 64 --episodes "${EPISODES:-4}" \
    --staleness sync "async q8 + partial" --corrections none "$CORRECTED" \
    --extra "${args[*]}" --out "$OUT" --workdir "$OUT/runs"
echo
cat "$OUT/results.md"
echo
echo "figure: $OUT/comparison.png   (per-level figures: $OUT/reward.png, $OUT/fraction.png)"
