"""Evidence for --algo.sampling_mask keep and --algo.prox_mode bypass.

    python -m benchmarks.sampling_mask [--prompts 64] [--episodes 2] [--out docs/sampling_mask]

Runs the tiny digit task through the real CLI (Ray + vLLM CPU + DeepSpeed, async + partial rollouts, TIS cap 2),
one run after another:

- ``top-p 0.8``: upstream's log-probs (full vocabulary) against the engine's truncated μ;
- ``top-p 0.8 + mask``: the same with ``--algo.sampling_mask keep``;
- ``fp32 recompute`` and ``fp32 bypass`` (top-p 1, fp32 engine and trainer): the make-experience time the
  bypass mode saves (upstream's old-log-prob forward skipped), as a ratio of per-step medians in one run set;
- ``fp32 top-p 0.8 + mask + bypass``: bypass made sound under truncated sampling by the mask.

Then a micro-benchmark of the mask's maths at a real vocabulary (V = 151,936, Qwen's), on this CPU: forward +
backward time and peak memory of the log-probs of 1,024 tokens, upstream's full-vocabulary ``log_probs_from_logits``
against the seam's ``truncated_log_probs``, for top-k 50 and top-p 0.8 (``--micro-only``: this part alone, a few
minutes).

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

from benchmarks.common import add_model_arguments, check_model_arguments, peak_allocated_bytes, world_for  # noqa: E402
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
    from benchmarks.common import run_cli
    from openrlhf_ess.tools.summary import read_scalars

    run_dir = tempfile.mkdtemp(dir=root)
    args = common_flags(a, world, run_dir, a.prompts, dtype="bf16")  # the bf16 runs, against FP32's
    args += ["--train.num_episodes", str(a.episodes), "--rollout.temperature", "1.0"] + ASYNC + flags
    t0 = time.time()
    rc, log = run_cli(args, run_dir, timeout=3600)
    if rc != 0:
        raise RuntimeError(f"run failed ({' '.join(flags)}):\n{log[-3000:]}")
    scalars = read_scalars(os.path.join(run_dir, "tb"))
    return {"wall_s": time.time() - t0, "curves": {k: scalars.get(tag, []) for k, tag in TAGS.items()}}


def _top_p_counts(logits, p: float = 0.8, rows: int = 128):
    """k_t of top-p sampling from these logits (T = 1): the smallest prefix of the sorted probabilities whose mass
    reaches p. Setup only (a sort of V per row), not timed."""
    import torch

    flat = logits.reshape(-1, logits.shape[-1])
    counts = []
    for start in range(0, flat.shape[0], rows):
        mass = flat[start : start + rows].softmax(-1).sort(-1, descending=True).values.cumsum(-1)
        counts.append((mass < p).sum(-1) + 1)
    return torch.cat(counts).reshape(logits.shape[:-1])


def micro(vocab: int = 151_936, tokens: int = 1024, reps: int = 5, masked_fn=None) -> dict:
    """Forward + backward seconds and peak bytes of the log-prob step at ``vocab``: upstream's full-vocabulary
    ``log_probs_from_logits`` against the seam's ``truncated_log_probs`` (what replaces it under ``keep``), on the
    same logits, interleaved ``reps`` times (medians), for top-k 50, top-p 0.8 (k_t from flat and from peaked
    logits) and k_t uniform in [1, 200) (the setting of the first measurement). ``masked_fn(x, labels, kept)``
    (-> log-probs) replaces the masked side, to measure another implementation the same way."""
    import torch

    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()  # upstream's models package imports flash-attn, absent on CPU
    from openrlhf.models.utils import log_probs_from_logits

    from openrlhf_ess.models.sampling_mask import truncated_log_probs

    if masked_fn is None:

        def masked_fn(x, labels, kept):
            return truncated_log_probs(x, labels, kept)[0]

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=g) * 3  # flat: entropy 7.5 nats, top-p 0.8 keeps ~2,400
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    weights = torch.randn(1, tokens, generator=g)  # d loss / d log-prob: any fixed values
    peaked = 5 / 3  # σ = 5: entropy 3.6 nats, top-p 0.8 keeps ~30 (closer to a trained LM's typical token)
    settings = {  # name: (logits scale, k_t)
        "top-k 50": (1.0, torch.full((1, tokens), 50)),
        "top-p 0.8, flat logits (σ = 3)": (1.0, _top_p_counts(logits)),
        "top-p 0.8, peaked logits (σ = 5)": (peaked, _top_p_counts(logits * peaked)),
        "k uniform in [1, 200)": (1.0, torch.randint(1, 200, (1, tokens), generator=g)),
    }

    def step(fn, scale, measure_memory=False):
        x = (logits * scale if scale != 1.0 else logits.clone()).requires_grad_(True)
        held = {}
        t0 = time.perf_counter()
        if measure_memory:
            fwd_peak = peak_allocated_bytes(lambda: held.update(lp=fn(x)))
        else:
            held["lp"] = fn(x)
        t1 = time.perf_counter()
        loss = (held.pop("lp") * weights).sum()
        if measure_memory:
            return fwd_peak, peak_allocated_bytes(loss.backward)
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    out = {"vocab": vocab, "tokens": tokens, "reps": reps, "logits_bytes": logits.numel() * 4, "settings": {}}
    for name, (scale, kept) in settings.items():
        upstream = lambda x: log_probs_from_logits(x, labels)  # noqa: E731
        masked = lambda x, kept=kept: masked_fn(x, labels, kept)  # noqa: E731
        times = {"upstream": [], "masked": []}
        for _ in range(reps):  # interleaved: both sides see the same load on a shared machine
            times["upstream"].append(step(upstream, scale))
            times["masked"].append(step(masked, scale))
        row = {"k median": float(kept.float().median()), "k max": int(kept.max())}
        for side, values in times.items():
            row[f"{side} fwd s"] = statistics.median(f for f, _ in values)
            row[f"{side} bwd s"] = statistics.median(b for _, b in values)
            row[f"{side} s"] = statistics.median(f + b for f, b in values)
            row[f"{side} peak fwd bytes"], row[f"{side} peak bwd bytes"] = step(
                upstream if side == "upstream" else masked, scale, measure_memory=True
            )
        row["ratio"] = row["masked s"] / row["upstream s"]
        out["settings"][name] = row
        print(f"[sampling_mask micro] {name}: {row}", flush=True)
    return out


def exact_k_support(x, k):
    """What vLLM's Triton top-k/top-p kernel keeps (CUDA, batches >= 8; ``topk_topp_triton.py``, 0.29): exactly k
    tokens per row, ties at the boundary trimmed in vocabulary order (lowest ids kept). Written independently
    of the trainer's rule: a stable sort by (value descending, id ascending), the first k."""
    import torch

    order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros_like(x, dtype=torch.bool)
    ranks = torch.arange(x.shape[-1]).expand_as(x)
    keep.scatter_(-1, order, ranks < k.unsqueeze(-1))
    return keep


