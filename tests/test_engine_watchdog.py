"""The engine watchdog (openrlhf_ess/trainer/ray/engine_watchdog.py, docs/faults.md §1): its progress rule and clock
on made-up answers, the driver thread's decision with fake Ray calls, the flag; and on the real stack, an engine whose
vLLM processes are SIGSTOPped mid-rollout stops the run, named, with no process left."""

import os
import types

import pytest

from openrlhf_ess.trainer.ray.engine_watchdog import (
    EngineClock,
    EngineWatchdog,
    WatchedEngines,
    poll_interval,
    progressed,
)

# ---------------------------------------------------------------- the progress rule and the clock


def test_progress_is_a_token_streamed_or_a_request_finished():
    before = {"a": 3, "b": 0}
    assert not progressed(before, {"a": 3, "b": 0})  # nothing moved
    assert progressed(before, {"a": 4, "b": 0})  # a streamed a token
    assert progressed(before, {"b": 0})  # a finished
    assert not progressed(before, {"a": 3, "b": 0, "c": 0})  # a new request alone is work handed in, not done
    assert not progressed({}, {"c": 0})
    assert progressed({"a": 3}, {})  # the last one finished


def test_the_clock_runs_only_while_requests_in_flight_make_no_progress():
    clock = EngineClock(0)
    clock.silent(asked_at=1.0)  # never answered: still starting, not counted
    assert clock.since is None and clock.stalled_for(500.0) == 0.0
    clock.answer(2.0, {"pid": 7, "tokens": {}})  # idle
    assert clock.stalled_for(100.0) == 0.0
    clock.answer(10.0, {"pid": 7, "tokens": {"a": 0, "b": 0}})  # work arrives at t=10
    clock.answer(15.0, {"pid": 7, "tokens": {"a": 0, "b": 0}})
    assert clock.stalled_for(15.0) == 5.0  # 15 - 10
    clock.answer(20.0, {"pid": 7, "tokens": {"a": 1, "b": 0}})  # a token: the stretch starts again
    clock.answer(28.0, {"pid": 7, "tokens": {"a": 1, "b": 0, "c": 0}})  # a new request only
    assert clock.stalled_for(28.0) == 8.0  # 28 - 20
    clock.answer(30.0, {"pid": 7, "tokens": {"b": 0, "c": 0}})  # a finished
    assert clock.stalled_for(31.0) == 1.0
    clock.silent(asked_at=33.0)  # the next call is not answered
    clock.silent(asked_at=33.0)
    assert clock.stalled_for(45.0) == 15.0 and clock.silent_since == 33.0  # since the last progress (t=30)
    clock.answer(46.0, {"pid": 7, "tokens": {}})  # it answered, idle
    assert clock.since is None and clock.silent_since is None


def test_an_engine_silent_after_an_idle_answer_is_timed_from_the_unanswered_call():
    clock = EngineClock(1)
    clock.answer(0.0, {"pid": 9, "tokens": {}})
    clock.silent(asked_at=5.0)
    assert clock.stalled_for(12.0) == 7.0  # 12 - 5


def test_poll_interval_is_a_tenth_of_the_bound_within_limits():
    assert poll_interval(600) == 10.0  # min(10, 60)
    assert poll_interval(30) == 3.0
    assert poll_interval(2) == 0.5  # max(0.5, 0.2)


# ---------------------------------------------------------------- the thread's decision, with fake Ray calls


class _Fake:
    """Two engines whose answers the test scripts; a call of a silent engine is never ready."""

    def __init__(self):
        self.now = 0.0
        self.answers = {0: {"pid": 100, "tokens": {}}, 1: {"pid": 101, "tokens": {}}}
        self.silent = set()
        self.dead = set()
        self.stopped = []
        self.out = []
        self.engines = ["engine0", "engine1"]

    def watchdog(self, watchdog_s=30.0):
        return EngineWatchdog(
            self.engines,
            watchdog_s,
            poll_s=3.0,
            out=self.out.append,
            stop_engine=self.stopped.append,
            ask=lambda engine: [self.engines.index(engine)],  # a fresh "ref" per call
            wait=self._wait,
            get=self._get,
            clock=lambda: self.now,
        )

    def _wait(self, refs, timeout):
        ready = [r for r in refs if r[0] not in self.silent]
        if len(ready) < len(refs):
            self.now += timeout  # waited the whole slice for the silent one
        return ready

    def _get(self, ref):
        if ref[0] in self.dead:
            from ray.exceptions import ActorDiedError

            raise ActorDiedError()
        return self.answers[ref[0]]


