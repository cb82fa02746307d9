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
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import add_model_arguments, check_model_arguments, world_for  # noqa: E402
from benchmarks.common import run_flags as common_flags  # noqa: E402
from openrlhf_ess.tools.summary import read_scalars  # noqa: E402

TIS = ["--algo.tis_cap", "2"]
SNAPSHOT = ["--algo.prox_mode", "snapshot", "--algo.prox_snapshots", "8"]
CORRECTIONS: Dict[str, List[str]] = {
    "none": [],
    "TIS": TIS,
    "TIS + snapshot": TIS + SNAPSHOT,
    "TIS + snapshot + ESS-LR": TIS + SNAPSHOT + ["--algo.ess_lr_enable"],
    "TIS + EWMA": TIS + ["--algo.prox_mode", "ewma"],
    # π_prox = μ (no old-log-prob forward): a correction of its own, the cheapest (issue 13)
    "bypass": ["--algo.prox_mode", "bypass"],
}
# Not in the default grid (choose with --corrections): ESS-LR over recompute's π_prox = π_V, whose weights
# π_V/μ carry the staleness (with an exact π_prox they carry only the engine mismatch).
# And PPO-EWMA with β set each step from the observed lag (β = L/(1+L), `--algo.prox_ewma_decay auto`).
EXTRA_CORRECTIONS: Dict[str, List[str]] = {
    "TIS + ESS-LR (recompute)": TIS + ["--algo.ess_lr_enable"],
    "TIS + EWMA auto": TIS + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "auto"],
    # The beta sweep of issue 15 §3 (β = 0.9 is "TIS + EWMA" above)
    "TIS + EWMA β=0.3": TIS + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "0.3"],
    "TIS + EWMA β=0.6": TIS + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "0.6"],
}
ALL_CORRECTIONS = {**CORRECTIONS, **EXTRA_CORRECTIONS}
STALENESS: Dict[str, List[str]] = {
    "sync": [],
    "async q1 + partial": ["--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "1"],
    "async q4 + partial": ["--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "4"],
    # Not in the default grid: a deeper queue, for the search of a regime where staleness hurts (staleness.md)
    "async q8 + partial": ["--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "8"],
}
DEFAULT_STALENESS = ["sync", "async q1 + partial", "async q4 + partial"]
# In synchronous training every token is lag 0: the exact and EWMA proximal policies equal recompute's.
SYNC_CORRECTIONS = ("none", "TIS", "bypass")
CURVES = ("train/reward", "train/version_lag/mean", "train/rho_ess", "train/lr_scale", "train/tis/clip_frac")
# Reward against wall-clock: seconds since the CLI was launched (start-up included) when each step was logged.
WALL = "wall/reward"


def config_flags(level: str, name: str) -> List[str]:
    """The CLI flags of one grid cell. A snapshot correction keeps as many versions as the level's queue can lag
    (queue + 1 with partial rollouts, + 1): 8 covers q1 and q4 (the recorded grid), q8 + partial needs 10."""
    flags = STALENESS[level] + ALL_CORRECTIONS[name]
    if "--algo.prox_snapshots" in flags and "--train.async_queue_size" in flags:
        queue = int(flags[flags.index("--train.async_queue_size") + 1])
        i = flags.index("--algo.prox_snapshots") + 1
        flags = flags[:i] + [str(max(int(flags[i]), queue + 2))] + flags[i + 1 :]
    return flags


def grid(staleness: List[str], corrections: List[str]):
    for level in staleness:
        for name in corrections:
            if level == "sync" and name not in SYNC_CORRECTIONS:
                continue
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
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800).returncode
    if rc != 0:
        raise RuntimeError(f"run failed ({rc}): see {run_dir}/log.txt")
    scalars = read_scalars(os.path.join(run_dir, "tb"))
    curves = {tag: scalars.get(tag, []) for tag in CURVES}
    curves[WALL] = reward_vs_wall(os.path.join(run_dir, "tb"), t0)
    curves["wall/total_s"] = time.time() - t0
    return curves


def reward_vs_wall(tb_dir: str, t0: float) -> List[List[float]]:
    """[(seconds since launch, reward), ...] in step order, from the event files' wall times."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = []
    for path in glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        if "train/reward" in acc.Tags()["scalars"]:
            events.extend((e.step, e.wall_time - t0, e.value) for e in acc.Scalars("train/reward"))
    return [[wall, value] for _, wall, value in sorted(events)]


def final_reward(curve, window: int) -> float:
    values = [v for _, v in curve]
    return statistics.mean(values[-window:]) if values else float("nan")


def reached(curve, threshold: float = 0.9) -> bool:
    return any(v >= threshold for _, v in curve)


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
        lags = [
            statistics.mean(v for _, v in r["train/version_lag/mean"]) for r in runs if r["train/version_lag/mean"]
        ]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        lag = f"{statistics.mean(lags):.2f}" if lags else ("0" if level == "sync" else "not logged")
        walls = [r["wall/total_s"] for r in runs if "wall/total_s" in r]
        wall = f"{statistics.mean(walls):.0f}" if walls else "–"
        reach = [next(s for s, v in r["train/reward"] if v >= 0.9) for r in runs if reached(r["train/reward"])]
        steps09 = f"{statistics.mean(reach):.1f} [{min(reach)}, {max(reach)}]" if reach else "never"
        if reach and len(reach) < len(runs):
            steps09 += f" / {len(runs) - len(reach)} never"
        lines.append(
            f"| {level} | {name} | {statistics.mean(finals):.3f} ± {sd:.3f} | [{min(finals):.3f}, {max(finals):.3f}] "
            f"| {statistics.mean(aucs):.3f} | [{min(aucs):.3f}, {max(aucs):.3f}] | {steps09} | {lag} | {wall} "
            f"| {len(runs)} |"
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


def plot(results: dict, out: str, levels: List[str]) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, len(levels), figsize=(5.2 * len(levels), 4.2), sharey=True, squeeze=False)
    for ax, level in zip(axes[0], levels):
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
    axes[0][0].set_ylabel("reward (mean over seeds, min–max band)")
    fig.tight_layout()
    paths.append(os.path.join(out, "reward.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if any(run.get(WALL) for runs in results.values() for run in runs):
        fig, axes = plt.subplots(1, len(levels), figsize=(5.2 * len(levels), 4.2), sharey=True, squeeze=False)
        for ax, level in zip(axes[0], levels):
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
        axes[0][0].set_ylabel("reward (mean over seeds, min–max band)")
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
                (line,) = ax.plot(steps, mean, label=key.split(" | ")[0])
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        for ax, title in zip(axes[0], ("ρ = ESS / B", "LR scale")):
            ax.ticklabel_format(axis="y", useOffset=False)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out, "ess_lr.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per configuration")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per episode (8 per step)")
    parser.add_argument("--episodes", type=int, default=6, help="passes over the prompts (8 steps each by default)")
    parser.add_argument("--staleness", nargs="*", default=DEFAULT_STALENESS, help=f"subset of {list(STALENESS)}")
    parser.add_argument(
        "--corrections", nargs="*", default=list(CORRECTIONS), help=f"subset of {list(ALL_CORRECTIONS)}"
    )
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "staleness"))
    parser.add_argument("--workdir", default=None, help="where runs are written (default: a new temp dir)")
    parser.add_argument(
        "--from-json", default=None, help="only re-render results.md and the plots from a results.json (no runs)"
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
        write_table(results, os.path.join(a.out, "results.md"), "python -m benchmarks.staleness", window=8)
        levels = [lvl for lvl in STALENESS if any(k.startswith(lvl + " | ") for k in results)]
        for path in plot(results, a.out, levels):
            print(f"[staleness] wrote {path}")
        return
    root = a.workdir or tempfile.mkdtemp(prefix="ess_staleness_")
    os.makedirs(a.out, exist_ok=True)
    world = world_for(a, root, a.prompts)
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
            curves = run_once(a, world, config_flags(level, name), run_dir, seed=42 + seed)
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
    command = "python -m benchmarks.staleness " + " ".join(sys.argv[1:])
    write_table(results, os.path.join(a.out, "results.md"), command.strip(), window=8)
    for path in plot(results, a.out, [lvl for lvl in a.staleness]):
        print(f"[staleness] wrote {path}")
    print(f"[staleness] wrote {a.out}/results.md, results.json ({(time.time() - t_start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
