"""Per-tensor checksums for the weight-sync check: a sync that leaves any weight wrong must not pass silently.

After a sync, the trainer and every engine each reduce every weight to (Σx, Σx², n) in float64. Both
sums are additive over concatenation, so the engine's fused tensors (vLLM packs gate/up into ``gate_up_proj``
and stacks MoE experts) are compared with the sum of the trainer's parts, and zero padding (vLLM pads the
vocabulary) changes neither. vLLM's fused ``qkv_proj`` is compared part by part (``qkv_proj.weight[q]``,
``[k]``, ``[v]``): with tensor parallelism above the model's KV-head count each KV head sits on several workers
(:func:`merge_tensor_parallel` counts it once). With the same dtype on both sides the sums agree to float64
rounding, so a tensor that differs by a single small update is caught and named — which the canary's
log-prob tolerance cannot do. The canary stays: it checks the engine's numerics end to end.

A tied LM head (input and output embeddings one tensor) is also checked by what it computes
(:func:`applied_head_checksum`): vLLM's head registers the embedding's parameter, so the parameter's sums cannot
see a head that computes from a stale copy of it (vLLM's CPU backend computes the logits from a kernel handle
packed from the weight).
"""

from __future__ import annotations

import math
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

Checksum = Tuple[float, float, int]  # (Σx, Σx², numel)

# HF parameter name -> the engine's name (vLLM's packed modules for Llama/Qwen-style models; its FusedMoE stacks every
# expert's gate and up projections into ``experts.w13_weight`` and the down projections into ``experts.w2_weight``).
# Experts first: their names also end in gate_proj/up_proj. transformers 5 already stores the experts fused, one 3-D
# ``experts.gate_up_proj`` and ``experts.down_proj`` per layer (found against a real vLLM engine's names,
# tests/test_sync_check.py): the sums are order-free, so its layout [E, 2I, H] against vLLM's w13 [E, 2I, H] (or
# transposed) compares all the same. q/k/v map onto their part of ``qkv_proj`` (``qkv_proj.weight[k]``), which the
# engine reports separately (:func:`engine_checksums`) because KV heads may be replicated across its workers.
_FUSED = (
    (re.compile(r"\.experts\.gate_up_proj$"), ".experts.w13_weight"),
    (re.compile(r"\.experts\.down_proj$"), ".experts.w2_weight"),
    (re.compile(r"\.experts\.\d+\.(gate|up)_proj\.weight$"), ".experts.w13_weight"),
    (re.compile(r"\.experts\.\d+\.down_proj\.weight$"), ".experts.w2_weight"),
    (re.compile(r"\.(q|k|v)_proj\.(.+)$"), r".qkv_proj.\2[\1]"),
    (re.compile(r"\.(gate|up)_proj\."), ".gate_up_proj."),
)
QKV_PARTS = ("q", "k", "v")

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


HEAD_PROBE_COLUMNS = 8  # one-hot hidden states the engine's tied LM head is applied to (see applied_head_checksum)