def test_a_stalled_engine_is_stopped_and_named_at_the_bound_and_only_it():
    fake = _Fake()
    dog = fake.watchdog(watchdog_s=30.0)
    fake.answers[1] = {"pid": 101, "tokens": {"r1": 5, "r2": 7, "r3": 0}}
    for t in (0.0, 10.0, 20.0):
        fake.now = t
        fake.answers[0] = {"pid": 100, "tokens": {"x": int(t)}}  # engine 0 streams a token every look
        assert dog.tick() is None
    fake.now = 29.9
    assert dog.tick() is None and not fake.stopped  # 29.9 s < 30 s
    fake.now = 30.0
    message = dog.tick()
    assert fake.stopped == ["engine1"]  # the stalled one, not the streaming one
    assert message.startswith("the vLLM engine 1 (RolloutRayActorImpl, pid 101) hung: it had 3 request(s) in flight")
    assert "12 output token(s) streamed by them so far" in message  # 5 + 7 + 0
    assert "for 30 s" in message and "--vllm.watchdog_s 30" in message and "--ckpt.load_enable" in message
    assert fake.out == ["engine watchdog: " + message] and dog.hung == message
    fake.now = 100.0
    assert dog.tick() is None and fake.stopped == ["engine1"]  # fires once


def test_an_engine_that_stops_answering_with_work_in_flight_is_hung():
    fake = _Fake()
    dog = fake.watchdog(watchdog_s=30.0)
    fake.answers[0] = {"pid": 100, "tokens": {"a": 2}}
    dog.tick()  # t=0: answered, one request in flight
    fake.silent.add(0)
    for t in (5.0, 20.0):
        fake.now = t
        assert dog.tick() is None
    fake.now = 31.0
    message = dog.tick()  # each look waits its whole poll_s (3 s) for the silent engine: it ends at t=34
    assert fake.stopped == ["engine0"]
    # the stretch began at its last answer (t=0); the unanswered call was sent at t=5: silent for 34 - 5 s
    assert "has not answered the watchdog for 29 s" in message and "it had 1 request(s) in flight" in message


def test_an_engine_that_never_answered_is_starting_not_hung():
    fake = _Fake()
    fake.silent.add(1)
    dog = fake.watchdog(watchdog_s=30.0)
    for t in (0.0, 100.0, 1000.0):
        fake.now = t
        assert dog.tick() is None
    assert not fake.stopped


def test_a_dead_engine_is_left_to_rays_error():
    fake = _Fake()
    fake.answers[0] = {"pid": 100, "tokens": {"a": 2}}
    dog = fake.watchdog(watchdog_s=30.0)
    dog.tick()
    fake.dead.add(0)
    for t in (10.0, 40.0, 100.0):
        fake.now = t
        assert dog.tick() is None
    assert not fake.stopped and not fake.out  # Ray fails the controller's calls on it; nothing to add


def test_stopping_the_watchdog_does_not_wait_a_whole_look():
    """The run's end stops the thread while a call is unanswered: it waits in slices, not the whole poll_s."""
    import time

    dog = EngineWatchdog(
        ["e"],
        600.0,  # poll_s 10 s
        ask=lambda engine: object(),
        wait=lambda refs, timeout: time.sleep(timeout) or [],  # never answered
        get=lambda ref: None,
        out=lambda msg: None,
    ).start()
    time.sleep(0.3)
    t0 = time.monotonic()
    dog.stop()
    assert time.monotonic() - t0 < 1.5 and not dog._thread.is_alive()  # one slice (0.5 s) at most, not 10 s


