"""Held-out eval during training: its requests are no rollouts, and every eval says when and on which weights it ran.

The engine half runs our real engine methods (``generate_responses``, the tracked stream, ``outgoing_streams``) on a
fake vLLM; the generator half our real SamplesGenerator methods on fake engine handles; the stack test the CLI.
"""

import asyncio
import os
import time
import types

import pytest

from openrlhf_ess.trainer import eval_clock

# ---- the clock (pure) --------------------------------------------------------------------------------------------


def test_launch_time_round_trips_through_the_environment():
    env = {eval_clock.LAUNCH_TIME_ENV: "stale value of a parent launch"}
    assert eval_clock.launch_time(env) is None  # unreadable: not logged
    assert eval_clock.export_launch_time(env, launched=1234.5) == 1234.5
    assert eval_clock.launch_time(env) == 1234.5
    assert eval_clock.launch_time({}) is None
    started = eval_clock.export_launch_time(env)  # default: this process's start, before this test ran
    assert time.time() - 3600 * 24 < started <= time.time() and eval_clock.launch_time(env) == started


def test_held_version_is_the_one_every_engine_holds():
    assert eval_clock.held_version([3, 3]) == 3
    assert eval_clock.held_version([3]) == 3
    assert eval_clock.held_version([3, 4]) is None  # a sync half done: not one version
    assert eval_clock.held_version([]) is None


def test_eval_clock_metrics():
    m = eval_clock.eval_clock_metrics(now=110.0, launched=10.0, first_step_start=60.0, version=2)
    assert m == {"weight_version": 2.0, "wall_clock_s": 100.0, "wall_clock_since_step1_s": 50.0}
    assert eval_clock.eval_clock_metrics(110.0, None, None, None) == {}  # unknown: left out, never a made-up 0
    assert eval_clock.eval_clock_metrics(110.0, 10.0, None, 0) == {"weight_version": 0.0, "wall_clock_s": 100.0}


def test_the_cli_forwards_its_launch_time_to_the_ray_workers(monkeypatch):
    from openrlhf_ess.cli import train_ppo_ray as cli

    monkeypatch.setenv(eval_clock.LAUNCH_TIME_ENV, "1")
    launched = eval_clock.export_launch_time()
    assert launched > 1 and cli._runtime_env()["env_vars"][eval_clock.LAUNCH_TIME_ENV] == repr(launched)


# ---- the engine: eval requests are served and tagged, never reported as rollouts to score ------------------------


def _output(prompt, tokens):
    out = types.SimpleNamespace(token_ids=tokens, logprobs=None, routed_experts=None)
    return types.SimpleNamespace(prompt_token_ids=prompt, outputs=[out])


def _fake_engine():
    """Our engine class without vLLM: upstream's generate_responses runs ``executor.execute`` once per sample; the
    executor (our version-tagging wrapper) streams two tokens through the real tracked stream, and checks what the
    engine tracks while the request is in flight."""
    from openrlhf_ess.trainer.ray import rollout_tags, vllm_engine

    engine = object.__new__(vllm_engine.RolloutRayActorImpl)
    engine.weight_version, engine._inflight, engine._finished = 2, {}, []
    engine.report_outgoing, engine.report_kept_counts, engine.report_routes = True, False, False
    engine.force_logprobs = False
    seen_inflight = []

    async def generate(prompt, sampling_params, *args, request_id=None, **kwargs):
        yield _output(prompt, [9])
        seen_inflight.append(sorted(engine._inflight))
        await asyncio.sleep(0)  # the other request starts meanwhile: both are in flight at once
        yield _output(prompt, [9, 8])

    tracked = vllm_engine.RolloutRayActorImpl._tracking_stream(engine, generate)

    class Executor:
        async def execute(self, prompt, **kwargs):
            async for _ in tracked(prompt, types.SimpleNamespace(min_tokens=0), f"r{prompt[0]}"):
                pass
            return {"observation_tokens": prompt + [9, 8], "action_ranges": [(len(prompt), len(prompt) + 2)]}

    engine.executor = rollout_tags._VersionTaggingExecutor(Executor())
    return engine, seen_inflight


def _params(**extra_args):
    return types.SimpleNamespace(logprobs=None, extra_args=extra_args or None)


