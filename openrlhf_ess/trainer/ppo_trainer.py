"""Controller (single-controller PPO trainer): upstream's ``PPOTrainer`` with our generator and maker.

Mirrors ``openrlhf/trainer/ppo_trainer.py``. Used only when a feature that consumes rollout
log-probs or versions is on; otherwise upstream's trainer runs untouched.
"""

from __future__ import annotations

from openrlhf_ess import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402
from openrlhf.trainer import ppo_trainer as _upstream  # noqa: E402

from openrlhf_ess import upstream  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402


class OffPolicyControllerMixin:
    """What every controller of ours adds to upstream's ``BasePPOTrainer`` subclasses."""

    weight_version = 0  # weight syncs done so far = the version the actor holds now

    def adopt_experience_maker(self) -> None:
        self.experience_maker = RemoteExperienceMaker.from_upstream(self.experience_maker)

    def train_step(self, rollout_samples, global_step):
        """Wraps upstream's: tell the maker the current version, merge its batch-global metrics."""
        self.experience_maker.weight_version = self.weight_version
        status, global_step = super().train_step(rollout_samples, global_step)
        status.update(self.experience_maker.last_metrics)
        return status, global_step

    def broadcast_to_vllm(self):
        """Wraps upstream's (and the async trainer's lock/pause around it): count the sync."""
        super().broadcast_to_vllm()
        self.weight_version += 1


_UpstreamPPOTrainer = upstream.ray_actor_class(_upstream.PPOTrainer)


class PPOTrainerImpl(OffPolicyControllerMixin, _UpstreamPPOTrainer):
    def __init__(self, *args, **kwargs):
        """Upstream's init, building our SamplesGenerator and adopting our experience maker."""
        upstream.rebind(_UpstreamPPOTrainer.__init__, {"SamplesGenerator": SamplesGenerator})(self, *args, **kwargs)
        self.adopt_experience_maker()


PPOTrainer = ray.remote(PPOTrainerImpl)
