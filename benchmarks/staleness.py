"""Staleness experiment: what each off-policy correction buys as rollouts grow stale.

    python -m benchmarks.staleness [--seeds 3] [--prompts 64] [--episodes 6] [--out docs/staleness]

Trains the tiny learnable task (digit reward) through the real CLI (Ray + vLLM + DeepSpeed) at several
staleness levels (synchronous; async with a queue of 1 and partial rollouts; async with a queue of 4 and
partial rollouts) with each correction (none; TIS; TIS + exact π_prox (snapshot); TIS + snapshot + ESS-LR;
TIS + EWMA π_prox; bypass, π_prox = μ), for several training seeds, one run after another. Writes, into ``--out``:
``results.json`` (every run's per-step curves), ``reward.png`` (reward vs step per staleness level, mean
over seeds with the min–max band), ``ess_lr.png`` (ρ_ESS and the LR scale of the ESS-LR runs) and
``results.md`` (final reward and the measured version lag per configuration), and ``reward_wall.png``
(reward vs seconds since launch). Not in the default grid, chosen with ``--staleness``/``--corrections``:
an async queue of 8 and TIS + EWMA with β from the lag (``auto``); LR, PPO epochs and other run flags go
through ``--extra`` (the search in docs/staleness.md, "A regime where staleness hurts"). The reading of
the numbers is written by hand in ``docs/staleness.md``.

GPU variant: ``--gpu --model MODEL --prompts-file DATA.jsonl --reward REWARD.py`` runs the same grid on a
real model with one GPU each for the actor and the engine (see docs/staleness.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import add_model_arguments, check_model_arguments, scalar_events, world_for  # noqa: E402
from benchmarks.common import run_flags as common_flags  # noqa: E402
from benchmarks.common import span as _span  # noqa: E402
from openrlhf_ess.tools.summary import read_scalars  # noqa: E402

TIS = ["--algo.tis_cap", "2"]
SNAPSHOT = ["--algo.prox_mode", "snapshot", "--algo.prox_snapshots", "8"]
CORRECTIONS: Dict[str, List[str]] = {
    "none": [],
    "TIS": TIS,
    "TIS + snapshot": TIS + SNAPSHOT,
    "TIS + snapshot + ESS-LR": TIS + SNAPSHOT + ["--algo.ess_lr_enable"],
    "TIS + EWMA": TIS + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "batch"],
    # π_prox = μ (no old-log-prob forward): a correction of its own, the cheapest
    "bypass": ["--algo.prox_mode", "bypass"],
}
# Not in the default grid (choose with --corrections): ESS-LR over recompute's π_prox = π_V, whose weights
# π_V/μ carry the staleness (with an exact π_prox they carry only the engine mismatch).
# And PPO-EWMA with β set each step from the observed lag (β = L/(1+L), `--algo.prox_ewma_decay auto`).
VCPO_VARIANT = [
    "--algo.ess_lr_enable",
    "--algo.advantage.baseline",
    "opob",
    "--algo.tis_cap",
    "2",
    "--algo.tis_level",
    "seq",
]
EXTRA_CORRECTIONS: Dict[str, List[str]] = {
    "TIS + ESS-LR (recompute)": TIS + ["--algo.ess_lr_enable"],
    "TIS + EWMA auto": TIS
    + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "batch", "--algo.prox_ewma_decay", "auto"],
    # The beta sweep (β = 0.9 is "TIS + EWMA" above)
    "TIS + EWMA β=0.3": TIS
    + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "batch", "--algo.prox_ewma_decay", "0.3"],
    "TIS + EWMA β=0.6": TIS
    + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "batch", "--algo.prox_ewma_decay", "0.6"],
    # No correction, but through our controllers, which tag every token's version (the lag is logged; a bound
    # no token reaches masks nothing): separates a correction's effect from the controllers' queueing
    "none, lag logged": ["--algo.max_version_lag", "1000"],
    # The other π_prox modes (every correction where uncorrected async overshoots)
    "TIS + interrupt": TIS + ["--algo.prox_mode", "interrupt"],
    "TIS + dedicated": TIS + ["--algo.prox_mode", "dedicated", "--algo.prox_dedicated_num_gpus", "0.2"],
    "TIS + loglinear": TIS + ["--algo.prox_mode", "loglinear"],
    # A variant of VCPO (ESS-LR + its off-policy optimal baseline over geometric-mean weights truncated at 2, with
    # this grid's PPO clip and epochs: what the rows "VCPO" of the recorded results ran), OPOB alone, the variant
    # over the exact π_prox, VCPO as its reference recipe trains (--algo.vcpo_enable; the group size and batch of
    # this grid kept), and PPO-EWMA as Hilton et al. published it (β per optimizer step, θ0 included, π_prox
    # recomputed for every minibatch)
    "VCPO": VCPO_VARIANT,
    # VCPO's parts one at a time, in its order (the variant above is all three): the product (sequence-level) TIS
    # weight truncated at 2, then ESS-LR over it
    "seq TIS": ["--algo.tis_cap", "2", "--algo.tis_level", "seq"],
    "seq TIS + ESS-LR": ["--algo.tis_cap", "2", "--algo.tis_level", "seq", "--algo.ess_lr_enable"],
    "OPOB": ["--algo.advantage.baseline", "opob"],
    "VCPO + snapshot": VCPO_VARIANT + SNAPSHOT,
    "VCPO (recipe)": ["--algo.vcpo_enable"],
    # The recipe with its ESS-guided LR cut held at 1 (ρ still computed and logged): which of its parts holds a
    # stale policy, the LR cut or the rest (the optimal baseline over the sequence weights, sequence TIS at 8)
    "VCPO (recipe) without LR cut": ["--algo.vcpo_enable", "--algo.ess_lr_floor", "1"],
    "TIS + EWMA (Hilton)": TIS + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "hilton"],
    # M2PO as the paper describes it (Algorithm 1's mask at its τ = 0.04) and as its released code runs it (the
    # adaptive clip from the same budget); both need one optimizer step per batch, the RLVR task's default
    "M2PO": ["--algo.m2po_tau", "0.04"],
    "M2PO (code)": ["--algo.m2po_tau", "0.04", "--algo.m2po_style", "code"],
    # AReaL's decoupled PPO with upstream's flags: π_prox recomputed at the step's weights (the default), the
    # behaviour weight π_prox/μ per token, tokens whose weight exceeds 5 masked (AReaL's behav_imp_weight_cap)
    "AReaL (decoupled)": [
        "--algo.advantage.is_correction_level",
        "token",
        "--algo.advantage.is_correction_mode",
        "mask",
        "--algo.advantage.is_correction_threshold",
        "0",
        "5",
    ],
}
ALL_CORRECTIONS = {**CORRECTIONS, **EXTRA_CORRECTIONS}
STALENESS: Dict[str, List[str]] = {
    "sync": [],
    "async q1 + partial": ["--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "1"],
    "async q4 + partial": ["--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "4"],
}
# Not in the default grid: the other queue depths of the target task's sweep (q8 also served the regime search), and
# q10, the GPU recipe's mapping of VCPO's reference staleness bound of 10 versions (docs/opob.md)
for _q in (2, 8, 10, 16):
    STALENESS[f"async q{_q} + partial"] = STALENESS["async q1 + partial"][:-1] + [str(_q)]
# A lag set exactly (--train.stale_k K, synchronous): every batch sampled by the weights K versions back; with one
# optimizer step per batch (the RLVR task's default) K versions are K optimizer steps, the anchors' unit
STALE_K = (1, 2, 4, 8, 16, 32, 64)
for _k in STALE_K:
    STALENESS[f"stale k{_k}"] = ["--train.stale_k", str(_k)]


def _level_order(key: str):
    if key == "sync":
        return (0, 0)
    if key.startswith("stale k"):
        return (2, int(key[len("stale k") :]))
    return (1, int(key[7:].split()[0]))


STALENESS = {k: STALENESS[k] for k in sorted(STALENESS, key=_level_order)}
DEFAULT_STALENESS = ["sync", "async q1 + partial", "async q4 + partial"]
# In synchronous training every token is lag 0: the exact and EWMA proximal policies equal recompute's.
SYNC_CORRECTIONS = ("none", "TIS", "bypass")
# The rows whose π_prox is scored at each sync (refused with --train.stale_k: snapshot is that lag's exact π_prox)
SCORE_AT_SYNC_ROWS = ("TIS + interrupt", "TIS + dedicated")
CURVES = (
    "train/reward",
    "train/version_lag/mean",
    "train/rho_ess",
    "train/lr_scale",
    "train/tis/clip_frac",
    "train/digit_fraction",
    "train/ppo_clip_ratio",
    "train/timing/generation",
    "train/timing/make_experience",
    "train/timing/ppo_train",
    "train/timing/step_total",
)
# The tasks: the monotone digit reward (tiny/reward.py) and the interior optimum f* = 0.5 (tiny/reward_target.py)
TASKS = ("digits", "target")
# Reward against wall-clock: seconds since the CLI was launched (start-up included) when each step was logged.
WALL = "wall/reward"


def config_flags(level: str, name: str) -> List[str]:
    """The CLI flags of one grid cell. A snapshot correction keeps as many versions as the level's queue can lag
    (queue + 1 with partial rollouts, + 1): 8 covers q1 and q4 (the recorded grid), q8 + partial needs 10; at a
    lag set to K, K + 1."""
    flags = STALENESS[level] + ALL_CORRECTIONS[name]
    if "--algo.prox_snapshots" in flags and "--train.async_queue_size" in flags:
        queue = int(flags[flags.index("--train.async_queue_size") + 1])
        i = flags.index("--algo.prox_snapshots") + 1
        flags = flags[:i] + [str(max(int(flags[i]), queue + 2))] + flags[i + 1 :]
    if "--algo.prox_snapshots" in flags and "--train.stale_k" in flags:  # versions v - K ... v
        k = int(flags[flags.index("--train.stale_k") + 1])
        i = flags.index("--algo.prox_snapshots") + 1
        flags = flags[:i] + [str(max(int(flags[i]), k + 1))] + flags[i + 1 :]
    return flags


def grid(staleness: List[str], corrections: List[str]):
    for level in staleness:
        for name in corrections:
            if level == "sync" and name not in SYNC_CORRECTIONS:
                continue
            if level.startswith("stale k") and name in SCORE_AT_SYNC_ROWS:
                continue  # they score the version the trainer leaves; at a set lag the engines hold an older one
            yield level, name


def run_flags(a, world: dict, run_dir: str, seed: int) -> List[str]:
    flags = common_flags(a, world, run_dir, a.prompts)
    return flags + [
        "--train.num_episodes",
        str(a.episodes),
        "--train.seed",
        str(seed),
        "--actor.lr_scheduler",
        "constant",
    ]


def run_once(a, world: dict, flags: List[str], run_dir: str, seed: int) -> Dict[str, List]:
    cmd = [sys.executable, "-m", "openrlhf_ess.cli.train_ppo_ray", *run_flags(a, world, run_dir, seed), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "offline"}
    t0 = time.time()
    rc = launch(cmd, run_dir, env, a.pin_engine_core, timeout=1800)
    if rc != 0:
        raise RuntimeError(f"run failed ({rc}): see {run_dir}/log.txt")
    scalars = read_scalars(os.path.join(run_dir, "tb"))
    curves = {tag: scalars.get(tag, []) for tag in CURVES}
    curves[WALL] = reward_vs_wall(os.path.join(run_dir, "tb"), t0)
    curves["wall/total_s"] = time.time() - t0
    return curves


def launch(cmd: List[str], run_dir: str, env: Dict[str, str], pin_engine_core: bool, timeout=None) -> int:
    """Runs ``cmd`` from the repository with its output in ``run_dir``/log.txt and returns its exit code; with
    ``pin_engine_core`` the engine side on core 0 (:func:`pin_training_side`, :class:`EngineSide`) and the processes
    moved there listed in ``run_dir``/pinned.txt. Past ``timeout`` seconds the command is killed and
    ``subprocess.TimeoutExpired`` raised."""
    preexec = pin_training_side(env) if pin_engine_core else None
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)
        pinner = EngineSide(proc.pid).start() if pin_engine_core else None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            if pinner is not None:
                pinner.stop()
    if pinner is not None:
        with open(os.path.join(run_dir, "pinned.txt"), "w") as f:
            f.write("\n".join(pinner.pinned) + "\n")
    return rc


def pin_training_side(env: Dict[str, str]):
    """The engine side on core 0, the training side on the others: returns the ``preexec_fn`` that gives the launched
    command every core but 0, and sets ``env`` so that vLLM's CPU worker binds itself to core 0.

    The CLI and what it starts (the driver, Ray, the DeepSpeed trainer, the controllers) inherit the cores but 0;
    the vLLM CPU worker binds itself to core 0 (VLLM_CPU_OMP_THREADS_BIND=0: "core ids=[0]" in the log; "auto" would
    pick from the inherited cores), and :class:`EngineSide` moves the rest of the engine (the Ray engine actor with
    vLLM's front end, and its EngineCore scheduler) there too as they appear. Generation and training then overlap on
    separate cores, as on GPUs, instead of competing for both."""
    others = sorted(os.sched_getaffinity(0) - {0})
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    return lambda: os.sched_setaffinity(0, others)


class EngineSide:
    """Moves the engine-side processes of one run (the Ray engine actor, vLLM's EngineCore and worker: found in the
    CLI's process tree by their process titles) to core 0 as they appear, every 0.5 s; ``pinned`` lists them."""

    PREFIXES = ("ray::RolloutRay", "VLLM::")

    def __init__(self, root: int):
        import threading

        self.root, self.pinned, self._done = root, [], set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "EngineSide":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            try:
                procs = psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                continue
            for p in procs:
                try:
                    name = p.name()
                    if name.startswith(self.PREFIXES):
                        # every thread, at every look: affinity is per thread, and threads started since inherit
                        # their creator's
                        for tid in os.listdir(f"/proc/{p.pid}/task"):
                            os.sched_setaffinity(int(tid), {0})
                        if p.pid not in self._done:
                            self._done.add(p.pid)
                            self.pinned.append(f"{p.pid} {name} -> core 0")
                except (psutil.Error, OSError):
                    pass


def reward_vs_wall(tb_dir: str, t0: float) -> List[List[float]]:
    """[(seconds since launch, reward), ...] in step order, from the event files' wall times."""
    return [[wall - t0, value] for _, wall, value in scalar_events(tb_dir, "train/reward")]


def final_reward(curve, window: int) -> float:
    values = [v for _, v in curve]
    return statistics.mean(values[-window:]) if values else float("nan")


def reached(curve, threshold: float = 0.9) -> bool:
    return any(v >= threshold for _, v in curve)


def distance_stats(fractions: List[float], target: float, window: int, near: float = 0.05) -> Dict[str, float]:
    """The interior-optimum task's trajectory measures, from the per-step batch mean digit fraction f_t.

    - ``final``: |f − f*| averaged over the last ``window`` steps (0 = settled at the optimum);
    - ``start``: |f − f*| averaged over the first 4 steps;
    - ``overshoot``: how far f went past f* on the far side from where it started, max_t s·(f_t − f*) with
      s = −sign(f_0 − f*), after the first crossing (0 when f never reached f*);
    - ``reach``: the first step with |f − f*| ≤ ``near`` (None: never);
    - ``diverged``: 1 when the run ended further from f* than it started (``final`` > ``start``).

    f_t is the mean over the batch trained on at step t, sampled by a policy up to the lag versions old. The
    batch mean is noisy (32 samples of ≤ 16 characters), so f_t crosses f* back and forth even when settled:
    sign changes do not measure oscillation; ``final`` and ``overshoot`` do.
    """
    dist = [f - target for f in fractions]
    if not dist:
        return {"final": float("nan"), "start": float("nan"), "overshoot": 0.0, "reach": None, "diverged": 0}
    side = -1.0 if dist[0] < 0 else 1.0  # the side f starts on; overshoot is measured on the other one
    first = next((i for i, d in enumerate(dist) if d * side <= 0), None)
    overshoot = max(0.0, max(-side * d for d in dist[first:])) if first is not None else 0.0
    reach = next((i + 1 for i, d in enumerate(dist) if abs(d) <= near), None)
    final = statistics.mean(abs(d) for d in dist[-window:])
    start = statistics.mean(abs(d) for d in dist[:4])
    return {"final": final, "start": start, "overshoot": overshoot, "reach": reach, "diverged": int(final > start)}


def _lag_cell(level: str, runs: List[dict]) -> str:
    """Mean version lag over the seeds; runs through upstream's controllers tag no versions."""
    lags = [statistics.mean(v for _, v in r["train/version_lag/mean"]) for r in runs if r["train/version_lag/mean"]]
    return f"{statistics.mean(lags):.2f}" if lags else ("0" if level == "sync" else "not logged")


def _wall_cell(runs: List[dict]) -> str:
    walls = [r["wall/total_s"] for r in runs if "wall/total_s" in r]
    return f"{statistics.mean(walls):.0f}" if walls else "–"


def _reach_cell(reach: List[float], n_runs: int) -> str:
    """Steps to a goal, mean [min, max] over the runs that reached it; the others counted after the slash."""
    if not reach:
        return "never"
    return _span(reach, "{:.1f}") + (f" / {n_runs - len(reach)} never" if len(reach) < n_runs else "")


def time_to_reward(curve_wall: List[List[float]], threshold: float, window: int = 4):
    """Seconds since launch at which the ``window``-step moving average of the reward first reaches ``threshold``
    (None: never); ``curve_wall`` = [(seconds since launch, reward), ...] in step order."""
    values = [v for _, v in curve_wall]
    for i in range(window - 1, len(values)):
        if statistics.mean(values[i - window + 1 : i + 1]) >= threshold:
            return curve_wall[i][0]
    return None


def write_time_to_reward_table(results: dict, path: str, command: str, window: int) -> None:
    """time_to_reward.md: seconds to 0.95 x sync's final reward (4-step moving average), start-up (launch to the
    first logged step), generation vs training time per step, per configuration (mean [min, max] over seeds)."""
    sync = [r for k, runs in results.items() if k.startswith("sync | ") for r in runs]
    if not sync:
        return
    target = 0.95 * statistics.mean(final_reward(r["train/reward"], window) for r in sync)
    lines = [
        "# Time to reward: raw results",
        "",
        f"Command: `{command}`. Threshold = 0.95 x sync's final reward (mean of its seeds' last {window} steps) "
        f"= {target:.3f}; time = seconds until the 4-step moving average of the reward reaches it, from the start "
        "of training step 1 (start-up excluded) and from launch (runs that never do are counted after the slash). "
        "Generation / training = per-step medians of timing/generation and timing/make_experience + "
        "timing/ppo_train. Every cell: mean [min, max] over seeds.",
        "",
        "| staleness | correction | training time to threshold (s) | time to threshold from launch (s) "
        "| first step logged (s) | run (s) | generation / step (s) "
        "| training / step (s) | gen / train | final reward | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, runs in results.items():
        level, name = key.split(" | ")
        times = [t for t in (time_to_reward(r[WALL], target) for r in runs) if t is not None]
        # training time: from the start of step 1 (its logged wall time minus its own duration), start-up excluded
        # (runs recorded before the per-step timings were kept have none: no training-time cell)
        timed = [r for r in runs if r[WALL] and r.get("train/timing/step_total")]
        begin = [r[WALL][0][0] - r["train/timing/step_total"][0][1] for r in timed]
        reached = (time_to_reward(r[WALL], target) for r in timed)
        train_times = [t - b for t, b in zip(reached, begin) if t is not None]
        starts = [r[WALL][0][0] for r in runs if r[WALL]]
        gen = [
            statistics.median(v for _, v in r["train/timing/generation"])
            for r in runs
            if r.get("train/timing/generation")
        ]
        train = [
            statistics.median(
                a + b for (_, a), (_, b) in zip(r["train/timing/make_experience"], r["train/timing/ppo_train"])
            )
            for r in runs
            if r.get("train/timing/ppo_train")
        ]
        ratio = f"{statistics.mean(gen) / statistics.mean(train):.1f}" if gen and train else "–"
        lines.append(
            f"| {level} | {name} | {_reach_cell(train_times, len(timed)) if timed else '–'} "
            f"| {_reach_cell(times, len(runs))} "
            f"| {_span(starts, '{:.0f}') if starts else '–'} "
            f"| {_wall_cell(runs)} | {_span(gen, '{:.2f}') if gen else '–'} "
            f"| {_span(train, '{:.2f}') if train else '–'} "
            f"| {ratio} | {_span([final_reward(r['train/reward'], window) for r in runs])} | {len(runs)} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_target_table(results: dict, path: str, command: str, window: int, target: float) -> None:
    """results.md for the interior-optimum task: reward, the distance to f*, overshoot, oscillation, ρ and the
    LR scale per configuration (mean [min, max] over seeds)."""
    lines = [
        "# Staleness experiment on the interior-optimum reward: raw results",
        "",
        f"Command: `{command}`. Reward = 1 − |f − f*| / max(f*, 1 − f*) with f the response's digit fraction and",
        f"f* = {target} (openrlhf_ess/tiny/reward_target.py). Every cell: mean [min, max] over seeds.",
        f"Final reward and final |f − f*| = mean of the last {window} steps; AUC = mean reward over all steps.",
        "Overshoot = furthest f went past f* after first reaching it (0 = never past); steps to f* = first step",
        "with |f − f*| ≤ 0.05 (runs that never get there counted after the slash); diverged = runs that ended",
        "further from f* than they started. ρ min / LR scale min = smallest ρ_ESS = ESS/B and ESS-LR scale",
        "logged (– when not logged). Lag = mean version lag (runs without any of our flags use upstream's",
        "controllers, which do not tag versions).",
        "Wall = seconds from launch to the end of the run (start-up included).",
        "",
        "| staleness | correction | final reward | AUC | final \\|f − f*\\| | overshoot | steps to f* | diverged "
        "| mean lag | ρ min | LR scale min | wall (s) | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, runs in results.items():
        level, name = key.split(" | ")
        stats = [distance_stats([v for _, v in r["train/digit_fraction"]], target, window) for r in runs]
        finals = [final_reward(r["train/reward"], window) for r in runs]
        aucs = [statistics.mean(v for _, v in r["train/reward"]) for r in runs]
        rho = [min(v for _, v in r["train/rho_ess"]) for r in runs if r.get("train/rho_ess")]
        scale = [min(v for _, v in r["train/lr_scale"]) for r in runs if r.get("train/lr_scale")]
        steps = _reach_cell([x["reach"] for x in stats if x["reach"] is not None], len(runs))
        lines.append(
            f"| {level} | {name} | {_span(finals)} | {_span(aucs)} | {_span([x['final'] for x in stats])} "
            f"| {_span([x['overshoot'] for x in stats])} | {steps} "
            f"| {sum(x['diverged'] for x in stats)}/{len(runs)} | {_lag_cell(level, runs)} "
            f"| {f'{min(rho):.3f}' if rho else '–'} | {f'{min(scale):.3f}' if scale else '–'} "
            f"| {_wall_cell(runs)} | {len(runs)} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_table(results: dict, path: str, command: str, window: int) -> None:
    lines = [
        "# Staleness experiment: raw results",
        "",
        f"Command: `{command}`. Final reward = mean of the last {window} steps of each run; mean ± standard",
        "deviation over seeds (min–max in brackets). AUC = mean reward over all steps (learning speed).",
        "Lag = mean version lag of the sampled tokens over the run (`version_lag/mean`); runs without any of our",
        "flags use upstream's controllers, which do not tag versions ('not logged').",
        "",
        "AUC [min, max] over seeds. Steps to 0.9 = first step whose reward is ≥ 0.9 (mean [min, max]; runs that",
        "never reach it are left out and counted after the slash). Wall = seconds from launch to the end of the",
        "run (start-up included), mean over seeds.",
        "",
        "| staleness | correction | final reward | [min, max] | AUC | AUC [min, max] | steps to 0.9 | mean lag "
        "| wall (s) | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, runs in results.items():
        level, name = key.split(" | ")
        finals = [final_reward(r["train/reward"], window) for r in runs]
        aucs = [statistics.mean(v for _, v in r["train/reward"]) for r in runs]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        reach = [next(s for s, v in r["train/reward"] if v >= 0.9) for r in runs if reached(r["train/reward"])]
        lines.append(
            f"| {level} | {name} | {statistics.mean(finals):.3f} ± {sd:.3f} | [{min(finals):.3f}, {max(finals):.3f}] "
            f"| {statistics.mean(aucs):.3f} | [{min(aucs):.3f}, {max(aucs):.3f}] | {_reach_cell(reach, len(runs))} "
            f"| {_lag_cell(level, runs)} | {_wall_cell(runs)} | {len(runs)} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _band(runs, tag):
    """Per step: mean, min, max over the runs that logged that step."""
    by_step: Dict[int, List[float]] = {}
    for r in runs:
        for step, value in r[tag]:
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (
        steps,
        [statistics.mean(by_step[s]) for s in steps],
        [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def _level_axes(plt, n: int, height: float):
    """One panel per staleness level, at most 3 per row (shared y); returns (figure, flat list of n axes)."""
    cols, rows = min(3, n), -(-n // 3)
    fig, grid = plt.subplots(rows, cols, figsize=(5.2 * cols, height * rows), sharey=True, squeeze=False)
    flat = [ax for row in grid for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def plot(results: dict, out: str, levels: List[str]) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = _level_axes(plt, len(levels), 4.2)
    for ax, level in zip(axes, levels):
        for key, runs in results.items():
            if not key.startswith(level + " | "):
                continue
            steps, mean, lo, hi = _band(runs, "train/reward")
            (line,) = ax.plot(steps, mean, label=key.split(" | ")[1])
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(level)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[::3]:
        ax.set_ylabel("reward (mean over seeds, min–max band)")
    fig.tight_layout()
    paths.append(os.path.join(out, "reward.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if any(run.get(WALL) for runs in results.values() for run in runs):
        fig, axes = _level_axes(plt, len(levels), 4.2)
        for ax, level in zip(axes, levels):
            for key, runs in results.items():
                if not key.startswith(level + " | ") or not all(run.get(WALL) for run in runs):
                    continue
                n = min(len(run[WALL]) for run in runs)  # per step index: mean wall time, mean and band of reward
                wall = [statistics.mean(run[WALL][i][0] for run in runs) for i in range(n)]
                rewards = [[run[WALL][i][1] for run in runs] for i in range(n)]
                (line,) = ax.plot(wall, [statistics.mean(r) for r in rewards], label=key.split(" | ")[1])
                ax.fill_between(
                    wall, [min(r) for r in rewards], [max(r) for r in rewards], color=line.get_color(), alpha=0.15
                )
            ax.set_title(level)
            ax.set_xlabel("seconds since launch (start-up included)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        for ax in axes[::3]:
            ax.set_ylabel("reward (mean over seeds, min–max band)")
        fig.tight_layout()
        paths.append(os.path.join(out, "reward_wall.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    ess = {k: r for k, r in results.items() if any(run["train/rho_ess"] for run in r)}
    if ess:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False)
        for key, runs in ess.items():
            for ax, tag in zip(axes[0], ("train/rho_ess", "train/lr_scale")):
                steps, mean, lo, hi = _band(runs, tag)
                (line,) = ax.plot(steps, mean, label=key.replace(" | ", ": "))
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        titles = ("ρ = ESS / B (1: every sample counts equally)", "ESS-LR scale = clamp(√ρ, floor, 1)")
        for ax, title in zip(axes[0], titles):
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.set_title(title)
            ax.set_xlabel("training step")
            ax.set_ylabel("ratio (mean over seeds, min–max band)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.supxlabel(
            "The ESS-LR runs: ρ of the per-sample weights π_prox/μ and the LR multiplier it gives. Near 1: the "
            "samples weigh alike (nothing to scale); low: a few samples dominate and the step is shortened.",
            fontsize=9,
            color="dimgrey",
        )
        fig.tight_layout()
        paths.append(os.path.join(out, "ess_lr.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def plot_target(results: dict, out: str, levels: List[str], target: float) -> str:
    """fraction.png: the digit fraction f of each step's batch against the optimum f*, one panel per staleness
    level, one line per correction (mean over seeds, min–max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = _level_axes(plt, len(levels), 4.4)
    for ax, level in zip(axes, levels):
        for key, runs in results.items():
            if key.startswith(level + " | "):
                steps, mean, lo, hi = _band(runs, "train/digit_fraction")
                (line,) = ax.plot(steps, mean, label=key.split(" | ")[1])
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"optimum f* = {target}")
        ax.set_title(level)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[::3]:
        ax.set_ylabel("digit fraction f of the trained batch")
    fig.suptitle(
        "Interior-optimum task: the digit fraction over training (mean over seeds, min–max band). "
        "Good: reaches the dashed line and stays on it; above it = overshoot.",
        fontsize=9,
    )
    fig.tight_layout()
    path = os.path.join(out, "fraction.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(results: dict, out: str, task: str) -> str:
    """comparison.png: every configuration on the same axes (mean over its seeds): reward per step, the digit
    fraction against f* (interior-optimum task) and reward against wall-clock."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ["reward"] + (["fraction"] if task == "target" else []) + ["wall"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 4.6), squeeze=False)
    for key, runs in results.items():
        label = key.replace(" | ", ": ")
        for ax, panel in zip(axes[0], panels):
            if panel == "wall":
                n = min(len(run.get(WALL) or []) for run in runs)
                if n:  # from the first logged step: start-up (70–150 s here, machine load) is left out
                    wall = [statistics.mean(run[WALL][i][0] - run[WALL][0][0] for run in runs) for i in range(n)]
                    ax.plot(wall, [statistics.mean(run[WALL][i][1] for run in runs) for i in range(n)], label=label)
                continue
            steps, mean, _, _ = _band(runs, "train/reward" if panel == "reward" else "train/digit_fraction")
            ax.plot(steps, mean, label=label)
    titles = {
        "reward": ("reward per training step", "training step", "reward (1 = best)"),
        "fraction": ("digit fraction f of the trained batch", "training step", "digit fraction f"),
        "wall": ("reward against wall-clock", "seconds since the first training step", "reward (1 = best)"),
    }
    for ax, panel in zip(axes[0], panels):
        title, xlabel, ylabel = titles[panel]
        if panel == "fraction":
            from openrlhf_ess.tiny.reward_target import TARGET

            ax.axhline(TARGET, color="black", linestyle="--", linewidth=1, label=f"optimum f* = {TARGET}")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    seeds = min(len(runs) for runs in results.values())
    caption = (
        f"Tiny CPU world, {'interior-optimum reward 1 − |f − 0.5|/0.5' if task == 'target' else 'digit reward'}; "
        f"{'one seed' if seeds == 1 else f'mean over {seeds} seeds'}. Good: the reward rises fast and stays high"
        + ("; f reaches the dashed line and stays on it (above it = overshoot)." if task == "target" else ".")
    )
    fig.suptitle("Synchronous vs asynchronous training, with and without corrections")
    fig.supxlabel("\n".join(textwrap.wrap(caption, 150)), fontsize=9, color="dimgrey")
    fig.tight_layout()
    path = os.path.join(out, "comparison.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(results: dict, out: str, command: str, levels: List[str], task: str) -> List[str]:
    """results.md and the plots of one results dict."""
    if task == "target":
        from openrlhf_ess.tiny.reward_target import TARGET

        write_target_table(results, os.path.join(out, "results.md"), command, window=8, target=TARGET)
        extra = [plot_target(results, out, levels, TARGET)]
    else:
        write_table(results, os.path.join(out, "results.md"), command, window=8)
        extra = []
    if any(k.startswith("sync | ") for k in results) and any(
        r.get("train/timing/generation") for v in results.values() for r in v
    ):
        write_time_to_reward_table(results, os.path.join(out, "time_to_reward.md"), command, window=8)
        extra.append(os.path.join(out, "time_to_reward.md"))
    return plot(results, out, levels) + extra + [plot_comparison(results, out, task)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per configuration")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per episode (8 per step)")
    parser.add_argument("--episodes", type=int, default=6, help="passes over the prompts (8 steps each by default)")
    parser.add_argument("--staleness", nargs="*", default=DEFAULT_STALENESS, help=f"subset of {list(STALENESS)}")
    parser.add_argument(
        "--corrections", nargs="*", default=list(CORRECTIONS), help=f"subset of {list(ALL_CORRECTIONS)}"
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default="digits",
        help="digits: reward = digit fraction (monotone); target: reward peaks at a digit fraction of 0.5 "
        "(tiny/reward_target.py), where stale samples can push the policy past the optimum",
    )
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "staleness"))
    parser.add_argument("--workdir", default=None, help="where runs are written (default: a new temp dir)")
    parser.add_argument(
        "--from-json", default=None, help="only re-render results.md and the plots from a results.json (no runs)"
    )
    parser.add_argument(
        "--pin-engine-core",
        action="store_true",
        help="time-to-reward setting: the vLLM worker on core 0 (its own binding), everything else on the other "
        "cores, so generation and training really overlap (docs/time_to_reward.md)",
    )
    add_model_arguments(parser)
    a = parser.parse_args()
    for level in a.staleness:
        if level not in STALENESS:
            parser.error(f"--staleness {level!r}: choose from {list(STALENESS)}")
    for name in a.corrections:
        if name not in ALL_CORRECTIONS:
            parser.error(f"--corrections {name!r}: choose from {list(ALL_CORRECTIONS)}")
    check_model_arguments(parser, a)

    if a.from_json:
        os.makedirs(a.out, exist_ok=True)
        with open(a.from_json) as f:
            results = json.load(f)
        levels = [lvl for lvl in STALENESS if any(k.startswith(lvl + " | ") for k in results)]
        for path in render(results, a.out, "python -m benchmarks.staleness", levels, a.task):
            print(f"[staleness] wrote {path}")
        return
    root = a.workdir or tempfile.mkdtemp(prefix="ess_staleness_")
    os.makedirs(a.out, exist_ok=True)
    world = world_for(a, root, a.prompts)
    if a.task == "target" and not a.model:
        world["reward"] = os.path.join(REPO, "openrlhf_ess", "tiny", "reward_target.py")
    configs = list(grid(a.staleness, a.corrections))
    total = len(configs) * a.seeds
    print(f"[staleness] {total} runs into {root}", flush=True)
    results: Dict[str, List[dict]] = {}
    t_start, done = time.time(), 0
    for level, name in configs:
        key = f"{level} | {name}"
        for seed in range(a.seeds):
            # ASCII only: Ray's core worker fails on a non-ASCII path (the β in "TIS + EWMA β=0.3")
            slug = f"{level}_{name}_s{seed}".replace(" ", "_").replace("+", "p").replace("β", "beta")
            run_dir = os.path.join(root, slug)
            os.makedirs(run_dir, exist_ok=True)
            t0 = time.time()
            try:
                curves = run_once(a, world, config_flags(level, name), run_dir, seed=42 + seed)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # one retry, then the run is reported missing
                print(f"[staleness] {key} seed {seed} failed ({e}); kept as {run_dir}.failed; retrying", flush=True)
                shutil.rmtree(run_dir + ".failed", ignore_errors=True)
                os.rename(run_dir, run_dir + ".failed")  # its log says why
                os.makedirs(run_dir)
                try:
                    curves = run_once(a, world, config_flags(level, name), run_dir, seed=42 + seed)
                except (RuntimeError, subprocess.TimeoutExpired) as e2:
                    print(f"[staleness] {key} seed {seed} failed twice ({e2}); left out", flush=True)
                    done += 1
                    continue
            results.setdefault(key, []).append(curves)
            done += 1
            eta = (time.time() - t_start) / done * (total - done)
            print(
                f"[staleness] {done}/{total} {key} seed {seed}: final reward "
                f"{final_reward(curves['train/reward'], 8):.3f} ({time.time() - t0:.0f} s, ~{eta / 60:.0f} min left)",
                flush=True,
            )
            with open(os.path.join(a.out, "results.json"), "w") as f:
                json.dump(results, f)
    command = "python -m benchmarks.staleness " + shlex.join(sys.argv[1:])
    for path in render(results, a.out, command.strip(), list(a.staleness), a.task):
        print(f"[staleness] wrote {path}")
    print(f"[staleness] wrote {a.out}/results.md, results.json ({(time.time() - t_start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