def test_engine_keeps_eval_requests_out_of_the_streams_scored_at_a_sync():
    from openrlhf_ess.trainer.ray import rollout_tags, vllm_engine

    engine, seen_inflight = _fake_engine()
    impl = vllm_engine.RolloutRayActorImpl

    async def both():
        train = impl.generate_responses(engine, [1, 2], None, _params(), max_length=64, hf_tokenizer=None)
        evaluation = impl.generate_responses(
            engine, [5, 6], None, _params(**{rollout_tags.EVAL_MARK: True}), max_length=64, hf_tokenizer=None
        )
        return await asyncio.gather(train, evaluation)  # concurrently: the mark stays with its own request

    (train,), (evaluation,) = asyncio.run(both())
    # both are served and tagged alike
    assert train["rollout_versions"] == [-1, -1, 2, 2] and evaluation["rollout_versions"] == [-1, -1, 2, 2]
    # while in flight, only the training request is tracked (it is the one a weight sync switches and reports)
    assert seen_inflight == [["r1"], ["r1"]]
    reports = asyncio.run(impl.outgoing_streams(engine))
    assert [r["stream"] for r in reports] == [[1, 2, 9, 8]]  # the eval's [5, 6, 9, 8] is not scored
    assert engine._inflight == {} and engine._finished == []


def test_is_evaluation_reads_the_mark():
    from openrlhf_ess.trainer.ppo_utils.samples_generator import eval_sampling_params
    from openrlhf_ess.trainer.ray import rollout_tags

    marked = eval_sampling_params(temperature=0.5, max_tokens=4)
    assert rollout_tags.is_evaluation(marked) and marked.temperature == 0.5 and marked.max_tokens == 4
    assert not rollout_tags.is_evaluation(_params())
    assert not rollout_tags.is_evaluation(_params(other=1))
    assert not rollout_tags.is_evaluation(object())


# ---- the generator: marks the eval's requests, records its clock ------------------------------------------------


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _FakeEngineHandle:
    """A Ray handle stand-in: ``.method.remote(...)`` returns the value itself (``ray.get`` is the identity)."""

    def __init__(self, version):
        self.sent = []
        self.get_num_unfinished_requests = _Remote(lambda: 0)
        self.held_weight_version = _Remote(lambda: version)
        self.generate_responses = _Remote(lambda **kw: self.sent.append(kw["sampling_params"]) or "ref")


def _samples_generator(monkeypatch, versions=(4, 4), tracked=True):
    import ray

    from openrlhf_ess import config
    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    monkeypatch.setattr(config, "needs_versions", lambda args: tracked)
    gen = SamplesGenerator.__new__(SamplesGenerator)
    gen.args = types.SimpleNamespace(
        rollout=types.SimpleNamespace(top_k=0, n_samples_per_prompt=4, batch_size=8),
        algo=types.SimpleNamespace(advantage=types.SimpleNamespace(is_correction_level="off")),
        vllm=types.SimpleNamespace(enable_sleep=False),
    )
    gen.vllm_engines, gen.tokenizer = [_FakeEngineHandle(v) for v in versions], None
    gen.eval_dataloader = [None]

    def fake_generate_vllm(dataloader_iter, num_prompts, dynamic_filtering, **kwargs):
        gen._dispatch_prompts_to_vllm(["held-out ="], [""], **kwargs)
        return [], 1, True

    gen._generate_vllm = fake_generate_vllm
    return gen


def test_generator_marks_only_the_evals_requests(monkeypatch):
    from openrlhf_ess.trainer.ray.rollout_tags import is_evaluation

    gen = _samples_generator(monkeypatch)
    gen._dispatch_prompts_to_vllm(["train ="], [""], max_new_tokens=4)
    gen.generate_eval_samples(max_new_tokens=4, temperature=0.6, n_samples_per_prompt=2)
    gen._dispatch_prompts_to_vllm(["train ="], [""], max_new_tokens=4)  # after the eval: training again
    sent = [p for e in gen.vllm_engines for p in e.sent]
    assert [is_evaluation(p) for p in sent] == [False, True, False]
    marked = next(p for p in sent if is_evaluation(p))
    assert marked.temperature == 0.6 and marked.max_tokens == 4  # otherwise upstream's eval params


