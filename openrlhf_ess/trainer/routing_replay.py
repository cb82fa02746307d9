"""``--algo.routing_replay``: the trainer's MoE forwards use the experts the engine chose (R3).

The maths and the seam are in ``models/routing_replay.py`` (docs/routing_replay.md); this module carries the
engine's expert ids from the rollout to every forward that scores a rollout token:

- **Engine → sample**: vLLM (≥ 0.29, ``enable_return_routed_experts``) returns per request ``routed_experts``
  [P + G − 1, num_hidden_layers, k] (uint8 up to 256 experts, else uint16): the route of every token it
  forwarded, prompt included; the last sampled token is never forwarded. :func:`observation_routes` puts them
  at the sample's token positions: ``rollout_routes`` [1, S, L, k], row i = the route of token i, the last token
  gets :func:`sentinel`. An agent's sample is several requests (one per turn): :func:`agent_routes` places them.
- **Weight sync** (--algo.prox_mode interrupt/dedicated): each stream scored there carries its routes (an in-flight
  request's read from vLLM's output processor, ``rollout_tags.inflight_routes``); :func:`stream_routes` lays them
  out for ``prox.stream_log_probs``.
- **Sample → micro-batch**: upstream right-pads sequences (prompt at column 0); :func:`pad_routes` pads routes
  the same way, with the sentinel.
- **Replay buffer, dynamic batch**: upstream's replay buffer and its ``balance_experiences``
  (``--train.dynamic_batch_enable``) rebuild each Experience from its dataclass fields, so ``trainer/carried.py``
  re-attaches the attribute after them (as it does the kept counts).
- **Forwards**: :func:`applied` wraps the policy's forward (π_prox, every forward-based prox mode) and the
  reference model's (π_ref); :func:`replayed_step` wraps upstream's whole ``training_step`` (π_θ), so the
  backward, and a gradient-checkpointing recompute inside it, sees the same routes.
- **Metrics** (training step): ``routing/replayed_frac``, the share of scoring positions (those whose logits
  give a response token's log-prob) that had an engine route, and ``routing/disagree_frac``, the share where
  the trainer's own top-k set differs from the engine's (mean over MoE layers), both from the same forward.

Sentinel: 255 in uint8, −1 in int16 ("no route": the model keeps its own top-k). With exactly 256 experts 255
is a real id; it then only lands on the last token and on padding, whose outputs score nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from openrlhf_ess import upstream
from openrlhf_ess.models import routing_replay as seam
from openrlhf_ess.trainer import carried
from openrlhf_ess.trainer.engine_contract import EngineContractError

FLAG = seam.FLAG
sentinel = seam.sentinel  # the "no route recorded" id of a route dtype (uint8: 255, int16: −1)


def routes_to_tensor(routes) -> torch.Tensor:
    """vLLM's numpy ``routed_experts`` [R, L, k] as a torch tensor: uint8 stays uint8, wider ids become int16."""
    array = np.asarray(routes)
    if array.ndim != 3:
        raise ValueError(f"{FLAG}: the engine's routes must be [tokens, layers, top_k], got shape {array.shape}")
    if array.dtype == np.uint8:
        return torch.from_numpy(array.copy())
    if array.size and int(array.max()) > np.iinfo(np.int16).max:
        raise ValueError(f"{FLAG}: expert id {int(array.max())} does not fit int16")
    return torch.from_numpy(array.astype(np.int16))


def observation_routes(routes, n_tokens: int, truncate_length: int) -> torch.Tensor:
    """A sample's routes [1, S, L, k], S = min(n_tokens, truncate_length), aligned with its ``sequences``.

    ``routes`` [n_tokens − 1, L, k]: vLLM's rows, one per forwarded token (the prompt, then every sampled token
    but the last). Row i of the result is the route of token i; row n_tokens − 1 (the last token, never
    forwarded) is the sentinel. Truncation keeps the first ``truncate_length`` rows, as upstream keeps the
    first tokens. Raises if the row count is not n_tokens − 1 (routes that would be placed on the wrong tokens).
    """
    rows = routes_to_tensor(routes)
    if rows.shape[0] != n_tokens - 1:
        raise RuntimeError(
            f"{FLAG}: the engine returned routes for {rows.shape[0]} tokens of a {n_tokens}-token sample; vLLM "
            "returns one per forwarded token (prompt + response - 1). The sample's tokens and the engine's request "
            "differ (an agent that edits tokens?); this is a bug, please report it."
        )
    length = min(n_tokens, truncate_length)
    out = torch.full((length, *rows.shape[1:]), sentinel(rows.dtype), dtype=rows.dtype)
    kept = min(rows.shape[0], length)
    out[:kept] = rows[:kept]
    return out.unsqueeze(0)


