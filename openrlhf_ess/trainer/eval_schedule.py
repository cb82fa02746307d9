"""When held-out evals run, and which step each one's label names.

Upstream evaluates when ``global_step % --eval.steps == 0`` and nowhere else:

- synchronous (``PPOTrainer.fit``): after such a step's weight sync; a run whose step count is not a multiple of
  N (or is smaller than N) never evaluates its final weights;
- async (``GenerateSamplesActor.fit``): the generator evaluates when a queue slot comes back carrying such a
  step count; the trainer may have synced newer weights by the time the eval takes the engines' lock (the eval
  labelled step 6 ran on step 7's weights), and the generator stops after the last rollout batch, before the
  trainer has trained it: the final step is never evaluated.

What this module adds, on every controller that evaluates (ours, and upstream's wrapped when only an eval is on):

- **the final step is evaluated**: after the last training step, unless it was just evaluated; upstream's
  ``fit`` closes the trackers at its end, so their ``close`` is held back until that eval has logged;
- **an eval's step label is the step whose weights it ran on** (async): the trainer records, inside the lock
  that excludes evals from weight syncs, the step whose weights it has just sent (:class:`WeightsStepLock`); the
  eval reads it under the same lock and its result is logged at that step. Two evals never run on one step's
  weights. ``eval/weight_version`` (the engines' sync count, ``trainer/eval_clock.py``) equals the label in a run
  that did not resume;
- **an async best checkpoint is named after the weights it holds**: the eval's result reaches the trainer behind
  the rollout batches already queued (up to ``--train.async_queue_size``), when it holds newer weights and keeps
  no copy of the evaluated ones; the checkpoint is tagged with the trainer's step (``best_global_step<that
  step>``) and a line says which step was evaluated.

Pre-flight names the eval steps a run will have (``eval_clock.planned_evals``, ``checks/preflight/outputs.py``).
"""

from __future__ import annotations

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import contextlib  # noqa: E402
from typing import Optional  # noqa: E402

import ray  # noqa: E402
from openrlhf.trainer.ppo_trainer import BasePPOTrainer  # noqa: E402

from openrlhf_ess import config  # noqa: E402

# ---- shared by the controllers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def trackers_left_open(*trackers):
    """Hold back the trackers' ``close`` (upstream's ``fit`` closes wandb and TensorBoard at its end) until the block
    is done, then close them. On an exception they are left as upstream leaves them (not closed)."""
    held = [t for t in trackers if t is not None]
    for tracker in held:
        tracker.close = lambda: None  # an instance attribute shadows the method until it is deleted
    try:
        yield
    except BaseException:
        for tracker in held:
            del tracker.close
        raise
    for tracker in held:
        del tracker.close
        tracker.close()


def _eval_generate_kwargs(args, generate_kwargs: dict) -> dict:
    """The generate kwargs upstream's evals use: the rollout's, with the eval's temperature and sample count."""
    return {
        **generate_kwargs,
        "temperature": args.eval.temperature,
        "n_samples_per_prompt": args.eval.n_samples_per_prompt,
    }


# ---- synchronous controller ----------------------------------------------------------------------------------------


class SyncEvalMixin:
    """Extends upstream's ``PPOTrainer``: the final step is evaluated (the other evals, and their step labels, are
    upstream's: they run right after their step's weight sync)."""

    _last_step = 0  # the last step trained (0: none)
    _last_client_states: Optional[dict] = None
    _evaluated_step: Optional[int] = None

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        """Extends upstream's (called after every step): remember the step and its client states, which the final
        eval's best checkpoint saves."""
        self._last_step, self._last_client_states = global_step, dict(client_states or {})
        return super().save_logs_and_checkpoints(global_step, logs_dict, client_states)

    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        """Extends upstream's (called after every eval): remember which step was evaluated."""
        self._evaluated_step = global_step
        return super().save_best_checkpoint(eval_metrics, global_step, client_states)

    def fit(self, global_step: int = 0) -> None:
        """Wraps upstream's: then the final step's eval, if it was not evaluated, before the trackers close."""
        with trackers_left_open(self.wandb_logger, self.tensorboard_logger):
            super().fit(global_step)
            step = self._last_step
            if config.eval_on(self.args) and self.eval_dataloader and step > 0 and self._evaluated_step != step:
                logs = self.evaluate(step, **_eval_generate_kwargs(self.args, self.generate_kwargs))
                self.save_best_checkpoint(logs, step, self._last_client_states)


# ---- async controller ----------------------------------------------------------------------------------------------


class WeightsStepLock:
    """Extends upstream's ``VLLMLock`` (the lock that keeps evals and weight syncs apart): it also holds the step
    whose weights the engines have, set by the trainer inside the lock right after each sync."""

    weights_step = 0

    async def set_weights_step(self, step: int) -> None:
        self.weights_step = int(step)

    async def get_weights_step(self) -> int:
        return self.weights_step


class _EvalsLabelledByWeights:
    """The generator's rollout queue, through which upstream's ``fit`` puts ``("eval", label, metrics)``: the label
    becomes the step whose weights the eval ran on (``generator._evaluated_step``). Before upstream's ``"done"``
    (after the last rollout batch) the generator serves the evals still due (:meth:`AsyncEvalGeneratorMixin.
    _evals_until_drained`). Everything else passes."""

    def __init__(self, queue, generator):
        self._queue, self._generator = queue, generator

    def put(self, item, *args, **kwargs):
        if isinstance(item, tuple) and len(item) == 3 and item[0] == "eval":
            item = ("eval", self._generator._evaluated_step, item[2])
        elif isinstance(item, str) and item == "done":
            self._generator._evals_until_drained()
        return self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