def test_generator_records_the_evals_clock_and_version(monkeypatch):
    monkeypatch.setenv(eval_clock.LAUNCH_TIME_ENV, repr(time.time() - 100.0))
    gen = _samples_generator(monkeypatch)
    gen.first_step_start = time.time() - 40.0
    gen.generate_eval_samples(max_new_tokens=4, n_samples_per_prompt=2)
    clock = gen.last_eval_clock
    assert clock["weight_version"] == 4.0
    assert 100.0 <= clock["wall_clock_s"] < 110.0 and 40.0 <= clock["wall_clock_since_step1_s"] < 50.0
    # engines not told versions (no feature tags tokens), or disagreeing: no version logged
    for kwargs in ({"tracked": False}, {"versions": (4, 5)}):
        gen = _samples_generator(monkeypatch, **kwargs)
        gen.generate_eval_samples(max_new_tokens=4, n_samples_per_prompt=2)
        assert "weight_version" not in gen.last_eval_clock and "wall_clock_s" in gen.last_eval_clock


def test_first_step_start_is_when_the_first_batch_was_handed_over(monkeypatch):
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator as Upstream

    from openrlhf_ess.trainer import resume, reward_check

    gen = _samples_generator(monkeypatch)
    gen.args.reward = types.SimpleNamespace(failure_policy="off")
    sample = types.SimpleNamespace(action_mask=types.SimpleNamespace(any=lambda: True))
    batches = iter([[], [sample], [sample]])
    monkeypatch.setattr(Upstream, "generate_samples", lambda self, **kw: (next(batches), None, 8, False))
    monkeypatch.setattr(reward_check, "check_rewards", lambda *a: None)
    monkeypatch.setattr(reward_check, "reward_source", lambda args: ())
    monkeypatch.setattr(resume, "applies", lambda args: False)
    gen.generate_samples()  # nothing produced yet
    assert gen.first_step_start is None
    before = time.time()
    gen.generate_samples()
    first = gen.first_step_start
    assert before <= first <= time.time()
    gen.generate_samples()
    assert gen.first_step_start == first  # the first batch only


# ---- the controllers add the clock to upstream's eval metrics ----------------------------------------------------


class _Logger:
    def __init__(self):
        self.logged, self.closed = [], 0

    def log_eval(self, step, logs):
        assert not self.closed, "logged after close"
        self.logged.append((step, dict(logs)))

    def log_train(self, step, logs):
        assert not self.closed, "logged after close"

    def close(self):
        self.closed += 1


class _FakeLock:
    """The eval/sync lock actor (eval_schedule.WeightsStepLock) with ``ray.get`` the identity."""

    def __init__(self, weights_step=0):
        self.weights_step, self.held = weights_step, 0
        self.get_weights_step = _Remote(lambda: self.weights_step)
        self.set_weights_step = _Remote(lambda step: setattr(self, "weights_step", step))
        self.acquire = _Remote(lambda: setattr(self, "held", self.held + 1))
        self.release = _Remote(lambda: setattr(self, "held", self.held - 1))


def test_sync_and_async_evals_log_the_clock(monkeypatch):
    # upstream's modules as ours imported them (ours first make upstream importable without flash-attn)
    from openrlhf_ess.trainer.ppo_trainer import PPOTrainerImpl
    from openrlhf_ess.trainer.ppo_trainer import _upstream as upstream_sync
    from openrlhf_ess.trainer.ppo_trainer_async import GenerateSamplesActorImpl
    from openrlhf_ess.trainer.ppo_trainer_async import _upstream as upstream_async

    fake_metrics = lambda loader, samples, n: {"eval_default_pass1": 0.5}  # noqa: E731
    monkeypatch.setattr(upstream_sync, "compute_eval_metrics", fake_metrics)
    monkeypatch.setattr(upstream_async, "compute_eval_metrics", fake_metrics)
    clock = {"weight_version": 2.0, "wall_clock_s": 30.0, "wall_clock_since_step1_s": 10.0}
    generator = types.SimpleNamespace(generate_eval_samples=lambda **kw: [], last_eval_clock=clock)

    trainer = object.__new__(PPOTrainerImpl)
    trainer.samples_generator, trainer.eval_dataloader = generator, None
    trainer.wandb_logger, trainer.tensorboard_logger = None, _Logger()
    trainer.args = types.SimpleNamespace(train=types.SimpleNamespace(stale_k=0))
    logs = PPOTrainerImpl.evaluate(trainer, 2, n_samples_per_prompt=2)
    assert logs == {"eval_default_pass1": 0.5, **clock}
    assert trainer.tensorboard_logger.logged == [(2, logs)]

    # --train.stale_k: the engines hold the trainer's weights for the eval and get theirs back after it, also when
    # the eval fails
    order = []
    trainer.args.train.stale_k = 2
    trainer._engines_eval_weights = lambda live: order.append(("live" if live else "back"))
    trainer.samples_generator = types.SimpleNamespace(
        generate_eval_samples=lambda **kw: order.append("eval") or [], last_eval_clock=clock
    )
    assert PPOTrainerImpl.evaluate(trainer, 4, n_samples_per_prompt=2) == logs
    assert order == ["live", "eval", "back"]
    order.clear()

    def fails(**kw):
        order.append("eval")
        raise RuntimeError("an engine died")

    trainer.samples_generator = types.SimpleNamespace(generate_eval_samples=fails, last_eval_clock=clock)
    with pytest.raises(RuntimeError, match="an engine died"):
        PPOTrainerImpl.evaluate(trainer, 6, n_samples_per_prompt=2)
    assert order == ["live", "eval", "back"]
    trainer.samples_generator = generator

    actor = object.__new__(GenerateSamplesActorImpl)
    actor.samples_generator, actor.eval_dataloader, actor.generate_kwargs = generator, None, {}
    actor.args = types.SimpleNamespace(eval=types.SimpleNamespace(temperature=0.6, n_samples_per_prompt=2))
    actor.vllm_lock = _FakeLock(weights_step=2)
    monkeypatch.setattr(upstream_async.ray, "get", lambda ref: ref)
    assert GenerateSamplesActorImpl._run_eval(actor) == {"eval_default_pass1": 0.5, **clock}
    assert actor._evaluated_step == 2  # the step whose weights the engines held (the lock's record)


