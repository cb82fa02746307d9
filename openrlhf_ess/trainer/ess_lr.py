"""ESS-guided LR scaling around the DeepSpeed engine step (docs/ess_lr.md).

Once per rollout batch, before that rollout's optimizer steps, every actor rank computes the log-space
ESS moments of its shard of the replay buffer; one all-gather (on the collective device, see
``openrlhf_ess/distributed.py``) makes them global, so every rank gets
the same scale. The scale multiplies the param-group LRs of the innermost optimizer for exactly the
optimizer steps of that rollout: a step pre-hook multiplies, a step post-hook restores, so the LR
scheduler (which DeepSpeed advances after the inner step) never sees the scaled value.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Dict, List, Optional, Tuple

import torch

from openrlhf_ess import distributed
from openrlhf_ess.models import corrections

logger = logging.getLogger(__name__)


def innermost_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer that really updates parameters under a DeepSpeed engine.

    ZeRO-0 fp32: ``engine.optimizer``; ZeRO 1-3 and the bf16 wrapper: ``engine.optimizer.optimizer``.
    """
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) or isinstance(
        getattr(opt, "optimizer", None), torch.optim.Optimizer
    ):
        opt = opt.optimizer
    return opt


class LrScaleHook:
    """Multiplies an optimizer's param-group LRs by ``scale`` for the duration of each ``step()``.

    Register after ``deepspeed.initialize`` (it takes a dummy step). ZeRO 1-3 call the inner
    ``step()`` once per param group: each call saves and restores its own groups. A ``step()`` that
    raises skips the post-hook: the next pre-hook and the end of :meth:`applied` restore its LRs.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.scale = 1.0
        self._saved: Optional[List[float]] = None
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def _pre(self, optimizer, args, kwargs) -> None:
        if self.scale == 1.0:
            return
        # A step that raised never reached _post: saving its scaled LRs as the originals would make this
        # step, and every later one, run at lr·scale².
        self._restore()
        self._saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self.scale

    def _post(self, optimizer, args, kwargs) -> None:
        self._restore()

    def _restore(self) -> None:
        """Put back the LRs the last pre-hook saved, if a post-hook has not already."""
        if self._saved is None:
            return
        for group, lr in zip(self.optimizer.param_groups, self._saved):
            group["lr"] = lr
        self._saved = None

    @contextlib.contextmanager
    def applied(self, scale: float):
        """Scale every optimizer step taken inside the block; back to 1 afterwards, whatever happens."""
        self.scale = float(scale)
        try:
            yield
        finally:
            self._restore()
            self.scale = 1.0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _local_moments(items, weight_form: str) -> torch.Tensor:
    """(4,) float64 [log Σw, log Σw², n, missing] for this rank's replay-buffer items."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    missing = any(it.rollout_log_probs is None or it.action_log_probs is None for it in items)
    if missing or not items:
        moments = torch.tensor([float("-inf"), float("-inf"), 0.0], dtype=torch.float64)
    else:
        batch = make_experience_batch(items)
        log_w, valid = corrections.sequence_log_weights(
            batch.action_log_probs, batch.rollout_log_probs, batch.action_mask, weight_form
        )
        moments = corrections.ess_log_moments(log_w.cpu(), valid.cpu())
    return torch.cat([moments, torch.tensor([float(missing)], dtype=torch.float64)])


def global_lr_scale(items, weight_form: str, rule: str, floor: float) -> Tuple[float, Dict[str, float]]:
    """The rollout's LR scale and its metrics, identical on every rank (one all-gather of 4 numbers).

    π_prox is the replay buffer's ``action_log_probs`` (what the loss uses as old log-probs), μ its
    ``rollout_log_probs``. If any rank lacks either, the scale is 1 for this rollout (never a stale
    value from an earlier one), with a warning and ``ess_lr_missing = 1``. Likewise if ρ or the scale is
    not finite (a NaN/inf log-prob on a response token; the clamp in the scale passes NaN): scale 1, a
    warning with the moments, and ``ess_lr_nonfinite = 1``.
    """
    # on the collective device (NCCL takes CUDA tensors only), back on the host after the gather
    shards = distributed.all_gather_rows(_local_moments(items, weight_form))
    missing = bool(shards[:, 3].max() > 0)
    moments = corrections.combine_log_moments(shards[:, :3])
    if missing or moments[2] == 0:
        logger.warning("ESS LR scaling: rollout log-probs or old log-probs missing for this rollout; using lr_scale=1")
        return 1.0, {"lr_scale": 1.0, "ess_lr_missing": 1.0, "ess_lr_nonfinite": 0.0}
    rho = corrections.ess_ratio_from_log_moments(moments)
    scale = corrections.lr_scale_from_rho(rho, floor, rule)
    # One host sync for all the numbers.
    log_sum, log_sum_sq, n_f, rho_f, scale_f = torch.cat([moments, torch.stack([rho, scale])]).tolist()
    if not (math.isfinite(rho_f) and math.isfinite(scale_f)):
        # Same fallback as a missing μ: a NaN scale would make every parameter NaN at the next step.
        logger.warning(
            "ESS LR scaling: not finite for this rollout: rho=%s, lr_scale=%s (log sum w=%s, log sum w^2=%s over "
            "%d trajectories; a NaN/inf pi_prox or mu on a response token); using lr_scale=1",
            rho_f,
            scale_f,
            log_sum,
            log_sum_sq,
            int(n_f),
        )
        return 1.0, {"lr_scale": 1.0, "ess_lr_missing": 0.0, "ess_lr_nonfinite": 1.0}
    return scale_f, {
        "lr_scale": scale_f,
        "rho_ess": rho_f,
        "ess": rho_f * n_f,
        "ess_lr_missing": 0.0,
        "ess_lr_nonfinite": 0.0,
    }