def test_watchdog_zero_watches_nothing():
    created = WatchedEngines(lambda: ["e"], 0.0)
    assert created() == ["e"] and created.watchdog is None and created.hung is None
    created.stop()


# ---------------------------------------------------------------- paused for a weight sync is not hung


def test_a_paused_engine_is_not_timed_and_is_timed_again_from_its_resume():
    clock = EngineClock(0)
    clock.answer(0.0, {"pid": 7, "tokens": {"a": 4}, "paused": False})
    clock.answer(5.0, {"pid": 7, "tokens": {"a": 4}, "paused": True})  # paused with a request in flight
    assert clock.stalled_for(900.0) == 0.0
    clock.answer(900.0, {"pid": 7, "tokens": {"a": 4}, "paused": False})  # resumed: its stretch starts here
    assert clock.stalled_for(903.0) == 3.0


def test_a_sync_longer_than_the_bound_with_requests_paused_across_it_is_not_a_hang():
    """Partial rollouts: the engine streams, is paused at t=20 for a weight sync that lasts 95 s (3x the 30 s
    bound: a large model's gather, kept set, regroup and broadcast), then resumes and streams again. Nothing is
    stopped. The same silence without the pause mark is a hang at the bound (the test can fail)."""
    for paused, fires_at in ((True, None), (False, 50.0)):
        fake = _Fake()
        dog = fake.watchdog(watchdog_s=30.0)
        fired = None
        for t in range(0, 160, 3):
            fake.now = float(t)
            streamed = t if t < 20 else (20 if t < 115 else t - 95)
            in_sync = 20 <= t < 115
            fake.answers[0] = {"pid": 100, "tokens": {"r1": streamed, "r2": 1}, "paused": paused and in_sync}
            if dog.tick() is not None and fired is None:
                fired = float(t)
        if fires_at is None:
            assert fired is None and fake.stopped == [] and dog.hung is None
        else:
            assert fired is not None and 50.0 <= fired <= 53.0 and fake.stopped == ["engine0"], fired


def _engine_with(llm):
    from openrlhf_ess.trainer.ray import vllm_engine

    engine = object.__new__(vllm_engine.RolloutRayActorImpl)
    engine.llm, engine._keeper, engine.engine_index = llm, None, 0
    return engine


def test_the_engine_marks_itself_paused_from_pause_to_resume_for_the_watchdog():
    """Our engine actor between upstream's pause_generation and resume_generation (vLLM's own calls stand-ins):
    watchdog_progress says paused, with its requests in flight; after the resume it does not."""
    import asyncio
    import types

    calls = []

    class State:
        detokenizer = types.SimpleNamespace(num_output_tokens=lambda: 6)

    class LLM:
        errored = False
        output_processor = types.SimpleNamespace(request_states={"r1": State()})

        async def pause_generation(self, mode):
            calls.append(("pause", mode))

        async def resume_generation(self):
            calls.append("resume")

    engine = _engine_with(LLM())

    async def sync():
        seen = [await engine.watchdog_progress()]
        await engine.pause_generation()
        seen.append(await engine.watchdog_progress())
        await engine.resume_generation()
        seen.append(await engine.watchdog_progress())
        return seen

    before, during, after = asyncio.run(sync())
    assert calls == [("pause", "keep"), "resume"]
    assert [p["paused"] for p in (before, during, after)] == [False, True, False]
    assert during["tokens"] == {"r1": 6} and during["pid"] == os.getpid()


def test_the_watchdogs_calls_run_in_the_engines_own_concurrency_group():
    """Declared on the actor class (a group of its own) and on the two methods the watchdog and a regroup call, so
    that they never queue behind up to 1,000 generation calls in the default group."""
    from openrlhf_ess.trainer.ray import vllm_engine

    groups = vllm_engine.RolloutRayActor._default_options["concurrency_groups"]
    assert set(groups) == {"watch"} and groups["watch"] >= 1
    impl = vllm_engine.RolloutRayActorImpl
    assert impl.watchdog_progress.__ray_concurrency_group__ == "watch"
    assert impl.held_weight_version.__ray_concurrency_group__ == "watch"
    assert not hasattr(impl.generate_responses, "__ray_concurrency_group__")  # the default group


