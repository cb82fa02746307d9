"""MoE routing replay (R3): the trainer's forward uses the experts the engine chose.

A sparse-MoE layer sends token t to the experts E_t = top-k(p_t), p_t = softmax(W_r h_t), and mixes
their outputs with gate weights g_t. The engine (vLLM) and the trainer (HF) compute h_t with
different kernels, so near-ties in p_t can resolve differently: the trainer then scores a token
with experts that never produced it, and log π_θ / μ carries that mismatch. Replay takes E_t from
the engine and only the weights from the trainer:

    E_t   = engine's expert ids for token t in this layer               (replayed, not differentiated)
    g_t,e = p_t,e                         for e in E_t                  (renorm off)
    g_t,e = p_t,e / Σ_{e' ∈ E_t} p_t,e'    for e in E_t                  (renorm on: norm_topk_prob, Mixtral)
    y_t   = Σ_{e ∈ E_t} g_t,e · Expert_e(h_t)  (+ the block's shared expert, unchanged)

p_t comes from the trainer's own router logits, so the router still gets a gradient through g_t.
This is exactly the family's own gate rule with top-k replaced by a lookup; replaying the ids the
model would pick itself reproduces its forward bit for bit.

The seam: in transformers 5 every supported family routes through one router module
(``<Family>TopKRouter``, the block's ``.gate``) whose forward returns
``(router_logits [N, E], gate_weights [N, k], expert_ids [N, k])`` over the N = B·S flattened tokens
of the block input. A forward hook on that module replaces the last two outputs; nothing else of
the model is touched, and experts / shared expert / aux loss code run as upstream wrote them.

Supported (``model_type``): qwen2_moe, qwen3_moe, olmoe (softmax, renorm iff ``norm_topk_prob``,
weights cast back to the logits' dtype) and mixtral (softmax, always renormalised, weights kept
fp32). Not supported: deepseek_v2/v3, glm4_moe and other grouped / sigmoid routers (their weights
use a bias-corrected choice score, group-limited top-k and ``routed_scaling_factor``: a different
gate rule, not written or tested here), and qwen3_next / qwen3_5_moe (hybrid models not checked).

Shapes: ``routes`` [B, S, L, k] integer (any int dtype; uint8 as stored), L = number of MoE layers
(ordinal) or number of decoder layers (vLLM's layout: dense layers' rows are ignored). A token whose
ids fall outside [0, E) (e.g. -1 in int16, 255 in uint8: "no route recorded", such as padding)
keeps the model's own top-k.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

# Name of the flag this seam serves; quoted in the pre-flight error.
FLAG = "--algo.routing_replay"


@dataclass(frozen=True)
class _Family:
    """How one HF family routes: its MoE block / router classes and its gate-weight rule."""

    block: str  # class name of the sparse-MoE block (whose ``.gate`` is the router)
    router: str  # class name of the router module the hook is put on
    renorm: Callable[[object], bool]  # config -> whether top-k weights are renormalised
    cast_to_logits_dtype: bool  # whether the router casts the fp32 weights back to the logits' dtype


_FAMILIES = {
    "qwen2_moe": _Family("Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", lambda c: bool(c.norm_topk_prob), True),
    "qwen3_moe": _Family("Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", lambda c: bool(c.norm_topk_prob), True),
    "olmoe": _Family("OlmoeSparseMoeBlock", "OlmoeTopKRouter", lambda c: bool(c.norm_topk_prob), True),
    "mixtral": _Family("MixtralSparseMoeBlock", "MixtralTopKRouter", lambda c: True, False),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)


def _config_of(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def supported(model_or_config) -> bool:
    """Whether routing replay supports this model (or config): its ``model_type`` is a listed family."""
    return getattr(_config_of(model_or_config), "model_type", None) in _FAMILIES


def require_supported(model_or_config) -> None:
    """Raise ``ValueError`` naming the model_type and the supported families unless :func:`supported`."""
    model_type = getattr(_config_of(model_or_config), "model_type", None)
    if model_type not in _FAMILIES:
        raise ValueError(
            f"{FLAG} needs a sparse-MoE model of one of the families {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"this model's model_type is {model_type!r}. Drop {FLAG} or use a supported MoE model."
        )


@dataclass(frozen=True)
class MoeLayer:
    """One sparse-MoE block of a loaded model: the block, its router, decoder-layer index and top-k."""

    block: torch.nn.Module
    router: torch.nn.Module
    layer_idx: int  # decoder-layer index (vLLM's route layout indexes by this)
    num_experts: int
    top_k: int


def moe_layers(model: torch.nn.Module) -> list[MoeLayer]:
    """Every sparse-MoE block of ``model``, in decoder-layer order. Raises if the model is unsupported.

    Also checks each block's router is the class the gate rule was written for, so a transformers
    upgrade that changes the router fails here instead of replaying with a stale rule.
    """
    require_supported(model)
    family = _FAMILIES[_config_of(model).model_type]
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ != family.block:
            continue
        router = module.gate
        if type(router).__name__ != family.router:
            raise ValueError(f"{FLAG}: {name}.gate is {type(router).__name__}, expected {family.router}")
        match = re.search(r"layers\.(\d+)\.", name + ".")
        if match is None:
            raise ValueError(f"{FLAG}: cannot tell the decoder layer of MoE block {name!r}")
        found.append(MoeLayer(module, router, int(match.group(1)), router.num_experts, router.top_k))
    if not found:
        raise ValueError(f"{FLAG}: no {family.block} found in this {_config_of(model).model_type} model")
    return found


def gate_weights(router_logits: torch.Tensor, expert_ids: torch.Tensor, renorm: bool, cast: bool) -> torch.Tensor:
    """Gate weights g [N, k] of the chosen experts from router logits [N, E] and ids [N, k] (long).

        p = softmax(z) in fp32;  g_e = p_e  (e ∈ ids);  if renorm: g_e /= Σ_{e' ∈ ids} p_e'

    Same operations, in the same order and precision, as the transformers 5 routers of the listed
    families (topk values of p are the gathered p), so own ids give the router's own weights bitwise.
    Differentiable in ``router_logits``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights = probs.gather(-1, expert_ids)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype) if cast else weights