# ---- the eval schedule: the final step evaluated, labels = the weights evaluated ---------------------------------


@pytest.fixture
def upstream_importable():
    """Upstream's trainer modules import on CPU once our compatibility shims are in (cpu_compat.apply)."""
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()


def test_run_steps_and_planned_evals():
    from openrlhf_ess.trainer.eval_clock import planned_evals, run_steps

    assert run_steps(32, 4, 1) == 8  # 32 prompts in batches of 4
    assert run_steps(30, 8, 2) == 8  # 8 + 8 + 8 + 6 prompts = 4 steps (the short one trained), twice
    assert planned_evals(2, 8) == [2, 4, 6, 8]  # the final step is a multiple
    assert planned_evals(3, 8) == [3, 6, 8]  # ... or not: evaluated after it anyway
    assert planned_evals(100, 8) == [8]  # beyond the run: the final step only
    assert planned_evals(1, 3) == [1, 2, 3] and planned_evals(5, 0) == []


def test_trackers_close_after_the_block_not_inside_it():
    from openrlhf_ess.trainer.eval_schedule import trackers_left_open

    tb = _Logger()
    with trackers_left_open(None, tb):
        tb.close()  # upstream's fit closing it at its end: held back
        tb.log_eval(8, {"x": 1.0})  # the final eval still logs
    assert tb.closed == 1 and tb.logged == [(8, {"x": 1.0})] and "close" not in vars(tb)
    tb = _Logger()
    with pytest.raises(RuntimeError):
        with trackers_left_open(tb):
            raise RuntimeError("fit failed")
    assert tb.closed == 0 and "close" not in vars(tb)  # as upstream leaves them on an error


class _Group:
    """An actor group stand-in: records the checkpoints upstream's save_best_checkpoint asks for."""

    def __init__(self):
        self.saved = []

    def async_run_method(self, method_name, tag, **kwargs):
        self.saved.append(tag)
        return []