def test_with_replacement_on_and_watchdog_zero_only_the_restart_deadline_is_kept():
    """--vllm.watchdog_s 0 with a keeper: the thread runs (every restart's deadline) but times no hang."""
    fake = _Fake()
    dog = EngineWatchdog(
        fake.engines,
        0.0,
        poll_s=3.0,
        out=fake.out.append,
        stop_engine=fake.stopped.append,
        ask=lambda engine: [fake.engines.index(engine)],
        wait=fake._wait,
        get=lambda ref: fake._get(ref) if isinstance(ref, list) and ref else ref,  # the keeper answers []
        clock=lambda: fake.now,
        keeper=_NoRestarts(),
    )
    fake.answers[0] = {"pid": 100, "tokens": {"r1": 3}}
    for t in range(0, 2000, 100):
        fake.now = float(t)
        assert dog.tick() is None
    assert fake.stopped == []


class _NoRestarts:
    """A keeper handle with nothing down or restarting."""

    overdue = type("_", (), {"remote": staticmethod(lambda timeout_s: [])})
    restarting = type("_", (), {"remote": staticmethod(lambda: [])})


# ---------------------------------------------------------------- a dead engine is not a hung one


def _killed_past_the_budget(ray_says):
    """One engine, replaced once already (``--vllm.max_restarts 1``: the budget is used), streaming a token at each
    look with a request in flight; at t=5 its actor process is SIGKILLed: its calls go unanswered from then (Ray
    holds them for a new instance) and Ray reports its actor as ``ray_says``. The keeper is the real one (its class,
    no Ray), on the test's clock."""
    from ray.exceptions import ActorDiedError

    from openrlhf_ess.trainer.ray.engine_keeper import EngineKeeperImpl
    from tests.helpers.one_rank import RemoteHandle

    world = types.SimpleNamespace(now=0.0, killed=False, dead=False, state="ALIVE", streamed=0)
    world.stopped, world.restarted, world.out = [], [], []
    keeper = EngineKeeperImpl(1, clock=lambda: world.now)
    keeper.hello(0, 100, reconstructed=False)
    keeper.stopping(0, "the vLLM engine 0 (RolloutRayActorImpl, pid 100) hung: it had 2 request(s) in flight")
    keeper.hello(0, 200, reconstructed=True)
    keeper.rejoined(0, 200, 1, 12.0)

    def wait(refs, timeout):
        if world.dead:
            return list(refs)  # a dead actor's calls fail at once
        if world.killed:
            world.now += timeout  # unanswered: each wait lasts its whole slice
            return []
        return list(refs)

    def get(ref):
        if not isinstance(ref, tuple):
            return ref  # the keeper's answer (RemoteHandle ran the call)
        if world.dead:
            raise ActorDiedError()
        world.streamed += 1
        return {"pid": 200, "tokens": {"r1": world.streamed}}

    dog = EngineWatchdog(
        ["engine-0"],
        watchdog_s=10.0,
        poll_s=1.0,
        out=world.out.append,
        stop_engine=world.stopped.append,
        restart_engine=world.restarted.append,
        ask=lambda engine: ("ask", engine),
        wait=wait,
        get=get,
        clock=lambda: world.now,
        keeper=RemoteHandle(keeper),
        state=lambda engine: world.state,
    )
    for t in range(5):
        world.now = float(t)
        assert dog.tick() is None
    world.now, world.killed, world.state = 5.0, True, ray_says
    return dog, keeper, world


