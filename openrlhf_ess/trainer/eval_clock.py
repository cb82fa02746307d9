"""When a held-out eval runs (:func:`planned_evals`: which steps; the controllers' side is ``eval_schedule.py``)
and when it ran: the metrics that place each eval on a wall-clock axis and a weight version.

Every eval (``--eval.dataset``, every ``--eval.steps`` steps) logs, besides upstream's ``eval/*`` metrics:

- ``eval/weight_version``: the weight version the rollout engines held while the eval generated (the number of
  weight syncs they had received; logged when the engines are told versions, i.e. a feature that tags rollout
  tokens with their version is on);
- ``eval/wall_clock_s``: seconds from the CLI's launch to the start of the eval;
- ``eval/wall_clock_since_step1_s``: seconds from the start of the first training step of this launch (when its
  rollout batch was handed to the trainer: step 1, or the first step after a resume) to the start of the eval.

The CLI exports its launch time (its process's start, Unix seconds) in :data:`LAUNCH_TIME_ENV`, which every Ray
worker receives. Times are ``time.time()`` of the machine that runs the eval; on a multi-node run its clock must
agree with the driver's (NTP) for ``eval/wall_clock_s``.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence

LAUNCH_TIME_ENV = "OPENRLHF_ESS_LAUNCH_TIME"


def run_steps(n_prompts: int, rollout_batch_size: int, num_episodes: int) -> int:
    """Training steps of a run: one per rollout batch of ``--rollout.batch_size`` prompts, the last one short (upstream
    trains it), times ``--train.num_episodes``."""
    return math.ceil(n_prompts / rollout_batch_size) * num_episodes


def planned_evals(every: int, total: int) -> List[int]:
    """The steps evaluated in a run of ``total`` steps with ``--eval.steps every``: each multiple of ``every``, and
    the final step (``eval_schedule.py``)."""
    steps = list(range(every, total + 1, every))
    return steps + [total] if total >= 1 and (not steps or steps[-1] != total) else steps


def process_start_time() -> float:
    """This process's start time (Unix seconds), so the launch time counts the imports before ``main`` ran."""
    import psutil

    return psutil.Process(os.getpid()).create_time()


def export_launch_time(environ: MutableMapping[str, str] = os.environ, launched: Optional[float] = None) -> float:
    """Set :data:`LAUNCH_TIME_ENV` to ``launched`` (default: this process's start); returns it. Overwrites a value
    inherited from a parent process: each launch counts from its own start."""
    launched = process_start_time() if launched is None else float(launched)
    environ[LAUNCH_TIME_ENV] = repr(launched)
    return launched


def launch_time(environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """The launch time the CLI exported, or None when unset or unreadable (then ``eval/wall_clock_s`` is not
    logged)."""
    try:
        return float(environ[LAUNCH_TIME_ENV])
    except (KeyError, ValueError):
        return None


def held_version(versions: Sequence[int]) -> Optional[int]:
    """The weight version every engine holds, or None when there is no engine or they differ (a sync half done:
    it cannot happen under the lock an eval holds, and is not logged as one version)."""
    distinct = set(int(v) for v in versions)
    return distinct.pop() if len(distinct) == 1 else None


def eval_clock_metrics(
    now: float, launched: Optional[float], first_step_start: Optional[float], version: Optional[int]
) -> Dict[str, float]:
    """The eval's extra metrics (upstream's logger prefixes them with ``eval/``), each left out when unknown:
    ``wall_clock_s`` = ``now - launched``, ``wall_clock_since_step1_s`` = ``now - first_step_start``,
    ``weight_version`` = ``version``."""
    out: Dict[str, float] = {}
    if version is not None:
        out["weight_version"] = float(version)
    if launched is not None:
        out["wall_clock_s"] = now - launched
    if first_step_start is not None:
        out["wall_clock_since_step1_s"] = now - first_step_start
    return out
