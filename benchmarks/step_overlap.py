"""What async buys per step where the engines and the trainer have devices of their own: the overlap formula over
the step-time parts this repository measured, for generation 1-10x the training time (a model, not a measurement).

    python -m benchmarks.step_overlap            # print the tables
    python -m benchmarks.step_overlap --write    # render them into docs/staleness.md between the markers

What the code does, per step (upstream's ``ppo_trainer.py`` and ``ppo_trainer_async.py``, which ours extend):

- **Sync** runs generation G, make-experience E, the update U and the weight sync S one after another:
  ``step = G + E + U + S`` (its ``timing/step_total`` is that sum).
- **Async** (any queue >= 1; with partial rollouts the sync pauses the engine, without them the engine's lock keeps
  the sync and a batch's generation apart: the same either way): the trainer runs E + U + S per step and the
  engine G + S per batch, so in steady state ``step = max(G, E + U + c) + S``, with c a correction's extra
  trainer time.

Units: the training time (E + U of sync with no correction) is 1, so a row's generation ``r`` is G / (E + U).
The parts, read from the stored results (means over their seeds):

- S / (E + U) from sync's own runs (``sync | none`` in docs/rlvr_grid/results.json): the sync as a transfer;
  and the pause an async run measured (``async q8 + partial | none``, over that run's own E + U), which on the
  2-core machine also holds the wait for the engine's current step under shared cores.
- A correction's extra c, over the trainer time of uncorrected async (the grid's async q8 rows, the same shared
  cores): its make-experience minus uncorrected async's (the grid: the snapshot's forward at each token's version,
  VCPO's gradient-norm pass, bypass's skipped old-log-prob forward), plus its update's extra from the
  interleaved per-step measurement (docs/step_overhead.md: TIS token, TIS seq, ESS-LR, as a share of the update).

Left out, and said so in the doc: the engine's extra for returning μ (measured here only under shared cores), and
whatever the async generator does outside the engine's generate call (on this machine the measured async step
exceeds the formula by the amounts :func:`check_rows` shows).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Dict, List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GRID = os.path.join(REPO, "docs", "rlvr_grid", "results.json")
OVERHEAD = os.path.join(REPO, "docs", "step_overhead.md")
DOC = os.path.join(REPO, "docs", "staleness.md")
BEGIN, END = "<!-- step_overlap: begin (python -m benchmarks.step_overlap --write) -->", "<!-- step_overlap: end -->"

SYNC, UNCORRECTED = "sync | none", "async q8 + partial | none"
# correction -> (its grid row at q8, the rows of docs/step_overhead.md whose update extras it pays)
CORRECTIONS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "none": (UNCORRECTED, ()),
    "TIS": ("async q8 + partial | TIS", ("TIS token",)),
    "TIS + snapshot": ("async q8 + partial | TIS + snapshot", ("TIS token",)),
    "bypass": ("async q8 + partial | bypass", ()),
    "VCPO (recipe)": ("async q8 + partial | VCPO (recipe)", ("TIS seq", "ESS-LR")),
}


def sync_step(gen: float, train: float, sync: float) -> float:
    """Sync: the phases one after another."""
    return gen + train + sync


def async_step(gen: float, train: float, sync: float, extra: float = 0.0) -> float:
    """Async in steady state: the slower of the engine's batch and the trainer's step, then the weight sync that
    stops both (``extra``: a correction's added trainer time)."""
    return max(gen, train + extra) + sync


def mean_timing(runs: Sequence[dict]) -> Dict[str, float]:
    """Mean over a grid row's seeds of each phase's mean seconds per step (``timing`` of each run)."""
    timed = [r["timing"] for r in runs if r.get("timing")]
    return {phase: statistics.mean(t[phase] for t in timed) for phase in timed[0]}


def read_overhead(text: str) -> Dict[str, float]:
    """docs/step_overhead.md's ratios to the baseline ("| config | s / ppo_train | ratio | IQR s |" rows)."""
    ratios = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"\d+\.\d+", cells[2]):
            ratios[cells[0]] = float(cells[2])
    return ratios