def test_a_killed_engine_that_ray_restarts_past_the_budget_is_named_dead_not_hung():
    """Its silence passes --vllm.watchdog_s long before its new instance reaches the keeper (a process start and
    vLLM's imports), but Ray is restarting the actor: that is a death, whose refused restart the keeper names with
    every failure in order, not a hang. The keeper's deadline runs from the silence. The same silence while Ray
    says the actor is alive (its own process stopped) is a hang at the bound."""
    dog, keeper, world = _killed_past_the_budget("RESTARTING")
    while world.now < 40.0:  # each look waits its 1 s for the silent engine
        assert dog.tick() is None
    assert dog.hung is None and world.stopped == [] and world.restarted == [] and world.out == []
    assert keeper.down == {0: {"since": 5.0, "cause": None}}  # the unanswered call was sent at t=5
    told = keeper.hello(0, 300, reconstructed=True)  # the new instance's first word: past the budget
    assert told["allowed"] is False and keeper.down == {}
    world.dead, world.state = True, "DEAD"  # its __init__ raised: Ray ends the actor and fails its calls
    for t in range(41, 60):
        world.now = float(t)
        assert dog.tick() is None
    assert dog.hung is None and world.stopped == [] and world.out == []
    assert told["history"] == (
        "[1] engine 0 (pid 100): the vLLM engine 0 (RolloutRayActorImpl, pid 100) hung: it had 2 request(s) in "
        "flight; replaced by pid 200 at weight version 1 in 12.0 s (0 request(s) sent again); "
        "[2] engine 0 (pid 200): its actor process died (a signal, a crash, or the kernel's memory killer); not "
        "replaced: --vllm.max_restarts 1 restart(s) already used"
    )

    dog, keeper, world = _killed_past_the_budget("ALIVE")
    while dog.hung is None:
        assert world.now < 16.0, "the stopped engine was not found hung"
        dog.tick()
    # its last progress at t=4: due at 14, silent since the call sent at t=5
    assert world.now == 14.0 and world.stopped == ["engine-0"] and world.restarted == []
    assert dog.hung.startswith(
        "the vLLM engine 0 (RolloutRayActorImpl, pid 200) hung: it has not answered the watchdog for 9 s"
    ), dog.hung
    assert keeper.down == {}


def test_an_engine_whose_actor_state_cannot_be_read_is_judged_by_its_clock():
    """No Ray answer about the actor (the default reader's failure, or an engine that is not an actor handle): the
    silence is a hang at the bound, as without the state."""
    from openrlhf_ess.trainer.ray.engine_watchdog import actor_state

    assert actor_state("engine0") is None
    dog, keeper, world = _killed_past_the_budget(None)
    while dog.hung is None:
        assert world.now < 16.0
        dog.tick()
    assert world.stopped == ["engine-0"] and "has not answered the watchdog" in dog.hung


# ---------------------------------------------------------------- the flag


def test_the_flag_default_and_its_bounds():
    from openrlhf_ess.cli.train_ppo_ray import build_parser
    from openrlhf_ess.config.flags import ENGINE_WATCHDOG_S

    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "vllm.watchdog_s"]
    assert action.default == ENGINE_WATCHDOG_S == 600.0
    assert "Default 600" in action.help % {"default": action.default} and "0 = off" in action.help
    assert action.type("0") == 0.0 and action.type("12.5") == 12.5
    for bad in ("-1", "nan", "inf", "ten"):
        with pytest.raises(Exception, match="expected seconds >= 0"):
            action.type(bad)


# ---------------------------------------------------------------- the real stack

