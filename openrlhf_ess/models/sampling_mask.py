"""Log-probs under the engine's truncated (top-p / top-k) sampling distribution (DESIGN.md §6).

With top-p or top-k the engine samples token y_t from

    μ̃_t(a) = μ_t(a) · 1[a ∈ S_t] / Z_t,      Z_t = Σ_{a ∈ S_t} μ_t(a),

where μ_t = softmax(z_t / T) and S_t is the kept support, and vLLM's ``processed_logprobs`` is
log μ̃_t(y_t) (= log_softmax of the masked, temperature-scaled logits). A trainer that scores y_t
with the full-vocabulary log π(y_t) is off by log Z_t on every token, even with identical weights.
The functions here apply the same support to the trainer's logits and renormalise:

    log π̃_t(y_t) = z_t(y_t)/T − logsumexp_{a ∈ S_t} z_t(a)/T = log π_t(y_t) − log Z^π_t.

The support is described by its size k_t = |S_t| (``kept_count``), reported by the engine per
sampled token (docs/sampling_mask.md): S_t is taken as the trainer's own top-k_t tokens of that
row. Both top-k and top-p keep a prefix of the tokens sorted by logit, so the count describes
either; it is shift- and temperature-invariant, and when engine and trainer logits rank two
boundary tokens differently the swap changes Z by the (tiny) difference of two near-tied
probabilities, not by a whole token's mass as a logit threshold would. The sampled token is always
kept (if a boundary swap pushed it out of the trainer's top-k_t, S_t gains it as an extra token).

``kept_count == 0`` (or ``|kept_count| >= V``) means "no truncation" (full vocabulary), so padding and
untruncated requests can share a batch. A **negative** ``kept_count = -k`` says the engine also banned the
stop tokens at that position (vLLM's ``min_tokens``: upstream samples every response's first token with
EOS banned) before keeping k tokens: the trainer then drops ``stop_ids`` from the row first and keeps
the top-k of the rest. The engine encodes this (``trainer/ray/vllm_engine.py``), because a banned EOS
is not the lowest-logit token and a count alone would cut the wrong one.

Shapes: ``logits`` [..., V] (any leading dims, e.g. [B, T, V]); ``tokens`` and ``kept_count``
[...] (the leading dims). Results are float32 [...]. Gradients flow through ``logits`` in
:func:`masked_log_probs` (the mask itself is not differentiable).
"""

from __future__ import annotations

from typing import Sequence

import torch


def support_mask(
    scaled_logits: torch.Tensor,
    kept_count: torch.Tensor,
    tokens: torch.Tensor | None = None,
    stop_ids: Sequence[int] = (),
):
    """Boolean [..., V] mask of the kept support: each row's top-``|kept_count|`` tokens, plus ``tokens``.

    Ties at the k-th value are all kept (as vLLM's top-k does). ``kept_count == 0`` or ``|kept_count| >= V``
    keeps the whole row. ``kept_count < 0``: ``stop_ids`` are removed from the row first (banned by the
    engine), then the top-``|kept_count|`` of the rest are kept.
    """
    vocab = scaled_logits.shape[-1]
    with torch.no_grad():
        count = kept_count.to(scaled_logits.device, torch.long)
        banned = count < 0
        count = count.abs()
        work = scaled_logits.detach()
        if len(stop_ids) and bool(banned.any()):
            stops = torch.as_tensor(list(stop_ids), device=work.device, dtype=torch.long)
            work = work.clone()
            column = work[..., stops]
            work[..., stops] = torch.where(banned.unsqueeze(-1), torch.full_like(column, float("-inf")), column)
        full = (count == 0) | (count >= vocab)
        # the k-th largest value of each row: one top-k up to the largest k needed (a peaked model's supports are
        # small, so this is far cheaper than sorting V), and the row's minimum where the whole row is kept
        index = torch.where(full, torch.ones_like(count), count).clamp(1, vocab) - 1
        largest = int(index.max()) + 1 if index.numel() else 1
        kth = work.topk(largest, dim=-1).values.gather(-1, index.unsqueeze(-1))
        if bool(full.any()):
            kth = torch.where(full.unsqueeze(-1), work.amin(dim=-1, keepdim=True), kth)
        mask = work >= kth
        if bool(banned.any()):  # a banned stop token is -inf, and so may be the k-th value
            mask &= work > float("-inf")
        mask |= (full & ~banned).unsqueeze(-1)
        if tokens is not None:
            mask.scatter_(-1, tokens.to(mask.device, torch.long).unsqueeze(-1), True)
    return mask


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits.float() / temperature


def masked_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    kept_count: torch.Tensor,
    temperature: float = 1.0,
    stop_ids: Sequence[int] = (),
) -> torch.Tensor:
    """log π̃(tokens): log-prob of each token under softmax(logits / T) truncated to S_t and renormalised.

    Args:
        logits: [..., V] raw (untempered) logits at the positions that predict ``tokens``.
        tokens: [...] sampled token ids.
        kept_count: [...] k_t = |S_t| reported by the engine (0: no truncation; < 0: ``stop_ids`` banned too).
        temperature: the sampling temperature T.
        stop_ids: the engine's stop tokens (banned where ``kept_count < 0``).

    Returns:
        [...] float32, equal to the engine's processed log-prob μ̃(y) when the weights agree.
    """
    scaled = _scaled(logits, temperature)
    mask = support_mask(scaled, kept_count, tokens, stop_ids)
    masked = scaled.masked_fill(~mask, float("-inf"))
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - masked.logsumexp(dim=-1)


