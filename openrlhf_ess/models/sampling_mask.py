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

``kept_count <= 0`` or ``>= V`` means "no truncation" (full vocabulary), so padding and untruncated
requests can share a batch.

Shapes: ``logits`` [..., V] (any leading dims, e.g. [B, T, V]); ``tokens`` and ``kept_count``
[...] (the leading dims). Results are float32 [...]. Gradients flow through ``logits`` in
:func:`masked_log_probs` (the mask itself is not differentiable).
"""

from __future__ import annotations

import torch


def support_mask(scaled_logits: torch.Tensor, kept_count: torch.Tensor, tokens: torch.Tensor | None = None):
    """Boolean [..., V] mask of the kept support: each row's top-``kept_count`` tokens, plus ``tokens``.

    Ties at the k-th value are all kept (as vLLM's top-k does). ``kept_count <= 0`` or ``>= V``
    keeps the whole row.
    """
    vocab = scaled_logits.shape[-1]
    with torch.no_grad():
        count = kept_count.to(scaled_logits.device, torch.long)
        full = (count <= 0) | (count >= vocab)
        index = torch.where(full, torch.ones_like(count), count).clamp(1, vocab) - 1
        ordered = scaled_logits.detach().sort(dim=-1, descending=True).values
        kth = ordered.gather(-1, index.unsqueeze(-1))
        mask = (scaled_logits.detach() >= kth) | full.unsqueeze(-1)
        if tokens is not None:
            mask.scatter_(-1, tokens.to(mask.device, torch.long).unsqueeze(-1), True)
    return mask


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits.float() / temperature


def masked_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, kept_count: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log π̃(tokens): log-prob of each token under softmax(logits / T) truncated to S_t and renormalised.

    Args:
        logits: [..., V] raw (untempered) logits at the positions that predict ``tokens``.
        tokens: [...] sampled token ids.
        kept_count: [...] k_t = |S_t| reported by the engine (<= 0: no truncation).
        temperature: the sampling temperature T.

    Returns:
        [...] float32, equal to the engine's processed log-prob μ̃(y) when the weights agree.
    """
    scaled = _scaled(logits, temperature)
    mask = support_mask(scaled, kept_count, tokens)
    masked = scaled.masked_fill(~mask, float("-inf"))
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - masked.logsumexp(dim=-1)


def log_kept_mass(
    logits: torch.Tensor, tokens: torch.Tensor, kept_count: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log Z_t = log Σ_{a∈S_t} softmax(logits / T)(a) (<= 0), for the kept-mass metric.

    Same arguments and support as :func:`masked_log_probs`; no gradient. The unmasked log-prob is
    ``masked_log_probs(...) + log_kept_mass(...)``.
    """
    with torch.no_grad():
        scaled = _scaled(logits, temperature)
        mask = support_mask(scaled, kept_count, tokens)
        return scaled.masked_fill(~mask, float("-inf")).logsumexp(dim=-1) - scaled.logsumexp(dim=-1)


def count_kept(processed_logprobs: torch.Tensor) -> torch.Tensor:
    """k_t from a row of the engine's processed log-probs (full vocab or top-N): the number of finite entries.

    Exact when the row holds the whole vocabulary, or the top-N with k_t < N (a count equal to N
    only says k_t >= N).
    """
    return torch.isfinite(processed_logprobs).sum(dim=-1)
