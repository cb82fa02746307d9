#!/usr/bin/env bash
# Side by side on the tiny CPU world's verifiable task (two-digit addition, exact-match reward, docs/rlvr_task.md),
# judged by the held-out accuracy of the current policy: synchronous training, async training (queue 8, partial
# rollouts) without corrections, and the same async run with a correction. One seed each, about 10 minutes a run
# on 2 cores with the task's defaults (a sync run measured 578-606 s); the five-seed grid behind the choice,
# docs/rlvr_grid.md, ran the task's earlier settings (N_EVAL=100 WARM_TARGET=0.27 SAMPLES=8 LR=1e-4).
#   bash examples/scripts/compare_tiny_cpu.sh
# Writes runs/compare/eval_steps.png and eval_wall.png (held-out accuracy against steps and wall-clock) and
# runs/compare/results.md (AUC, final accuracy, time to sync's final accuracy, every eval).
# CORRECTED picks the correction (a name of benchmarks/staleness.py): TIS (default), "VCPO (recipe)",
# "TIS + snapshot", bypass, ... STEPS=48 makes it a smoke run of a quarter of the time (too short for the curves to
# separate).
# TASK=target runs the interior-optimum task instead (32 steps, ~4 minutes; results in $OUT/target).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env_cpu.sh

OUT=${OUT:-runs/compare}
CORRECTED=${CORRECTED:-TIS}
TASK=${TASK:-rlvr}
RESULTS=$OUT
if [ "$TASK" = target ]; then RESULTS=$OUT/target; fi
rm -rf "$OUT"
python -m benchmarks.rlvr_grid --task "$TASK" --seeds 1 --steps "${STEPS:-200}" \
    --configs "sync | none" "async q8 + partial | none" "async q8 + partial | $CORRECTED" \
    --out "$OUT" --workdir "$OUT/runs"
echo
cat "$RESULTS/results.md"
echo
echo "figures: $RESULTS/eval_steps.png, $RESULTS/eval_wall.png"
