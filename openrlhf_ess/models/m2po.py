r"""M2PO, second-moment trust policy optimization: the maths, pure torch (docs/off_policy.md#m2po).

Zheng, Zhao and Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"
(arXiv 2510.01161; code: github.com/Infini-AI-Lab/M2PO). Per response token i of the batch, with r_i = π_θ/μ the
ratio of the current policy to the behaviour policy that sampled it:

    M̂2,i = (log r_i)²                                    the per-token second moment
    𝒯     = {i : A_i > 0 and r_i > 1, or A_i < 0 and r_i < 1}   the trust-region tokens

- ``paper`` (Algorithm 1, "M2PO Masking"): M ← 1; 𝒯 as above; while mean_{i∈𝒯} M̂2,i > τ: mask the argmax and
  drop it from 𝒯. The mean is over the trust-region tokens still in 𝒯 (Algorithm 1, lines 2–5), not over all
  tokens; the released code agrees (``_get_trust_region_tokens_delta_sq`` and ``M2_now = sum / token_num`` over
  those tokens, ``verl/trainer/ppo/core_algos.py``). The objective is J = (1/Σ_i |o_i|) Σ_i Σ_t M_{i,t} r_{i,t}
  A_{i,t}: no ε-clip, normalised by every valid token, masked ones included.
- ``code`` (``kpo_clip_harmful_tokens`` / ``_solve_tau_from_sorted_delta2`` there): nothing is masked; a bound b is
  chosen so that capping M̂2 at b² over 𝒯 keeps the capped mean below τ, and the loss is PPO's clipped surrogate
  with the ratio clipped to [exp(−b), exp(b)].

Removing the largest value of a set never raises its mean, so "drop the top k" is monotone in k and the smallest
such k is found in one sort and one cumulative sum (no loop). Ties: values are sorted descending with a stable
sort over the batch order (sample order, then position), so among equal M̂2 the token earlier in the batch is
masked first; the masked *count* and the M2 after masking do not depend on that choice.

No ``.item()`` here: callers sync once. Inputs of the trust region are whole-batch flat vectors of the valid
tokens, so the result does not depend on how the batch is split into micro-batches or ranks (:func:`flat_valid`).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

M2PO_STYLES = ("paper", "code")
# Upstream's PolicyLoss clamps log(π_θ/π_old) to ±20 before exp; the same clamp on log(π_θ/μ), and the "no clip"
# bound of the code style (a bound at the clamp never binds).
LOG_RATIO_CLAMP = 20.0


def trust_region(log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """𝒯 membership of each token (any shape): A > 0 and log r > 0, or A < 0 and log r < 0 (strict; A = 0 or
    r = 1 is never in 𝒯, as the released code's 1e-12 margins make it)."""
    return ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0))


