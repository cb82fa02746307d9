"""Policy loss: upstream's ``PolicyLoss`` plus sequence-level truncated IS (geometric mean or product).

Mirrors ``openrlhf/models/loss.py``. Token-level TIS needs no maths here: it is upstream's
``is_correction`` clip mode, configured from ``--algo.tis_cap`` (see ``openrlhf_ess/config/resolve.py``); our
subclass only checks, at both levels, that the rollout log-probs μ it needs are there.
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
        """Overrides upstream's for sequence-level TIS, and at every TIS level to check that μ is there.

        Decoupled PPO with w_i = min(exp(mean_t log(π_prox/μ)), C) (``seq``) or min(exp(Σ_t log(π_prox/μ)), C)
        (``seq_product``, VCPO's trajectory ratio):
        L = −w_i · min(r_t A_t, clip(r_t, 1−ε_l, 1+ε_h) A_t), r_t = π_θ/π_prox. The clipped surrogate
        (dual clip included) is positively homogeneous in A, so for the detached w_i ≥ 0 this equals
        upstream's loss computed on advantages w_i · A_t. The fifth output is the fraction of sequences
        (with at least one response token) whose w_i the cap C truncated.
        """
        if self.tis_cap is not None and rollout_log_probs is None:
            # Without this, upstream's token path and ours fail deep inside with a TypeError on None.
            raise RuntimeError(
                f"--algo.tis_cap {self.tis_cap} (--algo.tis_level {self.tis_level}) weights the loss by "
                "min(pi_prox/mu, C), but the rollout log-probs (μ) are missing: the vLLM engines did not return "
                "sampled-token log-probs for this batch (engines not started by openrlhf_ess.cli.train_ppo_ray, "
                "which asks them for log-probs, or an agent that drops them). Launch with openrlhf_ess.cli."
                "train_ppo_ray and an agent that keeps the engine's log-probs, or remove --algo.tis_cap."
            )
        if self.tis_level not in corrections.SEQUENCE_TIS_LEVELS or self.tis_cap is None:
            return super().forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kwargs)
        w = corrections.tis_weights(old_log_probs, rollout_log_probs, action_mask, self.tis_cap, self.tis_level)
        loss, clip_ratio, ppo_kl, _, _ = super().forward(
            log_probs, old_log_probs, advantages * w, action_mask, rollout_log_probs, **kwargs
        )
        vllm_kl = masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None).detach()
        # w is w_i on a row's response tokens and 0 elsewhere (prompt, padding), so its row max is w_i
        # wherever the response sits; a row without a response token is not a sequence of the loss.
        has_response = action_mask.bool().any(-1)
        truncated = corrections.tis_truncated(w.amax(-1), self.tis_cap) & has_response
        clipped_seqs = truncated.float().sum() / has_response.float().sum().clamp(min=1)
        return loss, clip_ratio, ppo_kl, vllm_kl, clipped_seqs
