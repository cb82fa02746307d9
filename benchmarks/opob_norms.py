"""How far the LM head's gradient norm moves VCPO's optimal baseline from the whole model's, and what each costs.

    python -m benchmarks.opob_norms [--seeds 3] [--prompts 8] [--n 8] [--max-new-tokens 48] [--out FILE]

b* = Σ w²‖g‖²R / Σ w²‖g‖² per prompt group needs each trajectory's gradient norm ‖g_i‖, g_i = ∇_θ log π_θ(τ_i).
The package computes the LM head's part exactly from the forward that already runs (models/opob.py); the
reference code takes every parameter's, from one backward per trajectory. On the offline tiny world (Qwen2, two
layers, H = 64; the digit-fraction reward), for each seed: sample ``--prompts`` × ``--n`` responses from the
model, then

- ‖g_i^W‖² by the package's hook (the forward with it, against the forward without);
- ‖g_i‖² over all parameters (embeddings, norms, attention, MLP and the head) by one backward per trajectory
  (autograd), and its head part, which must equal the hook's (a check, printed);
- ‖g_i‖² over all parameters by the package's ``--algo.advantage.opob_norm full`` (one forward with autograd and
  one backward for the whole batch, no parameter gradient), which must equal autograd's (a check, printed);
- b* with each norm (w = 1: the norms alone decide the difference), against the plain group mean.

Printed per seed, every seed shown: the head's share of ‖g‖², the within-group correlation of the two norms, the
mean |b*_head − b*_full| and, for scale, the mean |b*_full − group mean| (how far the full norm moves b* at
all), and the seconds of each way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def one_seed(world: dict, seed: int, prompts: int, n: int, max_new_tokens: int) -> dict:
    import torch

    from benchmarks.gradient_quality import Tiny
    from openrlhf_ess.models import opob as maths
    from openrlhf_ess.trainer import opob

    tiny = Tiny(world, max_new_tokens=max_new_tokens, samples_per_prompt=n)
    r = tiny.sample(prompts, torch.Generator().manual_seed(seed))
    model = tiny.model

    with torch.no_grad():
        t0 = time.perf_counter()
        tiny.log_probs(r)
        t_forward = time.perf_counter() - t0
        t0 = time.perf_counter()
        with opob.norms_captured(model.lm_head, r.sequences, r.action_mask, 1.0) as out:
            tiny.log_probs(r)
        t_head = time.perf_counter() - t0
    head = out[0].double()

    full, head_autograd = [], []
    t0 = time.perf_counter()
    for i in range(r.sequences.shape[0]):
        model.zero_grad(set_to_none=True)
        tiny.log_probs(r.chunk(i, i + 1)).sum().backward()
        full.append(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None).item())
        head_autograd.append(model.lm_head.weight.grad.double().pow(2).sum().item())
    t_full = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    full = torch.tensor(full, dtype=torch.float64)
    t0 = time.perf_counter()
    tiny.log_probs(r).sum().backward()  # a training step's forward and backward over the batch, for scale
    t_step = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    ours = opob.model_sq_grad_norms(model, lambda: tiny.log_probs(r).sum(-1))  # one forward + one backward
    t_ours = time.perf_counter() - t0
    check_full = ((ours - full).abs() / full).max()
    check = (head - torch.tensor(head_autograd, dtype=torch.float64)).abs().max() / head.abs().max()

    ones = torch.ones_like(full)
    rewards = r.rewards.double()
    b_head = maths.optimal_baseline(rewards, ones, head, n)
    b_full = maths.optimal_baseline(rewards, ones, full, n)
    mean = rewards.view(-1, n).mean(-1, keepdim=True).expand(-1, n).reshape(-1)
    groups_h, groups_f = head.sqrt().view(-1, n), full.sqrt().view(-1, n)
    corr = [
        torch.corrcoef(torch.stack([h, f]))[0, 1].item()
        for h, f in zip(groups_h, groups_f)
        if h.std() > 0 and f.std() > 0
    ]
    return {
        "seed": seed,
        "samples": int(full.numel()),
        "head_share": (head / full).mean().item(),
        "corr": statistics.mean(corr) if corr else float("nan"),
        "b_gap": (b_head - b_full).abs().mean().item(),
        "b_full_vs_mean": (b_full - mean).abs().mean().item(),
        "b_head_vs_mean": (b_head - mean).abs().mean().item(),
        "t_forward": t_forward,
        "t_head": t_head,
        "t_full": t_full,
        "t_ours": t_ours,
        "t_step": t_step,
        "hook_vs_autograd": check.item(),
        "full_vs_autograd": check_full.item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (the baseline's group)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default=None, help="write the table as markdown here")
    a = p.parse_args()
    import torch

    from openrlhf_ess.tiny.world import build_world

    torch.set_num_threads(1)
    lines = [
        "| seed | samples | head share of ‖g‖² | within-group corr(‖g^W‖, ‖g‖) | mean \\|b*_head − b*_full\\| | "
        "mean \\|b*_full − mean\\| | mean \\|b*_head − mean\\| | forward (s) | forward + head norms (s) | "
        "per-trajectory backward, full norms (s) | package's full norms, one pass (s) | "
        "forward + backward over the batch (s) | head hook vs autograd (rel) "
        "| full norms vs autograd (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as root:
        world = build_world(os.path.join(root, "world"))
        for seed in range(a.seeds):
            s = one_seed(world, seed, a.prompts, a.n, a.max_new_tokens)
            lines.append(
                f"| {s['seed']} | {s['samples']} | {s['head_share']:.2f} | {s['corr']:.2f} | {s['b_gap']:.4f} | "
                f"{s['b_full_vs_mean']:.4f} | {s['b_head_vs_mean']:.4f} | {s['t_forward']:.3f} | {s['t_head']:.3f} | "
                f"{s['t_full']:.3f} | {s['t_ours']:.3f} | {s['t_step']:.3f} | "
                f"{s['hook_vs_autograd']:.1e} | {s['full_vs_autograd']:.1e} |"
            )
            print(lines[-1], flush=True)
    from benchmarks.common import write_table

    write_table("opob_norms", "1 CPU thread, fp32", lines, a.out)


if __name__ == "__main__":
    main()
