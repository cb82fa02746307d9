"""``--algo.routing_replay``: the trainer's MoE forwards use the experts the engine chose (issue 23, R3).

The maths and the seam are in ``models/routing_replay.py`` (docs/routing_replay.md); this module carries the
engine's expert ids from the rollout to every forward that scores a rollout token:

- **Engine → sample**: vLLM (≥ 0.29, ``enable_return_routed_experts``) returns per request ``routed_experts``
  [P + G − 1, num_hidden_layers, k] (uint8 up to 256 experts, else uint16): the route of every token it
  forwarded, prompt included; the last sampled token is never forwarded. :func:`observation_routes` puts them
  at the sample's token positions: ``rollout_routes`` [1, S, L, k], row i = the route of token i, the last token
  gets :func:`sentinel`.
- **Sample → micro-batch**: upstream right-pads sequences (prompt at column 0); :func:`pad_routes` pads routes
  the same way, with the sentinel.
- **Replay buffer**: upstream rebuilds each Experience from its dataclass fields, so
  :func:`adopt_replay_buffer` re-attaches the attribute after its split and collate (as the kept counts are).
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
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch

from openrlhf_ess.models import routing_replay as seam

FLAG = seam.FLAG
SENTINEL_U8 = 255
SENTINEL_I16 = -1


def sentinel(dtype: torch.dtype) -> int:
    """The "no route recorded" id of a route dtype (uint8: 255, int16: −1)."""
    return SENTINEL_U8 if dtype == torch.uint8 else SENTINEL_I16


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


def pad_routes(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """[B, width, L, k]: each sample's routes [S_i, L, k] at columns 0..S_i − 1 (right padding, as upstream pads
    ``sequences``), the sentinel after; rows longer than ``width`` are cut."""
    first = rows[0]
    out = torch.full((len(rows), width, *first.shape[1:]), sentinel(first.dtype), dtype=first.dtype)
    for b, row in enumerate(rows):
        n = min(row.shape[0], width)
        out[b, :n] = row[:n]
    return out


def adopt_replay_buffer(buffer):
    """Make upstream's replay buffer (this instance) keep ``rollout_routes``: [S, L, k] per item, [B, S, L, k] per
    batch. Same mechanism as ``sampling_mask.adopt_replay_buffer``: on ``append`` row i goes to the i-th new item,
    cut to its sequence (upstream cuts right padding off the step fields); on ``collate_fn`` the rows are padded
    with the sentinel to the batch's sequence width. Composes with the kept counts' wrapper."""
    append, collate = buffer.append, buffer.collate_fn

    def append_keeping(experience) -> None:
        routes = getattr(experience, "rollout_routes", None)
        append(experience)
        if routes is None:
            return
        new = buffer.items[len(buffer.items) - min(len(routes), len(buffer.items)) :]
        for item, row in zip(new, routes[len(routes) - len(new) :]):
            item.rollout_routes = row[: item.sequences.shape[-1]].clone()

    def collate_keeping(batch):
        experience = collate(batch)
        items = batch[0] if buffer.dynamic_batch else batch
        experience.rollout_routes = batched_routes(items, experience.sequences.shape[-1])
        return experience

    buffer.append, buffer.collate_fn = append_keeping, collate_keeping
    return buffer


def batched_routes(items, width: int) -> Optional[torch.Tensor]:
    """[B, width, L, k] routes of replay-buffer items (None if none has them)."""
    rows = [getattr(item, "rollout_routes", None) for item in items]
    if any(r is None for r in rows):
        if all(r is None for r in rows):
            return None
        raise RuntimeError(f"{FLAG}: a replay-buffer batch mixes samples with and without routes")
    return pad_routes(rows, width)


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


@contextlib.contextmanager
def applied(model: torch.nn.Module, routes: Optional[torch.Tensor], own: Optional[seam.RouteRecord] = None):
    """Forwards of ``model`` (an OpenRLHF Actor, a DeepSpeed engine or the HF model) inside the block replay
    ``routes`` [B, S, L, k]; without routes nothing is installed (upstream's forward)."""
    if routes is None:
        yield
        return
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
    engine_moe: torch.Tensor, own: torch.Tensor, action_mask: torch.Tensor, num_experts: int
) -> ReplayStats:
    """``engine_moe`` [B, S, L_moe, k] the replayed routes (MoE layers only), ``own`` [B, S, L_moe, k] the
    trainer's own top-k in the same forward, ``action_mask`` (B, S − 1).

        replayed_frac = Σ_j m_j · r_j / Σ_j m_j,   disagree_frac = seam.disagree_frac over m_j · r_j

    m_j: position j scores a response token (:func:`scoring_positions`); r_j: it has an engine route."""
    engine_moe = engine_moe.to(own.device)
    mask = scoring_positions(action_mask.to(own.device), engine_moe.shape[1])
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
    with applied(module, routes, own):
        yield out
    engine_moe = routes[:, :, seam.moe_columns(module, routes)]
    out.append(replay_stats(engine_moe, own.routes, experience.action_mask, layers[0].num_experts))


def add_metrics(status: dict, stats: ReplayStats) -> None:
    """Put the step's metrics into upstream's training-step status (token-weighted, like its token means)."""
    for name, value in (("replayed_frac", stats.replayed_frac), ("disagree_frac", stats.disagree_frac)):
        status["metrics"][f"routing/{name}"] = value.detach().float().cpu()
        status["weights"][f"routing/{name}"] = "token"


def check_routes_contract(shape, num_layers: int, top_k: int, rows: Optional[int] = None) -> None:
    """Raise ``vllm_engine.EngineContractError`` unless the engine's ``routed_experts`` has shape
    [rows, num_layers, top_k] (``shape`` None: the engine returned no routes)."""
    from openrlhf_ess.trainer.ray.vllm_engine import EngineContractError

    fix = (
        "Fix: use vLLM >= 0.29 on GPU (what openrlhf[vllm]==0.11.2 installs; its engine returns routes with "
        "enable_return_routed_experts under either model runner); vLLM 0.31 returns them only with Model Runner V2 "
        "(VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton, so not on CPU. Or drop --algo.routing_replay."
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
