"""Policy loss: upstream's ``PolicyLoss`` plus sequence-level truncated IS.

Mirrors ``openrlhf/models/loss.py``. Token-level TIS needs no code here: it is upstream's
``is_correction`` clip mode, configured from ``--algo.tis_cap`` (see ``openrlhf_ess/config.py``).
"""

from __future__ import annotations

from openrlhf.models.loss import PolicyLoss as _UpstreamPolicyLoss
from openrlhf.models.utils import masked_mean

from openrlhf_ess.models import corrections


class PolicyLoss(_UpstreamPolicyLoss):
    tis_cap = None
    tis_level = "token"

    @classmethod
    def from_upstream(cls, loss: _UpstreamPolicyLoss, tis_cap: float, tis_level: str) -> "PolicyLoss":
        """Our loss with the configuration of the one upstream's trainer built."""
        ours = cls.__new__(cls)
        ours.__dict__.update(vars(loss))
        ours.tis_cap, ours.tis_level = tis_cap, tis_level
        return ours

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, **kwargs):
        """Overrides upstream's only for sequence-level TIS; everything else is upstream's.

        Decoupled PPO (shared/DESIGN.md §2) with w_i = min(exp(mean_t log(π_prox/μ)), C):
        L = −w_i · min(r_t A_t, clip(r_t, 1−ε_l, 1+ε_h) A_t), r_t = π_θ/π_prox. The clipped surrogate
        (dual clip included) is positively homogeneous in A, so for the detached w_i ≥ 0 this equals
        upstream's loss computed on advantages w_i · A_t.
        """
        if self.tis_level != "seq" or self.tis_cap is None:
            return super().forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kwargs)
        w = corrections.tis_weights(old_log_probs, rollout_log_probs, action_mask, self.tis_cap, "seq")
        loss, clip_ratio, ppo_kl, _, _ = super().forward(
            log_probs, old_log_probs, advantages * w, action_mask, rollout_log_probs, **kwargs
        )
        vllm_kl = masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None).detach()
        clipped_seqs = corrections.tis_truncated(w[:, :1], self.tis_cap).float().mean()
        return loss, clip_ratio, ppo_kl, vllm_kl, clipped_seqs
