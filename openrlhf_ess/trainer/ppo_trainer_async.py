"""Async controller: upstream's ``PPOTrainerAsync`` with our generator actor and training actor.

Mirrors ``openrlhf/trainer/ppo_trainer_async.py``. Both ours and :data:`PPOTrainerAsyncEval` (upstream's actors
with our eval schedule only, for a run that evaluates and needs none of our controllers' features) evaluate the
final step and label each eval with the step whose weights it ran on (``trainer/eval_schedule.py``).
"""

from __future__ import annotations

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402
from openrlhf.trainer import ppo_trainer_async as _upstream  # noqa: E402

from openrlhf_ess import upstream  # noqa: E402
from openrlhf_ess.trainer import resume, saving  # noqa: E402
from openrlhf_ess.trainer.eval_schedule import (  # noqa: E402
    AsyncEvalGeneratorMixin,
    AsyncEvalTrainerMixin,
    WeightsStepInLockMixin,
    WeightsStepLock,
)
from openrlhf_ess.trainer.ppo_trainer import OffPolicyControllerMixin, ScoreAtSyncMixin  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402

_UpstreamGenerate = upstream.ray_actor_class(_upstream.GenerateSamplesActor)
_UpstreamTraining = upstream.ray_actor_class(_upstream.TrainingActor)
_UpstreamAsync = upstream.ray_actor_class(_upstream.PPOTrainerAsync)


class VLLMLockImpl(WeightsStepLock, upstream.ray_actor_class(_upstream.VLLMLock)):
    """Upstream's lock between evals and weight syncs, also holding the step whose weights the engines have."""


VLLMLock = ray.remote(num_cpus=0)(VLLMLockImpl)


class GenerateSamplesActorImpl(AsyncEvalGeneratorMixin, _UpstreamGenerate):
    # Upstream's init, building our SamplesGenerator (keeps versions, checks μ).
    __init__ = upstream.rebind(_UpstreamGenerate.__init__, {"SamplesGenerator": SamplesGenerator})

    def load_state_dict(self, state_dict):
        """Extends upstream's (the data loader's saved position, on resume): the prompts dispatched but not
        trained at the checkpoint, from our sidecar of the checkpoint the actors loaded, are drawn first."""
        super().load_state_dict(state_dict)
        sidecar = resume.loaded_sidecar(self.args.ckpt.path) or {}
        self.samples_generator.replay_first(sidecar.get("replay", []))

    def _run_eval(self):
        """Extends upstream's (run under the lock that keeps weight syncs out): the eval's metrics also say on which
        weight version and when it ran (``eval/weight_version``, ``eval/wall_clock_s``,
        ``eval/wall_clock_since_step1_s``: trainer/eval_clock.py)."""
        return {**super()._run_eval(), **self.samples_generator.last_eval_clock}


class TrainingActorImpl(
    AsyncEvalTrainerMixin, OffPolicyControllerMixin, _UpstreamTraining, WeightsStepInLockMixin, ScoreAtSyncMixin
):
    # MRO: ours (the eval schedule's train_step first: OffPolicyControllerMixin's may call upstream's directly),
    # upstream's TrainingActor (lock + pause around the sync), WeightsStepInLockMixin (tells the lock
    # the step synced), ScoreAtSyncMixin (scores inside the pause), BasePPOTrainer (the sync itself).
    def __init__(self, pretrain, *args, **kwargs):
        super().__init__(pretrain, *args, **kwargs)
        self.adopt_experience_maker()
        self.setup_score_at_sync(pretrain)
        self._untrained_prompts = []

    def train_step(self, rollout_samples, global_step):
        """Wraps upstream's: remember the batch's untrained prompts (SamplesGenerator) for the checkpoint."""
        if rollout_samples:
            self._untrained_prompts = getattr(rollout_samples[0], "untrained_prompts", [])
        return super().train_step(rollout_samples, global_step)

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        """Extends upstream's: after every rank's save returned, our sidecar (trainer/resume.py) completes the
        checkpoint: the prompts to replay on resume, and what the resume prints."""
        super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        if resume.applies(self.args) and global_step % self.args.ckpt.save_steps == 0:
            states = client_states or {}
            state = {
                "replay": self._untrained_prompts,
                "episode": states.get("episode", 0),
                "prompts_trained": states.get("total_consumed_prompts", 0) - len(self._untrained_prompts),
                "weight_version": self.weight_version,
            }
            try:
                resume.write_sidecar(self.args.ckpt.path, global_step, state)
            except OSError as e:  # a full disk: say so and what is kept, not a bare "[Errno 28]"
                raise saving.checkpoint_write_error(e, self.args.ckpt.path, resume.tag_of(global_step)) from e


GenerateSamplesActor = ray.remote(GenerateSamplesActorImpl)
TrainingActor = ray.remote(TrainingActorImpl)


def _with_actors(generate_actor, training_actor):
    """Upstream's ``PPOTrainerAsync.__init__`` creating these actors and our lock, then giving the trainer the
    generator's handle (the final eval runs on the generator, which holds the eval set)."""
    upstream_init = upstream.rebind(
        _UpstreamAsync.__init__,
        {"GenerateSamplesActor": generate_actor, "TrainingActor": training_actor, "VLLMLock": VLLMLock},
    )

    def __init__(self, *args, **kwargs):
        upstream_init(self, *args, **kwargs)
        ray.get(self.trainer_actor.set_evaluator.remote(self.generator_actor))

    return __init__


class PPOTrainerAsyncImpl(_UpstreamAsync):
    __init__ = _with_actors(GenerateSamplesActor, TrainingActor)


PPOTrainerAsync = ray.remote(PPOTrainerAsyncImpl)


class GenerateSamplesActorEvalImpl(AsyncEvalGeneratorMixin, _UpstreamGenerate):
    """Upstream's generator actor with our eval labels and final eval."""


class TrainingActorEvalImpl(AsyncEvalTrainerMixin, _UpstreamTraining, WeightsStepInLockMixin):
    """Upstream's training actor with our final eval and best-checkpoint tag.

    Upstream's two methods that call zero-argument ``super()`` (``__init__``, ``broadcast_to_vllm``) are passed
    through here, as :class:`TrainingActorImpl` and its mixins do: inherited as they are, they travel to the actor's
    worker by value (upstream's module name ``TrainingActor`` is the remote wrapper, not the class), with a copy of
    the class as their ``super()``'s, and the actor fails with ``TypeError: super(type, obj)``
    (``tests/test_upstream_contract.py`` checks every actor class of ours for such a method)."""

    def __init__(self, pretrain, *args, **kwargs):
        super().__init__(pretrain, *args, **kwargs)

    def broadcast_to_vllm(self):
        super().broadcast_to_vllm()


class PPOTrainerAsyncEvalImpl(_UpstreamAsync):
    __init__ = _with_actors(ray.remote(GenerateSamplesActorEvalImpl), ray.remote(TrainingActorEvalImpl))


PPOTrainerAsyncEval = ray.remote(PPOTrainerAsyncEvalImpl)
