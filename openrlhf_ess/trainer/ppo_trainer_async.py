"""Async controller: upstream's ``PPOTrainerAsync`` with our generator actor and training actor.

Mirrors ``openrlhf/trainer/ppo_trainer_async.py``.
"""

from __future__ import annotations

from openrlhf_ess import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402
from openrlhf.trainer import ppo_trainer_async as _upstream  # noqa: E402

from openrlhf_ess import upstream  # noqa: E402
from openrlhf_ess.trainer.ppo_trainer import OffPolicyControllerMixin, ScoreAtSyncMixin  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402

_UpstreamGenerate = upstream.ray_actor_class(_upstream.GenerateSamplesActor)
_UpstreamTraining = upstream.ray_actor_class(_upstream.TrainingActor)
_UpstreamAsync = upstream.ray_actor_class(_upstream.PPOTrainerAsync)


class GenerateSamplesActorImpl(_UpstreamGenerate):
    # Upstream's init, building our SamplesGenerator (keeps versions, checks μ).
    __init__ = upstream.rebind(_UpstreamGenerate.__init__, {"SamplesGenerator": SamplesGenerator})


class TrainingActorImpl(OffPolicyControllerMixin, _UpstreamTraining, ScoreAtSyncMixin):
    # MRO: ours, upstream's TrainingActor (lock + pause around the sync), ScoreAtSyncMixin (scores inside
    # the pause), BasePPOTrainer (the sync itself).
    def __init__(self, pretrain, *args, **kwargs):
        super().__init__(pretrain, *args, **kwargs)
        self.adopt_experience_maker()
        self.setup_score_at_sync(pretrain)


GenerateSamplesActor = ray.remote(GenerateSamplesActorImpl)
TrainingActor = ray.remote(TrainingActorImpl)


class PPOTrainerAsyncImpl(_UpstreamAsync):
    # Upstream's init, creating our generator and training actors.
    __init__ = upstream.rebind(
        _UpstreamAsync.__init__, {"GenerateSamplesActor": GenerateSamplesActor, "TrainingActor": TrainingActor}
    )


PPOTrainerAsync = ray.remote(PPOTrainerAsyncImpl)