def _layer_axis(routes: torch.Tensor, layers: list[MoeLayer], num_hidden_layers: int) -> list[int]:
    """Index into routes' layer axis for each MoE block: ordinal (L = #MoE layers) or decoder index (L = #layers)."""
    num = routes.shape[2]
    if num == len(layers):
        return list(range(len(layers)))
    if num == num_hidden_layers:
        return [layer.layer_idx for layer in layers]
    raise ValueError(
        f"routes have {num} layers; expected {len(layers)} (MoE layers) or {num_hidden_layers} (decoder layers)"
    )


def moe_columns(model: torch.nn.Module, routes: torch.Tensor) -> list[int]:
    """Index into ``routes``' layer axis [B, S, L, k] of each MoE layer of ``model``, in :func:`moe_layers` order
    (``routes[:, :, moe_columns(...)]`` is the routes in the ordinal layout :func:`record_routes` uses)."""
    return _layer_axis(routes, moe_layers(model), _config_of(model).num_hidden_layers)


@contextlib.contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor, own: RouteRecord | None = None) -> Iterator[None]:
    """Inside the block, every MoE layer of ``model`` uses the expert ids in ``routes`` [B, S, L, k].

    Gate weights follow :func:`gate_weights` from the model's own router logits (gradient reaches
    the router). Tokens with any id outside [0, E) keep the model's own top-k. The forward's input
    must be the same [B, S] tokens the routes describe (no KV-cache decoding).

    ``own`` (a :class:`RouteRecord` of ``len(moe_layers(model))`` layers): filled with the ids the model's
    own router chose in the same forward, before they are replaced (``routing/disagree_frac`` without an
    extra forward).

    With gradient checkpointing, call ``backward()`` inside the block too: the recomputed forward
    must see the same routes, or the gradient belongs to a different forward.
    """
    layers = moe_layers(model)
    family = _FAMILIES[_config_of(model).model_type]
    renorm = family.renorm(_config_of(model))
    if routes.dim() != 4 or routes.shape[3] != layers[0].top_k:
        raise ValueError(f"routes must be [B, S, L, top_k={layers[0].top_k}], got {tuple(routes.shape)}")
    axis = _layer_axis(routes, layers, _config_of(model).num_hidden_layers)
    flat = routes.reshape(-1, routes.shape[2], routes.shape[3])  # [B·S, L, k], the routers' token order
    if own is not None:
        own._shape = tuple(routes.shape[:2])

    def make_hook(layer: MoeLayer, column: int, ordinal: int):
        def hook(router, args, output):
            logits, _, own_ids = output
            replay = flat[:, column].to(device=own_ids.device, dtype=torch.long)
            if replay.shape[0] != own_ids.shape[0]:
                raise ValueError(
                    f"routes hold {replay.shape[0]} tokens but MoE layer {layer.layer_idx} saw {own_ids.shape[0]}"
                )
            recorded = ((replay >= 0) & (replay < layer.num_experts)).all(dim=-1, keepdim=True)
            expert_ids = torch.where(recorded, replay, own_ids)
            if own is not None:
                own._ids[ordinal] = own_ids.detach()
            return logits, gate_weights(logits, expert_ids, renorm, family.cast_to_logits_dtype), expert_ids

        return hook

    handles = [
        layer.router.register_forward_hook(make_hook(layer, col, ordinal))
        for ordinal, (layer, col) in enumerate(zip(layers, axis))
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RouteRecord:
    """Filled by :func:`record_routes`; ``routes`` is [B, S, L_moe, k] (long) after the forward."""

    def __init__(self, num_layers: int):
        self._ids: list[torch.Tensor | None] = [None] * num_layers
        self._shape: tuple[int, ...] | None = None

    @property
    def routes(self) -> torch.Tensor:
        if self._shape is None or any(ids is None for ids in self._ids):
            raise RuntimeError("record_routes: no complete forward was recorded")
        return torch.stack(self._ids, dim=1).reshape(*self._shape, len(self._ids), -1)


@contextlib.contextmanager
def record_routes(model: torch.nn.Module) -> Iterator[RouteRecord]:
    """Record the model's own top-k expert ids per MoE layer: ``record.routes`` [B, S, L_moe, k].

    The layer axis is ordinal over MoE layers (see :func:`moe_layers` for their decoder indices).
    Each forward overwrites the previous one (so a checkpointing recompute is harmless); inside
    :func:`replay_routes` it records the replayed ids, i.e. what the experts actually used.
    """
    layers = moe_layers(model)
    record = RouteRecord(len(layers))

    def make_hook(column: int):
        def hook(router, args, output):
            record._ids[column] = output[2].detach()

        return hook

    def shape_hook(module, args):
        record._shape = tuple(args[0].shape[:-1])  # [B, S] of the first MoE block's input

    handles = [layer.router.register_forward_hook(make_hook(col)) for col, layer in enumerate(layers)]
    handles.append(layers[0].block.register_forward_pre_hook(shape_hook))
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def disagree_frac(trainer_routes: torch.Tensor, engine_routes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of masked tokens whose expert SET differs, averaged over layers (metric ``routing/disagree_frac``).

        d = (1/L) Σ_l  Σ_t m_t · 1[set(E^trainer_{t,l}) ≠ set(E^engine_{t,l})] / Σ_t m_t

    ``trainer_routes``, ``engine_routes``: [B, S, L, k] integer (any dtypes); ``mask``: [B, S] (bool or 0/1).
    Order inside the top-k does not count. Returns a 0-dim float32 tensor (0 when the mask is empty).
    """
    trainer_sorted = trainer_routes.long().sort(dim=-1).values
    engine_sorted = engine_routes.long().sort(dim=-1).values
    differs = (trainer_sorted != engine_sorted).any(dim=-1).float()  # [B, S, L]
    weight = mask.float().unsqueeze(-1)
    per_layer = (differs * weight).sum(dim=(0, 1)) / weight.sum().clamp(min=1.0)  # [L]
    return per_layer.mean()


SENTINEL_U8 = 255
SENTINEL_I16 = -1


def sentinel(dtype: torch.dtype) -> int:
    """The "no route recorded" id of a route dtype (uint8: 255, int16: −1): outside [0, E), so the token keeps
    the model's own top-k. Here, not in ``trainer/routing_replay.py``, so that ``trainer/carried.py`` pads routes
    without importing the trainer module that imports it."""
    return SENTINEL_U8 if dtype == torch.uint8 else SENTINEL_I16


def route_dtype(num_experts: int) -> torch.dtype:
    """Storage dtype of expert ids: uint8 if num_experts <= 256, else int16 (see :func:`route_bytes_per_token`)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def route_bytes_per_token(num_layers: int, top_k: int, num_experts: int) -> int:
    """Bytes to store one token's routes: num_layers · top_k · itemsize.

    itemsize is 1 (uint8) if num_experts <= 256, else 2 (int16) — vLLM's rule too (it uses uint16
    above 256). The "no route" sentinel is 255 in uint8 and -1 in int16; with exactly 256 experts
    255 is a real id, so uint8 has no sentinel: such rows must be masked out by the caller (padding
    is, by the attention mask and the loss mask) rather than marked.
    """
    itemsize = 1 if num_experts <= 256 else 2
    return num_layers * top_k * itemsize
