"""Evidence for --algo.sampling_mask keep and --algo.prox_mode bypass (issue 13 items 7 and 10).

    python -m benchmarks.sampling_mask [--prompts 64] [--episodes 2] [--out docs/sampling_mask]

Runs the tiny digit task through the real CLI (Ray + vLLM CPU + DeepSpeed, async + partial rollouts, TIS cap 2),
one run after another:

- ``top-p 0.8``: upstream's log-probs (full vocabulary) against the engine's truncated μ;
- ``top-p 0.8 + mask``: the same with ``--algo.sampling_mask keep``;
- ``fp32 recompute`` and ``fp32 bypass`` (top-p 1, fp32 engine and trainer): the make-experience time the
  bypass mode saves (upstream's old-log-prob forward skipped), as a ratio of per-step medians in one run set;
- ``fp32 top-p 0.8 + mask + bypass``: bypass made sound under truncated sampling by the mask.

Then a micro-benchmark of the mask's maths at a real vocabulary (V = 151,936, Qwen's), on this CPU: the
masked log-probs of 1,024 response tokens against upstream's full-vocabulary ``log_probs_from_logits``.

Writes ``results.json`` (every run's per-step curves) and ``results.md`` (the side-by-side table) into ``--out``.
The reading is written by hand in docs/sampling_mask.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import add_model_arguments, check_model_arguments, world_for  # noqa: E402
from benchmarks.common import run_flags as common_flags  # noqa: E402

ASYNC = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.tis_cap", "2"]
FP32 = ["--vllm.dtype", "float32", "--ds.param_dtype", "fp32"]
MASK = ["--algo.sampling_mask", "keep"]
TOP_P = ["--rollout.top_p", "0.8"]
RUNS = {
    "top-p 0.8": TOP_P,
    "top-p 0.8 + mask": TOP_P + MASK,
    "fp32 recompute": FP32,
    "fp32 bypass": FP32 + ["--algo.prox_mode", "bypass"],
    "fp32 top-p 0.8 + mask + bypass": FP32 + TOP_P + MASK + ["--algo.prox_mode", "bypass"],
}
TAGS = {
    "reward": "train/reward",
    "mismatch k1": "train/mismatch/k1",
    "max |log ratio|": "train/mismatch/max_abs_log_ratio",
    "TIS clip frac": "train/tis/clip_frac",
    "TIS mean weight": "train/tis/mean_weight",
    "log kept mass": "train/sampling_mask/log_kept_mass",
    "make-experience s": "train/timing/make_experience",
    "ppo_train s": "train/timing/ppo_train",
    "old-log-prob forwards": "train/prox/recompute_forwards",
}


def run_one(a, world, flags, root) -> dict:
    from openrlhf_ess.tools.summary import read_scalars
    from tests.helpers.e2e import run_cli

    run_dir = tempfile.mkdtemp(dir=root)
    args = common_flags(a, world, run_dir, a.prompts)
    args += ["--train.num_episodes", str(a.episodes), "--rollout.temperature", "1.0"] + ASYNC + flags
    t0 = time.time()
    rc, log = run_cli(args, run_dir, timeout=3600)
    if rc != 0:
        raise RuntimeError(f"run failed ({' '.join(flags)}):\n{log[-3000:]}")
    scalars = read_scalars(os.path.join(run_dir, "tb"))
    return {"wall_s": time.time() - t0, "curves": {k: scalars.get(tag, []) for k, tag in TAGS.items()}}


def micro(vocab: int = 151_936, tokens: int = 1024, reps: int = 5) -> dict:
    """Seconds for the masked log-probs of ``tokens`` positions at ``vocab`` vs upstream's full-vocabulary ones."""
    import torch

    from openrlhf_ess import cpu_compat

    cpu_compat.apply()  # upstream's models package imports flash-attn, absent on CPU
    from openrlhf.models.utils import log_probs_from_logits

    from openrlhf_ess.models.sampling_mask import apply_to_log_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    kept = torch.randint(1, 200, (1, tokens), generator=g)  # a peaked model's top-p support: tens to hundreds
    full_s, mask_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        lp = log_probs_from_logits(logits, labels)
        full_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        apply_to_log_probs(logits, labels, lp, kept)
        mask_s.append(time.perf_counter() - t0)
    return {"vocab": vocab, "tokens": tokens, "full_s": statistics.median(full_s), "mask_s": statistics.median(mask_s)}


