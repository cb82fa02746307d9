"""The off-policy k2 KL loss inside upstream's ``training_step`` (``--algo.kl.off_policy_k2_enable``).

Upstream's ``training_step`` computes the KL term with ``compute_approx_kl``; with the flag the trainer runs a
copy of that method whose ``compute_approx_kl`` is :func:`off_policy_k2_kl` (``upstream.rebind``: upstream's
module is not touched). The micro-batch's μ and the IS cap reach it through a context variable, set around
the call by :func:`context`. The maths is ``corrections.kl_loss_k2``.
"""

from __future__ import annotations

import contextlib
import contextvars

from openrlhf_ess.models import corrections

# (μ of the micro-batch in training_step, IS cap, TIS level, action mask) for the off-policy k2 KL below.
_K2_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("openrlhf_ess_k2_context")
K2_DEFAULT_IS_CAP = 10.0  # upstream's bound on its KL IS weight (KL_IS_WEIGHT_CLIP)


def off_policy_k2_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1", unbiased_gradient=False):
    """Stands in for upstream's ``compute_approx_kl`` inside training_step with --algo.kl.off_policy_k2_enable."""
    rollout_log_probs, cap, tis_level, action_mask = _K2_CONTEXT.get()
    return corrections.kl_loss_k2(
        log_probs,
        log_probs_base,
        prox_log_probs=log_probs_old,
        rollout_log_probs=rollout_log_probs,
        tis_cap=cap,
        value_estimator=kl_estimator,
        tis_level=tis_level,
        action_mask=action_mask,
    )


@contextlib.contextmanager
def context(rollout_log_probs, algo, action_mask=None):
    """μ of the micro-batch, the cap (--algo.tis_cap, else upstream's KL IS bound), the TIS level and the action
    mask (sequence-level weights need it) for the block."""
    cap = algo.tis_cap if algo.tis_cap is not None else K2_DEFAULT_IS_CAP
    token = _K2_CONTEXT.set((rollout_log_probs, cap, algo.tis_level, action_mask))
    try:
        yield
    finally:
        _K2_CONTEXT.reset(token)
