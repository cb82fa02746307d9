"""Controller (single-controller PPO trainer): upstream's ``PPOTrainer`` with our generator and maker.

Mirrors ``openrlhf/trainer/ppo_trainer.py``. Used only when a feature that consumes rollout
log-probs or versions is on; otherwise upstream's trainer runs untouched, or, when the run evaluates
(``--eval.dataset`` and ``--eval.steps``), upstream's with our eval schedule only (:data:`PPOTrainerEval`:
the final step evaluated, ``trainer/eval_schedule.py``).
"""

from __future__ import annotations

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import collections  # noqa: E402
import time  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from openrlhf.trainer import ppo_trainer as _upstream  # noqa: E402

from openrlhf_ess import config, upstream  # noqa: E402
from openrlhf_ess.trainer import prox  # noqa: E402
from openrlhf_ess.trainer.eval_schedule import SyncEvalMixin  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402


class OffPolicyControllerMixin:
    """What every controller of ours adds to upstream's ``BasePPOTrainer`` subclasses."""

    weight_version = 0  # weight syncs done so far = the version the actor holds now

    def adopt_experience_maker(self) -> None:
        self.experience_maker = RemoteExperienceMaker.from_upstream(self.experience_maker)

    def train_step(self, rollout_samples, global_step):
        """Wraps upstream's: tell the maker the current version, merge its batch-global metrics.

        With --train.dynamic_batch_enable it runs upstream's ``BasePPOTrainer.train_step`` (the next one in our
        controllers' MRO, tests/test_carried.py) with ``carried.balance_experiences``: upstream's balance drops
        the per-sample attributes (kept counts, routes) before the actors' ``append``."""
        self.experience_maker.weight_version = self.weight_version
        replaced = self.check_replaced_engines()
        if self.args.train.dynamic_batch_enable:
            from openrlhf_ess.trainer import carried

            balanced_train_step = upstream.train_step_with_balance(carried.balance_experiences)
            status, global_step = balanced_train_step(self, rollout_samples, global_step)
        else:
            status, global_step = super().train_step(rollout_samples, global_step)
        status.update(replaced)
        status.update(self.experience_maker.last_metrics)
        status.update(getattr(self, "prox_sync_metrics", {}))  # the last sync's (score-at-sync modes)
        self.prox_sync_metrics = {}
        return status, global_step

    def check_replaced_engines(self) -> dict:
        """--vllm.max_restarts (``trainer/ray/engine_keeper.py``): before a batch is trained, if an engine was replaced
        since the last look, the sync check on every engine now (checksums and canary against the trainer, which
        holds the weights the replaced engine loaded): a wrong load stops the run before its samples are trained.
        Returns the check's metrics and the run's ``faults/*`` counts."""
        if self.args.vllm.max_restarts <= 0:
            return {}
        from openrlhf_ess.trainer.ray import engine_keeper

        keeper = engine_keeper.find()
        metrics = {}
        replaced = ray.get(keeper.unverified.remote())
        if replaced:
            metrics.update(ray.get(self.actor_model_group.async_run_method(method_name="check_replaced_engines"))[0])
            print(
                f"[openrlhf-ess] replaced vLLM engine(s) {replaced}: the weight sync check (checksums now, canary) "
                f"passed on every engine at version {self.weight_version}; training on their samples",
                flush=True,
            )
        metrics.update(ray.get(keeper.metrics.remote()))
        return metrics

    def broadcast_to_vllm(self):
        """Wraps upstream's (and the async trainer's lock/pause around it): count the sync."""
        super().broadcast_to_vllm()
        self.weight_version += 1


_UpstreamPPOTrainer = upstream.ray_actor_class(_upstream.PPOTrainer)


class PPOTrainerImpl(SyncEvalMixin, OffPolicyControllerMixin, _UpstreamPPOTrainer):
    def __init__(self, *args, **kwargs):
        """Upstream's init, building our SamplesGenerator and adopting our experience maker."""
        upstream.rebind(_UpstreamPPOTrainer.__init__, {"SamplesGenerator": SamplesGenerator})(self, *args, **kwargs)
        self.adopt_experience_maker()

    @torch.no_grad()
    def evaluate(self, global_step, **generate_kwargs):
        """Upstream's, its metrics extended with when and on which weight version the eval ran
        (``eval/weight_version``, ``eval/wall_clock_s``, ``eval/wall_clock_since_step1_s``: trainer/eval_clock.py)."""
        generator = self.samples_generator

        def with_clock(*args, **kwargs):
            return {**_upstream.compute_eval_metrics(*args, **kwargs), **generator.last_eval_clock}

        evaluate = upstream.rebind(_UpstreamPPOTrainer.evaluate.__wrapped__, {"compute_eval_metrics": with_clock})
        if config.stale_k(self.args) <= 0:
            return evaluate(self, global_step, **generate_kwargs)
        self._engines_eval_weights(live=True)  # --train.stale_k: the eval measures the trainer's policy
        try:
            return evaluate(self, global_step, **generate_kwargs)
        finally:
            self._engines_eval_weights(live=False)

    def _engines_eval_weights(self, live: bool) -> None:
        """--train.stale_k: the trainer's live weights to the engines before an eval, their K-behind ones after it
        (``ActorPPOTrainer.eval_weights``); woken for it as upstream's sync wakes them (--vllm.enable_sleep)."""
        if self.args.vllm.enable_sleep:
            _upstream.batch_vllm_engine_call(self.vllm_engines, "wake_up", tags=["weights"])
        ray.get(self.actor_model_group.async_run_method(method_name="eval_weights", live=live))


