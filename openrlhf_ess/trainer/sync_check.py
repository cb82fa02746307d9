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

# HF parameter name -> the engine's fused parameter name (vLLM's packed modules for Llama/Qwen-style models; its
# FusedMoE stacks every expert's gate and up projections into ``experts.w13_weight`` and the down projections into
# ``experts.w2_weight``: issue 29 item 5, MoE experts were never compared). Experts first: their names also end in
# gate_proj/up_proj. transformers 5 already stores the experts fused, one 3-D ``experts.gate_up_proj`` and
# ``experts.down_proj`` per layer (found against a real vLLM engine's names, tests/test_sync_check.py): the sums are
# order-free, so its layout [E, 2I, H] against vLLM's w13 [E, 2I, H] (or transposed) compares all the same.
_FUSED = (
    (re.compile(r"\.experts\.gate_up_proj$"), ".experts.w13_weight"),
    (re.compile(r"\.experts\.down_proj$"), ".experts.w2_weight"),
    (re.compile(r"\.experts\.\d+\.(gate|up)_proj\.weight$"), ".experts.w13_weight"),
    (re.compile(r"\.experts\.\d+\.down_proj\.weight$"), ".experts.w2_weight"),
    (re.compile(r"\.(q|k|v)_proj\."), ".qkv_proj."),
    (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."),
)
MIN_COVERAGE = 0.95  # below this fraction of the trainer's weight elements compared, the check says so loudly

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
        renamed = pattern.sub(fused, hf_name)
        if renamed != hf_name:
            return renamed
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
    for name, ours in trainer.items():
        if name not in engine:
            continue
        compared += 1
        if not _close(engine[name], ours, tol):
            bad.append(name)
    return bad, compared


def _close(theirs: Checksum, ours: Checksum, tol: float) -> bool:
    """Σx² relative to itself, Σx relative to its bound √(n·Σx²); written as "within" so that NaN sums (NaN
    weights on either side) are never close."""
    (es, ess, _), (s, ss, n) = theirs, ours
    scale = math.sqrt(max(n * ss, 1e-30))
    return abs(es - s) <= tol * scale and abs(ess - ss) <= tol * max(ss, 1e-30)


def coverage(trainer: Dict[str, Checksum], engine: Dict[str, Checksum]) -> float:
    """The fraction of the trainer's weight elements whose tensor the engine also reported (what the check can
    compare). Names on one side only are not compared; this says how much that leaves out."""
    total = sum(n for _, _, n in trainer.values())
    return sum(n for name, (_, _, n) in trainer.items() if name in engine) / total if total else 0.0


def merge_tensor_parallel(workers: List[Dict[str, Checksum]], trainer: Dict[str, Checksum]) -> Dict[str, Checksum]:
    """One engine's checksums from its tensor-parallel workers' (issue 29, item 5: engines with TP > 1 were never
    checked). A sharded tensor holds fewer elements per worker than the trainer's tensor: its worker sums add up to
    the whole (Σx, Σx² and n are additive; vocabulary padding adds zeros). A replicated one holds them all in every
    worker: worker 0's sums are the engine's if every worker agrees (to float64 rounding), else NaN sums, which
    never match, so the check names the tensor. Names the trainer does not have are left out (nothing to decide
    the layout by)."""
    out: Dict[str, Checksum] = {}
    for name, (_, _, n_trainer) in trainer.items():
        parts = [w[name] for w in workers if name in w]
        if len(parts) != len(workers) or not parts:
            continue
        if all(n >= n_trainer for _, _, n in parts):  # replicated (padding only adds elements)
            # replicas that disagree: NaN sums, which never match, so the check names the tensor
            agree = all(_close(part, parts[0], SAME_DTYPE_TOL) for part in parts[1:])
            out[name] = parts[0] if agree else (math.nan, math.nan, parts[0][2])
        else:  # sharded
            out[name] = (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts))
    return out


def align_experts(trainer: Dict[str, Checksum], engine_names: Iterable[str]) -> Dict[str, Checksum]:
    """The trainer's fused expert names (``<layer>.mlp.experts.w13_weight``) renamed to the engine's where vLLM
    nests its FusedMoE weights one level deeper (e.g. ``experts.routed_experts.w13_weight`` in newer layouts): the
    one engine tensor under the same layer's ``experts`` with the same final name. Other names are unchanged."""
    names = list(engine_names)
    out: Dict[str, Checksum] = {}
    for name, sums in trainer.items():
        if ".experts." in name and name not in names:
            layer, _, tail = name.partition(".experts.")
            found = [e for e in names if e.startswith(layer + ".experts.") and e.endswith("." + tail)]
            name = found[0] if len(found) == 1 else name
        out[name] = sums
    return out