def _mean(points, digits=4):
    """Mean over the run's steps, or '–' for a metric the run does not log."""
    values = [v for _, v in points]
    return f"{statistics.mean(values):.{digits}f}" if values else "–"


def _median(points, digits=2):
    values = [v for _, v in points][1:]  # the first step pays start-up costs
    return f"{statistics.median(values):.{digits}f}" if values else "–"


def write_markdown(results: dict, path: str, command: str) -> None:
    lines = [
        "# Sampling mask and bypass: measured (tiny CPU stack)",
        "",
        f"Command: `{command}`. Async + partial rollouts, TIS cap 2, T = 1.0; every number is a per-step mean",
        "over the run (timings: the median over steps 2..n). Written by `benchmarks/sampling_mask.py`.",
        "",
        "(`old-log-prob forwards` is logged by the non-default prox modes only: recompute runs one per step.)",
        "",
        "| run | steps | final reward | mismatch k1 | max abs log ratio | TIS clip frac | TIS mean weight | "
        "log kept mass | make-experience s | ppo_train s | old-log-prob forwards |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["runs"].items():
        c = r["curves"]
        final = [v for _, v in c["reward"]][-3:]
        lines.append(
            f"| {name} | {len(c['reward'])} | {statistics.mean(final):.3f} | {_mean(c['mismatch k1'])} | "
            f"{_mean(c['max |log ratio|'], 3)} | {_mean(c['TIS clip frac'])} | {_mean(c['TIS mean weight'])} | "
            f"{_mean(c['log kept mass'])} | {_median(c['make-experience s'])} | {_median(c['ppo_train s'])} | "
            f"{_mean(c['old-log-prob forwards'], 1)} |"
        )
    runs = results["runs"]
    if "fp32 recompute" in runs and "fp32 bypass" in runs:
        ratio = float(_median(runs["fp32 bypass"]["curves"]["make-experience s"], 4)) / float(
            _median(runs["fp32 recompute"]["curves"]["make-experience s"], 4)
        )
        lines += ["", f"bypass / recompute make-experience time (medians): **{ratio:.2f}x**."]
    m = results.get("micro")
    if m:
        lines += [
            "",
            f"Mask maths at V = {m['vocab']:,}, {m['tokens']} response tokens, this CPU (1 thread): masked "
            f"{m['mask_s']:.3f} s vs upstream's full-vocabulary log-probs {m['full_s']:.3f} s "
            f"(**{m['mask_s'] / m['full_s']:.1f}x** that step; the model forward is not included).",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per episode (8 per step)")
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--runs", nargs="*", default=list(RUNS), help="subset of: " + "; ".join(RUNS))
    parser.add_argument("--no-micro", action="store_true", help="skip the V = 151,936 micro-benchmark")
    parser.add_argument("--report", action="store_true", help="only rewrite results.md from --out/results.json")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "sampling_mask"))
    add_model_arguments(parser)
    a = parser.parse_args()
    check_model_arguments(parser, a)
    os.makedirs(a.out, exist_ok=True)
    command = "python -m benchmarks.sampling_mask " + " ".join(x for x in sys.argv[1:] if x != "--report")
    if a.report:
        with open(os.path.join(a.out, "results.json")) as f:
            write_markdown(json.load(f), os.path.join(a.out, "results.md"), command.strip())
        return
    root = tempfile.mkdtemp(prefix="ess_mask_bench_")
    world = world_for(a, root, a.prompts)
    for name in a.runs:
        if name not in RUNS:
            parser.error(f"--runs {name!r}: choose from {list(RUNS)}")
    results = {"runs": {}}
    for name in a.runs:
        print(f"[sampling_mask] {name} ...", flush=True)
        results["runs"][name] = run_one(a, world, RUNS[name], root)
        with open(os.path.join(a.out, "results.json"), "w") as f:  # after each run: a crash keeps what was measured
            json.dump(results, f, indent=1)
    if not a.no_micro:
        results["micro"] = micro()
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_markdown(results, os.path.join(a.out, "results.md"), command.strip())
    print(open(os.path.join(a.out, "results.md")).read())


if __name__ == "__main__":
    main()