def parts(grid: Dict[str, list], overhead: Dict[str, float]) -> Dict[str, object]:
    """The measured parts in units of sync's training time (E + U): the sync's share as sync measured it and as
    uncorrected async measured it, and each correction's extra trainer time (see the module docstring)."""
    sync, plain = mean_timing(grid[SYNC]), mean_timing(grid[UNCORRECTED])
    train_sync = sync["make_experience"] + sync["ppo_train"]
    train_async = plain["make_experience"] + plain["ppo_train"]
    extras = {}
    for name, (row, update_rows) in CORRECTIONS.items():
        t = mean_timing(grid[row])
        make = t["make_experience"] - plain["make_experience"]
        update = sum(overhead[u] - 1.0 for u in update_rows) * plain["ppo_train"]
        extras[name] = (make + update) / train_async
    return {
        "gen_over_train": sync["generation"] / train_sync,
        "sync_share": sync["broadcast"] / train_sync,
        "async_sync_share": plain["broadcast"] / train_async,
        "extras": extras,
    }


def rows(sync_share: float, async_sync_share: float, extras: Dict[str, float], ratios=range(1, 11)) -> List[list]:
    """One row per generation/training ratio r: [r, sync step, then per correction (async step, sync step over
    it)], in units of the training time; sync without a correction against async with each."""
    out = []
    for r in ratios:
        s = sync_step(r, 1.0, sync_share)
        row = [r, s]
        for c in extras.values():
            a = async_step(r, 1.0, async_sync_share, c)
            row += [a, s / a]
        out.append(row)
    return out


def check_rows(grid: Dict[str, list]) -> List[list]:
    """The formula against this machine's own measured async steps, per grid row at q8: [row, engine's G (its
    batch's generation less the sync pause that falls inside it), E + U, S, the formula's step, the measured
    step]. A check of what the formula leaves out, not part of the table."""
    out = []
    for name, (row, _) in CORRECTIONS.items():
        t = mean_timing(grid[row])
        gen = t["generation"] - t["broadcast"]
        train = t["make_experience"] + t["ppo_train"]
        out.append([name, gen, train, t["broadcast"], async_step(gen, train, t["broadcast"]), t["step_total"]])
    return out


def render(p: Dict[str, object], checks: List[list]) -> str:
    names = list(p["extras"])
    head = "| generation / training | sync step | " + " | ".join(f"async, {n}" for n in names) + " |"
    rule = "|---" * (2 + len(names)) + "|"
    extras = ", ".join(f"{n} {c:+.2f}" for n, c in p["extras"].items())
    lines = [
        f"Parts, in units of sync's training time (make-experience + update): generation on this machine "
        f"{p['gen_over_train']:.2f}; weight sync {p['sync_share']:.2f} as sync measured it, "
        f"{p['async_sync_share']:.2f} "
        f"as uncorrected async measured its pause; each correction's extra trainer time: {extras}.",
        "",
    ]
    for label, share in (
        (f"the async weight sync as sync's ({p['sync_share']:.2f})", p["sync_share"]),
        (f"the async weight sync as this machine's async pause ({p['async_sync_share']:.2f})", p["async_sync_share"]),
    ):
        lines += [
            f"Step time in units of the training time, and sync's step over async's (> 1: async is faster), with "
            f"{label}:",
            "",
            head,
            rule,
        ]
        for row in rows(p["sync_share"], share, p["extras"]):
            cells = [f"{row[2 + 2 * i]:.2f} ({row[3 + 2 * i]:.2f}×)" for i in range(len(names))]
            lines.append(f"| {row[0]}× | {row[1]:.2f} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "The formula against this machine's measured async steps (seconds, means over the five seeds of each q8 row; "
        "G = the batch's generation less the sync pause inside it):",
        "",
        "| async q8 row | G | E + U | S | max(G, E + U) + S | measured step | measured − formula |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, gen, train, sync, formula, measured in checks:
        lines.append(
            f"| {name} | {gen:.3f} | {train:.3f} | {sync:.3f} | {formula:.3f} | {measured:.3f} | "
            f"{measured - formula:+.3f} |"
        )
    return "\n".join(lines) + "\n"


def render_stored(grid_path: str = GRID, overhead_path: str = OVERHEAD) -> str:
    with open(grid_path) as f:
        grid = json.load(f)
    with open(overhead_path) as f:
        overhead = read_overhead(f.read())
    return render(parts(grid, overhead), check_rows(grid))


def write_block(doc_path: str, block: str) -> None:
    """Replace the text between the markers in ``doc_path`` with ``block``."""
    with open(doc_path) as f:
        text = f.read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(doc_path, "w") as f:
        f.write(text[:start] + "\n" + block + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"render into {os.path.relpath(DOC, REPO)}")
    a = parser.parse_args()
    block = render_stored()
    if a.write:
        write_block(DOC, block)
        print(f"wrote {DOC}")
    else:
        print(block)


if __name__ == "__main__":
    main()
