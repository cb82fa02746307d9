r"""Off-policy corrections for asynchronous RL: the maths, as flat pure-torch functions.

Notation, per response token t of trajectory i, shapes (B, T):

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
    return torch.stack([torch.logsumexp(moments[:, 0], 0), torch.logsumexp(moments[:, 1], 0), moments[:, 2].sum()])


def ess_ratio_from_log_moments(moments: torch.Tensor) -> torch.Tensor:
    r"""ρ = ESS / B with ESS = (Σw)² / Σw² = exp(2·log Σw − log Σw²); ρ ∈ (0, 1]. NaN if B = 0."""
    log_sum, log_sum_sq, n = moments[0], moments[1], moments[2]
    return torch.exp(2 * log_sum - log_sum_sq) / n


def ess_ratio(log_w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """ρ = ESS/B of one batch (the single-process form of the two functions above)."""
    return ess_ratio_from_log_moments(ess_log_moments(log_w, valid))


def lr_scale_from_rho(rho: torch.Tensor, floor: float, rule: str = "sqrt") -> torch.Tensor:
    r"""LR multiplier: clamp(√ρ, floor, 1) (``sqrt``, VCPO) or clamp(ρ, floor, 1) (``linear``).

    A NaN ρ gives a NaN scale (clamp passes NaN): ``ess_lr.global_lr_scale`` falls back to 1 then.
    """
    if rule not in ESS_RULES:
        raise ValueError(f"unknown ESS rule {rule!r}; expected one of {ESS_RULES}")
    if not 0 < floor <= 1 or math.isnan(floor):
        raise ValueError(f"floor must be in (0, 1], got {floor}")
    raw = rho.sqrt() if rule == "sqrt" else rho
    return raw.clamp(min=floor, max=1.0)


# ---- train/inference mismatch and truncated importance sampling (docs/off_policy.md) ---------------------


def mismatch_stats(prox_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor) -> torch.Tensor:
    r"""Mismatch between π_prox and μ on tokens sampled from μ: (4,) [k1, k3, χ², max |log r|].

    With r = π_prox/μ per token (1-D inputs, sampled tokens only):
    k1 = E_μ[−log r] and k3 = E_μ[r − 1 − log r] estimate KL(μ‖π_prox) (Schulman, "Approximating KL
    divergence"); χ² = E_μ[r²] − 1 = χ²(π_prox‖μ) is the variance of the IS weight. Zeros if empty.
    """
    if prox_log_probs.numel() == 0:
        return torch.zeros(4, dtype=torch.float64)
    log_r = prox_log_probs.to(torch.float64) - rollout_log_probs.to(torch.float64)
    r = log_r.clamp(max=20.0).exp()  # exp(20) bounds χ² against one absurd token; k1 stays exact
    return torch.stack([(-log_r).mean(), (r - 1 - log_r).mean(), (r * r).mean() - 1, log_r.abs().max()])


def tis_weights(
    prox_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    action_mask: torch.Tensor,
    cap: float,
    level: str = "token",
) -> torch.Tensor:
    r"""Truncated importance weights on the train/inference discrepancy, detached: (B, T).

    token:        w_t = min(π_prox(a_t)/μ(a_t), C)
    seq:          w_t = min(exp(mean_{t'} log(π_prox/μ)), C) for every token of the sequence (geometric mean)
    seq_product:  w_t = min(exp(Σ_{t'} log(π_prox/μ)), C) for every token of the sequence (the trajectory's
                  likelihood ratio π_prox(τ)/μ(τ), VCPO's ``rollout_is=sequence``; arXiv 2602.17616)

    Truncated IS: Ionides (2008); for LLM RL, Yao et al., "Your efficient RL framework secretly brings
    you off-policy RL training" (2025). The sums are taken in float64 and the exponent is bounded by log C
    before ``exp``, so a 4,096-token product cannot overflow (it underflows to 0 for a very unlikely
    trajectory, its true truncated value to float32 precision). Masked positions get weight 0.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}; expected one of {TIS_LEVELS}")
    mask = action_mask.to(torch.float32)
    if level == "seq_product":  # Σ_t of up to 4,096 terms: float64, bounded by log C before the cast
        log_seq, _ = sequence_log_weights(prox_log_probs.detach(), rollout_log_probs.detach(), action_mask, level)
        log_r = log_seq.clamp(max=math.log(cap)).float()[:, None].expand_as(mask)
    else:
        log_r = (prox_log_probs.float() - rollout_log_probs.float()).detach() * mask
        if level == "seq":
            log_r = (log_r.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(mask)
    # log C bounds the exponent, so no overflow for any input
    return log_r.clamp(max=math.log(cap)).exp() * mask


TIS_LEVELS = ("token", "seq", "seq_product")
SEQUENCE_TIS_LEVELS = ("seq", "seq_product")  # one weight per sequence, applied to all its tokens
TIS_DEFAULT_CAP = {"seq_product": 8.0}  # VCPO's rollout_is_threshold for the product; other levels need a cap


def tis_truncated(weights: torch.Tensor, cap: float) -> torch.Tensor:
    """Which :func:`tis_weights` the cap truncated (a weight at the cap, up to float rounding)."""
    return weights >= cap * (1 - 1e-6)


# ---- approximate proximal policy without an extra forward ("loglinear") ---------------------------------


def loglinear_prox_log_probs(
    rollout_log_probs: torch.Tensor, current_log_probs: torch.Tensor, version_lag: torch.Tensor
) -> torch.Tensor:
    r"""AReaL's log-linear proximal policy: log π_prox = log μ + α (log π_V − log μ), α = L / (L + 1).

    μ is the behaviour policy (the engine at the token's version v), π_V the training-side policy at the
    version V being trained (upstream's recomputed log-prob) and L = V − v the version lag. α is AReaL's
    (v_prox − v_behave)/(v_θ − v_behave) with v_prox = V and v_θ = V + 1 (arXiv 2505.24298 §4 and its code):
    a fresh token (L = 0) keeps π_prox = μ, a very stale one tends to π_V. Shapes (B, T); no forward.
    """
    lag = version_lag.to(current_log_probs.dtype).clamp(min=0)
    alpha = lag / (lag + 1)
    return rollout_log_probs + alpha * (current_log_probs - rollout_log_probs)


# ---- PPO-EWMA decay from the observed staleness ("ewma"; --algo.prox_ewma_decay auto) ----------------------


def ewma_decay_for_age(age: float) -> float:
    r"""PPO-EWMA decay β whose weight average has mean age ``age`` optimizer steps: β = age / (1 + age).

    The EWMA θ̄_n = β θ̄_{n−1} + (1 − β) θ_n gives the weights of k steps ago the share (1 − β) βᵏ, so its mean
    age is Σ_k k (1 − β) βᵏ = β / (1 − β) steps; solving β / (1 − β) = age gives β = age / (1 + age)
    (age 0 → β = 0, the live weights; age 1 → 0.5; age 9 → 0.9, the fixed default). Hilton et al., "Batch
    size-invariance for policy optimization" (arXiv 2110.00641) set β_prox from the age the proximal policy
    should have (what matters is how old it is); here that age is the observed one, the batch's version lag in
    optimizer steps, so π_prox is on average as old as the policy that sampled the batch.
    """
    age = float(age)
    if not age >= 0 or math.isinf(age):
        raise ValueError(f"EWMA age (version lag in optimizer steps) must be finite and >= 0, got {age}")
    return age / (1.0 + age)


def ewma_decay_for_batch(decay: float, batch_size: int, ref_batch_size: int) -> float:
    r"""Hilton et al.'s batch-size-invariance rule for the PPO-EWMA decay: β = β_ref^(B / B_ref).

    "Batch size-invariance for policy optimization" (arXiv 2110.00641, §4): when the batch size is divided by c,
    β_prox → β_prox^(1/c), so that the EWMA averages over the same number of *samples*: its weights per sample
    decay as β_ref^(1/B_ref) whatever the batch. ``decay`` β_ref is the decay tuned at ``ref_batch_size`` samples
    per optimizer step; ``batch_size`` B is this run's (B = B_ref gives β_ref back).
    """
    if not 0 < decay < 1 or batch_size < 1 or ref_batch_size < 1:
        raise ValueError(f"need 0 < decay < 1 and batch sizes >= 1, got {decay}, {batch_size}, {ref_batch_size}")
    return decay ** (batch_size / ref_batch_size)


# ---- KL-to-reference loss: k1/k2/k3 value, importance-weighted k2 gradient (k2 option) -------------------

KL_VALUE_ESTIMATORS = ("k1", "k2", "k3")
# Bound on log-space quantities before exp: k3's exponent −x, and log w from below. exp(20) ≈ 4.9e8 stays
# finite in float32 even for log-probs of −1e4, whereas exp(89) already overflows float32 to inf, and inf·0
# (a token with π_θ = π_ref) is NaN in both the value and its gradient.
KL_LOG_BOUND = 20.0
# Upper bound on the whole k2 weight w, the same as upstream's bound on its KL IS weight
# (openrlhf.models.utils.KL_IS_WEIGHT_CLIP): no factor of w, staleness or discrepancy, can exceed it.
K2_IS_WEIGHT_CLIP = 10.0


def kl_loss_k2(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    prox_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    value_estimator: str = "k3",
    tis_level: str = "token",
    action_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Per-token KL(π_θ‖π_ref) loss: forward value k1/k2/k3, gradient that of the weighted k2 surrogate.

    With x = log π_θ(a) − log π_ref(a) (``ref_log_probs`` = log π_ref, the frozen reference model):

        value  k1 = x,   k2 = ½ x²,   k3 = e^{−x} − 1 + x                     (``value_estimator``)
        w      = min((π_θ/π_prox) · d, W),   W = 10                           (detached; decoupled weight)
        d      = min(π_prox(a_t)/μ(a_t), C)                                    (``tis_level="token"``)
        d_i    = min(exp(mean_t log(π_prox/μ)), C), every token of sequence i (``tis_level="seq"``)
        d_i    = min(exp(Σ_t log(π_prox/μ)), C), every token of sequence i    (``tis_level="seq_product"``)
        out    = value + w · ½ x² − stopgrad(w · ½ x²)                         (straight-through)

    so ``out`` equals the chosen estimator and ∂out/∂log π_θ = w · x. Why: the reverse-KL gradient is
    ∇KL(π_θ‖π_ref) = E_{a~π_θ}[(log π_θ − log π_ref) ∇log π_θ], and ∇(½x²) = x ∇log π_θ is exactly that
    integrand. Tokens are sampled from μ (the inference engine, possibly stale), so the expectation needs
    the importance weight π_θ/μ = (π_θ/π_prox)(π_prox/μ); the second (train/inference discrepancy) factor is
    TIS-capped at C as in the policy loss, which trades a little bias for bounded variance.
    d follows the TIS level: it is the very weight :func:`tis_weights` gives the policy loss, per token or
    per sequence. The whole weight is then bounded by W = :data:`K2_IS_WEIGHT_CLIP`, upstream's bound on its
    KL IS weight, so the staleness factor π_θ/π_prox (which no cap touches) cannot blow up the gradient.
    By contrast k3 used directly as a loss has pathwise gradient (1 − π_ref/π_θ)∇log π_θ, whose on-policy
    expectation is ∇KL(π_ref‖π_θ), the *forward* KL: biased for the reverse KL it reports.

    Differs from upstream ``compute_approx_kl(..., unbiased_gradient=True)`` (``--algo.kl.unbiased_gradient``)
    only in the weight: upstream uses w = min(π_θ/π_old, 10), i.e. it ignores the train/inference
    discrepancy π_prox/μ; we use min((π_θ/π_prox) · d, 10) with the TIS-capped d. We also do not clamp the
    value to [−10, 10] (callers see the true estimate; only k3's exponent is bounded, see :data:`KL_LOG_BOUND`).

    Args:
        log_probs: (B, T) log π_θ(a_t), the only input that receives a gradient.
        ref_log_probs: (B, T) log π_ref(a_t).
        prox_log_probs: (B, T) log π_prox(a_t), or None: π_prox = π_θ (the first factor is 1 and the
            discrepancy factor becomes min(π_θ/μ, C)).
        rollout_log_probs: (B, T) log μ(a_t), or None: no discrepancy factor (on-policy w.r.t. π_prox).
        tis_cap: C > 0, or None: the uncapped π_prox/μ. Ignored without ``rollout_log_probs``.
        value_estimator: one of :data:`KL_VALUE_ESTIMATORS`, the forward value only.
        tis_level: one of :data:`TIS_LEVELS`, as ``--algo.tis_level``: per-token d (default) or the
            sequence's d_i (geometric mean or product), which needs ``action_mask``.
        action_mask: (B, T), 1 on response tokens; used only by the sequence levels.
    Returns:
        (B, T) per-token loss in float32 (float64 if the inputs are), unmasked: the caller applies
        ``action_mask`` and the token/sequence mean.

    References: J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html (k1, k2, k3);
    Liu et al., "Rethinking KL Regularization in RLHF: From Value Estimation to Gradient Optimization",
    arXiv 2510.01555 (k2 as loss ≡ k1 in reward on-policy; k3 as loss biased; off-policy needs IS).
    """
    if value_estimator not in KL_VALUE_ESTIMATORS:
        raise ValueError(f"unknown KL value estimator {value_estimator!r}; expected one of {KL_VALUE_ESTIMATORS}")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if tis_level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {tis_level!r}; expected one of {TIS_LEVELS}")
    if tis_level in SEQUENCE_TIS_LEVELS and rollout_log_probs is not None and action_mask is None:
        raise ValueError(f"tis_level={tis_level!r} reduces log(pi_prox/mu) over each sequence: pass action_mask")
    # bf16 log-probs lose the small differences that KL is made of: compute in at least float32.
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    log_probs = log_probs.to(dtype)
    x = log_probs - ref_log_probs.to(dtype)

    if value_estimator == "k1":
        value = x
    elif value_estimator == "k2":
        value = 0.5 * x.square()
    else:
        # e^{−x} overflows for x < −88 (float32); below x = −20 the value saturates at e^20 − 21 ≈ 4.9e8.
        x_k3 = x.clamp(min=-KL_LOG_BOUND)
        value = torch.exp(-x_k3) - 1 + x_k3

    # log w = min((log π_θ − log π_prox) + log d, log W), in log space, exp once at the end.
    log_theta = log_probs.detach()
    log_prox = log_theta if prox_log_probs is None else prox_log_probs.to(dtype)
    log_w = log_theta - log_prox
    if rollout_log_probs is not None:
        if tis_level in SEQUENCE_TIS_LEVELS:
            # The policy loss's own per-sequence weight (float32). It is 0 off the response: take d = 1 there
            # rather than log 0 = −inf, which a +inf staleness term on a padding token would turn into NaN.
            cap = tis_cap if tis_cap is not None else math.inf
            d = tis_weights(log_prox, rollout_log_probs, action_mask, cap, tis_level).to(dtype)
            log_disc = torch.where(action_mask.bool(), d.log(), torch.zeros_like(d))
        else:
            log_disc = log_prox - rollout_log_probs.to(dtype)
            if tis_cap is not None:
                log_disc = log_disc.clamp(max=math.log(tis_cap))
        log_w = log_w + log_disc
    w = log_w.clamp(-KL_LOG_BOUND, math.log(K2_IS_WEIGHT_CLIP)).exp().detach()

    surrogate = w * (0.5 * x.square())
    # Bracketed so the forward value is bit-exact: (value + s) − s would round value away when s ≫ value.
    return value.detach() + (surrogate - surrogate.detach())
