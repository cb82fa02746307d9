r"""Off-policy corrections for asynchronous RL: the maths, as flat pure-torch functions.

Notation (shared/DESIGN.md §1), per response token t of trajectory i, shapes (B, T):

- ``rollout_log_probs``  log μ(a_t)       behaviour policy: the vLLM engine that sampled the token
- ``prox_log_probs``     log π_prox(a_t)  proximal policy: the training-side model at the sampling version
- ``log_probs``          log π_θ(a_t)     current policy being optimised
- ``action_mask``        1 on response tokens that were sampled (environment tokens are 0)

No ray, deepspeed or vllm imports, no host synchronisation (``.item()``) inside: callers sync once.

References
- ESS-guided LR scaling: VCPO, arXiv 2602.17616 (ESS of trajectory importance weights; LR ∝ √(ESS/B)).
- Effective sample size: Kong (1992); ESS = (Σw)² / Σw².
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

ESS_WEIGHT_FORMS = ("geo_mean", "seq_product")
ESS_RULES = ("sqrt", "linear")


def sequence_log_weights(
    prox_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    action_mask: torch.Tensor,
    form: str = "geo_mean",
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Per-trajectory log importance weight log w_i and which trajectories have one.

    ``geo_mean`` (default, VCPO):  log w_i = mean_t (log π_prox − log μ)   (geometric-mean token ratio)
    ``seq_product`` (VCPO code):   log w_i = Σ_t   (log π_prox − log μ)   (the length-coupled product)

    Args:
        prox_log_probs, rollout_log_probs: (B, T) float.
        action_mask: (B, T), 1 on response tokens.
        form: one of :data:`ESS_WEIGHT_FORMS`.
    Returns:
        log_w: (B,) float64 (0 where invalid), valid: (B,) bool, False for a trajectory with no
        response token (its weight is undefined and it does not count towards B).
    """
    if form not in ESS_WEIGHT_FORMS:
        raise ValueError(f"unknown ESS weight form {form!r}; expected one of {ESS_WEIGHT_FORMS}")
    mask = action_mask.to(torch.float64)
    diff = (prox_log_probs.to(torch.float64) - rollout_log_probs.to(torch.float64)) * mask
    n_tokens = mask.sum(-1)
    valid = n_tokens > 0
    total = diff.sum(-1)
    log_w = total / n_tokens.clamp(min=1) if form == "geo_mean" else total
    return torch.where(valid, log_w, torch.zeros_like(log_w)), valid


def ess_log_moments(log_w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    r"""Shift-free log-space sufficient statistics of a (shard of a) batch, for a global ESS.

    Returns (3,) float64: [log Σ w_i, log Σ w_i², n] over valid i (log 0 = −inf for an empty
    shard). Combining shards: log-sum-exp the first two entries, add the third. Computing in log
    space means exp(Σ_t …) over 32k tokens cannot overflow.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=log_w.device)
    lw = torch.where(valid, log_w.to(torch.float64), neg_inf)
    return torch.stack([torch.logsumexp(lw, 0), torch.logsumexp(2 * lw, 0), valid.to(torch.float64).sum()])


def combine_log_moments(moments: torch.Tensor) -> torch.Tensor:
    """Combine (K, 3) per-shard :func:`ess_log_moments` into the (3,) moments of the union."""
    return torch.stack(
        [torch.logsumexp(moments[:, 0], 0), torch.logsumexp(moments[:, 1], 0), moments[:, 2].sum()]
    )


def ess_ratio_from_log_moments(moments: torch.Tensor) -> torch.Tensor:
    r"""ρ = ESS / B with ESS = (Σw)² / Σw² = exp(2·log Σw − log Σw²); ρ ∈ (0, 1]. NaN if B = 0."""
    log_sum, log_sum_sq, n = moments[0], moments[1], moments[2]
    return torch.exp(2 * log_sum - log_sum_sq) / n


def ess_ratio(log_w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """ρ = ESS/B of one batch (the single-process form of the two functions above)."""
    return ess_ratio_from_log_moments(ess_log_moments(log_w, valid))


def lr_scale_from_rho(rho: torch.Tensor, floor: float, rule: str = "sqrt") -> torch.Tensor:
    r"""LR multiplier: clamp(√ρ, floor, 1) (``sqrt``, VCPO) or clamp(ρ, floor, 1) (``linear``)."""
    if rule not in ESS_RULES:
        raise ValueError(f"unknown ESS rule {rule!r}; expected one of {ESS_RULES}")
    if not 0 < floor <= 1 or math.isnan(floor):
        raise ValueError(f"floor must be in (0, 1], got {floor}")
    raw = rho.sqrt() if rule == "sqrt" else rho
    return raw.clamp(min=floor, max=1.0)
