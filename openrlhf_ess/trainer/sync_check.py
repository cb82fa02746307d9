"""Per-tensor checksums for the weight-sync check (issue: nothing fails silently).

After a sync, the trainer and every engine each reduce every weight to (Σx, Σx², n) in float64. Both
sums are additive over concatenation, so the engine's fused tensors (vLLM packs q/k/v into ``qkv_proj``
and gate/up into ``gate_up_proj``) are compared with the sum of the trainer's parts, and zero padding
(vLLM pads the vocabulary) changes neither. With the same dtype on both sides the sums agree to
float64 rounding, so a tensor that differs by a single small update is caught and named — which the
canary's log-prob tolerance cannot do. The canary stays: it checks the engine's numerics end to end.
"""

from __future__ import annotations

import math
import re
from typing import Dict, Iterable, List, Tuple

import torch

Checksum = Tuple[float, float, int]  # (Σx, Σx², numel)

# HF parameter name -> the engine's fused parameter name (vLLM's packed modules for Llama/Qwen-style models)
_FUSED = ((re.compile(r"\.(q|k|v)_proj\."), ".qkv_proj."), (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."))

SAME_DTYPE_TOL = 1e-9  # float64 sums of identical values, summed in a different order
CAST_TOL = 1e-2  # the engine keeps another dtype than the trainer sent: rounding changes the sums


CHUNK_ELEMENTS = 1 << 24  # float64 working copy per step: 128 MiB, whatever the parameter's size


def checksum(t: torch.Tensor) -> Checksum:
    """(Σx, Σx², n) in float64, summed on ``t``'s own device in chunks: no host copy of a GPU parameter, and the
    extra device memory is one chunk in float64 (a 70B model's 1B-element embedding would need 8 GB at once)."""
    flat = t.detach().reshape(-1)
    s = torch.zeros((), dtype=torch.float64, device=flat.device)
    ss = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        x = flat[start : start + CHUNK_ELEMENTS].to(torch.float64)
        s += x.sum()
        ss += torch.dot(x, x)  # (x * x).sum() would hold a second chunk
        del x  # before the next chunk is made: one chunk alive at a time
    return (s.item(), ss.item(), flat.numel())


def engine_name(hf_name: str) -> str:
    for pattern, fused in _FUSED:
        hf_name = pattern.sub(fused, hf_name)
    return hf_name


def trainer_checksums(named: Iterable[Tuple[str, torch.Tensor]]) -> Dict[str, Checksum]:
    """The trainer's checksums, summed into the engine's (fused) names."""
    return combine_checksums((name, checksum(t)) for name, t in named)


def combine_checksums(named_sums: Iterable[Tuple[str, Checksum]]) -> Dict[str, Checksum]:
    """Per-tensor checksums by HF name, summed into the engine's (fused) names (Σx, Σx² and n are additive)."""
    out: Dict[str, List[float]] = {}
    for name, (s, ss, n) in named_sums:
        acc = out.setdefault(engine_name(name), [0.0, 0.0, 0])
        acc[0] += s
        acc[1] += ss
        acc[2] += n
    return {k: (v[0], v[1], int(v[2])) for k, v in out.items()}


def mismatched(trainer: Dict[str, Checksum], engine: Dict[str, Checksum], tol: float) -> Tuple[List[str], int]:
    """Names whose sums differ beyond ``tol`` (relative), and how many names were compared.

    Σx² is compared relative to itself; Σx relative to its bound √(n·Σx²) (Σx can be ~0). Names on one
    side only (tied embeddings, buffers, layouts we do not know) are not compared.
    """
    bad, compared = [], 0
    for name, (s, ss, n) in trainer.items():
        if name not in engine:
            continue
        es, ess, _ = engine[name]
        compared += 1
        scale = math.sqrt(max(n * ss, 1e-30))
        # written as "not within" so that NaN sums (NaN weights on either side) count as a mismatch
        if not (abs(es - s) <= tol * scale and abs(ess - ss) <= tol * max(ss, 1e-30)):
            bad.append(name)
    return bad, compared
