"""What --algo.advantage.opob_norm full costs at a shape where matmuls dominate: the make-experience forward with the
whole-model norm pass against upstream's, and both against a training step, side by side, with the profiler's split.

    python -m benchmarks.opob_full_cost [--hidden 1024] [--layers 4] [--vocab 32768] [--rows 4] [--prompt 128]
                                        [--actions 384] [--reps 3] [--out FILE]

A random Qwen2 (H = 1,024, I = 3H, 16 heads of 64, 4 key-value heads, untied head, V = 32,768, fp32, gradient
checkpointing on, non-re-entrant: upstream's default) scores ``--rows`` rows of ``--prompt`` + ``--actions`` tokens.
Three things run on the same rows, interleaved (one of each, then again) so drift of a shared machine hits all
alike; each is timed ``--reps`` times and the median kept, in CPU seconds of this process (one thread: the work's
cost, also where other jobs share the cores; wall-clock beside it):

- ``upstream``: upstream's make-experience forward (``PolicyModelActor.forward`` as OpenRLHF ships it: evaluation
  mode, no gradient) - what runs with ``--algo.advantage.opob_norm head`` or no baseline at all;
- ``full``: ours with ``--algo.advantage.opob_norm full`` (``PolicyModelActorImpl.forward``: the pass's one forward
  with autograd gives the log-probs and the per-sample norms come from its recomputation and one backward that
  writes no gradient; upstream's forward does not run), the pass budget set to the whole micro-batch
  (``--algo.advantage.opob_pass_tokens`` = rows x tokens: one pass);
- ``step``: a training step's forward and backward through upstream's ``Actor`` (training mode, the same
  checkpointing, the loss -Σ log π over the actions, every weight's gradient written), without the optimizer.

Then each runs once under ``torch.profiler`` (CPU): the share of its time in matrix products (``aten::mm``,
``addmm``, ``bmm``, ``baddbmm``, the attention kernel) says whether the shape is matmul-bound, and the peak of live
allocations (``benchmarks.common.peak_allocated_bytes``) gives each one's memory.

By count (docs/opob.md): the pass is one forward, the checkpointed layers' recomputation (stopping where the step's
does) and one backward without weight gradients, so about one step's multiply-adds less the weight gradients'
share plus the norm products (each linear's per-row ‖Σ_t a_t h_tᵀ‖², T×T or direct); upstream's forward is a third
of a step. CPU, fp32, 1 thread: the ratios, not the seconds, are what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MiB = 1 << 20
MATMUL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)


def build(hidden: int, layers: int, vocab: int, max_len: int):
    """A random Qwen2 of the given shape (heads of 64, a key-value head per 256 of H, sdpa attention), in training
    mode with non-re-entrant checkpointing (``benchmarks.opob_norm_memory.build``)."""
    from benchmarks.opob_norm_memory import build as qwen2

    return qwen2(
        layers, hidden, vocab, head_dim=64, kv_heads=max(1, hidden // 256), max_len=max_len, attn_implementation="sdpa"
    )


def upstream_actor(model, temperature: float = 1.0):
    """Upstream's ``Actor`` around ``model`` (made importable on CPU first), as its make-experience forward uses it."""
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()
    from openrlhf.models import Actor

    actor = Actor(model, temperature=temperature)
    actor.packing_samples = False  # set by upstream only when it loads the model from a path
    return actor


def policy_actor(model, norm: str = "full", pass_tokens: int = 0, max_len: int = 12, temperature: float = 1.0):
    """The real ``PolicyModelActorImpl`` (not a Ray actor) around upstream's ``Actor``, with the flags its
    make-experience forward reads: ``--algo.advantage.baseline opob`` with ``norm``, the pass budget, one training
    row per micro-batch of ``max_len`` tokens (tests/test_opob_full_norm.py builds its actors with it too)."""
    from openrlhf_ess.trainer.ray.ppo_actor import PolicyModelActorImpl

    impl = PolicyModelActorImpl.__new__(PolicyModelActorImpl)
    impl.actor = upstream_actor(model, temperature)
    advantage = types.SimpleNamespace(baseline="opob", opob_norm=norm, opob_pass_tokens=pass_tokens)
    args = types.SimpleNamespace(
        algo=types.SimpleNamespace(advantage=advantage),
        train=types.SimpleNamespace(micro_batch_size=1),
        data=types.SimpleNamespace(max_len=max_len),
    )
    impl.strategy = types.SimpleNamespace(args=args, ring_attn_group=None, is_rank_0=lambda: False)
    impl.trainer = types.SimpleNamespace(routing_replay=False, stop_ids=None)
    return impl