PPOTrainer = ray.remote(PPOTrainerImpl)


class PPOTrainerEvalImpl(SyncEvalMixin, _UpstreamPPOTrainer):
    """Upstream's ``PPOTrainer`` (its generator and maker) with our eval schedule: a run that evaluates and needs
    none of our controllers' features."""

    def __init__(self, *args, **kwargs):
        """Upstream's init, called through a copy of it (as :class:`PPOTrainerImpl` does): inherited as it is, its
        zero-argument ``super()`` fails in the Ray actor with ``TypeError: super(type, obj)``, since upstream's module
        name ``PPOTrainer`` is the remote wrapper, not the class, so the class travels to the actor by value."""
        upstream.rebind(_UpstreamPPOTrainer.__init__)(self, *args, **kwargs)


PPOTrainerEval = ray.remote(PPOTrainerEvalImpl)


class ScoreAtSyncMixin(_upstream.BasePPOTrainer):
    """Score the outgoing version's tokens at each weight sync (--algo.prox_mode interrupt / dedicated).

    Placed between upstream's async ``TrainingActor`` and ``BasePPOTrainer`` in the MRO, so its
    ``broadcast_to_vllm`` runs inside upstream's lock and generation pause (docs/prox_modes.md):

    1. every engine reports the token streams that sampled tokens with the outgoing version V (in-flight
       prefixes and finished, unconsumed responses; those the trainer already consumed are skipped);
    2. their V tokens are scored with V's weights: the actor's one kept copy (interrupt) or the dedicated
       model, which still holds V (dedicated); the log-probs wait in a ProxStore for their sample;
    3. upstream's sync sends V+1 to the engines (and to the dedicated model); generation resumes.
    """

    prox_store = prox_scorer = None

    def setup_score_at_sync(self, pretrain: str) -> None:
        if self.args.algo.prox_mode not in config.SCORE_AT_SYNC_MODES:
            return
        self.prox_store = prox.ProxStore(keep_versions=config.max_lag_possible(self.args) + 1)
        self.consumed = collections.Counter()  # streams consumed since the last sync: not scored again
        self.prox_sync_metrics = {}
        if self.args.algo.prox_mode == "dedicated":
            from openrlhf_ess.trainer.ray import prox_scorer

            self.prox_scorer = prox_scorer.create(self.args, pretrain)
        self.experience_maker.prox_store, self.experience_maker.consumed = self.prox_store, self.consumed

    def broadcast_to_vllm(self):
        if self.prox_store is None:
            return super().broadcast_to_vllm()
        t0 = time.time()
        version = self.weight_version
        reports = [r for batch in ray.get([e.outgoing_streams.remote() for e in self.vllm_engines]) for r in batch]
        todo = []
        for report in reports:
            key = tuple(report["stream"])
            if report["finished"] and self.consumed[key] > 0:
                self.consumed[key] -= 1
                continue
            todo.append(report)
        self.consumed.clear()
        kept = [r["kept"] for r in todo] if config.sampling_mask_on(self.args) else None
        routes = [r["routes"] for r in todo] if config.routing_replay_on(self.args) else None
        log_probs = self._score(version, [r["stream"] for r in todo], kept, routes) if todo else []
        for report, lp in zip(todo, log_probs):
            self.prox_store.put(report["stream"], report["versions"], version, lp)
        scored_s = time.time() - t0
        super().broadcast_to_vllm()
        metrics = {
            "prox/sync_score_seconds": scored_s,
            "prox/sync_scored_streams": float(len(todo)),
            "prox/sync_scored_tokens": float(sum(r["versions"].count(version) for r in todo)),
            "prox/sync_skipped_consumed": float(len(reports) - len(todo)),
        }
        if self.prox_scorer is not None:
            t1 = time.time()
            refs = self.actor_model_group.async_run_method(method_name="weights_blob")
            ray.get(self.prox_scorer.load_weights.remote(version + 1, refs[0]))
            ray.get(refs)
            metrics["prox/dedicated_load_seconds"] = time.time() - t1
        metrics["prox/evicted_entries"] = float(self.prox_store.evict_before(version + 1))
        metrics["prox/store_entries"] = float(len(self.prox_store))
        self.prox_sync_metrics = metrics

    def _score(self, version: int, streams, kept=None, routes=None):
        if self.prox_scorer is not None:
            return ray.get(self.prox_scorer.score.remote(version, streams, kept, routes))
        actors = upstream.group_actors(self.actor_model_group)
        # every rank gets a share (maybe none): under ZeRO-3 all of them must take part in the forwards
        size = -(-len(streams) // len(actors))
        chunks = [slice(i * size, (i + 1) * size) for i in range(len(actors))]
        results = ray.get(
            [
                actor.score_streams.remote(
                    version,
                    streams[part],
                    None if kept is None else kept[part],
                    None if routes is None else routes[part],
                )
                for actor, part in zip(actors, chunks)
            ]
        )
        return [lp for chunk in results for lp in chunk]