def _upstream_sync_trainer(monkeypatch, cls, steps, every):
    """``cls`` (a subclass of upstream's PPOTrainer) built without Ray, running upstream's real ``fit``,
    ``evaluate``, ``save_best_checkpoint`` and ``save_logs_and_checkpoints`` over ``steps`` fake rollout batches; the
    eval metric rises with the step, so every eval is a new best."""
    from openrlhf.trainer import ppo_trainer as upstream_sync

    monkeypatch.setattr(upstream_sync.ray, "get", lambda refs: refs)
    trainer = object.__new__(cls)
    trainer.args = types.SimpleNamespace(
        train=types.SimpleNamespace(num_episodes=1),
        eval=types.SimpleNamespace(dataset="heldout.jsonl", steps=every, temperature=0.6, n_samples_per_prompt=2),
        ckpt=types.SimpleNamespace(save_steps=float("inf"), best_metric_key=""),
        logger=types.SimpleNamespace(logging_steps=1),
        algo=types.SimpleNamespace(dynamic_filtering_enable=False),
    )
    trainer.generate_kwargs = {"temperature": 1.0}
    trainer.wandb_logger, trainer.tensorboard_logger = None, _Logger()
    trainer.best_eval_metric_value, trainer.best_eval_metric_key = float("-inf"), ""
    trainer._latest_eval_metric_value = None
    trainer.actor_model_group, trainer.critic_model_group = _Group(), None
    trainer.eval_dataloader = [None]
    trainer.prompts_dataloader = type("Loader", (), {"__len__": lambda s: steps, "state_dict": lambda s: {}})()
    trainer.init_checkpoint_states = lambda: {"episode": 0, "global_step": 0, "total_consumed_prompts": 0}
    batches = iter(range(1, steps + 1))

    def generate_samples(**kwargs):
        i = next(batches)
        return [f"batch{i}"], None, 1, i == steps

    trainer.samples_generator = types.SimpleNamespace(generate_samples=generate_samples)
    trainer.evaluated_with = []

    def generate_eval_samples(**kwargs):
        trainer.evaluated_with.append(kwargs)
        return []

    trainer.samples_generator.generate_eval_samples = generate_eval_samples
    trainer.step = 0

    def train_step(rollout_samples, global_step):
        trainer.step = global_step + 1
        return {}, global_step + 1

    trainer.train_step = train_step
    metric = lambda loader, samples, n: {"eval_default_pass1": trainer.step / 10}  # noqa: E731
    monkeypatch.setattr(upstream_sync, "compute_eval_metrics", metric)
    return trainer


@pytest.mark.parametrize("every, evals", [(2, [2, 4, 6, 8]), (3, [3, 6, 8]), (100, [8])])
def test_sync_run_evaluates_its_final_step(upstream_importable, monkeypatch, every, evals):
    """Upstream's fit over 8 steps evaluates the multiples of --eval.steps; the final step 8 is evaluated too
    (once), logged before the tracker closes, and its best checkpoint saved."""
    from openrlhf.trainer.ppo_trainer import PPOTrainer

    from openrlhf_ess import upstream
    from openrlhf_ess.trainer.ppo_trainer import PPOTrainerEvalImpl, PPOTrainerImpl

    # ours adds the clock (tested above): upstream's here
    monkeypatch.setattr(PPOTrainerImpl, "evaluate", upstream.ray_actor_class(PPOTrainer).evaluate)
    for cls in (PPOTrainerEvalImpl, PPOTrainerImpl):
        trainer = _upstream_sync_trainer(monkeypatch, cls, steps=8, every=every)
        cls.fit(trainer)
        tb = trainer.tensorboard_logger
        assert [step for step, _ in tb.logged] == evals, cls
        assert [logs["eval_default_pass1"] for _, logs in tb.logged] == [s / 10 for s in evals]  # that step's
        assert tb.closed == 1
        assert trainer.actor_model_group.saved == [f"best_global_step{s}" for s in evals]
        assert all(kw["temperature"] == 0.6 and kw["n_samples_per_prompt"] == 2 for kw in trainer.evaluated_with)


def test_sync_run_without_eval_steps_is_upstreams(upstream_importable, monkeypatch):
    from openrlhf_ess.trainer.ppo_trainer import PPOTrainerEvalImpl

    trainer = _upstream_sync_trainer(monkeypatch, PPOTrainerEvalImpl, steps=4, every=float("inf"))
    PPOTrainerEvalImpl.fit(trainer)  # --eval.steps -1 (inf in the actors): no eval, not even the final one
    assert trainer.tensorboard_logger.logged == [] and trainer.tensorboard_logger.closed == 1


class _Queue:
    def __init__(self, items=()):
        self.items = list(items)

    def put(self, item, block=True):
        self.items.append(item)

    def get(self, block=True):
        return self.items.pop(0)