def batch(vocab: int, rows: int, prompt: int, actions: int):
    import torch

    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, vocab, (rows, prompt + actions), generator=g)
    att = torch.ones_like(seq)
    am = torch.ones(rows, actions, dtype=torch.bool)
    return seq, att, am


def runners(model, seq, att, am):
    """The three things measured, each a no-argument callable."""

    from openrlhf_ess.trainer.ray.ppo_actor import _UpstreamPolicyModelActor

    rows, tokens = seq.shape
    impl = policy_actor(model, pass_tokens=rows * tokens, max_len=tokens)
    actor = upstream_actor(model)

    def upstream():
        _UpstreamPolicyModelActor.forward(impl, seq, am, att)

    def full():
        out = impl.forward(seq, am, att)
        assert out.shape == (rows, am.shape[1] + 1)

    def step():
        actor.train()
        lp = actor(seq, am, att)
        (-(lp * am).sum()).backward()
        model.zero_grad(set_to_none=True)

    return {"upstream": upstream, "full": full, "step": step}


def timed(fns: dict, reps: int):
    """Per run, the seconds of CPU time this process spent (``time.process_time``: on one thread, what the work
    cost, whatever else shares the cores) and of wall-clock."""
    cpu = {name: [] for name in fns}
    wall = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    return cpu, wall


def profiled(fn) -> dict:
    """One run under torch.profiler: total self CPU time, the matrix products' share, and the five largest ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = {}
    for e in prof.key_averages():
        ops[e.key] = ops.get(e.key, 0.0) + e.self_cpu_time_total
    total = sum(ops.values())
    matmul = sum(v for k, v in ops.items() if k in MATMUL_OPS)
    top = [(k, v / total) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:5]]
    return {"total_s": total / 1e6, "matmul_share": matmul / total if total else 0.0, "top": top}


def main(argv=None):
    import torch

    from benchmarks.common import peak_allocated_bytes, write_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--actions", type=int, default=384)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--out", default=None)
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokens = a.prompt + a.actions
    model = build(a.hidden, a.layers, a.vocab, tokens)
    seq, att, am = batch(a.vocab, a.rows, a.prompt, a.actions)
    fns = runners(model, seq, att, am)
    fns["step"]()  # warm-up: the first call allocates what later ones reuse
    seconds, wall = timed(fns, a.reps)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    prof = {k: profiled(fn) for k, fn in fns.items()}
    peak = {} if a.no_memory else {k: peak_allocated_bytes(fn) / MiB for k, fn in fns.items()}
    shape = (
        f"Qwen2, H = {a.hidden:,}, {a.layers} layers, V = {a.vocab:,}, {a.rows} rows x ({a.prompt} prompt + "
        f"{a.actions} action) tokens"
    )
    lines = [
        f"| {shape} | CPU seconds, median of {a.reps} (each run) | × step | wall-clock median (s) | matmul share "
        "(profiler) | peak (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "upstream": "upstream's make-experience forward (no grad)",
        "full": "make-experience with `full` (the pass; upstream's forward skipped)",
        "step": "training step: forward + backward, checkpointed",
    }
    for k in ("upstream", "full", "step"):
        runs = ", ".join(f"{s:.2f}" for s in seconds[k])
        mem = f"{peak[k]:.0f}" if peak else "–"
        lines.append(
            f"| {names[k]} | {med[k]:.2f} ({runs}) | {med[k] / med['step']:.2f}× | {statistics.median(wall[k]):.2f} | "
            f"{prof[k]['matmul_share']:.0%} | {mem} |"
        )
    lines += [
        "",
        f"make-experience with `full` against without: {med['full'] / med['upstream']:.2f}×; extra over upstream's, "
        f"in training steps: {(med['full'] - med['upstream']) / med['step']:.2f}.",
        "",
        "| run | five largest ops, share of the profiled run's self time |",
        "|---|---|",
    ]
    for k in ("upstream", "full", "step"):
        lines.append(f"| {k} | " + ", ".join(f"{n} {share:.0%}" for n, share in prof[k]["top"]) + " |")
    write_table("opob_full_cost", f"CPU, fp32, 1 thread, torch {torch.__version__}", lines, a.out)


if __name__ == "__main__":
    main()
