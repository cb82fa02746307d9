"""What --algo.advantage.baseline opob costs: the make-experience forward with and without the per-sample LM-head
gradient norms, side by side, and their peak memory.

    python -m benchmarks.opob_cost [--reps 5] [--out docs/opob_cost.md]

OPOB adds work only to the actor's old-log-prob forward (one per rollout batch): the ghost-norm computation on the
LM head's inputs and logits (models/opob.py); the training step itself is unchanged. Two measurements, interleaved
(with, without, with, ...) so machine drift hits both alike, median of ``--reps``:

1. the whole forward (a Qwen2 body + head at V = 151,936, the vocabulary of Qwen2.5/Qwen3) of B responses of A
   tokens, as upstream's ``Actor.forward`` scores them, with and without ``trainer/opob.py::norms_captured``;
2. the norms alone against the LM head's own forward (A·V·H) at A = 256 and 1,024, H = 1,024, and the peak of live
   allocations the norms add (``benchmarks.common.peak_allocated_bytes``).

CPU numbers (fp32, 1 thread); the ratio, not the seconds, is what carries to a GPU, where A²·V and A·V·H run as
the same kind of matmul.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

V = 151_936


def _median_pair(fn_a, fn_b, reps):
    a, b = [], []
    for _ in range(reps):
        for fn, out in ((fn_a, a), (fn_b, b)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def whole_forward(reps: int, batch: int, prompt: int, actions: int, hidden: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_ess.trainer import opob

    config = Qwen2Config(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    seq = torch.randint(0, V, (batch, prompt + actions))
    mask = torch.ones(batch, actions)

    def plain():
        with torch.no_grad():
            logits = model(seq).logits[:, -actions - 1 : -1]
            logits.log_softmax(-1).gather(-1, seq[:, -actions:, None])

    def with_norms():
        with opob.norms_captured(model.lm_head, seq, mask, 1.0) as out, torch.no_grad():
            plain()
        assert len(out) == 1

    plain()
    with_norms()  # warm-up
    t_plain, t_opob = _median_pair(plain, with_norms, reps)
    return t_plain, t_opob


def _one_response(actions: int, hidden: int):
    """One response of ``actions`` tokens at the LM head (V = 151,936): its inputs h, the head's weight, the tokens,
    the mask and the logits z = h·Wᵀ."""
    import torch

    torch.manual_seed(0)
    h = torch.randn(1, actions, hidden)
    w = torch.randn(V, hidden) / hidden**0.5
    return h, w, torch.randint(0, V, (1, actions)), torch.ones(1, actions), h @ w.T


def norms_alone(reps: int, actions: int, hidden: int):

    from benchmarks.common import peak_allocated_bytes
    from openrlhf_ess.models import opob

    h, w, y, m, z = _one_response(actions, hidden)

    def head():
        h @ w.T

    def norms():
        opob.lm_head_sq_grad_norms(h, z, y, m)

    t_head, t_norms = _median_pair(head, norms, reps)
    peak = peak_allocated_bytes(norms)
    return t_head, t_norms, peak


def methods(reps: int, actions: int, hidden: int):
    """The two exact ways of the norms (models/opob.py: ``gram`` A²·V, ``direct`` A·V·H) against the LM head's own
    forward, with the peak each adds."""

    from benchmarks.common import peak_allocated_bytes
    from openrlhf_ess.models import opob

    h, w, y, m, z = _one_response(actions, hidden)
    out = {}
    for method in ("gram", "direct"):
        t_head, t_norms = _median_pair(
            lambda: h @ w.T, lambda: opob.lm_head_sq_grad_norms(h, z, y, m, method=method), reps
        )
        peak = peak_allocated_bytes(lambda: opob.lm_head_sq_grad_norms(h, z, y, m, method=method))
        out[method] = (t_head, t_norms, peak)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="write the tables as markdown here")
    p.add_argument(
        "--methods-only",
        nargs="*",
        type=int,
        default=None,
        metavar="A",
        help="only the table of the two norm methods, at these response lengths (e.g. 1024 4096)",
    )
    p.add_argument("--hidden", type=int, default=1024, help="H of the methods table")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    if a.methods_only is not None:
        lines = [
            f"| A (one response), H = {a.hidden:,}, V = 151,936 | LM head forward A·V·H (s) | gram A²·V (s) | "
            "direct A·V·H (s) | gram / head | direct / head | peak gram / direct (MiB) | auto takes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for actions in a.methods_only:
            r = methods(a.reps, actions, a.hidden)
            t_head = statistics.median([r["gram"][0], r["direct"][0]])
            lines.append(
                f"| {actions:,} | {t_head:.2f} | {r['gram'][1]:.2f} | {r['direct'][1]:.2f} | "
                f"{r['gram'][1] / t_head:.2f}x | {r['direct'][1] / t_head:.2f}x | "
                f"{r['gram'][2] / 2**20:.0f} / {r['direct'][2] / 2**20:.0f} | "
                f"{'gram' if actions <= a.hidden else 'direct'} |"
            )
            print(lines[-1], flush=True)
        _write(a, lines)
        return
    lines = [
        "| make-experience forward (Qwen2 body, V = 151,936, H = 256, 2 layers; B x (64 prompt + A) tokens) | "
        "without OPOB (s) | with OPOB (s) | ratio |",
        "|---|---|---|---|",
    ]
    for batch, actions in ((4, 128), (2, 512)):
        t_plain, t_opob = whole_forward(a.reps, batch, 64, actions, 256)
        lines.append(f"| B = {batch}, A = {actions} | {t_plain:.3f} | {t_opob:.3f} | {t_opob / t_plain:.2f}x |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "| A (one response), H = 1,024, V = 151,936 | LM head forward A·V·H (s) | norms (s) | norms / head | "
        "peak the norms add (MiB) | A x A fp32 (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for actions in (256, 1024):
        t_head, t_norms, peak = norms_alone(a.reps, actions, 1024)
        lines.append(
            f"| {actions} | {t_head:.3f} | {t_norms:.3f} | {t_norms / t_head:.2f}x | {peak / 2**20:.0f} | "
            f"{actions * actions * 4 / 2**20:.0f} |"
        )
        print(lines[-1], flush=True)
    _write(a, lines)


def _write(a, lines) -> None:
    from benchmarks.common import write_table

    write_table("opob_cost", f"1 CPU thread, fp32, median of {a.reps} interleaved repetitions", lines, a.out)


if __name__ == "__main__":
    main()
