"""Per-step overhead of each openrlhf-ess feature on the tiny CPU stack, measured side by side in one run.

    python -m benchmarks.overhead [--prompts 64] [--out docs/benchmarks.md]

Runs the real CLI (Ray + vLLM CPU + DeepSpeed) once per configuration, in groups that share a baseline
(sync without a reference model; sync with a KL loss; async + partial rollouts), and reports per-step
times from the run's own timing metrics (first step dropped as warm-up) and the peak resident memory of
the whole process tree, as ratios against the group's baseline. Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import add_model_arguments, check_model_arguments, run_flags, world_for  # noqa: E402
from openrlhf_ess.tools.summary import read_scalars  # noqa: E402

ASYNC = ["--train.async_enable", "--train.partial_rollout_enable"]
ZERO3_2RANKS = ["--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2"]
KL = ["--algo.kl.init_coef", "0.01", "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--ref.num_gpus_per_node", "1"]
GROUPS = {
    "sync": {
        "off": [],
        "ESS-LR": ["--algo.ess_lr_enable"],
        "TIS token": ["--algo.tis_cap", "2"],
        "TIS seq": ["--algo.tis_cap", "2", "--algo.tis_level", "seq"],
    },
    "sync check": {"check off": ["--vllm.sync_check_tol", "0"], "check on (default)": []},
    "sync + KL loss": {"off": KL, "k2 KL": KL + ["--algo.kl.off_policy_k2_enable"]},
    "async + partial": {
        "off (recompute)": ASYNC,
        "snapshot": ASYNC + ["--algo.prox_mode", "snapshot", "--algo.prox_snapshots", "3"],
        "interrupt": ASYNC + ["--algo.prox_mode", "interrupt"],
        "dedicated": ASYNC + ["--algo.prox_mode", "dedicated"],
        "ewma": ASYNC + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "batch"],
        "loglinear": ASYNC + ["--algo.prox_mode", "loglinear"],
    },
    # the π_prox modes on a ZeRO-3 actor over two ranks (each rank keeps its partition of the copies)
    "async + partial, ZeRO-3, 2 actor ranks": {
        "off (recompute)": ASYNC + ZERO3_2RANKS,
        "snapshot": ASYNC + ZERO3_2RANKS + ["--algo.prox_mode", "snapshot", "--algo.prox_snapshots", "3"],
        "interrupt": ASYNC + ZERO3_2RANKS + ["--algo.prox_mode", "interrupt"],
        "dedicated": ASYNC + ZERO3_2RANKS + ["--algo.prox_mode", "dedicated"],
        "ewma": ASYNC + ZERO3_2RANKS + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "batch"],
    },
}
TIMINGS = ("timing/ppo_train", "timing/make_experience", "timing/generation", "timing/broadcast", "timing/step_total")
# What a π_prox mode or the sync check reports as its own cost (seconds per step), summed into one column.
OWN_COST = (
    "prox/extra_forward_seconds",
    "prox/sync_score_seconds",
    "prox/dedicated_load_seconds",
    "sync/checksum_seconds",
    "sync/canary_seconds",
)


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_once(a, world: dict, flags: List[str], run_dir: str, prompts: int) -> Dict[str, float]:
    args = run_flags(a, world, run_dir, prompts)
    if "--algo.kl.init_coef" in flags:  # the KL group sets its own coefficient
        i = args.index("--algo.kl.init_coef")
        del args[i : i + 2]
    cmd = [sys.executable, "-m", "openrlhf_ess.cli.train_ppo_ray", *args, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peak = 0
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def sample():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _tree_rss(proc.pid))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        done.set()
        sampler.join()
    if rc != 0:
        raise RuntimeError(f"run failed ({rc}): see {run_dir}/log.txt")
    return summarize_run(run_dir, peak / 2**30)


def summarize_run(run_dir: str, peak_rss_gb: float) -> Dict[str, float]:
    """Median per-step times (first step dropped as warm-up; the median resists the odd slow step that a
    shared 2-core machine produces) and the peak memory, saved next to the run."""
    scalars = read_scalars(os.path.join(run_dir, "tb"))
    out = {"peak_rss_gb": peak_rss_gb, "steps": float(len(scalars["train/reward"]))}
    for tag in TIMINGS + OWN_COST:
        values = [v for _, v in scalars.get(f"train/{tag}", [])][1:]
        out[tag] = statistics.median(values) if values else float("nan")
    own = {t for t in OWN_COST if out[t] == out[t]}  # NaN: the run does not report it
    if "prox/sync_score_seconds" in own:  # interrupt: the actor's scoring is inside the sync's scoring time
        own.discard("prox/extra_forward_seconds")
    out["own_cost"] = sum(out[t] for t in own)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(out, f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per run (8 per step)")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    parser.add_argument("--groups", nargs="*", default=list(GROUPS), help=f"subset of {list(GROUPS)}")
    add_model_arguments(parser)
    a = parser.parse_args()
    check_model_arguments(parser, a)
    root = tempfile.mkdtemp(prefix="ess_bench_")
    world = world_for(a, root, a.prompts)
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    for group, configs in GROUPS.items():
        if group not in a.groups:
            continue
        results[group] = {}
        for name, flags in configs.items():
            run_dir = os.path.join(root, f"{group}_{name}".replace(" ", "_").replace("+", "p"))
            os.makedirs(run_dir)
            t0 = time.time()
            results[group][name] = run_once(a, world, flags, run_dir, a.prompts)
            print(f"[bench] {group} / {name}: {results[group][name]} ({time.time() - t0:.0f} s)", flush=True)
    write_report(results, a.out, a.prompts)
    print(f"[bench] wrote {a.out}")


def write_report(results, path: str, prompts: int) -> None:
    """Write the tables of the groups just run. A rerun of some groups (``--groups``) keeps the other groups'
    tables and the hand-written reading (from "## Reading" on) of an existing report."""
    header = [
        "# Overhead of each feature (tiny CPU stack)",
        "",
        f"Measured with `python -m benchmarks.overhead --prompts {prompts}` on a 2-core CPU machine: the real CLI",
        "(Ray + vLLM CPU engine + DeepSpeed ZeRO-2 unless the group says otherwise, tiny Qwen2), 8 prompts x 4",
        "samples per step, one run per configuration, a group's runs in one invocation (`--groups` reruns some",
        "groups and keeps the others). Per-step seconds are the run's own `train/timing/*` metrics, median",
        "over the steps after the first; ratios are against the group's baseline (same flags, feature off). Peak",
        "memory is the resident memory of the whole process tree (Ray workers included). One run of 7 timed steps",
        "per configuration on a shared 2-core machine: differences of ~10% are noise (a feature cannot make a",
        "step faster; ratios below 1 show the noise level). 'own cost' is what the feature reports as its own",
        "time per step (median): π_prox extra forwards, scoring at sync, the dedicated model's weight load, the",
        "weight-sync canary; it is measured inside the step, so it is not subject to the between-run noise.",
        "",
    ]
    sections = {}
    for group, runs in results.items():
        base = next(iter(runs.values()))
        lines = [
            f"## {group}",
            "",
            "| config | ppo_train s/step | ratio | make_experience s/step | ratio |"
            " generation s/step | broadcast s/step | step total s | own cost s/step | own / total |"
            " peak RSS GB | ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in runs.items():
            lines.append(
                f"| {name} | {r['timing/ppo_train']:.4f} | {r['timing/ppo_train'] / base['timing/ppo_train']:.3f} "
                f"| {r['timing/make_experience']:.4f} | "
                f"{r['timing/make_experience'] / base['timing/make_experience']:.3f} | "
                f"{r['timing/generation']:.3f} | {r['timing/broadcast']:.3f} | {r['timing/step_total']:.3f} | "
                f"{r.get('own_cost', 0.0):.4f} | {r.get('own_cost', 0.0) / r['timing/step_total']:.1%} | "
                f"{r['peak_rss_gb']:.2f} | "
                f"{r['peak_rss_gb'] / base['peak_rss_gb']:.3f} |"
            )
        sections[group] = "\n".join(lines) + "\n"
    kept, reading = {}, ""
    if os.path.exists(path):
        text = open(path).read()
        if "\n## Reading" in text:
            text, reading = text[: text.index("\n## Reading")], text[text.index("\n## Reading") :]
        for section in text.split("\n## ")[1:]:
            kept[section.split("\n", 1)[0]] = "## " + section.strip("\n") + "\n"
    kept.update(sections)
    order = [g for g in GROUPS if g in kept] + [g for g in kept if g not in GROUPS]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(header) + "\n" + "\n".join(kept[g] for g in order) + reading)


if __name__ == "__main__":
    main()