def bytes_digest(t: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes (moved to the host, contiguous): equal on both sides of a transfer exactly when
    every bit arrived (the start-up probe of a re-formed weight sync group, ``WeightSync.startup_regroup_probe``)."""
    import hashlib

    return hashlib.sha256(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def applied_name(head: str) -> str:
    """The name under which a tied LM head is compared by what it computes: ``lm_head.weight[applied]``."""
    return f"{head}.weight[applied]"


def probe_columns(hidden: int) -> List[int]:
    """The :data:`HEAD_PROBE_COLUMNS` hidden dimensions (weight columns) the tied-head check reads, evenly spread
    from the first to the last."""
    k = max(1, min(HEAD_PROBE_COLUMNS, hidden))
    return sorted({round(i * (hidden - 1) / max(1, k - 1)) for i in range(k)})


def head_columns_checksum(weight: torch.Tensor) -> Checksum:
    """The trainer's side of the tied-head check: the sums of the :func:`probe_columns` of its embedding [V, H]."""
    return checksum(weight.detach()[:, probe_columns(weight.shape[1])])


def applied_head_checksum(head: torch.nn.Module) -> Optional[Checksum]:
    """The engine's side of the tied-head check: the sums of the logits its LM head computes (through its kernel,
    ``quant_method.apply``, as vLLM's logits processor calls it) for one-hot hidden states e_j, j in
    :func:`probe_columns`. Those logits are column j of the weight the kernel computes with, exactly in any float
    dtype (one product by 1, the rest zeros), and its zero vocabulary padding adds nothing: so they equal the sums
    of the trainer's embedding columns (:func:`head_columns_checksum`) to float64 rounding, and a head whose kernel
    holds other weights than the parameter it shares is named. None for a head without a 2-D weight."""
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2 or not weight.numel():
        return None
    cols = probe_columns(weight.shape[1])
    probes = torch.zeros(len(cols), weight.shape[1], dtype=weight.dtype, device=weight.device)
    probes[torch.arange(len(cols)), torch.tensor(cols)] = 1
    with torch.no_grad():
        logits = head.quant_method.apply(head, probes)
    return checksum(logits)


def tied_head(model: torch.nn.Module) -> Optional[Tuple[str, torch.nn.Parameter]]:
    """(name of the output-embedding module, the shared weight) of an HF model whose input and output embeddings are
    one tensor (``tie_word_embeddings``), else None."""
    try:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    weight = getattr(out, "weight", None)
    if weight is None or inp is None or weight is not getattr(inp, "weight", None):
        return None
    name = next((n for n, m in model.named_modules() if m is out), None)
    return (name, weight) if name else None


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


def merge_tensor_parallel(
    workers: List[Dict[str, Checksum]],
    trainer: Dict[str, Checksum],
    replicas: Optional[List[Dict[str, int]]] = None,
) -> Dict[str, Checksum]:
    """One engine's checksums from its tensor-parallel workers' (in TP rank order).

    Each name's workers fall into consecutive groups of ``r`` that hold the same shard (vLLM places a replicated KV
    head on TP ranks ``j·r .. j·r + r - 1``): the engine's sums are the sum over groups of one member's sums, if the
    members of every group agree (to float64 rounding), else NaN sums, which never match, so the check names the
    tensor. ``r`` is what every worker reported in ``replicas`` (:func:`engine_checksums`: a KV part's replica
    count, 1 for a vocabulary shard, the TP size for a weight they all hold whole); for a name without it, ``r`` is
    the TP size if every worker holds at least the trainer's element count (a replicated tensor) and 1 otherwise
    (a sharded one: its shards add up to the whole; vocabulary padding adds zeros). Names the trainer does not have
    are left out (nothing to decide the layout by)."""
    out: Dict[str, Checksum] = {}
    for name, (_, _, n_trainer) in trainer.items():
        parts = [w[name] for w in workers if name in w]
        if len(parts) != len(workers) or not parts:
            continue
        out[name] = merge_groups(parts, shard_replicas(name, parts, n_trainer, replicas))
    return out


def shard_replicas(
    name: str, parts: List[Checksum], n_trainer: int, replicas: Optional[List[Dict[str, int]]]
) -> Optional[int]:
    """How many consecutive workers hold each shard of ``name`` (see :func:`merge_tensor_parallel`); None when the
    workers report different counts (the merge then fails the tensor)."""
    reported = {r.get(name) for r in replicas} if replicas else {None}
    if reported != {None}:
        return reported.pop() if len(reported) == 1 else None
    return len(parts) if all(n >= n_trainer for _, _, n in parts) else 1


def merge_groups(parts: List[Checksum], r: Optional[int]) -> Checksum:
    """The sum over consecutive groups of ``r`` workers of one member's sums; NaN sums when a group's members
    disagree or ``r`` does not divide the worker count."""
    nan = (math.nan, math.nan, parts[0][2])
    if not r or r < 1 or len(parts) % r:
        return nan
    total = [0.0, 0.0, 0]
    for start in range(0, len(parts), r):
        group = parts[start : start + r]
        if not all(_close(member, group[0], SAME_DTYPE_TOL) for member in group[1:]):
            return nan
        total = [total[0] + group[0][0], total[1] + group[0][1], total[2] + group[0][2]]
    return (total[0], total[1], int(total[2]))


def part_name(name: str, part: str) -> str:
    """The name of one part (q, k or v) of a fused ``qkv_proj`` parameter: ``...qkv_proj.weight[k]``."""
    return f"{name}[{part}]"


def fold_parts(sums: Dict[str, Checksum], other: Iterable[str]) -> Dict[str, Checksum]:
    """``sums`` with each complete set of parts ``X[q]``, ``X[k]``, ``X[v]`` replaced by their sum ``X`` where the
    other side names ``X`` whole and not its parts: a checkpoint that stores ``qkv_proj`` fused (Phi-3), or an engine
    layout whose ``qkv_proj`` could not be split (quantised packing). Other names are unchanged."""
    other = set(other)
    out = dict(sums)
    for name in {n.rpartition("[")[0] for n in sums if n.endswith(("[q]", "[k]", "[v]"))}:
        keys = [part_name(name, p) for p in QKV_PARTS]
        if name in other and name not in out and all(k in out for k in keys) and not any(k in other for k in keys):
            parts = [out.pop(k) for k in keys]
            out[name] = (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts))
    return out