def agent_routes(observation: Sequence[int], calls: Sequence[Tuple[Sequence[int], Sequence[int], Any]]) -> np.ndarray:
    """The routes [n − 1, L, k] of a sample built from several engine requests (an agent's turns), n =
    len(observation), in vLLM's row layout (row i: the route of token i), ready for :func:`observation_routes`.

    ``calls``: per request, in order, (prompt ids P_c, output ids G_c, its ``routed_experts`` [|P_c| + |G_c| − 1,
    L, k]). Each request's prompt + output must be a prefix of the observation (upstream's agent executor
    appends action and environment feedback to the observation it sends next); a request that is not is a
    token edit the routes cannot follow, and raises. Row rule, one route per position for the trainer's single
    forward:

    - position i with |P_c| − 1 ≤ i < |P_c| + |G_c| − 1 scores request c's own sampled token i + 1: it takes c's
      row, the route of the forward that produced that token's μ;
    - every other position (prompt, environment feedback) takes the row of the latest request that forwarded
      it (vLLM returns cached prefix blocks' rows as they were stored, so that is the route the engine used);
    - positions no request forwarded (feedback after the last turn) get :func:`sentinel` (they score nothing).
    """
    n = len(observation)
    rows = [routes_to_tensor(routes) for _, _, routes in calls]
    if not rows:
        raise RuntimeError(f"{FLAG}: a sample with no engine request has no routes")
    out = torch.full((max(n - 1, 0), *rows[0].shape[1:]), sentinel(rows[0].dtype), dtype=rows[0].dtype)
    for (prompt, output, _), row in zip(calls, rows):
        covered = len(prompt) + len(output)
        if row.shape[0] != covered - 1 or list(observation[:covered]) != list(prompt) + list(output):
            raise RuntimeError(
                f"{FLAG}: an agent turn's request (prompt {len(prompt)} + output {len(output)} tokens, routes for "
                f"{row.shape[0]}) is not a prefix of the sample's {n} tokens, so its routes cannot be placed: the "
                "agent must send the observation so far, unedited, as each turn's prompt (as upstream's executor "
                "does)."
            )
        if row.dtype != out.dtype:
            raise RuntimeError(f"{FLAG}: an agent's turns returned routes of dtypes {out.dtype} and {row.dtype}")
        out[: row.shape[0]] = row
    for (prompt, _, _), row in zip(calls, rows):
        start = max(len(prompt) - 1, 0)
        out[start : row.shape[0]] = row[start:]
    return out.numpy()


def stream_routes(routes: Sequence[Any], lengths: Sequence[int], width: int) -> torch.Tensor:
    """[B, width, L, k] routes of token streams scored at a weight sync (``prox.stream_log_probs``): stream b of
    ``lengths[b]`` tokens has ``routes[b]`` of at least lengths[b] − 1 rows (vLLM's layout); the stream's tokens
    get them at columns 0..lengths[b] − 2, the last token and the padding the sentinel."""
    rows = []
    for row, length in zip(routes, lengths):  # vLLM's numpy rows; observation_routes converts them once
        if len(row) < length - 1:
            raise RuntimeError(
                f"{FLAG}: a stream of {length} tokens scored at a weight sync has routes for {len(row)} of them; "
                "this is a bug, please report it."
            )
        rows.append(observation_routes(row[: length - 1], length, length)[0])
    return pad_routes(rows, width)


# [B, width, L, k]: each sample's routes at columns 0..S_i − 1 (right padding, as upstream pads ``sequences``), the
# sentinel after; rows longer than ``width`` are cut. One padding rule for the experience maker and the buffer.
pad_routes = carried.pad_routes


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside an OpenRLHF ``Actor`` (``.model``) and a DeepSpeed engine (``.module``)."""
    # registered submodules only: a DeepSpeed engine forwards unknown attributes (lm_head, config) to its module
    while "lm_head" not in model._modules:
        inner = model._modules.get("module")
        inner = inner if inner is not None else model._modules.get("model")
        if inner is None:
            return model
        model = inner
    return model


def missing_routes_error(where: str) -> RuntimeError:
    return RuntimeError(
        f"{FLAG}: {where} came without the engine's routes (rollout_routes), so its MoE layers would choose their "
        "own experts; this is a bug, please report it."
    )


def packs(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an OpenRLHF ``Actor`` built with ``--ds.packing_samples`` (forced on by
    ``--train.dynamic_batch_enable``): its forward unpads the batch to (1, Σ lengths) before the HF model."""
    return bool(getattr(model, "packing_samples", False))