class AsyncEvalGeneratorMixin:
    """Extends upstream's ``GenerateSamplesActor``: each eval is labelled with the step whose weights it ran on, never
    two on one step's weights, and :meth:`evaluate_final` for the trainer's final-step eval."""

    _evaluated_step = -1  # the weights step of the last eval

    def fit(self, episode: int, total_consumed_prompts: int) -> None:
        """Wraps upstream's: its evals go to the trainer labelled by the weights they ran on."""
        if not isinstance(self.rollout_queue, _EvalsLabelledByWeights):
            self.rollout_queue = _EvalsLabelledByWeights(self.rollout_queue, self)
        return super().fit(episode, total_consumed_prompts)

    def _weights_step(self) -> int:
        return ray.get(self.vllm_lock.get_weights_step.remote())

    def _should_eval(self, global_step):
        """Extends upstream's: not again on the weights the last eval ran on."""
        return super()._should_eval(global_step) and self._weights_step() > self._evaluated_step

    def _run_eval(self):
        """Extends upstream's (run under the lock, so no sync changes the weights meanwhile): record their step."""
        self._evaluated_step = self._weights_step()
        return super()._run_eval()

    def _evals_until_drained(self) -> None:
        """After the last rollout batch was queued (upstream's ``fit`` then puts ``"done"`` and returns): answer the
        slots the trainer frees as upstream's loop does, with an eval where one is due, until every slot is back
        (the trainer has taken every queued batch). Upstream's generator stopped here, up to
        ``--train.async_queue_size`` steps before the trainer's end, so the evals due in those steps never came."""
        if not config.eval_on(self.args):
            return
        held = 0
        while held < self.args.train.async_queue_size:
            global_step = self.rollout_slots.get(block=True)
            if self._should_eval(global_step) and not self._eval_just_done:
                self._eval_just_done, self._last_eval_step = True, global_step
                ray.get(self.vllm_lock.acquire.remote())
                try:
                    metrics = self._run_eval()
                finally:
                    ray.get(self.vllm_lock.release.remote())
                self.rollout_queue.put(("eval", global_step, metrics), block=True)  # its slot comes back with it
                continue
            self._eval_just_done = False
            held += 1

    def evaluate_final(self) -> Optional[tuple]:
        """Evaluate the weights the engines hold now, under the lock: (their step, the metrics); None when the last
        eval ran on them already. Called by the trainer after its last step (this actor's ``fit`` has returned)."""
        ray.get(self.vllm_lock.acquire.remote())
        try:
            if self._weights_step() <= self._evaluated_step:
                return None
            metrics = self._run_eval()
        finally:
            ray.get(self.vllm_lock.release.remote())
        return self._evaluated_step, metrics


class AsyncEvalTrainerMixin:
    """Extends upstream's ``TrainingActor``: the final step is evaluated (by the generator, which holds the eval set),
    and a best checkpoint is tagged with the step whose weights it holds. Needs :class:`WeightsStepInLockMixin`
    after upstream's ``TrainingActor`` in the MRO, which tells the lock the step each sync sent."""

    _evaluator = None  # the generator actor's handle
    _next_weights_step = 0  # the step whose weights the next sync sends

    def set_evaluator(self, generator) -> None:
        self._evaluator = generator

    def init_checkpoint_states(self):
        """Extends upstream's: a resume's first sync sends the loaded step's weights."""
        states = super().init_checkpoint_states()
        self._next_weights_step = int(states.get("global_step", 0) or 0)
        return states

    def train_step(self, rollout_samples, global_step):
        """Wraps upstream's: the sync at its end sends step ``global_step + 1``'s weights."""
        self._next_weights_step = global_step + 1
        return super().train_step(rollout_samples, global_step)

    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        """Extends upstream's: ``global_step`` is the evaluated step; the checkpoint holds the trainer's weights now
        (``client_states["global_step"]``), which may be newer, and is tagged with their step."""
        evaluated = global_step
        held = int((client_states or {}).get("global_step", evaluated))
        before = self.best_eval_metric_value
        super().save_best_checkpoint(eval_metrics, held, client_states)
        if self.best_eval_metric_value != before and held != evaluated:
            print(
                f"[openrlhf-ess] best eval: the weights of step {evaluated}; the best checkpoint "
                f"best_global_step{held} holds step {held}'s (the eval's result reached the trainer "
                f"{held - evaluated} step(s) later, behind the queued rollout batches, and an async run keeps no "
                "copy of older weights)",
                flush=True,
            )

    def fit(self, global_step: int = 0) -> None:
        """Wraps upstream's: after the last step, the final eval, before the trackers close."""
        with trackers_left_open(self.wandb_logger, self.tensorboard_logger):
            super().fit(global_step)
            self._final_eval()

    def _final_eval(self) -> None:
        states = dict(getattr(self, "_latest_client_states", None) or {})
        if not (config.eval_on(self.args) and self._evaluator is not None and states.get("global_step")):
            return
        done = ray.get(self._evaluator.evaluate_final.remote())
        if done is None:
            return
        step, metrics = done
        print(f"[openrlhf-ess] eval after the final step {step}: {metrics}", flush=True)
        for tracker in (self.wandb_logger, self.tensorboard_logger):
            if tracker is not None:
                tracker.log_eval(step, metrics)
        self.save_best_checkpoint(metrics, step, states)


class WeightsStepInLockMixin(BasePPOTrainer):
    """Placed between upstream's ``TrainingActor`` and ``BasePPOTrainer`` in the MRO, so its ``broadcast_to_vllm`` runs
    inside the lock upstream's takes: after the sync, the lock is told the step whose weights the engines now hold."""

    def broadcast_to_vllm(self):
        super().broadcast_to_vllm()
        ray.get(self.vllm_lock.set_weights_step.remote(self._next_weights_step))