def tie_error(vocab: int = 151_936, rows: int = 256, seed: int = 0) -> dict:
    """What vLLM's Triton kernel keeps (exactly k_t) against two trainer rules: keeping every
    token tied with the k_t-th value (the rule before the fix) and ours now (``support_mask``: exactly k_t). On
    bf16-rounded LM-like rows (a few strong tokens over a N(0, 1.5²) tail: top token ≈ 0.6) and fp32 ones, for
    top-k 50 and top-p 0.8 (k_t = Triton's count): how often the boundary is tied, and the error in log π̃,
    Δ = log Σ_{trainer's S} e^z − log Σ_{Triton's S} e^z, with its bound log(1 + m/k_t) (m extra tied tokens)."""
    import torch

    from openrlhf_ess.models.sampling_mask import support_mask

    g = torch.Generator().manual_seed(seed)
    out = {}
    for dtype in ("bfloat16", "float32"):
        z = torch.randn(rows, vocab, generator=g) * 1.5
        z[:, :8] += torch.linspace(14, 6, 8)
        z = z[:, torch.randperm(vocab, generator=g)]
        z = z.to(getattr(torch, dtype)).float()
        sorted_p = z.softmax(-1).sort(-1, descending=True).values
        top_p_k = ((sorted_p.cumsum(-1) - sorted_p) < 0.8).sum(-1)  # Triton's top-p count: smallest prefix >= p
        for name, k in (("top-k 50", torch.full((rows,), 50)), ("top-p 0.8", top_p_k)):
            triton = exact_k_support(z, k)
            kth = z.sort(-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
            lse_triton = z.masked_fill(~triton, float("-inf")).logsumexp(-1)
            row = {"median_k": int(k.median())}
            for rule, keep in (("all ties kept (before)", z >= kth), ("exactly k_t (now)", support_mask(z, k))):
                extra = (keep & ~triton).sum(-1)
                delta = z.masked_fill(~keep, float("-inf")).logsumexp(-1) - lse_triton
                row[rule] = {
                    "tied_rows": float((extra > 0).float().mean()),
                    "mean_delta": float(delta.abs().mean()),
                    "max_delta": float(delta.abs().max()),
                    "max_bound": float(torch.log1p(extra / k).max()),
                }
            out[f"{dtype} {name}"] = row
    return out


def micro_markdown(m: dict) -> list:
    """The micro-benchmark's table (results.md and the docs quote it)."""
    size = m["logits_bytes"]
    lines = [
        "Command: `python -m benchmarks.sampling_mask --micro-only` (or the full run). "
        f"Log-prob step at V = {m['vocab']:,}, {m['tokens']} tokens, fp32 logits ({size / 2**20:.0f} MiB), this CPU "
        f"(1 thread), forward + backward, medians of {m['reps']} interleaved repetitions; peak = bytes allocated "
        "beyond the logits during the forward / the backward (torch.profiler), in units of the logits' size:",
        "",
        "| k_t | k median / max | upstream fwd + bwd s | masked fwd + bwd s | **masked / upstream** | "
        "upstream peak fwd / bwd | masked peak fwd / bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in m["settings"].items():
        lines.append(
            f"| {name} | {r['k median']:.0f} / {r['k max']} | {r['upstream fwd s']:.2f} + {r['upstream bwd s']:.2f} | "
            f"{r['masked fwd s']:.2f} + {r['masked bwd s']:.2f} | **{r['ratio']:.2f}x** | "
            f"{r['upstream peak fwd bytes'] / size:.2f} / {r['upstream peak bwd bytes'] / size:.2f} | "
            f"{r['masked peak fwd bytes'] / size:.2f} / {r['masked peak bwd bytes'] / size:.2f} |"
        )
    return lines


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
    if m and "settings" in m:
        lines += [""] + micro_markdown(m)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompts per episode (8 per step)")
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--runs", nargs="*", default=list(RUNS), help="subset of: " + "; ".join(RUNS))
    parser.add_argument("--no-micro", action="store_true", help="skip the V = 151,936 micro-benchmark")
    parser.add_argument(
        "--micro-only", action="store_true", help="only the micro-benchmark (keeps the runs in --out/results.json)"
    )
    parser.add_argument("--report", action="store_true", help="only rewrite results.md from --out/results.json")
    parser.add_argument(
        "--ties", action="store_true", help="only print the tie-handling error against vLLM's Triton kernel (JSON)"
    )
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "sampling_mask"))
    add_model_arguments(parser)
    a = parser.parse_args()
    if a.ties:
        print(json.dumps(tie_error(), indent=1))
        return
    check_model_arguments(parser, a)
    os.makedirs(a.out, exist_ok=True)
    command = "python -m benchmarks.sampling_mask " + " ".join(x for x in sys.argv[1:] if x != "--report")
    if a.report:
        with open(os.path.join(a.out, "results.json")) as f:
            write_markdown(json.load(f), os.path.join(a.out, "results.md"), command.strip())
        return
    if a.micro_only:
        path = os.path.join(a.out, "results.json")
        results = json.load(open(path)) if os.path.exists(path) else {"runs": {}}
        results["micro"] = micro()
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        write_markdown(results, os.path.join(a.out, "results.md"), "python -m benchmarks.sampling_mask")
        print("\n".join(micro_markdown(results["micro"])))
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