def flat_valid(pieces: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The valid tokens of every piece, in batch order (piece, row, position), as one flat float64 vector.

    ``pieces[k]`` and ``masks[k]`` are (B_k, A_k): micro-batches of any widths; padding (mask 0) is left out, so
    the vector is the same however the batch is split.
    """
    return torch.cat([p.to(torch.float64)[m.bool()] for p, m in zip(pieces, masks)])


def unflatten(flat: torch.Tensor, masks: Sequence[torch.Tensor], fill) -> List[torch.Tensor]:
    """Inverse of :func:`flat_valid`: each piece's (B_k, A_k) tensor, ``flat``'s values at its valid tokens and
    ``fill`` elsewhere."""
    out, start = [], 0
    for m in masks:
        valid = m.bool()
        n = int(valid.sum())
        piece = torch.full(valid.shape, fill, dtype=flat.dtype, device=flat.device)
        piece[valid] = flat[start : start + n]
        out.append(piece)
        start += n
    return out


def masked_by_budget(log_ratio: torch.Tensor, advantages: torch.Tensor, tau: float) -> Tuple[torch.Tensor, ...]:
    r"""Algorithm 1 over one flat batch of valid tokens: which tokens M2PO masks.

    Args:
        log_ratio: (N,) log r_i = log π_θ − log μ of every valid token of the batch (float64 advised).
        advantages: (N,) A_i.
        tau: τ > 0, the budget on the trust-region tokens' mean (log r)² (0.04 in the paper).
    Returns:
        masked (N,) bool (True: M_i = 0), m2_before, m2_after: 0-dim float64, mean (log r)² over 𝒯 before and
        over what remains of 𝒯 after (0 for an empty set), n_trust: 0-dim int64, |𝒯| before.

    With v sorted descending over 𝒯 (n values, S_k = Σ_{j≥k} v_j), dropping the top k leaves the mean
    S_k / (n − k); k* is the smallest k with S_k ≤ τ (n − k) (k = n: 𝒯 empty, mean 0). The top k* are masked.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    in_tr = trust_region(log_ratio, advantages)
    idx = torch.nonzero(in_tr).flatten()
    v = log_ratio.to(torch.float64)[idx].square()
    n = v.numel()
    order = torch.sort(v, descending=True, stable=True).indices
    ordered = v[order]
    # suffix sums: remaining[k] = Σ_{j≥k} ordered[j], k = 0..n (remaining[n] = 0)
    zero = torch.zeros(1, dtype=torch.float64, device=v.device)
    remaining = torch.cat([ordered.flip(0).cumsum(0).flip(0), zero])
    count = torch.arange(n, -1, -1, dtype=torch.float64, device=v.device)  # n − k
    within = remaining <= tau * count  # S_k / (n − k) ≤ τ, multiplied out (k = n: 0 ≤ 0)
    k_star = torch.argmax(within.to(torch.int8))  # the first True; within[n] is always True
    masked = torch.zeros_like(log_ratio, dtype=torch.bool)
    drop = order[torch.arange(n, device=v.device) < k_star]
    masked[idx[drop]] = True
    m2_before = remaining[0] / max(n, 1)
    m2_after = remaining[k_star] / count[k_star].clamp(min=1)
    return masked, m2_before, m2_after, torch.tensor(n)


def code_clip_bound(log_ratio: torch.Tensor, advantages: torch.Tensor, tau: float) -> Tuple[torch.Tensor, ...]:
    r"""The released code's adaptive clip bound b on |log r| (``kpo_clip_harmful_tokens``), over one flat batch.

    Over 𝒯 (n values v = (log r)², sorted ascending, C_k = Σ_{j≤k} v_j): if mean v ≤ τ, no bound (b =
    :data:`LOG_RATIO_CLAMP`, which never binds). Else k* is the first k with v_k (n − k − 1) + C_k ≥ τ n, i.e.
    Σ_j min(v_j, v_k) ≥ τ n, and b = √v_{k*−1} (0 if k* = 0): the largest of the values whose cap keeps the capped
    mean below τ. The code's 1e-12 margins are left out. The loss then clips r to [exp(−b), exp(b)].

    Returns b, m2_before, m2_after (mean of min(v, b²) over 𝒯, the code's ``M2_after``), n_trust; 0-dim tensors.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    v = log_ratio.to(torch.float64)[trust_region(log_ratio, advantages)].square()
    n = v.numel()
    no_bound = torch.tensor(LOG_RATIO_CLAMP, dtype=torch.float64, device=v.device)
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64, device=v.device)
        return no_bound, zero, zero, torch.tensor(0)
    ordered = torch.sort(v).values
    m2_before = ordered.sum() / n
    capped_at = ordered * torch.arange(n - 1, -1, -1, dtype=torch.float64, device=v.device) + ordered.cumsum(0)
    k_star = torch.argmax((capped_at >= tau * n).to(torch.int8))  # exists when mean > τ (k = n − 1: the sum)
    bound_sq = torch.where(k_star > 0, ordered[(k_star - 1).clamp(min=0)], torch.zeros_like(m2_before))
    over = m2_before > tau
    bound = torch.where(over, bound_sq.sqrt(), no_bound)
    m2_after = torch.where(over, torch.minimum(ordered, bound_sq).sum() / n, m2_before)
    return bound, m2_before, m2_after, torch.tensor(n)


def m2po_loss(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    style: str,
    keep: torch.Tensor | None = None,
    log_bound: torch.Tensor | float | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Per-token M2PO loss (B, A), unreduced, and which tokens it cut (masked or clipped), (B, A) bool.

    r = exp(clamp(log π_θ − log μ, ±20)), the ratio to the behaviour policy.
    ``paper``: −M r A (``keep`` is M, bool). ``code``: −min(r A, clip(r, e^{−b}, e^{b}) A) (``log_bound`` is b).
    The caller reduces over *all* valid tokens (masked ones count in the normaliser: the paper's 1/Σ|o_i|).
    """
    if style not in M2PO_STYLES:
        raise ValueError(f"unknown M2PO style {style!r}; expected one of {M2PO_STYLES}")
    log_r = (log_probs - rollout_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_r.exp()
    if style == "paper":
        if keep is None:
            raise ValueError("M2PO paper style needs the batch's mask (keep)")
        keep = keep.bool()
        return -torch.where(keep, ratio * advantages, torch.zeros_like(ratio)), ~keep
    if log_bound is None:
        raise ValueError("M2PO code style needs the batch's clip bound (log_bound)")
    bound = torch.as_tensor(log_bound, dtype=ratio.dtype, device=ratio.device)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(torch.exp(-bound), torch.exp(bound)) * advantages
    return -torch.min(surr1, surr2), surr2 < surr1
