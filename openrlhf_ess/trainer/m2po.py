"""M2PO (``--algo.m2po_tau``, ``--algo.m2po_style``): the batch's mask or clip bound, and its way into the loss.

Algorithm 1 of M2PO sorts every token of the optimizer batch together, so its mask is a function of the whole
batch, not of a micro-batch or a rank's share. The controller's experience maker holds the whole rollout batch,
and with one optimizer step per rollout batch (which validation requires) that batch is the optimizer batch and
π_θ at the step is the π_old the maker just recomputed, so log r = log π_θ − log μ at the step equals
log π_old − log μ here. :func:`mark_batch` runs there, after the advantages, over every valid token at once (no
collective: no rank sees a part of it); the result rides to the actors on each Experience:

- ``paper``: the keep mask ``m2po_keep`` (B, A) bool, carried through upstream's rebuilds by ``carried.py``;
- ``code``: the clip bound b in ``info[CLIP_BOUND_KEY]``, one value per sample (upstream's ``info`` travels
  per sample through its splits and batches, and the actor logs it).

Around each training step :func:`applied` hands the micro-batch's mask or bound to our ``PolicyLoss``
(``models/loss.py``), which computes the loss over every valid token (masked ones count in the normaliser).

Memory on the controller, transient: log r and the advantages of the valid tokens in float64, and the sort's
values, indices and suffix sums over the trust-region tokens, under 64 bytes per token (512 x 4096 tokens: under
128 MiB, freed after the call); kept: the keep mask, 1 byte per token, sent to the actors with the batch.
The maths is ``models/m2po.py``.
"""

from __future__ import annotations

import contextlib
from typing import Dict

import torch

from openrlhf_ess.models import m2po
from openrlhf_ess.trainer import carried

KEEP_ATTR = carried.M2PO_KEEP.name  # paper style: (B, A) bool on each Experience, True = in the loss
CLIP_BOUND_KEY = "m2po/clip_log_bound"  # code style: b per sample in Experience.info (logged by the actor)


def mark_batch(experiences, tau: float, style: str) -> Dict[str, float]:
    """The batch's M2PO mask (``paper``) or clip bound (``code``) on every experience; returns its metrics.

    log r = action_log_probs − rollout_log_probs (π_old and μ) and the advantages, over every valid token
    (``action_mask``) of all ``experiences`` together. Metrics: ``m2po/m2_before`` and ``m2po/m2_after`` (mean
    (log r)² over the trust-region tokens, before and after masking / capping), ``m2po/masked_frac`` (valid tokens
    masked, or beyond the clip bound), ``m2po/trust_region_frac`` (valid tokens in the trust region) and, code style,
    ``m2po/clip_log_bound``.
    """
    if style not in m2po.M2PO_STYLES:
        raise ValueError(f"unknown --algo.m2po_style {style!r}; expected one of {m2po.M2PO_STYLES}")
    missing = sum(exp.rollout_log_probs is None for exp in experiences)
    if missing:
        raise RuntimeError(
            f"--algo.m2po_tau: {missing} of {len(experiences)} micro-batches came without rollout log-probs (mu), so "
            "their ratio to the behaviour policy is unknown. The engines return mu whenever --algo.m2po_tau is set; "
            "an agent (--train.agent_func_path) must return them too."
        )
    masks = [exp.action_mask for exp in experiences]
    log_ratio = m2po.flat_valid(
        [exp.action_log_probs.double() - exp.rollout_log_probs.double() for exp in experiences], masks
    )
    advantages = m2po.flat_valid([exp.advantages for exp in experiences], masks)
    n_valid = max(log_ratio.numel(), 1)
    if style == "paper":
        masked, before, after, n_trust = m2po.masked_by_budget(log_ratio, advantages, tau)
        for exp, keep in zip(experiences, m2po.unflatten(~masked, masks, True)):
            setattr(exp, KEEP_ATTR, keep)
        n_masked = masked.sum()
        bound = torch.zeros((), dtype=torch.float64)
    else:
        bound, before, after, n_trust = m2po.code_clip_bound(log_ratio, advantages, tau)
        n_masked = (m2po.trust_region(log_ratio, advantages) & (log_ratio.abs() > bound)).sum()
    nonfinite = (~torch.isfinite(log_ratio)).sum()
    stats = [before, after, n_masked, n_trust, bound, nonfinite]
    numbers = torch.stack([x.double() for x in stats]).tolist()  # one host sync
    if numbers[5]:
        raise RuntimeError(
            f"--algo.m2po_tau: log(pi_old/mu) is NaN/inf on {int(numbers[5])} response tokens of this batch, a "
            "log-prob that --algo.nonfinite_logprobs did not mask; M2PO's mask would leave them out of the trust "
            "region silently. Check the engines' log-probs (mu) and the actor's (pi_old)."
        )
    out = {
        "m2po/m2_before": numbers[0],
        "m2po/m2_after": numbers[1],
        "m2po/masked_frac": numbers[2] / n_valid,
        "m2po/trust_region_frac": numbers[3] / n_valid,
    }
    if style == "code":
        out[CLIP_BOUND_KEY] = numbers[4]
        for exp in experiences:
            exp.info[CLIP_BOUND_KEY] = torch.full((len(exp.sequences),), numbers[4], dtype=torch.float32)
    return out


def batch_of(experience, style: str):
    """The micro-batch's keep mask (``paper``) or clip bound (``code``), as :func:`mark_batch` left them."""
    if style == "paper":
        keep = getattr(experience, KEEP_ATTR, None)
        if keep is None or keep.shape != experience.action_mask.shape:
            raise RuntimeError(
                f"--algo.m2po_style paper: a training micro-batch has no M2PO mask of its shape ({KEEP_ATTR}); this "
                "is a bug, please report it."
            )
        return keep
    bounds = experience.info.get(CLIP_BOUND_KEY)
    if bounds is None or len(bounds) == 0:
        raise RuntimeError(
            f"--algo.m2po_style code: a training micro-batch has no clip bound ({CLIP_BOUND_KEY}); this is a bug, "
            "please report it."
        )
    return torch.as_tensor(bounds[0], dtype=torch.float32)


@contextlib.contextmanager
def applied(loss_fn, experience, style: str):
    """The micro-batch's mask or bound on ``loss_fn`` (our PolicyLoss) for the block, cleared afterwards."""
    value = batch_of(experience, style)
    loss_fn.m2po_keep, loss_fn.m2po_log_bound = (value, None) if style == "paper" else (None, value)
    try:
        yield
    finally:
        loss_fn.m2po_keep = loss_fn.m2po_log_bound = None