def test_async_generator_labels_an_eval_with_the_weights_it_ran_on(upstream_importable, monkeypatch):
    """Upstream's GenerateSamplesActor.fit with a queue of 2: the slot that triggered the eval carried step 6, but the
    trainer had synced step 7 before the eval took the lock: the eval goes to the trainer labelled 7. After the last
    batch the generator keeps answering freed slots until both are back: the slot of step 8 (step 8's weights
    synced) gets its eval there, the repeated 8 none (just evaluated), and "done" follows. The final eval runs on
    newer weights only."""
    from openrlhf.trainer import ppo_trainer_async as upstream_async

    from openrlhf_ess.trainer.ppo_trainer_async import GenerateSamplesActorEvalImpl

    monkeypatch.setattr(upstream_async.ray, "get", lambda ref: ref)
    metrics = {"eval_default_pass1": 0.5}
    monkeypatch.setattr(upstream_async, "compute_eval_metrics", lambda loader, samples, n: metrics)
    actor = object.__new__(GenerateSamplesActorEvalImpl)
    actor.args = types.SimpleNamespace(
        eval=types.SimpleNamespace(dataset="heldout.jsonl", steps=2, temperature=0.6, n_samples_per_prompt=2),
        train=types.SimpleNamespace(num_episodes=1, async_queue_size=2),
    )
    actor.eval_dataloader, actor.generate_kwargs = [None], {}
    actor._last_eval_step, actor._eval_just_done, actor._partial_rollout = -1, False, False
    lock, queue = _FakeLock(weights_step=7), _Queue()
    actor.vllm_lock, actor.rollout_queue = lock, queue
    # slot tokens, each the trainer's step count when it freed the slot; the generator gives 7 back (no batch)
    slots = actor.rollout_slots = _Queue([6, 7])
    actor.prompts_dataloader = []
    seen_by_eval = []

    def generate_eval_samples(**kwargs):
        seen_by_eval.append((lock.weights_step, lock.held))
        return []

    def no_batch(**kwargs):  # the last batch was queued before: the loader is exhausted
        slots.items += [8, 8]  # meanwhile the trainer synced step 8 and freed both slots (the 2nd after the eval)
        lock.weights_step = 8
        return [], None, 0, True

    actor.samples_generator = types.SimpleNamespace(generate_eval_samples=generate_eval_samples)
    actor.samples_generator.generate_samples = no_batch
    lock.weights_step = 7
    slots.items = [6, 7]
    GenerateSamplesActorEvalImpl.fit(actor, episode=0, total_consumed_prompts=0)
    # labelled by the weights (7), not by the slot's 6; then step 8's eval in the tail; then the end
    assert queue.items == [("eval", 7, metrics), ("eval", 8, metrics), "done"]
    assert seen_by_eval == [(7, 1), (8, 1)] and lock.held == 0  # each under the lock
    assert GenerateSamplesActorEvalImpl.evaluate_final(actor) is None  # step 8's weights were evaluated already
    lock.weights_step = 9
    assert GenerateSamplesActorEvalImpl.evaluate_final(actor) == (9, metrics) and lock.held == 0


def test_async_trainer_evaluates_the_final_step_and_tags_a_best_checkpoint_by_its_weights(
    upstream_importable, monkeypatch, capsys
):
    """Upstream's TrainingActor.fit over a queue: 4 batches, then an eval of step 2's weights that arrives when the
    trainer holds step 4's (the queue was deep), then the end. The eval is logged at 2; its best checkpoint is
    tagged with step 4 (the weights it holds); after the last step the generator evaluates step 4's weights, logged at
    4 before the tracker closes."""
    from openrlhf.trainer import ppo_trainer as upstream_sync

    from openrlhf_ess.trainer.ppo_trainer_async import TrainingActorEvalImpl

    monkeypatch.setattr(upstream_sync.ray, "get", lambda refs: refs)
    trainer = object.__new__(TrainingActorEvalImpl)
    trainer.args = types.SimpleNamespace(
        eval=types.SimpleNamespace(dataset="heldout.jsonl", steps=2),
        ckpt=types.SimpleNamespace(save_steps=float("inf"), best_metric_key=""),
        logger=types.SimpleNamespace(logging_steps=1),
        algo=types.SimpleNamespace(dynamic_filtering_enable=False),
    )
    trainer.wandb_logger, trainer.tensorboard_logger = None, _Logger()
    trainer.best_eval_metric_value, trainer.best_eval_metric_key = float("-inf"), ""
    trainer._latest_eval_metric_value = None
    trainer.actor_model_group, trainer.critic_model_group = _Group(), None
    batch = lambda i: ([f"b{i}"], {"episode": 0}, None, 0.0)  # noqa: E731
    trainer.rollout_queue = _Queue(
        [batch(1), batch(2), batch(3), batch(4), ("eval", 2, {"eval_default_pass1": 0.2}), "done"]
    )
    trainer.rollout_slots = _Queue()
    trainer.train_step = lambda samples, step: ({}, step + 1)
    finals = []
    evaluator = types.SimpleNamespace(
        evaluate_final=_Remote(lambda: finals.append(1) or (4, {"eval_default_pass1": 0.4}))
    )
    TrainingActorEvalImpl.set_evaluator(trainer, evaluator)
    TrainingActorEvalImpl.fit(trainer)
    tb = trainer.tensorboard_logger
    assert tb.logged == [(2, {"eval_default_pass1": 0.2}), (4, {"eval_default_pass1": 0.4})]
    assert tb.closed == 1 and finals == [1]
    assert trainer.actor_model_group.saved == ["best_global_step4", "best_global_step4"]
    out = capsys.readouterr().out
    assert "best eval: the weights of step 2; the best checkpoint best_global_step4 holds step 4's" in out