def log_kept_mass(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    kept_count: torch.Tensor,
    temperature: float = 1.0,
    stop_ids: Sequence[int] = (),
) -> torch.Tensor:
    """log Z_t = log Σ_{a∈S_t} softmax(logits / T)(a) (<= 0), for the kept-mass metric.

    Same arguments and support as :func:`masked_log_probs`; no gradient. The unmasked log-prob is
    ``masked_log_probs(...) + log_kept_mass(...)``.
    """
    with torch.no_grad():
        scaled = _scaled(logits, temperature)
        mask = support_mask(scaled, kept_count, tokens, stop_ids)
        return scaled.masked_fill(~mask, float("-inf")).logsumexp(dim=-1) - scaled.logsumexp(dim=-1)


NOT_TRUNCATED = 0  # the kept count of positions the engine did not truncate (prompt, padding, env feedback)
CHUNK_ROWS = 256  # rows of [V] logits masked at once by apply_to_log_probs (memory: a few copies of one chunk)


class _MaskedRows(torch.autograd.Function):
    """log π̃ at selected rows of scaled logits, without keeping a masked copy of the logits for backward.

    Forward and backward work in chunks of ``CHUNK_ROWS`` rows; backward recomputes the support from the
    saved logits: d log π̃(y) / d x_a = 1[a = y] − π̃(a) on S_t (0 off it).
    """

    @staticmethod
    def forward(ctx, flat, rows, tokens, kept, stop_ids):
        out = torch.empty(rows.numel(), dtype=torch.float32, device=flat.device)
        log_z = torch.empty_like(out)
        for start in range(0, rows.numel(), CHUNK_ROWS):
            part = slice(start, start + CHUNK_ROWS)
            x = flat[rows[part]].float()
            mask = support_mask(x, kept[part], tokens[part], stop_ids)
            kept_lse = x.masked_fill(~mask, float("-inf")).logsumexp(-1)
            out[part] = x.gather(-1, tokens[part].unsqueeze(-1)).squeeze(-1) - kept_lse
            log_z[part] = kept_lse - x.logsumexp(-1)
        ctx.save_for_backward(flat, rows, tokens, kept)
        ctx.stop_ids = stop_ids
        ctx.mark_non_differentiable(log_z)
        return out, log_z

    @staticmethod
    def backward(ctx, grad_out, _grad_log_z):
        flat, rows, tokens, kept = ctx.saved_tensors
        grad = torch.zeros_like(flat)
        for start in range(0, rows.numel(), CHUNK_ROWS):
            part = slice(start, start + CHUNK_ROWS)
            x = flat[rows[part]].float()
            mask = support_mask(x, kept[part], tokens[part], ctx.stop_ids)
            probs = x.masked_fill(~mask, float("-inf")).softmax(-1)
            g = -probs
            g.scatter_add_(-1, tokens[part].unsqueeze(-1), torch.ones_like(g[:, :1]))
            grad.index_add_(0, rows[part], (g * grad_out[part].unsqueeze(-1)).to(grad.dtype))
        return grad, None, None, None, None


def apply_to_log_probs(
    scaled_logits: torch.Tensor,
    labels: torch.Tensor,
    log_probs: torch.Tensor,
    kept_count: torch.Tensor,
    stop_ids: Sequence[int] = (),
):
    """Full-vocabulary log-probs with the truncated rows replaced by log π̃ (the trainer's seam).

    Args:
        scaled_logits: [..., V] logits already divided by the temperature (as upstream's actor holds them).
        labels: [...] the token each position predicts.
        log_probs: [...] upstream's full-vocabulary log-probs of ``labels`` (differentiable).
        kept_count: [...] the engine's k_t per position (0 where nothing was truncated: prompt, padding).
        stop_ids: the engine's stop tokens (banned where ``kept_count < 0``).

    Returns:
        (log_probs with rows ``kept_count != 0`` replaced by log π̃ (gradients flow through both),
        log Z_t at those rows (no grad, float32), the [...] bool selection). Only the selected rows are
        masked, ``CHUNK_ROWS`` at a time, and backward recomputes the mask: the extra memory is a few
        chunks of [CHUNK_ROWS, V], never a second copy of the logits.
    """
    vocab = scaled_logits.shape[-1]
    selected = kept_count != 0
    rows = selected.reshape(-1).nonzero().squeeze(-1).to(scaled_logits.device)
    flat = scaled_logits.reshape(-1, vocab)
    tokens = labels.reshape(-1).to(rows.device).long()[rows]
    kept = kept_count.reshape(-1).to(rows.device).long()[rows]
    masked, log_z = _MaskedRows.apply(flat, rows, tokens, kept, tuple(stop_ids))
    out = log_probs.clone()
    out[selected.to(out.device)] = masked.to(out.dtype)
    return out, log_z, selected


def count_kept(processed_logprobs: torch.Tensor) -> torch.Tensor:
    """k_t from a row of the engine's processed log-probs (full vocab or top-N): the number of finite entries.

    Exact when the row holds the whole vocabulary, or the top-N with k_t < N (a count equal to N
    only says k_t >= N).
    """
    return torch.isfinite(processed_logprobs).sum(dim=-1)
