"""Peak memory of --algo.advantage.opob_norm full's pass against the training step it precedes, on CPU.

    python -m benchmarks.opob_norm_memory [--hidden H] [--vocab V] [--shape L B T ...] [--out FILE]

A random Qwen2 (by default H = 128, I = 384, 4 heads of 32, V = 4,096; ``--hidden``/``--vocab`` for others, I = 3H;
fp32, gradient checkpointing on, training mode as upstream's actor runs it) scores B rows of T tokens. For each
shape, the peak of live CPU allocations over the weights (``benchmarks.common.peak_allocated_bytes``: torch.profiler's
memory events) of:

- ``step``: a training forward and backward of the same rows, each parameter's gradient dropped as it
  accumulates (``register_post_accumulate_grad_hook``): the activations-and-logits footprint of a ZeRO-3 step,
  whose gradients are reduced and partitioned as they come;
- ``pass``: ``trainer/opob.py::model_sq_grad_norms`` as shipped (a checkpointed layer's inputs taken again from
  the backward's recomputation);
- ``kept``: the same pass keeping every layer's inputs from the forward (the form before that change), for scale.

Grows with B, L (layers) and T (= prompt + A): printed as a table, ratios against ``step``.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MiB = 1 << 20


def build(
    layers: int,
    hidden: int = 128,
    vocab: int = 4096,
    head_dim: int = 32,
    kv_heads: int = 1,
    max_len: int = 4096,
    device: str = "cpu",
    dtype=None,
    **extra,
):
    """A random untied Qwen2 (I = 3H), in training mode with non-re-entrant checkpointing (upstream's default), on
    ``device`` in ``dtype`` (fp32 by default); ``extra`` goes to its config (e.g. ``attn_implementation``)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype or torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def log_prob_sums(model, seq):
    """Σ_t log softmax(z_t)[y_t] over the second half of each row (the response), as the actor scores it."""
    import torch

    logits = model(input_ids=seq, use_cache=False).logits
    a = seq.shape[1] // 2
    lp = torch.log_softmax(logits[:, -a - 1 : -1].float(), -1).gather(-1, seq[:, -a:, None])[..., 0]
    return lp.sum(-1)


def peaks(model, rows: int, length: int) -> dict:
    import torch

    from benchmarks.common import gradients_dropped, peak_allocated_bytes
    from openrlhf_ess.trainer import opob

    seq = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(1))

    def step():
        with gradients_dropped(model):
            log_prob_sums(model, seq).sum().backward()

    def norm_pass():
        opob.model_sq_grad_norms(model, lambda: log_prob_sums(model, seq))

    def kept():
        hook = opob._NormPass.hook

        def keep_all(self, module, inputs, out):  # as if no layer were recomputed: every input kept from the forward
            depth, self.inside[0] = self.inside[0], 0
            try:
                hook(self, module, inputs, out)
            finally:
                self.inside[0] = depth

        opob._NormPass.hook = keep_all
        try:
            norm_pass()
        finally:
            opob._NormPass.hook = hook

    return {name: peak_allocated_bytes(fn) for name, fn in (("step", step), ("pass", norm_pass), ("kept", kept))}


SHAPES = [  # (layers, rows, tokens)
    (4, 1, 512),
    (4, 2, 512),
    (4, 4, 512),
    (2, 2, 512),
    (8, 2, 512),
    (4, 2, 256),
    (4, 2, 1024),
]


def main(argv=None):
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128, help="H (heads of 32)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument(
        "--shape", type=int, nargs=3, action="append", metavar=("L", "B", "T"), help="instead of the default shapes"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "| layers L | rows B | tokens T | step (MiB) | pass (MiB) | pass / step | kept (MiB) | kept / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layers, rows, length in args.shape or SHAPES:
        p = peaks(build(layers, hidden=args.hidden, vocab=args.vocab), rows, length)
        lines.append(
            f"| {layers} | {rows} | {length} | {p['step'] / MiB:.1f} | {p['pass'] / MiB:.1f} | "
            f"{p['pass'] / p['step']:.2f} | {p['kept'] / MiB:.1f} | {p['kept'] / p['step']:.2f} |"
        )
        print(lines[-1], flush=True)
    from benchmarks.common import write_table

    setting = f"CPU, fp32, 1 thread, gradient checkpointing on, H = {args.hidden:,}, V = {args.vocab:,}"
    write_table("opob_norm_memory", setting, lines, args.out)


if __name__ == "__main__":
    main()