def test_the_lock_is_told_the_step_each_sync_sent(upstream_importable, monkeypatch):
    """Inside upstream's TrainingActor.broadcast_to_vllm (which takes the lock), after the sync: step 3's weights
    for the sync at the end of train_step(global_step=2); a resume's first sync sends the loaded step."""
    from openrlhf.trainer import ppo_trainer as upstream_sync
    from openrlhf.trainer import ppo_trainer_async as upstream_async

    from openrlhf_ess.trainer.ppo_trainer_async import TrainingActorEvalImpl

    monkeypatch.setattr(upstream_async.ray, "get", lambda refs: refs)
    trainer = object.__new__(TrainingActorEvalImpl)
    trainer.vllm_lock, trainer._partial_rollout = _FakeLock(), False
    order = []
    trainer.vllm_lock.acquire = _Remote(lambda: order.append("acquire"))
    trainer.vllm_lock.release = _Remote(lambda: order.append("release"))
    trainer.vllm_lock.set_weights_step = _Remote(lambda step: order.append(("step", step)))
    monkeypatch.setattr(upstream_sync.BasePPOTrainer, "broadcast_to_vllm", lambda self: order.append("sync"))
    monkeypatch.setattr(upstream_sync.BasePPOTrainer, "train_step", lambda self, s, g: self.broadcast_to_vllm())
    TrainingActorEvalImpl.train_step(trainer, ["batch"], 2)
    assert order == ["acquire", "sync", ("step", 3), "release"]
    monkeypatch.setattr(upstream_sync.BasePPOTrainer, "init_checkpoint_states", lambda self: {"global_step": 10})
    TrainingActorEvalImpl.init_checkpoint_states(trainer)
    order.clear()
    TrainingActorEvalImpl.broadcast_to_vllm(trainer)
    assert order == ["acquire", "sync", ("step", 10), "release"]


# ---- through the CLI ---------------------------------------------------------------------------------------------


def _trained_texts(audit: str, tokenizer) -> list:
    """The decoded sequences (prompt + response) of every trained micro-batch the audit trail kept."""
    import glob

    import torch

    texts = []
    for path in sorted(glob.glob(os.path.join(audit, "batch_v*.pt"))):
        for mb in torch.load(path)["micro_batches"]:
            texts += tokenizer.batch_decode(mb["sequences"], skip_special_tokens=True)
    return texts


