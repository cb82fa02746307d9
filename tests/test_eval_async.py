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
    from openrlhf_ess.trainer.ray import vllm_engine

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

    engine.executor = vllm_engine._VersionTaggingExecutor(Executor())
    return engine, seen_inflight


def _params(**extra_args):
    return types.SimpleNamespace(logprobs=None, extra_args=extra_args or None)


def test_engine_keeps_eval_requests_out_of_the_streams_scored_at_a_sync():
    from openrlhf_ess.trainer.ray import vllm_engine

    engine, seen_inflight = _fake_engine()
    impl = vllm_engine.RolloutRayActorImpl

    async def both():
        train = impl.generate_responses(engine, [1, 2], None, _params(), max_length=64, hf_tokenizer=None)
        evaluation = impl.generate_responses(
            engine, [5, 6], None, _params(**{vllm_engine.EVAL_MARK: True}), max_length=64, hf_tokenizer=None
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
    from openrlhf_ess.trainer.ray import vllm_engine

    marked = eval_sampling_params(temperature=0.5, max_tokens=4)
    assert vllm_engine.is_evaluation(marked) and marked.temperature == 0.5 and marked.max_tokens == 4
    assert not vllm_engine.is_evaluation(_params())
    assert not vllm_engine.is_evaluation(_params(other=1))
    assert not vllm_engine.is_evaluation(object())


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
    from openrlhf_ess.trainer.ray.vllm_engine import is_evaluation

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
        self.logged = []

    def log_eval(self, step, logs):
        self.logged.append((step, dict(logs)))


def test_sync_and_async_evals_log_the_clock(monkeypatch):
    from openrlhf.trainer import ppo_trainer as upstream_sync
    from openrlhf.trainer import ppo_trainer_async as upstream_async

    from openrlhf_ess.trainer.ppo_trainer import PPOTrainerImpl
    from openrlhf_ess.trainer.ppo_trainer_async import GenerateSamplesActorImpl

    fake_metrics = lambda loader, samples, n: {"eval_default_pass1": 0.5}  # noqa: E731
    monkeypatch.setattr(upstream_sync, "compute_eval_metrics", fake_metrics)
    monkeypatch.setattr(upstream_async, "compute_eval_metrics", fake_metrics)
    clock = {"weight_version": 2.0, "wall_clock_s": 30.0, "wall_clock_since_step1_s": 10.0}
    generator = types.SimpleNamespace(generate_eval_samples=lambda **kw: [], last_eval_clock=clock)

    trainer = object.__new__(PPOTrainerImpl)
    trainer.samples_generator, trainer.eval_dataloader = generator, None
    trainer.wandb_logger, trainer.tensorboard_logger = None, _Logger()
    logs = PPOTrainerImpl.evaluate(trainer, 2, n_samples_per_prompt=2)
    assert logs == {"eval_default_pass1": 0.5, **clock}
    assert trainer.tensorboard_logger.logged == [(2, logs)]

    actor = object.__new__(GenerateSamplesActorImpl)
    actor.samples_generator, actor.eval_dataloader, actor.generate_kwargs = generator, None, {}
    actor.args = types.SimpleNamespace(eval=types.SimpleNamespace(temperature=0.6, n_samples_per_prompt=2))
    assert GenerateSamplesActorImpl._run_eval(actor) == {"eval_default_pass1": 0.5, **clock}


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
def test_async_eval_logs_version_and_wall_clock_and_never_trains_on_eval_prompts(tiny_world, tmp_path):
    """Async + partial rollouts + interrupt π_prox, 8 steps of 4 prompts, a held-out eval every 2 steps: evals at
    steps 2, 4 and 6 (the generator ends after the last batch) on the weights of that step, wall-clock keys
    increasing, no eval prompt in a trained batch, and no eval stream scored at a sync (the store is empty once the
    last batch is trained; an eval's 16 streams stayed there before the engine left them out)."""
    import json

    from transformers import AutoTokenizer

    from openrlhf_ess.tiny.world import build_prompts
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    heldout = build_prompts(str(tmp_path / "heldout.jsonl"), n=8, seed=1)
    read = lambda p: [json.loads(line)["input"] for line in open(p)]  # noqa: E731
    eval_prompts, train_prompts = read(heldout), read(tiny_world["prompts"])[:32]
    assert not set(eval_prompts) & set(train_prompts)
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    audit = os.path.join(run_dir, "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=32) + [
        "--rollout.batch_size",
        "4",
        "--train.batch_size",
        "16",
        "--train.async_enable",
        "--train.partial_rollout_enable",
        "--algo.prox_mode",
        "interrupt",
        "--algo.prox_audit_dir",
        audit,
        "--eval.dataset",
        heldout,
        "--eval.steps",
        "2",
        "--eval.n_samples_per_prompt",
        "2",
    ]
    started = time.time()
    rc, log = run_cli(args, run_dir, timeout=900)
    assert rc == 0, log[-4000:]
    tb = read_tensorboard(run_dir)
    steps = lambda key: [s for s, _ in tb[key]]  # noqa: E731
    values = lambda key: [v for _, v in tb[key]]  # noqa: E731
    assert steps("eval/eval_default_pass1") == [2, 4, 6]
    assert values("eval/eval_num_samples") == [16.0] * 3
    assert steps("eval/weight_version") == [2, 4, 6] and values("eval/weight_version") == [2.0, 4.0, 6.0]
    wall, since = values("eval/wall_clock_s"), values("eval/wall_clock_since_step1_s")
    assert steps("eval/wall_clock_s") == steps("eval/wall_clock_since_step1_s") == [2, 4, 6]
    assert 0 < since[0] < wall[0] and wall == sorted(set(wall)) and since == sorted(set(since))
    offsets = [w - s for w, s in zip(wall, since)]  # one clock, two origins: a constant offset
    assert max(offsets) - min(offsets) < 0.01
    assert wall[-1] < time.time() - started  # counted from this CLI's launch, not from an older time
    # no eval prompt in a trained batch; every trained sequence starts with a training prompt
    texts = _trained_texts(audit, AutoTokenizer.from_pretrained(tiny_world["model"]))
    assert len(texts) == 8 * 16
    assert not [t for t in texts if any(p in t for p in eval_prompts)]
    assert all(any(t.startswith(p) for p in train_prompts) for t in texts)
    # eval streams were not scored at a sync: once the last batch is trained, nothing is left in the store
    assert values("train/prox/store_entries")[-1] == 0.0
