"""Print a short summary of a run from its tensorboard logs: steps, reward at start and end, timings.

python -m openrlhf_ess.tools.summary RUN_TENSORBOARD_DIR
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Dict, List, Tuple


def read_scalars(tb_dir: str) -> Dict[str, List[Tuple[int, float]]]:
    """{tag: [(step, value), ...]} sorted by step, from every event file under ``tb_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: Dict[str, List[Tuple[int, float]]] = {}
    for path in glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(values) for tag, values in scalars.items()}


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(tb_dir: str, window: int = 8) -> str:
    scalars = read_scalars(tb_dir)
    reward = [v for _, v in scalars.get("train/reward", [])]
    if not reward:
        return f"no train/reward scalars under {tb_dir}"
    lines = [
        f"steps: {len(reward)}",
        f"reward: first {min(window, len(reward))} steps {_mean(reward[:window]):.3f} -> "
        f"last {min(window, len(reward))} steps {_mean(reward[-window:]):.3f}",
    ]
    for tag in ("train/timing/generation", "train/timing/ppo_train", "train/timing/broadcast"):
        if tag in scalars:
            lines.append(f"{tag.split('/', 1)[1]}: {_mean([v for _, v in scalars[tag]]):.3f} s/step")
    extra = sorted(t for t in scalars if t.startswith(("train/ess", "train/lr_scale", "train/rho")))
    for tag in extra:
        lines.append(f"{tag}: last {scalars[tag][-1][1]:.4g}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(summarize(sys.argv[1]))


if __name__ == "__main__":
    main()
