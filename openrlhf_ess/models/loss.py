"""Policy loss: upstream's ``PolicyLoss`` with truncated IS at every level (token, geometric mean, product).

Mirrors ``openrlhf/models/loss.py``. The TIS weight is :func:`corrections.tis_weights`, the one function the
metrics (``tis/*``) and the optimal baseline read too; the loss is upstream's on advantages w·A (the clipped
surrogate is positively homogeneous in A, so for the detached w ≥ 0 this is w times upstream's loss). Upstream's
own ``--algo.advantage.is_correction_*`` stays available on its own (setting both is refused).
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
        if tis_cap is not None and loss.is_correction_level != "off":  # pre-flight refuses both flags together
            raise ValueError(
                "--algo.tis_cap with upstream's --algo.advantage.is_correction_level "
                f"{loss.is_correction_level}: the weight would apply twice; set one IS correction."
            )
        ours = cls.__new__(cls)
        ours.__dict__.update(vars(loss))
        ours.tis_cap, ours.tis_level = tis_cap, tis_level
        return ours

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, **kwargs):
        """Overrides upstream's for truncated IS (``--algo.tis_cap``), after checking that μ is there.

        Decoupled PPO with w_t = min(π_prox/μ, C) (``token``), or one weight per sequence w_i =
        min(exp(mean_t log(π_prox/μ)), C) (``seq``) or min(exp(Σ_t log(π_prox/μ)), C) (``seq_product``, VCPO's
        trajectory ratio): L = −w · min(r_t A_t, clip(r_t, 1−ε_l, 1+ε_h) A_t), r_t = π_θ/π_prox. The clipped
        surrogate (dual clip included) is positively homogeneous in A, so for the detached w ≥ 0 this equals
        upstream's loss computed on advantages w · A_t. The fourth output is upstream's ``vllm_kl``, the fifth
        (upstream's ``is_filter_ratio``) the fraction the cap C truncated: of response tokens (``token``), or of
        sequences with at least one response token.
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
        if self.tis_cap is None:
            return super().forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kwargs)
        w = corrections.tis_weights(old_log_probs, rollout_log_probs, action_mask, self.tis_cap, self.tis_level)
        loss, clip_ratio, ppo_kl, _, _ = super().forward(
            log_probs, old_log_probs, advantages * w, action_mask, rollout_log_probs, **kwargs
        )
        vllm_kl = masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None).detach()
        if self.tis_level not in corrections.SEQUENCE_TIS_LEVELS:
            truncated = corrections.tis_truncated(w, self.tis_cap).float()
            return loss, clip_ratio, ppo_kl, vllm_kl, masked_mean(truncated, action_mask, dim=None)
        # w is w_i on a row's response tokens and 0 elsewhere (prompt, padding), so its row max is w_i
        # wherever the response sits; a row without a response token is not a sequence of the loss.
        has_response = action_mask.bool().any(-1)
        truncated = corrections.tis_truncated(w.amax(-1), self.tis_cap) & has_response
        clipped_seqs = truncated.float().sum() / has_response.float().sum().clamp(min=1)
        return loss, clip_ratio, ppo_kl, vllm_kl, clipped_seqs
