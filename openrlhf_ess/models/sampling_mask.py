"""Log-probs under the engine's truncated (top-p / top-k) sampling distribution (docs/sampling_mask.md).

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
S_t has exactly k_t tokens: of the tokens tied at the k_t-th value, only as many as k_t leaves room for
(vLLM's Triton top-k/top-p kernel, used on CUDA for batches >= 8, keeps exactly k; tied tokens are equal, so
which ones does not change Z).

``kept_count == 0`` (or ``|kept_count| >= V``) means "no truncation" (full vocabulary), so padding and
untruncated requests can share a batch. A **negative** ``kept_count = -k`` says the engine also banned the
stop tokens at that position (vLLM's ``min_tokens``: upstream samples every response's first token with
EOS banned) before keeping k tokens: the trainer then drops ``stop_ids`` from the row first and keeps
the top-k of the rest. The engine encodes this (``trainer/ray/vllm_engine.py``), because a banned EOS
is not the lowest-logit token and a count alone would cut the wrong one.

Shapes: ``logits`` [..., V] (any leading dims, e.g. [B, T, V]); ``tokens`` and ``kept_count``
[...] (the leading dims). Results are float32 [...]. Gradients flow through ``logits`` in
:func:`masked_log_probs` (the mask itself is not differentiable).

:func:`support_mask`, :func:`masked_log_probs` and :func:`log_kept_mass` are the plain formulas (a top-k of
the row, a masked copy of the logits). The trainer's seam uses :func:`truncated_log_probs`: every row of the
actor's logits in one autograd function, upstream's value bit for bit where k_t = 0, the k-th value found
from block maxima instead of a top-k of V, and ONE logits-sized gradient in backward (docs/sampling_mask.md,
"Maths module and tests").
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

    Exactly ``|kept_count|`` tokens: ties at the k-th value are trimmed in vocabulary order, as vLLM's Triton kernel
    does (its PyTorch path keeps every tie and counts it in k_t, so then the count covers them all; tied tokens are
    equal, so Z is the engine's either way). ``kept_count == 0`` or ``|kept_count| >= V``
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
        # exactly |k| tokens, as vLLM keeps (see _exact_k_lse): ties at the k-th value trimmed in vocabulary order
        tied_over = ~full & (mask.sum(-1) > count)
        if bool(tied_over.any()):
            above = work > kth
            at_kth = mask & ~above
            room = (count - above.sum(-1)).unsqueeze(-1)
            if tokens is not None:  # a sampled token tied at the k-th value was one the engine kept: it goes first
                sampled = torch.zeros_like(mask).scatter_(-1, tokens.to(mask.device, torch.long).unsqueeze(-1), True)
                first = at_kth & sampled
                room = room - first.sum(-1, keepdim=True)
                at_kth = at_kth & ~sampled
            else:
                first = torch.zeros_like(mask)
            trimmed = above | first | (at_kth & (at_kth.cumsum(-1) <= room))
            mask = torch.where(tied_over.unsqueeze(-1), trimmed, mask)
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
CHUNK_ROWS = 256  # rows of [V] logits per step of the truncated log-probs' forward/backward (temporaries' size)
UPSTREAM_LSE_ROWS = 1024  # upstream's _logsumexp_by_chunk chunk: the same calls give the same bits
OVERSAMPLE = 16  # block maxima per needed token in the k-th-value search: ≈ V / OVERSAMPLE candidates per row
MIN_BLOCK = 32  # smaller contiguous blocks make their max-reduction slow on CPU (measured): strided ones then
STRIDED_BLOCKS = 4  # strided block maxima per needed token (larger k_t): ≈ 1.1 (k + s) candidates per row


def _upstream_logsumexp(flat: torch.Tensor) -> torch.Tensor:
    """[N] logsumexp of the rows of ``flat`` [N, V] as ``openrlhf.models.utils._logsumexp_by_chunk`` computes it
    (the fp32 path of upstream's ``log_probs_from_logits`` without flash-attn): same chunks and calls, same bits
    (``tests/test_sampling_mask.py`` compares the bits with upstream's function)."""
    out = torch.zeros(flat.shape[0], device=flat.device, dtype=flat.dtype)
    for start in range(0, flat.shape[0], UPSTREAM_LSE_ROWS):
        out[start : start + UPSTREAM_LSE_ROWS] = torch.logsumexp(flat[start : start + UPSTREAM_LSE_ROWS], dim=-1)
    return out


def _banned_stops(cols: torch.Tensor, banned: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """[R, W] bool: the entry (column ``cols``) is a stop token of a row whose stops are banned (``banned`` [R])."""
    return torch.isin(cols, stops) & banned.unsqueeze(-1)


def _exact_k_lse(values: torch.Tensor, kth: torch.Tensor, k: torch.Tensor):
    """log Σ_{a ∈ S} e^{x_a} over exactly k entries, and each row's tie share, for ``values`` [R, W] that hold every
    entry >= ``kth`` [R] (the k-th largest, ``k`` [R] >= 1) of their row.

    S = the entries > τ and n = k − #(> τ) of the entries = τ: vLLM keeps exactly k_t tokens (its Triton kernel,
    CUDA batches >= 8, trims tied boundary values in vocabulary order; its PyTorch path keeps all ties and counts
    them in k_t), and tied entries are equal, so Σ_S e^x = Σ_{> τ} e^x + n·e^τ whichever of them the engine kept:
    the same Z as the engine's whenever the logits agree (with all ties counted, Z would be too large by
    up to log(1 + m/k) with m extra tied tokens). share = n / #(= τ) (1 without a tie at the boundary): the
    gradient gives each tied entry that share of its probability (the mean of the one-sided gradients)."""
    t = kth.unsqueeze(-1)
    above = values > t
    n_above = above.sum(-1)
    n_tied = (values == t).sum(-1)
    keep = (k - n_above).clamp(min=1)
    lse = torch.logaddexp(values.masked_fill(~above, float("-inf")).logsumexp(-1), kth + keep.to(values.dtype).log())
    share = keep.to(values.dtype) / n_tied.clamp(min=1).to(values.dtype)
    share = torch.where(kth > float("-inf"), share, torch.ones_like(share))
    return lse, share


def _kth_by_blocks(x, local, k, banned, stops, block):
    """τ = the k-th largest non-stop value of rows ``local`` of ``x`` [C, V], and log Σ_{non-stop a: x_a >= τ} e^x_a.

    The row is cut into V // ``block`` blocks (the last V mod ``block`` entries count as blocks of one). L = the
    (k + s)-th largest block maximum (s = #stops on a banned row): at least k + s entries, so k non-stop ones, are
    >= L, hence τ >= L and every entry >= τ (ties at τ included) lies in a block whose maximum is >= L. Only those
    blocks (≈ (k + s) · block entries) are read again. Cost per row: one max-reduction over V (of a view of ``x``,
    no copy) instead of a top-k of V, plus a top-k of ≈ V / OVERSAMPLE candidates.
    """
    rows, vocab = local.numel(), x.shape[1]
    n_blocks = vocab // block
    body = x[:, : n_blocks * block].view(x.shape[0], n_blocks, block)  # a view of x
    tail = x[local, n_blocks * block :]
    block_max = body.amax(-1)[local]  # [R, n_blocks]
    need = k + stops.numel() * banned.long()
    maxima = torch.cat([block_max, tail], dim=1)
    lower = maxima.topk(int(need.max()), dim=-1).values.gather(-1, (need - 1).unsqueeze(-1))  # L, [R, 1]
    # the blocks with maximum >= L are the top-m blocks of each row, m = the largest such count over the rows (a
    # row with fewer gets a few blocks below L: real entries of its row, harmless)
    m = int((block_max >= lower).sum(-1).max())
    picked = block_max.topk(m, dim=-1).indices  # [R, m]
    values = torch.cat([body[local.unsqueeze(-1), picked].flatten(1), tail], dim=1)  # [R, m · block + V mod block]
    if stops.numel() and bool(banned.any()):
        cols = (picked.unsqueeze(-1) * block + torch.arange(block, device=x.device)).flatten(1)
        tail_cols = torch.arange(n_blocks * block, vocab, device=x.device).expand(rows, -1)
        values.masked_fill_(_banned_stops(torch.cat([cols, tail_cols], dim=1), banned, stops), float("-inf"))
    kth = values.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1)).squeeze(-1)
    return (kth, *_exact_k_lse(values, kth, k))


def _kth_largest(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[R] the k-th largest entry of each row of ``values`` [R, W] (``k`` [R] >= 1), from one unsorted top-k: row r
    gets max(k) − k_r entries of +inf first, so the max(k)-th largest of every padded row is its k_r-th."""
    most = int(k.max())
    pad = torch.arange(most, device=values.device) < (most - k).unsqueeze(-1)
    pad = torch.where(pad, float("inf"), float("-inf")).to(values.dtype)
    return torch.cat([values, pad], dim=1).topk(most, dim=-1, sorted=False).values.amin(-1)


def _kth_by_bound(x, local, k, banned, stops):
    """What :func:`_kth_by_blocks` returns, for k_t too large for blocks of MIN_BLOCK entries (hundreds to
    thousands of tokens: top-p on a flat distribution).

    Here the blocks are strided (block j = entries j, j + n, j + 2n, ..., n = V // block), so their maxima are an
    element-wise max of ``block`` contiguous slices: one fast pass over V for any block size. n ≈ STRIDED_BLOCKS ·
    max(k + s); L = each row's (k + s)-th largest maximum, a lower bound of τ as in :func:`_kth_by_blocks`. Then one
    comparison pass keeps the entries >= L (≈ 1.1 (k + s) per row: all entries >= τ, ties included), and τ is
    the k-th largest of those.
    """
    rows, vocab = local.numel(), x.shape[1]
    need = k + stops.numel() * banned.long()
    block = vocab // (STRIDED_BLOCKS * int(need.max()))
    n_blocks = vocab // block
    block_max = x[:, : n_blocks * block].view(x.shape[0], block, n_blocks).amax(1)  # a view of x: column j = block j
    lower = _kth_largest(torch.cat([block_max[local], x[local, n_blocks * block :]], dim=1), need)
    bound = torch.full_like(x[:, :1], float("inf"))  # the other rows of the chunk: no entry
    bound[local, 0] = lower
    at, col = (x >= bound).nonzero().unbind(-1)  # in row order
    member = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
    member[local] = torch.arange(rows, device=x.device)
    at = member[at]
    keep = at >= 0  # (a +inf logit in another row would pass its bound)
    if stops.numel() and bool(banned.any()):
        keep &= ~(torch.isin(col, stops) & banned[at.clamp(min=0)])
    at, col = at[keep], col[keep]
    count = torch.bincount(at, minlength=rows)
    pos = torch.arange(at.numel(), device=x.device) - (count.cumsum(0) - count)[at]  # rank within the row
    packed = torch.full((rows, int(count.max())), float("-inf"), dtype=x.dtype, device=x.device)
    packed[at, pos] = x[local[at], col]
    kth = _kth_largest(packed, k)
    return (kth, *_exact_k_lse(packed, kth, k))


def _kth_direct(x, k, banned, stops):
    """What :func:`_kth_by_blocks` returns, from a top-k of the rows ``x`` [R, V] (a copy: modified here), for the
    large k where block maxima cannot prune. k >= V - s keeps every non-stop entry: τ = -inf."""
    vocab = x.shape[1]
    if stops.numel() and bool(banned.any()):
        x.masked_fill_(_banned_stops(torch.arange(vocab, device=x.device).expand_as(x), banned, stops), float("-inf"))
    every = k >= vocab - stops.numel() * banned.long()
    if bool(every.all()):
        return torch.full_like(x[:, 0], float("-inf")), x.logsumexp(-1), torch.ones_like(x[:, 0])
    k = torch.where(every, torch.ones_like(k), k)
    width = min(int(k.max()) + 1, vocab)  # one more than needed: shows whether ties at τ run past the window
    top = x.topk(width, dim=-1).values
    kth = top.gather(-1, (k - 1).unsqueeze(-1)).squeeze(-1)
    kept_lse, share = _exact_k_lse(top, kth, k)
    kth = torch.where(every, float("-inf"), kth)
    again = every | (top[:, -1] >= kth) if width < vocab else every  # support wider than the window: whole rows
    if bool(again.any()):
        rest = x[again]
        lse_again, share_again = _exact_k_lse(rest, kth[again], torch.where(every[again], vocab, k[again]))
        kept_lse[again] = torch.where(every[again], rest.logsumexp(-1), lse_again)
        share[again] = torch.where(every[again], 1.0, share_again)
    return kth, kept_lse, share


def _support_threshold(flat, rows, count, banned, stops):
    """τ_t and log Σ_{a ∈ S_t, a kept by the cut} e^{x_a} for ``rows`` [R] of ``flat`` [N, V] (|k_t| = ``count``
    [R] >= 1, ``banned`` [R]), CHUNK_ROWS consecutive rows of ``flat`` at a time.

    By k_t + s (s = #stops on a banned row): up to V / (OVERSAMPLE · MIN_BLOCK) contiguous blocks
    (:func:`_kth_by_blocks`), then strided blocks of >= 2 entries and a bound (:func:`_kth_by_bound`), beyond that
    (k_t over V / (2 · STRIDED_BLOCKS)) a top-k of the rows (:func:`_kth_direct`), which takes the rows of a chunk
    in groups whose k_t are within a factor 2, so that a row does not pay for a much larger k_t in its chunk.
    """
    vocab = flat.shape[1]
    kth = torch.empty(rows.numel(), dtype=flat.dtype, device=flat.device)
    kept_lse = torch.empty_like(kth)
    share = torch.empty_like(kth)
    need = count + stops.numel() * banned.long()
    small = need * (OVERSAMPLE * MIN_BLOCK) <= vocab
    bounded = need * (STRIDED_BLOCKS * 2) <= vocab
    # 0: blocks, 1: bound, else a top-k, by ⌈log2 (k + s)⌉ (+ 2)
    group = torch.where(small, 0, torch.where(bounded, 1, 2 + torch.ceil(torch.log2(need.double())).long()))
    chunk_of = rows // CHUNK_ROWS
    for chunk, by in torch.unique(torch.stack([chunk_of, group], dim=1), dim=0).tolist():
        members = ((chunk_of == chunk) & (group == by)).nonzero().squeeze(-1)
        start = chunk * CHUNK_ROWS
        x = flat[start : start + CHUNK_ROWS]
        local, k, ban, most = rows[members] - start, count[members], banned[members], int(need[members].max())
        if by == 0:
            result = _kth_by_blocks(x, local, k, ban, stops, vocab // (OVERSAMPLE * most))
        elif by == 1:
            result = _kth_by_bound(x, local, k, ban, stops)
        else:
            result = _kth_direct(x[local], k, ban, stops)
        kth[members], kept_lse[members], share[members] = result
    return kth, kept_lse, share


class _TruncatedLogProbs(torch.autograd.Function):
    """log π̃(y) at every row of scaled logits [N, V]: ONE gradient of their size, nothing of their size saved.

    Rows with k_t = 0 (or |k_t| >= V and no stop to drop) get upstream's full-vocabulary value, bit for bit:
    x_y − logsumexp(x) with upstream's logsumexp calls (or the caller's ``full_lse``). The other rows:
    x_y − log Σ_{a ∈ S_t} e^{x_a}, S_t = the |k_t| largest non-stop entries (τ_t the |k_t|-th value; of the entries
    tied at τ_t, as many as k_t leaves room for: :func:`_exact_k_lse`) ∪ {y}. Saved for backward: the logits (which
    the caller holds anyway) and [N] vectors (τ_t, the row's logsumexp over its support, flags); backward writes
    d log π̃(y)/d x_a = 1[a = y] − π̃(a) on S_t (0 off it) chunk by chunk into the one [N, V] gradient, with
    upstream's own operations on the full rows (so their gradient is upstream's too).
    """

    @staticmethod
    def forward(ctx, flat, labels, kept, stop_ids, full_lse):
        vocab = flat.shape[1]
        stops = torch.as_tensor(sorted(set(stop_ids)), dtype=torch.long, device=flat.device)
        if full_lse is None:
            full_lse = _upstream_logsumexp(flat)
        picked = flat.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        count = kept.abs()
        banned = (kept < 0) & (stops.numel() > 0)
        cut = (count > 0) & ((count < vocab) | banned)  # rows whose support is not the whole vocabulary
        rows = cut.nonzero().squeeze(-1)
        kth = torch.full_like(full_lse, float("-inf"))
        row_lse = full_lse.clone()
        forced = torch.zeros_like(cut)
        share = torch.ones_like(full_lse)
        if rows.numel():
            kth_r, lse_r, share[rows] = _support_threshold(
                flat, rows, count[rows].clamp(max=vocab), banned[rows], stops
            )
            # the sampled token is always kept: add it where the cut or the ban dropped it
            y_value = picked[rows]
            dropped = (y_value < kth_r) | (banned[rows] & torch.isin(labels[rows], stops))
            row_lse[rows] = torch.where(dropped, torch.logaddexp(lse_r, y_value), lse_r)
            kth[rows], forced[rows] = kth_r, dropped
        log_probs = picked - row_lse
        log_z = (row_lse - full_lse).float()  # exactly 0 on full rows
        ctx.save_for_backward(flat, labels, row_lse, kth, banned, forced, stops, share)
        ctx.mark_non_differentiable(log_z)
        return log_probs, log_z

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_log_z):
        if grad_log_probs is None:
            return None, None, None, None, None
        flat, labels, row_lse, kth, banned, forced, stops, share = ctx.saved_tensors
        tied_rows = (share < 1).nonzero().squeeze(-1)  # a tie at τ_t: each tied entry gets its share
        neg = (-grad_log_probs).to(flat.dtype).unsqueeze(-1)
        grad = torch.empty_like(flat)  # the one [N, V] tensor of this function's backward
        chunks_cut = set((kth > float("-inf")).nonzero().squeeze(-1).div(CHUNK_ROWS, rounding_mode="floor").tolist())
        banned_rows, forced_rows = banned.nonzero().squeeze(-1), forced.nonzero().squeeze(-1)
        for start in range(0, flat.shape[0], CHUNK_ROWS):
            part = slice(start, start + CHUNK_ROWS)
            x, out = flat[part], grad[part]
            # upstream's logsumexp backward, -g · exp(x − lse), here with lse over S_t and 0 off it
            torch.sub(x, row_lse[part].unsqueeze(-1), out=out)
            if start // CHUNK_ROWS in chunks_cut:
                out.masked_fill_(x < kth[part].unsqueeze(-1), float("-inf"))
            out.exp_()
            tied = tied_rows[(tied_rows >= start) & (tied_rows < start + CHUNK_ROWS)] - start
            for r in tied.tolist():
                at_tau = x[r] == kth[start + r]
                out[r] = torch.where(at_tau, out[r] * share[start + r], out[r])
            ban = banned_rows[(banned_rows >= start) & (banned_rows < start + CHUNK_ROWS)] - start
            if ban.numel() and stops.numel():
                out[ban.unsqueeze(-1), stops] = 0
            add = forced_rows[(forced_rows >= start) & (forced_rows < start + CHUNK_ROWS)] - start
            if add.numel():
                y = labels[part][add]
                out[add, y] = (x[add, y] - row_lse[part][add]).exp()
            out.mul_(neg[part])
            out.scatter_add_(-1, labels[part].unsqueeze(-1), -neg[part])  # + g at y, as upstream's gather backward
        return grad, None, None, None, None


def _flat(scaled_logits: torch.Tensor, labels: torch.Tensor, kept_count: torch.Tensor):
    vocab = scaled_logits.shape[-1]
    flat = scaled_logits.reshape(-1, vocab)  # a view of upstream's contiguous logits
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()  # upstream's actor hands fp32; other callers pay a copy
    device = flat.device
    return flat, labels.reshape(-1).to(device, torch.long), kept_count.reshape(-1).to(device, torch.long)


def truncated_log_probs(
    scaled_logits: torch.Tensor,
    labels: torch.Tensor,
    kept_count: torch.Tensor,
    stop_ids: Sequence[int] = (),
):
    """Upstream's ``log_probs_from_logits`` with the truncated rows renormalised over their kept support (the seam).

    Args:
        scaled_logits: [..., V] logits already divided by the temperature (as upstream's actor holds them).
        labels: [...] the token each position predicts.
        kept_count: [...] the engine's k_t per position (0 where nothing was truncated: prompt, padding).
        stop_ids: the engine's stop tokens (banned where ``kept_count < 0``).

    Returns:
        (log-probs [...] in the logits' dtype: upstream's value bit for bit where k_t = 0, log π̃ elsewhere,
        differentiable in ``scaled_logits``; log Z_t at the rows ``kept_count != 0`` (no grad, float32); the [...]
        bool selection). Memory: one backward gradient of the logits' size (upstream's own path has one), [N]
        vectors saved, temporaries of CHUNK_ROWS rows.
    """
    flat, tokens, kept = _flat(scaled_logits, labels, kept_count)
    log_probs, log_z = _TruncatedLogProbs.apply(flat, tokens, kept, tuple(stop_ids), None)
    selected = kept_count != 0
    return log_probs.view(scaled_logits.shape[:-1]), log_z[selected.reshape(-1).to(log_z.device)], selected


def apply_to_log_probs(
    scaled_logits: torch.Tensor,
    labels: torch.Tensor,
    log_probs: torch.Tensor,
    kept_count: torch.Tensor,
    stop_ids: Sequence[int] = (),
):
    """Full-vocabulary log-probs the caller already has, with the truncated rows replaced by log π̃.

    For callers that computed the full log-probs their own way (scoring at a sync, under no_grad): the full
    logsumexp is taken from them (lse = x_y − log_probs), so only the truncated rows are read again. Under autograd
    the gradient is right but this function's backward is a second [.., V] tensor next to the caller's: the
    trainer's seam uses :func:`truncated_log_probs` instead.

    Args:
        scaled_logits: [..., V] logits already divided by the temperature.
        labels: [...] the token each position predicts.
        log_probs: [...] the full-vocabulary log-probs of ``labels``.
        kept_count: [...] the engine's k_t per position (0 where nothing was truncated: prompt, padding).
        stop_ids: the engine's stop tokens (banned where ``kept_count < 0``).

    Returns:
        (log_probs with rows ``kept_count != 0`` replaced by log π̃, log Z_t at those rows (no grad, float32), the
        [...] bool selection).
    """
    flat, tokens, kept = _flat(scaled_logits, labels, kept_count)
    picked = flat.detach().gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    full_lse = picked - log_probs.detach().reshape(-1).to(picked)
    masked, log_z = _TruncatedLogProbs.apply(flat, tokens, kept, tuple(stop_ids), full_lse)
    selected = kept_count != 0
    out = torch.where(selected.to(log_probs.device), masked.view_as(log_probs).to(log_probs.dtype), log_probs)
    return out, log_z[selected.reshape(-1).to(log_z.device)], selected


def count_kept(processed_logprobs: torch.Tensor) -> torch.Tensor:
    """k_t from a row of the engine's processed log-probs (full vocab or top-N): the number of finite entries.

    Exact when the row holds the whole vocabulary, or the top-N with k_t < N (a count equal to N
    only says k_t >= N).
    """
    return torch.isfinite(processed_logprobs).sum(dim=-1)