@pytest.mark.stack
def test_async_queue_of_8_evals_label_their_weights_train_no_eval_prompt_and_write_only_their_folders(
    tiny_world, tmp_path
):
    """Async with a queue of 8 rollout batches, partial rollouts, interrupt π_prox and token TIS, 16 steps of 2
    prompts, a held-out eval every 3 steps. Evals are due after steps 3, 6, 9, 12 and 15 and after the final step 16
    (not a multiple), each on the weights the engines hold when it starts (the slots that trigger them carry the
    trainer's step when it freed them, while up to 8 batches were queued), never twice on one step's; each is
    labelled with the step whose weights it ran on (the label is eval/weight_version), wall-clock keys increase, no
    eval prompt is in a trained batch, no eval stream is scored at a sync (the store is empty once the last batch is
    trained; an eval's 16 streams stayed there before the engine left them out), and a best checkpoint is tagged
    with the step whose weights it holds.

    Started in a working directory that holds a first run's best checkpoint where upstream's default --ckpt.path
    puts it (./ckpt/checkpoints_ppo_ray/_actor/best_global_step4), with its own --ckpt.output_dir and no
    --ckpt.path: its checkpoints go under its output folder, and nothing of the first run's is deleted or changed.
    One run for both stories: each CLI run costs ~40 s of start-up on 2 cores."""
    import glob
    import json
    import re
    import sys

    from transformers import AutoTokenizer

    from openrlhf_ess.tiny.world import build_prompts
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    heldout = build_prompts(str(tmp_path / "heldout.jsonl"), n=8, seed=1)
    read = lambda p: [json.loads(line)["input"] for line in open(p)]  # noqa: E731
    eval_prompts, train_prompts = read(heldout), read(tiny_world["prompts"])[:32]
    assert not set(eval_prompts) & set(train_prompts)
    workdir = tmp_path / "workdir"
    first = workdir / "ckpt" / "checkpoints_ppo_ray" / "_actor" / "best_global_step4"
    os.makedirs(first)
    (first / "mp_rank_00_model_states.pt").write_bytes(b"the first run's weights")
    (first.parent / "latest").write_text("best_global_step4")

    def tree(folder):
        return sorted(
            (os.path.relpath(os.path.join(r, n), folder), open(os.path.join(r, n), "rb").read())
            for r, _, names in os.walk(folder)
            for n in names
        )

    before = tree(workdir)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    audit = os.path.join(run_dir, "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=32)
    i = args.index("--ckpt.path")
    args = args[:i] + args[i + 2 :]  # not passed: under --ckpt.output_dir (run/ckpt)
    args += ["--rollout.batch_size", "2", "--train.batch_size", "8", "--train.async_enable"]
    args += ["--train.async_queue_size", "8", "--train.partial_rollout_enable", "--algo.tis_cap", "2"]
    args += ["--algo.prox_mode", "interrupt", "--algo.prox_audit_dir", audit]
    args += ["--eval.dataset", heldout, "--eval.steps", "3", "--eval.n_samples_per_prompt", "2"]
    launcher = ["env", "-C", str(workdir), sys.executable, "-m"]  # the CLI's working directory
    started = time.time()
    rc, log = run_cli(args, run_dir, timeout=900, launcher=launcher)
    assert rc == 0, log[-4000:]
    own = os.path.join(run_dir, "ckpt", "checkpoints_ppo_ray")
    assert f"(the previous best is deleted) -> {own} (--ckpt.path);" in log
    assert f". --ckpt.path not passed: {own}, under --ckpt.output_dir (upstream's default" in log
    assert "evals at steps 3, 6, 9, 12, 15, 16 of 16 steps (32 prompts / --rollout.batch_size 2" in log

    tb = read_tensorboard(run_dir)
    steps = lambda key: [s for s, _ in tb[key]]  # noqa: E731
    values = lambda key: [v for _, v in tb[key]]  # noqa: E731
    labels = steps("eval/eval_default_pass1")
    # an eval due at 3, 6, ... runs on the weights the engines hold when it starts (the trainer, with up to 8
    # batches queued, may be several syncs ahead), never twice on one step's; then the final step 16
    assert 2 <= len(labels) <= 6 and labels[-1] == 16 and labels == sorted(set(labels)) and labels[0] >= 3, labels
    assert values("eval/eval_num_samples") == [16.0] * len(labels)  # 8 held-out prompts x 2 samples
    assert steps("eval/weight_version") == labels and values("eval/weight_version") == [float(s) for s in labels]
    wall, since = values("eval/wall_clock_s"), values("eval/wall_clock_since_step1_s")
    assert steps("eval/wall_clock_s") == steps("eval/wall_clock_since_step1_s") == labels
    assert 0 < since[0] < wall[0] and wall == sorted(set(wall)) and since == sorted(set(since))
    offsets = [w - s for w, s in zip(wall, since)]  # one clock, two origins: a constant offset
    assert max(offsets) - min(offsets) < 0.01
    assert wall[-1] < time.time() - started  # counted from this CLI's launch, not from an older time
    # no eval prompt in a trained batch; every trained sequence starts with a training prompt
    texts = _trained_texts(audit, AutoTokenizer.from_pretrained(tiny_world["model"]))
    assert len(texts) == 16 * 8  # 16 steps of 2 prompts x 4 samples
    assert not [t for t in texts if any(p in t for p in eval_prompts)]
    assert all(any(t.startswith(p) for p in train_prompts) for t in texts)
    # eval streams were not scored at a sync: once the last batch is trained, nothing is left in the store
    assert values("train/prox/store_entries")[-1] == 0.0
    # the best checkpoint: one (the previous best rotated away), in its own folder, tagged with the step whose
    # weights it holds: the evaluated one, or the later one a line names
    (best,) = glob.glob(os.path.join(own, "_actor", "best_global_step*"))
    held = int(best.rsplit("step", 1)[1])
    named = re.findall(r"best eval: the weights of step (\d+); the best checkpoint best_global_step(\d+) holds", log)
    assert held in labels or str(held) in [h for _, h in named], (held, labels, named)
    assert all(int(h) > int(e) for e, h in named), named
    assert tree(workdir) == before  # the first run's checkpoint, untouched
