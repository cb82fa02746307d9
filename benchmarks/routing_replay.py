"""Cost of ``--algo.routing_replay`` in the trainer: one Qwen3-MoE decoder layer at Qwen3-30B-A3B's sizes.

The replay hook (``openrlhf_ess/models/routing_replay.py``) changes only what each MoE block's router returns: it
takes the engine's expert ids and recomputes the gate weights from the router's own logits (a softmax and a
gather over [tokens, experts]), instead of the router's top-k. Everything else of the forward and backward runs
unchanged. This times forward + backward of one decoder layer (attention + the sparse-MoE block: 128 experts,
top-8, hidden 2048, expert width 768, as Qwen3-30B-A3B) on ``--tokens`` tokens, without and with the hook
replaying the layer's own routes (so both compute the same function), interleaved, medians of ``--repeats``;
and the bytes autograd saves for the backward of one forward, both ways (the activation memory replay adds).

    python -m benchmarks.routing_replay --tokens 1024 --repeats 5

CPU fp32 here; on GPU (``--device cuda --dtype bf16``) the ratio is what a user's step pays per MoE layer.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from openrlhf_ess.models import routing_replay as seam

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=1,
    vocab_size=1024,  # the LM head is not what replay touches; a small vocabulary keeps the timing on the layer
    max_position_embeddings=8192,
)


def build(device: str, dtype: torch.dtype, sizes: dict = QWEN3_30B_A3B):
    """A one-layer Qwen3-MoE causal LM of ``sizes`` (seed 0), on ``device`` in ``dtype``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**sizes)
    config._attn_implementation = "sdpa"
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)


def step(model, ids: torch.Tensor, routes=None) -> float:
    """Seconds of one forward + backward (gradients cleared first), replaying ``routes`` if given."""
    model.zero_grad(set_to_none=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if routes is None:
        model(input_ids=ids).logits.float().mean().backward()
    else:
        with seam.replay_routes(model, routes):
            model(input_ids=ids).logits.float().mean().backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def saved_bytes(model, ids: torch.Tensor, routes=None) -> int:
    """Bytes autograd keeps for the backward of one forward (every tensor saved, counted once per storage): the
    activation memory a training step holds between its forward and backward."""
    seen = {}

    def pack(t):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with seam.replay_routes(model, routes) if routes is not None else contextlib.nullcontext():
            out = model(input_ids=ids).logits
    del out
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def measure(model, tokens: int, repeats: int) -> dict:
    """Forward + backward of ``model`` on ``tokens`` random tokens without and with the hook replaying the model's
    own routes (the same function both ways), after one warm-up each, interleaved (machine load hits both alike):
    every repeat's seconds, their medians, and the bytes saved for backward both ways."""
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=model.device)
    with torch.no_grad(), seam.record_routes(model) as rec:
        model(input_ids=ids)
    routes = rec.routes.to(seam.route_dtype(config.num_experts))
    step(model, ids), step(model, ids, routes)  # warm-up
    plain, replayed = [], []
    for _ in range(repeats):
        plain.append(step(model, ids))
        replayed.append(step(model, ids, routes))
    return {
        "plain": plain,
        "replayed": replayed,
        "off_s": statistics.median(plain),
        "replay_s": statistics.median(replayed),
        "saved_off": saved_bytes(model, ids),
        "saved_replay": saved_bytes(model, ids, routes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = parser.parse_args()
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    m = measure(build(a.device, dtype), a.tokens, a.repeats)
    p, r, mem_off, mem_replay = m["off_s"], m["replay_s"], m["saved_off"], m["saved_replay"]
    layers, k, experts = 48, QWEN3_30B_A3B["num_experts_per_tok"], QWEN3_30B_A3B["num_experts"]
    print(
        "| tokens | device, dtype | forward+backward s, off | with replay | with / off "
        "| saved for backward MiB, off | with replay | route bytes/token (48 layers) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {a.tokens} | {a.device}, {a.dtype} | {p:.3f} | {r:.3f} | **{r / p:.3f}×** "
        f"| {mem_off / 2**20:.1f} | {mem_replay / 2**20:.1f} | {seam.route_bytes_per_token(layers, k, experts)} |"
    )
    print(f"all repeats (s): off {[round(x, 3) for x in m['plain']]}, replay {[round(x, 3) for x in m['replayed']]}")


if __name__ == "__main__":
    main()