# A reward file for --reward.remote_url (upstream calls it inside the engine actor). At each call until it sticks, it
# SIGSTOPs the engine's vLLM processes below the actor (EngineCore and its worker: a stuck kernel or a deadlock as the
# engine's own processes see it), then counts the requests in flight in the engine's vLLM (its AsyncLLM, found by the
# garbage collector: test-only). Some in flight: they stay stopped, and the actor's pid, that count and the stopped
# pids are written to the marker. None (every request of the rollout already generated): they continue.
STOP_ENGINE_REWARD = """
import gc
import os
import signal

import psutil
import torch

_stopped = False


def _inflight():
    for obj in gc.get_objects():
        if type(obj).__name__ == "AsyncLLM":
            return obj.output_processor.get_num_unfinished_requests()
    raise RuntimeError("no AsyncLLM in the engine actor")


def reward_func(queries, prompts, labels):
    global _stopped
    if not _stopped:
        below = psutil.Process().children(recursive=True)
        vllm = [p for p in below if "resource_tracker" not in " ".join(p.cmdline())]
        for p in vllm:
            p.send_signal(signal.SIGSTOP)
        inflight = _inflight()
        if inflight:
            _stopped = True
            with open({marker!r}, "w") as f:
                f.write(f"{{os.getpid()}} {{inflight}} " + " ".join(str(p.pid) for p in vllm))
        else:
            for p in vllm:
                p.send_signal(signal.SIGCONT)
    rewards = torch.tensor([0.5] * len(queries))
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{}}}}
"""


ASYNC_PARTIAL = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.ess_lr_enable"]


@pytest.mark.real_stack
@pytest.mark.parametrize(
    "flags",
    [
        # the default tier runs a hang on the real stack in test_engine_replacement.py (after a replacement)
        pytest.param([], id="sync", marks=pytest.mark.slow),
        pytest.param(ASYNC_PARTIAL, id="async-partial", marks=pytest.mark.slow),
    ],
)
def test_an_engine_stopped_mid_rollout_is_found_hung_and_the_run_stops(tiny_world, tmp_path, flags):
    """--vllm.watchdog_s 10: the engine's vLLM processes are SIGSTOPped while the first rollout's requests are in
    flight; sync (upstream's controller) and, slow, async with partial rollouts (our controllers, the generator in its
    own actor). Without the watchdog the run waits forever; with it, the run stops with exit 1 within the bound plus a
    look, our last line names the engine's pid and its requests in flight, and no process of the run is left (the
    stopped ones included)."""
    from tests.helpers.e2e import tiny_args
    from tests.helpers.faults import run_cli_tracked

    run_dir = str(tmp_path)
    marker = os.path.join(run_dir, "stopped")
    reward = os.path.join(run_dir, "reward.py")
    with open(reward, "w") as f:
        f.write(STOP_ENGINE_REWARD.format(marker=marker))
    args = tiny_args(tiny_world, run_dir, steps_prompts=8)
    args[args.index("--reward.remote_url") + 1] = reward
    # responses of up to 48 tokens end at different steps, so some are still generating when the first are scored
    args[args.index("--rollout.max_new_tokens") + 1] = "48"
    args[args.index("--data.max_len") + 1] = "96"
    run = run_cli_tracked(args + ["--vllm.watchdog_s", "10"] + flags, run_dir, timeout=600)
    assert not run.timed_out, run.log[-6000:]
    assert os.path.exists(marker), "no reward call found requests in flight: " + run.log[-3000:]
    engine_pid, inflight, *stopped = open(marker).read().split()
    assert int(inflight) > 0 and stopped, open(marker).read()
    assert run.rc == 1, run.log[-6000:]
    ours = [line for line in run.log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1, run.log[-6000:]
    named = f"openrlhf-ess: error: the vLLM engine 0 (RolloutRayActorImpl, pid {engine_pid}) hung"
    assert ours[0].startswith(named), ours
    assert "request(s) in flight" in ours[0] and "--vllm.watchdog_s 10" in ours[0], ours
    # found within the bound and a look (10 s + 1 s) after the stop, and the run ended seconds later
    assert run.ended_at - os.stat(marker).st_mtime < 10 + 1 + 30, run.ended_at - os.stat(marker).st_mtime
    assert "Global step" not in run.log
    assert not run.leftovers, run.leftovers  # the SIGSTOPped EngineCore and worker went with their actor
    assert not run.shm_left, f"/dev/shm files of the run left behind: {run.shm_left}"
    print(f"stopped -> CLI exit: {run.ended_at - os.stat(marker).st_mtime:.1f} s")
