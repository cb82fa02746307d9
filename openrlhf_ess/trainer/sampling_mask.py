"""``--algo.sampling_mask keep``: the trainer's log-probs over the support the engine sampled from.

The maths is in ``models/sampling_mask.py`` (docs/sampling_mask.md); this module is the trainer's seam:

- **Where**: upstream's ``Actor.forward`` computes every token log-prob with ``log_probs_from_logits`` on the
  temperature-scaled fp32 logits. :func:`install` gives one ``Actor`` *instance* (the policy's, the reference
  model's) a copy of that forward whose ``log_probs_from_logits`` is :func:`log_probs_from_logits` here
  (``upstream.actor_forward_with_log_probs``; upstream's class is not touched). Outside an :func:`applied`
  block it is upstream's function, unchanged.
- **What**: inside ``applied(kept, sequences, attention_mask)`` the positions that predict a sampled token
  get log π̃ = log-prob renormalised over the engine's kept support (its top-|k_t| tokens of the trainer's
  logits, stop tokens removed where k_t < 0), so π_θ (training step), π_prox (every forward-based prox mode)
  and π_ref (the reference model's forward) are all computed on that support. Streams scored at a weight sync
  (interrupt, dedicated) go through ``prox.stream_log_probs`` with the counts instead.
- **Carrying**: the engine's counts ride as ``rollout_kept_counts`` (B, A) next to ``rollout_versions``
  (samples generator → experience maker → actors). Upstream's replay buffer and its ``balance_experiences``
  (``--train.dynamic_batch_enable``) rebuild each Experience from its dataclass fields, so ``trainer/carried.py``
  re-attaches the attribute after them.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import torch  # noqa: E402

from openrlhf_ess import upstream  # noqa: E402
from openrlhf_ess.models import sampling_mask as maths  # noqa: E402
from openrlhf_ess.models.sampling_mask import NOT_TRUNCATED  # noqa: E402


@dataclass
class _Active:
    kept_by_token: torch.Tensor  # (B, S): the kept count of the distribution that sampled token j, at column j
    sequences: torch.Tensor  # (B, S), to check that the labels' layout is the one we rebuild
    attention_mask: Optional[torch.Tensor]
    stop_ids: Sequence[int]
    log_z_sum: Union[float, torch.Tensor] = 0.0  # on the logits' device: read once, not synced per forward
    tokens: int = 0


_ACTIVE: contextvars.ContextVar[Optional[_Active]] = contextvars.ContextVar("openrlhf_ess_sampling_mask", default=None)


def stop_token_ids(model_dir: str) -> List[int]:
    """The tokens vLLM bans while a request is shorter than ``min_tokens``: the tokenizer's EOS and the
    generation config's ``eos_token_id`` (one id or a list), as vLLM's ``SamplingParams.update_from_generation_config``
    collects them into ``all_stop_token_ids`` (upstream sets no other stop tokens)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    ids = set()
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    if eos is not None:
        ids.add(int(eos))
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: vLLM falls back to the model config's fields
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    extra = generation.eos_token_id
    if extra is not None:
        ids.update([int(extra)] if isinstance(extra, int) else map(int, extra))
    return sorted(ids)


def kept_by_token(kept_actions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, S) counts from the (B, A) per-action-column counts: action column j is token S - A + j (upstream's
    ``Actor.forward`` returns ``log_probs[:, :-1][:, -A:]``, whose column j predicts that token)."""
    out = torch.full((kept_actions.shape[0], seq_len), NOT_TRUNCATED, dtype=torch.long)
    width = kept_actions.shape[1]
    out[:, seq_len - width :] = kept_actions.to("cpu", torch.long)
    return out


def to_label_layout(per_token: torch.Tensor, labels: torch.Tensor, attention_mask: Optional[torch.Tensor]):
    """``per_token`` (B, S) in the layout of the labels upstream's forward scores: rolled by one (position j
    predicts token j + 1), and with ``--ds.packing_samples`` unpadded to (1, Σ lengths) in flash-attn's
    ``unpad_input`` order (the attention mask's nonzero positions, row-major). Ring attention is rejected
    by the config."""
    rolled = torch.roll(per_token, shifts=-1, dims=1)
    if tuple(labels.shape) == tuple(per_token.shape):
        return rolled
    if attention_mask is None or labels.shape[0] != 1:
        raise RuntimeError(f"sampling mask: labels {tuple(labels.shape)} for a batch of {tuple(per_token.shape)}")
    return upstream.packed_layout(rolled, attention_mask)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Upstream's ``log_probs_from_logits``; inside :func:`applied`, with the truncated rows renormalised.

    Inside, upstream's function is not called: ``maths.truncated_log_probs`` computes every row (upstream's value,
    bit for bit, where k_t = 0) in one autograd function, so the backward holds one logits-sized gradient, as
    upstream's own path does.
    """
    active = _ACTIVE.get()
    if active is None:
        return upstream.upstream_log_probs_from_logits()(logits, labels, temperature)
    # the labels are the sequences in the layout we rebuild for the counts: check it, do not assume it
    expected = to_label_layout(active.sequences, labels, active.attention_mask).to(labels.device)
    if not torch.equal(expected, labels):
        raise RuntimeError(
            "sampling mask: the actor's label layout is not the one the kept counts were placed in (upstream's "
            "Actor.forward changed?); refusing to mask the wrong tokens."
        )
    if temperature != 1.0:
        logits.div_(temperature)  # as upstream's function does (upstream's Actor passes 1: its logits are scaled)
    kept = to_label_layout(active.kept_by_token, labels, active.attention_mask).to(labels.device)
    log_probs, log_z, _ = maths.truncated_log_probs(logits, labels, kept, active.stop_ids)
    active.log_z_sum = active.log_z_sum + log_z.sum()
    active.tokens += log_z.numel()
    return log_probs


@contextlib.contextmanager
def applied(
    kept_actions: Optional[torch.Tensor],
    sequences: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    stop_ids: Sequence[int],
):
    """Forwards of an installed Actor inside this block score the sampled tokens over their kept support.

    ``kept_actions`` (B, A) as carried with the experience (None: nothing to mask, upstream's forward). Yields
    the state, whose ``log_z_sum`` / ``tokens`` give the mean log Z_t of the block's forwards.
    """
    if kept_actions is None:
        yield None
        return
    state = _Active(kept_by_token(kept_actions, sequences.shape[1]), sequences.cpu(), attention_mask, stop_ids)
    if state.attention_mask is not None:
        state.attention_mask = state.attention_mask.cpu()
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)


def install(actor) -> None:
    """Give this ``openrlhf.models.Actor`` instance the forward with our log-prob seam (idempotent)."""
    if getattr(actor, "_openrlhf_ess_sampling_mask", False):
        return
    actor.forward = types.MethodType(upstream.actor_forward_with_log_probs(log_probs_from_logits), actor)
    actor._openrlhf_ess_sampling_mask = True
