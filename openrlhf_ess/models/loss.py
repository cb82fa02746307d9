"""Policy loss: upstream's ``PolicyLoss`` with truncated IS at every level (token, geometric mean, product), or M2PO.

Mirrors ``openrlhf/models/loss.py``. The TIS weight is :func:`corrections.tis_weights`, the one function the
metrics (``tis/*``) and the optimal baseline read too; the loss is upstream's on advantages w·A (the clipped
surrogate is positively homogeneous in A, so for the detached w ≥ 0 this is w times upstream's loss). Upstream's
own ``--algo.advantage.is_correction_*`` stays available on its own (setting both is refused). With
``--algo.m2po_tau`` the loss is M2PO's instead (``models/m2po.py``), on the batch's mask or clip bound that
``trainer/m2po.py`` puts on the loss around each training step.
"""

from __future__ import annotations

from openrlhf.models.loss import PolicyLoss as _UpstreamPolicyLoss
from openrlhf.models.loss import aggregate_loss
from openrlhf.models.utils import masked_mean

from openrlhf_ess.models import corrections, m2po


class PolicyLoss(_UpstreamPolicyLoss):
    tis_cap = None
    tis_level = "token"
    m2po_style = None  # --algo.m2po_style with --algo.m2po_tau; None: off
    m2po_keep = m2po_log_bound = None  # the micro-batch's mask (paper) or clip bound (code), set around each step

    @classmethod
    def from_upstream(
        cls, loss: _UpstreamPolicyLoss, tis_cap: float, tis_level: str, m2po_style: str | None = None
    ) -> "PolicyLoss":
        """Our loss with the configuration of the one upstream's trainer built."""
        if tis_cap is not None and loss.is_correction_level != "off":  # pre-flight refuses both flags together
            raise ValueError(
                "--algo.tis_cap with upstream's --algo.advantage.is_correction_level "
                f"{loss.is_correction_level}: the weight would apply twice; set one IS correction."
            )
        ours = cls.__new__(cls)
        ours.__dict__.update(vars(loss))
        ours.tis_cap, ours.tis_level, ours.m2po_style = tis_cap, tis_level, m2po_style
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
        if self.m2po_style is not None:
            return self.m2po_forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kwargs)
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

    def m2po_forward(self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, **kwargs):
        """M2PO's loss (``--algo.m2po_tau``): −M (π_θ/μ) A (paper) or PPO's surrogate with the ratio to μ clipped to
        [e^{−b}, e^{b}] (code), reduced by upstream's ``aggregate_loss`` over every valid token, masked ones included
        (the paper's normaliser 1/Σ|o_i|). The second and fifth outputs are the fraction of valid tokens the mask or
        the clip cut in this micro-batch; the fourth upstream's ``vllm_kl``, E[log μ − log π_old]."""
        if rollout_log_probs is None:
            raise RuntimeError(
                f"--algo.m2po_tau (--algo.m2po_style {self.m2po_style}) takes the ratio to the behaviour policy "
                "pi_theta/mu, but the rollout log-probs (mu) are missing for this batch. Launch with "
                "openrlhf_ess.cli.train_ppo_ray and an agent that keeps the engine's log-probs."
            )
        per_token, cut = m2po.m2po_loss(
            log_probs, rollout_log_probs, advantages, self.m2po_style, self.m2po_keep, self.m2po_log_bound
        )
        loss = aggregate_loss(per_token, action_mask, token_level_loss=self.token_level_loss, **kwargs)
        cut_frac = masked_mean(cut.float(), action_mask, dim=None)
        ppo_kl = masked_mean(-(log_probs - old_log_probs).detach(), action_mask, dim=None)
        vllm_kl = masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None).detach()
        return loss, cut_frac, ppo_kl, vllm_kl, cut_frac
