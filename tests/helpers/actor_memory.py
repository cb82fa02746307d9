"""The memory self-check's activation floors (``checks/selfcheck.py::step_floor``, ``logits_floor``) against what
upstream's real ``Actor`` holds: shared by ``tests/test_selfcheck.py`` and GPU check ``7.step_floor``."""

from __future__ import annotations

import types
from typing import Dict, Tuple


def peak_bytes(fn, device: str) -> int:
    """Peak memory growth while ``fn`` runs: CUDA's ``max_memory_allocated`` over what was allocated before; on the
    CPU torch.profiler's memory events (``benchmarks.common.peak_allocated_bytes``)."""
    import torch

    if device != "cuda":
        from benchmarks.common import peak_allocated_bytes

        return peak_allocated_bytes(fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measured_and_floors(model, rows: int, length: int, device: str = "cpu") -> Tuple[Dict, Dict, Dict]:
    """Upstream's ``Actor`` around ``model`` (made importable on CPU first) scoring ``rows`` random rows of
    ``length`` tokens, the second half actions: the peak of a training forward + backward (each gradient dropped as
    it accumulates, ZeRO-3's footprint) and of a no-grad forward; the floors for the same tokens from the shape
    ``memory_probe`` reads off the actor. Returns (measured, floors, shape)."""
    import torch

    from benchmarks.common import gradients_dropped
    from benchmarks.opob_full_cost import upstream_actor
    from openrlhf_ess.checks import selfcheck

    actor = upstream_actor(model)
    shape = selfcheck.memory_probe(types.SimpleNamespace(actor=actor))["shape"]
    seq = torch.randint(1, shape["vocab"], (rows, length), generator=torch.Generator().manual_seed(0)).to(device)
    att, am = torch.ones_like(seq), torch.ones(rows, length // 2, dtype=torch.bool, device=device)

    def step():
        with gradients_dropped(model):
            actor(seq, am, att).sum().backward()

    def forward():
        with torch.no_grad():
            actor(seq, am, att)

    measured = {"step": peak_bytes(step, device), "forward": peak_bytes(forward, device)}
    floors = {
        "step": selfcheck.step_floor(rows * length, **shape),
        "forward": selfcheck.logits_floor(rows * length, shape["vocab"], shape["dtype_bytes"]),
    }
    return measured, floors, shape