pack = upstream.packed_layout  # [B, S, ...] → [1, N, ...] as upstream's packed forward lays out its tokens


@contextlib.contextmanager
def applied(
    model: torch.nn.Module,
    routes: Optional[torch.Tensor],
    own: Optional[seam.RouteRecord] = None,
    attention_mask: Optional[torch.Tensor] = None,
):
    """Forwards of ``model`` (an OpenRLHF Actor, a DeepSpeed engine or the HF model) inside the block replay
    ``routes`` [B, S, L, k]; without routes nothing is installed (upstream's forward). A packing ``Actor``
    (:func:`packs`) feeds its HF model the unpadded tokens: the routes are packed the same way with
    ``attention_mask`` (B, S), which it then needs."""
    if routes is None:
        yield
        return
    if packs(model):
        if attention_mask is None:
            raise RuntimeError(f"{FLAG}: a packed forward needs the attention mask to pack the routes; this is a bug")
        routes = pack(routes, attention_mask)
    module = hf_model(model)
    device = next(module.parameters()).device
    with seam.replay_routes(module, routes.to(device), own):
        yield


def scoring_positions(action_mask: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: positions whose logits give a response token's log-prob (position j predicts token j + 1,
    and upstream's ``action_mask`` (B, A) is indexed by j, A = width − 1)."""
    out = torch.zeros(action_mask.shape[0], width, dtype=torch.bool, device=action_mask.device)
    a = min(action_mask.shape[1], width)
    out[:, :a] = action_mask[:, :a].bool()
    return out


def has_route(routes_moe: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[B, S] bool: every MoE layer of the token has ids in [0, E) (a replayed route, not the sentinel)."""
    ids = routes_moe.long()
    return ((ids >= 0) & (ids < num_experts)).all(dim=-1).all(dim=-1)


@dataclass
class ReplayStats:
    """The two metrics of one training step (0-dim tensors; no host sync here)."""

    replayed_frac: torch.Tensor
    disagree_frac: torch.Tensor
    tokens: torch.Tensor


def replay_stats(
    engine_moe: torch.Tensor,
    own: torch.Tensor,
    action_mask: torch.Tensor,
    num_experts: int,
    attention_mask: Optional[torch.Tensor] = None,
) -> ReplayStats:
    """``engine_moe`` [B, S, L_moe, k] the replayed routes (MoE layers only), ``own`` the trainer's own top-k in
    the same forward ([B, S, L_moe, k], or [1, N, L_moe, k] from a packed forward, which ``attention_mask`` (B, S)
    then packs ``engine_moe`` and the positions to), ``action_mask`` (B, S − 1).

        replayed_frac = Σ_j m_j · r_j / Σ_j m_j,   disagree_frac = seam.disagree_frac over m_j · r_j

    m_j: position j scores a response token (:func:`scoring_positions`); r_j: it has an engine route."""
    engine_moe = engine_moe.to(own.device)
    mask = scoring_positions(action_mask.to(own.device), engine_moe.shape[1])
    if attention_mask is not None:
        engine_moe, mask = pack(engine_moe, attention_mask), pack(mask, attention_mask)
    replayed = mask & has_route(engine_moe, num_experts)
    tokens = mask.sum()
    return ReplayStats(
        replayed_frac=replayed.sum().float() / tokens.clamp(min=1).float(),
        disagree_frac=seam.disagree_frac(own, engine_moe, replayed),
        tokens=tokens,
    )


@contextlib.contextmanager
def replayed_step(actor: torch.nn.Module, experience) -> Iterator[List[ReplayStats]]:
    """Wraps one training step (forward and backward) of the policy: replays ``experience.rollout_routes`` and
    records the trainer's own top-k of the same forward; yields a list that holds the step's
    :class:`ReplayStats` after the block."""
    routes = getattr(experience, "rollout_routes", None)
    if routes is None:
        raise missing_routes_error("a training batch")
    module = hf_model(actor)
    layers = seam.moe_layers(module)
    own = seam.RouteRecord(len(layers))
    out: List[ReplayStats] = []
    attention_mask = experience.attention_mask
    with applied(actor, routes, own, attention_mask):
        yield out
    engine_moe = routes[:, :, seam.moe_columns(module, routes)]
    packed = attention_mask if packs(actor) else None
    out.append(replay_stats(engine_moe, own.routes, experience.action_mask, layers[0].num_experts, packed))


def add_metrics(status: dict, stats: ReplayStats) -> None:
    """Put the step's metrics into upstream's training-step status (token-weighted, like its token means)."""
    for name, value in (("replayed_frac", stats.replayed_frac), ("disagree_frac", stats.disagree_frac)):
        status["metrics"][f"routing/{name}"] = value.detach().float().cpu()
        status["weights"][f"routing/{name}"] = "token"


def check_routes_contract(shape, num_layers: int, top_k: int, rows: Optional[int] = None) -> None:
    """Raise :class:`EngineContractError` unless the engine's ``routed_experts`` has shape
    [rows, num_layers, top_k] (``shape`` None: the engine returned no routes)."""

    fix = (
        "Fix: use vLLM >= 0.29 on GPU (what openrlhf[vllm]==0.11.2 installs; its engine returns routes with "
        "enable_return_routed_experts under either model runner); vLLM >= 0.31 returns them only with Model Runner "
        "V2 (VLLM_USE_V2_MODEL_RUNNER=1, which needs Triton, so not on CPU, and not with --algo.sampling_mask keep, "
        "which forces V1) and prefix caching (--vllm.enable_prefix_caching). Or drop --algo.routing_replay."
    )
    expected = f"[{rows if rows is not None else 'P+G-1'}, {num_layers}, {top_k}]"
    if shape is None:
        raise EngineContractError(
            f"start-up self-check failed (engine contract, {FLAG}): the engine returned no routed_experts for a "
            f"request (expected {expected}). {fix}"
        )
    shape = tuple(int(n) for n in shape)
    if len(shape) != 3 or shape[1:] != (num_layers, top_k) or (rows is not None and shape[0] != rows):
        raise EngineContractError(
            f"start-up self-check failed (engine contract, {FLAG}): the engine's routed_experts have shape "
            f"{list(shape)}, expected {expected} (tokens forwarded, num_hidden_layers, num_experts_per_tok of "
            f"the model config). {fix}"
        )


def check_inflight_routes_contract(
    mid_rows: Optional[int], needed: int, prefix_equal: bool, max_tokens: int = 0
) -> None:
    """Raise :class:`EngineContractError` unless a request's routes read while it was still generating
    (``rollout_tags.inflight_routes``: what a weight sync scores in --algo.prox_mode interrupt/dedicated) had at
    least ``needed`` rows (prompt + tokens streamed so far − 1) and equal the first rows of its final routes.
    ``needed`` 0: the ``max_tokens``-token request streamed nothing before it finished, so no read was made."""

    if needed == 0:
        raise EngineContractError(
            f"start-up self-check failed (engine contract, {FLAG} with scoring at a weight sync): a "
            f"{max_tokens}-token request streamed no output before it finished, so the mid-generation route read "
            "could not be checked "
            "(and partial rollouts' token tracking relies on streamed outputs). Fix: use the pinned vLLM, or "
            "--algo.prox_mode snapshot."
        )

    fix = (
        "Fix: use the pinned vLLM (0.29 on GPU: its output processor accumulates each request's routed_experts per "
        "step, which the engine reads at a sync), or use --algo.prox_mode snapshot (exact, no scoring at the sync), "
        "or drop --algo.routing_replay."
    )
    if mid_rows is None or mid_rows < needed:
        raise EngineContractError(
            f"start-up self-check failed (engine contract, {FLAG} with scoring at a weight sync): a request's routes "
            f"read mid-generation had {mid_rows} rows, expected >= {needed} (prompt + tokens so far - 1). {fix}"
        )
    if not prefix_equal:
        raise EngineContractError(
            f"start-up self-check failed (engine contract, {FLAG} with scoring at a weight sync): a request's routes "
            f"read mid-generation differ from the first {mid_rows} rows of its final routes. {fix}"
        )