def whole_replicas(module: torch.nn.Module, tp_size: int) -> int:
    """How many consecutive TP workers hold the same shard of ``module``: 1 for a layer split over every rank, more
    where vLLM built it with a smaller TP size than the engine's (its own ``tp_size``), all for a layer built whole."""
    return max(1, tp_size // max(1, getattr(module, "tp_size", tp_size)))


def qkv_layout(layer: torch.nn.Module, tp_size: int) -> Optional[List[Tuple[str, int, int]]]:
    """(part, rows in this worker's shard, replicas) for q, k and v of a vLLM ``QKVParallelLinear`` (any module with
    its ``num_heads``, ``num_kv_heads``, ``head_size`` and ``num_kv_head_replicas``), else None.

    A worker's ``qkv_proj`` holds, along its output dimension, its ``num_heads`` query heads, then its
    ``num_kv_heads`` key heads, then as many value heads (vllm/model_executor/layers/linear.py). Query heads are
    split across the layer's TP ranks; with more ranks than KV heads each KV head is on ``num_kv_head_replicas``
    consecutive ranks. A layer built without TP (its ``tp_size`` 1 in a TP engine) is whole on every rank."""
    try:
        heads, kv_heads, head_size = layer.num_heads, layer.num_kv_heads, layer.head_size
        kv_replicas = layer.num_kv_head_replicas
    except AttributeError:
        return None
    v_head_size = getattr(layer, "v_head_size", None) or head_size
    whole = whole_replicas(layer, tp_size)
    return [
        ("q", heads * head_size, whole),
        ("k", kv_heads * head_size, whole * kv_replicas),
        ("v", kv_heads * v_head_size, whole * kv_replicas),
    ]


def split_qkv(param: torch.Tensor, layout: List[Tuple[str, int, int]]) -> Optional[List[torch.Tensor]]:
    """``param``'s q, k and v blocks along its ``output_dim`` (views), or None if it is not laid out as
    ``layout`` says (no ``output_dim``, or a quantised packing that changes the row count)."""
    dim = getattr(param, "output_dim", None)
    rows = [n for _, n, _ in layout]
    if dim is None or param.dim() <= dim or param.shape[dim] != sum(rows):
        return None
    return list(param.detach().split(rows, dim=dim))


def engine_checksums(
    model: torch.nn.Module,
    tp_size: int = 1,
    loaded: Optional[Dict[str, Checksum]] = None,
    tied_heads: Iterable[str] = (),
) -> Tuple[Dict[str, Checksum], Dict[str, int]]:
    """One engine worker's checksums ``{name: (Σx, Σx², n)}`` and, by name, how many consecutive TP workers hold the
    same data (for :func:`merge_tensor_parallel`; names left out are merged by element count).

    A ``qkv_proj`` parameter is reported as its q, k and v parts (:func:`qkv_layout`; replicas: the KV heads'). A
    vocabulary-parallel embedding or LM head (a module with ``num_embeddings_per_partition``) is a shard on every
    worker, padding included. A parameter vLLM emptied (its CPU backend repacks dense linears into a kernel handle)
    is reported by ``loaded``: the sums of what the loader received, by engine name, the whole tensor on every
    worker. Each module named in ``tied_heads`` (an LM head sharing the input embedding's weight) is also reported
    by what it computes, as :func:`applied_name` (:func:`applied_head_checksum`; a vocabulary shard per worker)."""
    loaded = loaded or {}
    tied_heads = set(tied_heads)
    qkv, vocab, applied = {}, {}, {}
    for prefix, module in model.named_modules():
        if prefix in tied_heads:
            sums = applied_head_checksum(module)
            if sums is not None:
                applied[applied_name(prefix)] = sums, whole_replicas(module, tp_size)
        layout = qkv_layout(module, tp_size)
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{prefix}.{pname}" if prefix else pname
            if layout is not None:
                qkv[full] = layout
            elif hasattr(module, "num_embeddings_per_partition"):
                vocab[full] = whole_replicas(module, tp_size)
    sums: Dict[str, Checksum] = {}
    replicas: Dict[str, int] = {}
    for name, param in model.named_parameters():
        if not param.numel():  # repacked away: what the loader received, whole on every worker
            for key in (k for k in loaded if k == name or k.startswith(name + "[")):
                sums[key], replicas[key] = loaded[key], tp_size
            continue
        blocks = split_qkv(param, qkv[name]) if name in qkv else None
        if blocks is None:
            sums[name] = checksum(param)
            if name in vocab:
                replicas[name] = vocab[name]
            continue
        for (part, _, r), block in zip(qkv[name], blocks):
            sums[part_name(name, part)], replicas[part_name(name, part)] = checksum(block), r
    for name, (head_sums, r) in applied.items():
        sums[name], replicas[name] = head_sums, r
    return sums, replicas


def emptied_names(model: torch.nn.Module) -> List[str]:
    """The parameters vLLM emptied after loading (its CPU backend repacks dense linears into a kernel handle and
    leaves a 0-element placeholder): their sums can only come from what the loader received."""
    return [name for name, param in model.named_parameters() if not param.numel()]


def checkpoint_checksums(files: Iterable[str], names: Iterable[str], dtype: torch.dtype) -> Dict[str, Checksum]:
    """What an engine's own loader received at its start for the parameters ``names`` (engine names, e.g. those of
    :func:`emptied_names`), read from the checkpoint's safetensors ``files``: each HF tensor cast to the engine's
    ``dtype`` (the loader's copy into its parameter does that cast), summed into the engine's (fused) names like the
    loads of a sync (:func:`trainer_checksums`). One tensor in memory at a time."""
    from safetensors import safe_open

    wanted = set(names)

    def tensors():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if engine_name(key).split("[")[0] in wanted:
                        yield key, f.get_tensor(key).to(dtype)

    return trainer_checksums(tensors())


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
