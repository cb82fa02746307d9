"""Engine replacement (--vllm.max_restarts; openrlhf_ess/trainer/ray/engine_keeper.py): the keeper's record and
budget, the flag's pre-flight, the watchdog's restart; on the real stack, an engine actor and an engine core killed
mid-rollout are replaced, every prompt is trained exactly once, and one failure past the budget stops the run with
every failure named."""

import collections
import json
import os
import re
import types

import pytest

from openrlhf_ess.config import ConfigError
from openrlhf_ess.trainer.ray import engine_keeper, engine_watchdog

# ---------------------------------------------------------------- the keeper's record (no Ray: its class as is)


def _keeper(n=2):
    return engine_keeper.EngineKeeperImpl(n)


def test_a_restart_gets_the_last_syncs_weights_and_version_within_the_budget():
    keeper = _keeper(2)
    assert keeper.hello(0, 100, reconstructed=False) == {"allowed": True}
    canary = {"ids": [5, 6], "log_probs": [-1.0], "tol": 0.5, "rel_tol": 0.1}
    keeper.put_weights(3, ["ref-a", "ref-b"], canary)
    told = keeper.hello(0, 200, reconstructed=True)
    assert told == {"allowed": True, "version": 3, "refs": ["ref-a", "ref-b"], "canary": canary}
    assert keeper.restarting() == [0] and keeper.budget_left() == 1
    line = keeper.rejoined(0, 200, 3, 31.5, canary=0.0012)
    assert line == (
        "engine 0 (pid 100): its actor process died (a signal, a crash, or the kernel's memory killer); replaced "
        "by pid 200 at weight version 3 in 31.5 s, its canary 1.20e-03 nats from the trainer's"
    )
    assert keeper.restarting() == [] and keeper.unverified() == [0] and keeper.unverified() == []


def test_calls_sent_again_are_counted_by_their_task_id_against_the_last_replacement():
    keeper = _keeper(2)
    keeper.hello(1, 10, reconstructed=False)
    for task in ("t1", "t2", "t3"):
        keeper.started(1, task)
    keeper.hello(1, 11, reconstructed=True)
    keeper.rejoined(1, 11, 0, 5.0)
    keeper.started(1, "t2")  # sent again by Ray: same task id
    keeper.started(1, "t3")
    keeper.started(1, "t4")  # a new call
    assert keeper.metrics() == {
        "faults/engine_restarts": 1.0,
        "faults/restart_seconds": 5.0,
        "faults/prompts_requeued": 2.0,
        "faults/restarts_failed": 0.0,
    }
    assert keeper.history()[0]["requeued"] == 2


def test_a_restart_past_the_budget_is_refused_and_every_failure_is_named_in_order():
    keeper = _keeper(1)
    keeper.hello(0, 100, reconstructed=False)
    keeper.hello(1, 101, reconstructed=False)
    keeper.stopping(1, "the vLLM engine 1 (RolloutRayActorImpl, pid 101) hung: it had 2 request(s) in flight")
    keeper.hello(1, 201, reconstructed=True)
    keeper.rejoined(1, 201, 2, 12.0)
    told = keeper.hello(0, 300, reconstructed=True)
    assert told["allowed"] is False and told["max_restarts"] == 1
    assert told["history"] == (
        "[1] engine 1 (pid 101): the vLLM engine 1 (RolloutRayActorImpl, pid 101) hung: it had 2 request(s) in "
        "flight; replaced by pid 201 at weight version 2 in 12.0 s (0 request(s) sent again); "
        "[2] engine 0 (pid 100): its actor process died (a signal, a crash, or the kernel's memory killer); not "
        "replaced: --vllm.max_restarts 1 restart(s) already used"
    )
    assert keeper.budget_left() == 0


def _restarted_engine(engine_log_probs, keeper):
    """Our engine actor as ``_rejoin`` sees it after the load: its canary answer and the keeper's handle."""
    import asyncio

    from openrlhf_ess.trainer.ray.vllm_engine import RolloutRayActorImpl

    engine = object.__new__(RolloutRayActorImpl)
    engine.engine_index, engine.weight_version = 0, 3

    async def prompt_log_probs(ids):
        return list(engine_log_probs)

    async def answered(value):
        return value

    engine.prompt_log_probs = prompt_log_probs
    engine._keeper = types.SimpleNamespace(
        not_replaced=types.SimpleNamespace(remote=lambda i, why: answered(keeper.not_replaced(i, why)))
    )
    return lambda reference: asyncio.run(engine._check_rejoined(reference))


def test_a_restarted_engine_checks_its_canary_against_the_trainers_before_it_serves():
    """The trainer's log-probs of the canary under the synced weights (kept with them) against the restarted
    engine's: rounding passes and returns the mean |diff| (by hand: 0.001); an engine 0.2 nats off on every token
    (other weights) fails, its restart is named as not replaced with the numbers, and it does not serve. Before
    the first sync there is no reference, and nothing to check."""
    keeper = _keeper(2)
    keeper.hello(0, 100, reconstructed=False)
    keeper.hello(0, 200, reconstructed=True)
    trainer = [-2.0, -0.5, -3.0, -1.25]
    reference = {"ids": [1, 2, 3, 4, 5], "log_probs": trainer, "tol": 0.05, "rel_tol": 0.1}
    check = _restarted_engine([x + 0.001 for x in trainer], keeper)
    assert check(reference) == pytest.approx(0.001, abs=1e-6)  # float32 log-probs, as the engine returns them
    assert check(None) is None
    check = _restarted_engine([x - 0.2 for x in trainer], keeper)
    with pytest.raises(RuntimeError, match=r"vLLM engine 0 restarted and its canary log-probs at weight version 3 "):
        check(reference)
    line = engine_keeper.history_text(keeper.history())
    assert "not replaced: its canary log-probs at weight version 3 are 0.200 nats (mean |diff|; " in line, line
    assert "above --vllm.sync_check_tol 0.05 or --vllm.sync_check_rel_tol 0.1" in line, line


def test_a_restart_that_fails_to_start_is_named_as_such():
    """The new engine said hello and never rejoined (its start failed: Ray leaves the actor dead)."""
    keeper = _keeper(2)
    keeper.hello(0, 100, reconstructed=False)
    keeper.hello(0, 200, reconstructed=True)
    assert keeper.restarting() == [0]
    assert engine_keeper.history_text(keeper.history()).endswith("; not replaced: the restart failed")


def test_a_restart_whose_instance_dies_during_its_start_is_closed_as_failed_and_the_engine_watched_again():
    """Restart 1's new instance (pid 200) dies during its own start (a crash while loading): Ray starts pid 300,
    whose hello closes restart 1 as failed. Only restart 2 is open (the watchdog times the engine again once it
    rejoins), restart 1 used one of the run's 2 (as it used one of Ray's), and both are named in order."""
    keeper = _keeper(2)
    keeper.hello(0, 100, reconstructed=False)
    keeper.hello(0, 200, reconstructed=True)
    told = keeper.hello(0, 300, reconstructed=True)
    assert told["allowed"] is True
    assert keeper.restarting() == [0] and keeper.budget_left() == 0
    keeper.rejoined(0, 300, 0, 20.0)
    assert keeper.restarting() == []
    assert keeper.metrics()["faults/restarts_failed"] == 1.0 and keeper.metrics()["faults/engine_restarts"] == 1.0
    assert engine_keeper.history_text(keeper.history()) == (
        "[1] engine 0 (pid 100): its actor process died (a signal, a crash, or the kernel's memory killer); not "
        "replaced: its new instance (pid 200) died during its start, before it served; "
        "[2] engine 0 (pid 200): its actor process died (a signal, a crash, or the kernel's memory killer); "
        "replaced by pid 300 at weight version 0 in 20.0 s (0 request(s) sent again)"
    )
    assert keeper.hello(0, 400, reconstructed=True)["allowed"] is False  # the budget of 2 is used


def test_a_restart_whose_start_raises_is_closed_once_and_leaves_nothing_open(monkeypatch):
    """Our engine's ``__init__`` on a restart: its start raises (vLLM's free-memory check, say); the keeper is told
    why before the error goes on (Ray then leaves the actor dead), and a second report changes nothing."""
    import asyncio

    from openrlhf_ess.trainer.ray.vllm_engine import RolloutRayActorImpl

    keeper = _keeper(2)
    keeper.hello(0, 100, reconstructed=False)
    engine = object.__new__(RolloutRayActorImpl)

    async def hello():
        engine._keeper = RemoteHandleAsync(keeper)
        return keeper.hello(0, 200, reconstructed=True)

    async def start(*args, **kwargs):
        raise ValueError("Free memory on device (30.1/79.1 GiB) is less than desired GPU memory utilization")

    engine._hello_keeper, engine._start = hello, start
    with pytest.raises(ValueError, match="Free memory on device"):
        asyncio.run(RolloutRayActorImpl.__init__(engine, engine_index=0, replaceable=True))
    assert keeper.restarting() == [] and keeper.overdue(0.0) == []
    keeper.not_replaced(0, "a second report")
    line = engine_keeper.history_text(keeper.history())
    assert line.endswith(
        "not replaced: its start failed (ValueError: Free memory on device (30.1/79.1 GiB) is less "
        "than desired GPU memory utilization)"
    ), line
    assert keeper.metrics()["faults/restarts_failed"] == 1.0


def test_a_rejoined_engine_holds_no_ref_of_the_kept_weights():
    """The refs a restarted engine loaded in its ``__init__`` pin the model in Ray's object store while anything
    holds them; the engine lets them go once it has rejoined, so the keeper's next sync frees the set (at 70B, 140 GB
    a restart would otherwise keep for the engine's life)."""
    import asyncio
    import gc
    import weakref

    from openrlhf_ess.trainer.ray.vllm_engine import RolloutRayActorImpl

    class Ref:  # stands in for a Ray ObjectRef: what pins the object is a live reference to it
        pass

    keeper = _keeper(2)
    keeper.hello(0, 100, reconstructed=False)
    ref = Ref()
    keeper.put_weights(1, [ref])
    alive = weakref.ref(ref)
    del ref
    engine = object.__new__(RolloutRayActorImpl)
    loaded = []

    async def hello():
        engine._keeper = RemoteHandleAsync(keeper)
        return keeper.hello(0, 200, reconstructed=True)

    async def start(*args, **kwargs):
        pass

    async def rejoin(told):
        loaded.append(len(told["refs"]))

    engine._hello_keeper, engine._start, engine._rejoin = hello, start, rejoin
    asyncio.run(RolloutRayActorImpl.__init__(engine, engine_index=0, replaceable=True))
    assert loaded == [1] and engine._restart["version"] == 1 and "refs" not in engine._restart
    keeper.put_weights(2, [])  # the next sync replaces the kept set
    gc.collect()
    assert alive() is None


class RemoteHandleAsync:
    """An actor handle as an async actor sees it: ``await handle.method.remote(...)`` runs the method at once."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)

        async def answered(*args, **kwargs):
            return method(*args, **kwargs)

        return types.SimpleNamespace(remote=answered)


def test_the_keeper_remembers_a_bounded_number_of_task_ids_per_engine():
    keeper = _keeper(1)
    keeper.hello(0, 100, reconstructed=False)
    for i in range(engine_keeper.SEEN_TASKS_PER_ENGINE + 10):
        keeper.started(0, f"t{i}")
    assert len(keeper.seen_tasks[0]) == engine_keeper.SEEN_TASKS_PER_ENGINE
    keeper.hello(0, 101, reconstructed=True)
    keeper.rejoined(0, 101, 0, 1.0)
    keeper.started(0, "t9")  # forgotten (among the 10 oldest): a new call
    keeper.started(0, f"t{engine_keeper.SEEN_TASKS_PER_ENGINE + 9}")  # the newest: sent again
    assert keeper.metrics()["faults/prompts_requeued"] == 1.0


# ---------------------------------------------------------------- every restart has a deadline


def _clocked_keeper(n=2):
    now = [0.0]
    keeper = engine_keeper.EngineKeeperImpl(n, clock=lambda: now[0])
    keeper.hello(0, 100, reconstructed=False)
    keeper.hello(1, 101, reconstructed=False)
    return keeper, now


def test_a_restart_is_due_from_the_kill_until_it_rejoins_and_says_what_it_waits_for():
    keeper, now = _clocked_keeper()
    now[0] = 1000.0
    keeper.stopping(1, "the vLLM engine 1 (RolloutRayActorImpl, pid 101) hung: it had 2 request(s) in flight")
    now[0] = 1299.0
    assert keeper.overdue(300.0) == []
    now[0] = 1300.0
    [due] = keeper.overdue(300.0)
    assert due["engine"] == 1 and due["waited"] == 300.0 and due["cause"].startswith("the vLLM engine 1 (")
    assert due["waiting"] == engine_keeper.WAITING_FOR_PLACEMENT  # Ray never started its new instance
    now[0] = 1310.0
    keeper.hello(1, 201, reconstructed=True)  # the deadline still runs from the kill, not from this start
    now[0] = 1350.0
    [due] = keeper.overdue(300.0)
    assert due["waited"] == 350.0
    assert due["waiting"].startswith("its new instance (pid 201, started 40 s ago) to serve: vLLM's start-up")
    keeper.rejoined(1, 201, 0, 45.0)
    assert keeper.overdue(0.0) == []


def test_an_unannounced_death_is_due_from_its_new_instances_hello():
    keeper, now = _clocked_keeper()
    now[0] = 50.0
    keeper.hello(0, 200, reconstructed=True)  # SIGKILLed: nobody told the keeper before Ray restarted it
    now[0] = 149.0
    assert keeper.overdue(100.0) == []
    now[0] = 150.0
    [due] = keeper.overdue(100.0)
    assert (due["engine"], due["cause"], due["waited"]) == (0, None, 100.0)
    message = engine_keeper.overdue_message(due, 100.0)
    assert message.startswith(
        "vLLM engine 0 was not back 100 s after it went down, past --vllm.restart_timeout_s 100: its actor process "
        "died (a signal, a crash, the kernel's memory killer, or its node); the run waited for its new instance "
        "(pid 200, started 100 s ago) to serve"
    ), message


def test_a_death_the_watchdog_found_is_due_from_the_silence_and_a_known_restart_is_not_reported_again():
    keeper, now = _clocked_keeper(1)
    now[0] = 110.0
    keeper.died(0, 10.0)  # silent since t=100, Ray restarting the actor: its new instance has not said hello
    now[0] = 399.0
    assert keeper.overdue(300.0) == []
    now[0] = 400.0
    [due] = keeper.overdue(300.0)
    assert (due["engine"], due["cause"], due["waited"]) == (0, None, 300.0)
    assert due["waiting"] == engine_keeper.WAITING_FOR_PLACEMENT  # Ray never started its new instance
    keeper.hello(0, 200, reconstructed=True)  # its first word: the deadline still runs from the silence
    assert keeper.down[0]["since"] == 100.0 and keeper.down[0]["pid"] == 200
    now[0] = 420.0
    keeper.rejoined(0, 200, 0, 20.0)
    keeper.died(0, 25.0)  # a report of the same death that reaches the keeper after the restart said hello (t=400)
    assert keeper.down == {} and keeper.overdue(0.0) == []
    now[0] = 500.0
    keeper.died(1, 5.0)  # engine 1 dies past the budget of 1: reported, then its new instance is refused
    assert keeper.down == {1: {"since": 495.0, "cause": None}}
    assert keeper.hello(1, 201, reconstructed=True)["allowed"] is False
    keeper.died(1, 8.0)  # late: the refusal is known
    assert keeper.down == {} and keeper.overdue(0.0) == []


def test_the_auto_deadline_is_three_first_starts_and_at_least_the_floor():
    assert engine_watchdog.restart_deadline(90.0, [500.0]) == 90.0  # given: as given
    assert engine_watchdog.restart_deadline(None, []) == 300.0  # nothing measured yet: the floor
    assert engine_watchdog.restart_deadline(None, [20.0, 50.0]) == 300.0  # 3 x 50 = 150 < 300
    assert engine_watchdog.restart_deadline(None, [20.0, 130.0]) == 390.0  # 3 x the slowest


def test_the_watchdog_stops_the_run_when_a_restart_misses_its_deadline():
    """One engine: first answer at 1 s (its first start: 1 s, so the auto deadline is the 300 s floor), then hung
    with a request in flight; killed for a restart at the 10 s bound; its new instance is never placed (no hello, no
    answer). The watchdog waits for it until 300 s after the kill, then stops it for good, naming it."""
    now = [0.0]
    keeper = engine_keeper.EngineKeeperImpl(1, clock=lambda: now[0])
    keeper.hello(0, 7, reconstructed=False)
    from tests.helpers.one_rank import RemoteHandle

    killed, stopped, out = [], [], []

    def wait(refs, timeout):  # after the kill nothing answers: each wait lasts its whole slice
        if not killed:
            return list(refs)
        now[0] += timeout
        return []

    dog = engine_watchdog.EngineWatchdog(
        ["engine-0"],
        watchdog_s=10.0,
        poll_s=1.0,
        out=out.append,
        stop_engine=stopped.append,
        restart_engine=killed.append,
        ask=lambda engine: ("ask", engine),
        wait=lambda refs, timeout: wait(refs, timeout),
        get=lambda ref: {"pid": 7, "tokens": {"r1": 3}} if isinstance(ref, tuple) else ref,
        clock=lambda: now[0],
        keeper=RemoteHandle(keeper),
    )
    for t in range(1, 12):
        now[0] = float(t)
        dog.tick()
    assert killed == ["engine-0"] and dog.first_starts == {0: 1.0} and dog.deadline() == 300.0
    kill_at = keeper.down[0]["since"]
    message = None
    while message is None:  # each look waits its 1 s for the silent engine
        assert now[0] < kill_at + 302, "the deadline passed without a verdict"
        message = dog.tick()
        assert message is None or now[0] >= kill_at + 300, f"stopped {now[0] - kill_at} s after the kill"
    assert stopped == ["engine-0"] and message == dog.hung
    assert message.startswith(
        "vLLM engine 0 was not back 300 s after it went down, past --vllm.restart_timeout_s 300: the vLLM engine 0 "
        "(RolloutRayActorImpl, pid 7) hung: it had 1 request(s) in flight"
    ), message
    assert "the run waited for Ray to place and start its new instance" in message


# ---------------------------------------------------------------- every engine call turns a dead core into a restart

# The engine calls that can be the first to meet a dead engine core (the controller's, the weight sync's, the sync
# check's), written out here, not read from the package.
CALLS = {
    "generate_responses": ("prompt", "label", types.SimpleNamespace(logprobs=None, extra_args=None), 64, None),
    "pause_generation": (),
    "resume_generation": (),
    "init_process_group": ("127.0.0.1", 1234, 1, 3, "openrlhf", "nccl", False),
    "update_weight": ("w", "bfloat16", [2, 2]),
    "update_weight_cuda_ipc": ("w", "bfloat16", [2, 2], None),
    "reset_prefix_cache": (),
    "prompt_log_probs": ([1, 2, 3],),
    "weight_checksums": (),
    "stage_weights_from_safetensors": (b"",),
    "load_weights_from_safetensors": (b"",),
    "load_weights_from_refs": ([], False, 3),
    "pause_if_serving": (),
}


class _DeadCore:
    """vLLM's AsyncLLM after its engine core died: ``errored``, and every call into it raises (awaited or
    iterated)."""

    errored = True

    def __getattr__(self, name):
        return _DeadCore()

    def __call__(self, *args, **kwargs):
        return _DeadCall()


class _DeadCall:
    def __await__(self):
        raise RuntimeError("EngineDeadError: EngineCore encountered an issue")
        yield  # a generator: awaiting it raises

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise RuntimeError("EngineDeadError: EngineCore encountered an issue")


class _Exited(BaseException):
    pass


def _dead_engine(monkeypatch, replaceable):
    from openrlhf_ess.trainer.ray import vllm_engine

    engine = object.__new__(vllm_engine.RolloutRayActorImpl)
    engine.engine_index, engine.weight_version, engine._inflight = 0, 0, {}
    engine.force_logprobs = engine.report_kept_counts = False
    engine.llm = _DeadCore()
    engine._untracked_generate = _DeadCore()
    engine.executor = _DeadCore()
    told = []
    engine._keeper = (
        types.SimpleNamespace(
            stopping=types.SimpleNamespace(remote=lambda i, cause: told.append((i, cause))),
            started=types.SimpleNamespace(remote=lambda i, task: None),
        )
        if replaceable
        else None
    )
    fake_ray = types.SimpleNamespace(
        get=lambda ref, timeout=None: ref, get_runtime_context=lambda: types.SimpleNamespace(get_task_id=lambda: "t")
    )
    monkeypatch.setattr(vllm_engine, "ray", fake_ray)

    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(vllm_engine.os, "_exit", exit_)
    return engine, told


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_engine_call_that_meets_a_dead_core_ends_the_actor_for_a_replacement(monkeypatch, name):
    import asyncio

    engine, told = _dead_engine(monkeypatch, replaceable=True)
    with pytest.raises(_Exited):
        asyncio.run(getattr(engine, name)(*CALLS[name]))
    assert told == [(0, "its vLLM engine core died (RuntimeError)")]

    engine, told = _dead_engine(monkeypatch, replaceable=False)  # replacement off: the caller gets the error
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        asyncio.run(getattr(engine, name)(*CALLS[name]))
    assert told == []


# ---------------------------------------------------------------- pre-flight


def _args(**over):
    vllm = dict(max_restarts=1, num_engines=1, sync_backend="reload", sync_check_tol=0.05, enable_sleep=False)
    vllm.update(over.pop("vllm", {}))
    algo = dict(prox_mode="recompute")
    algo.update(over.pop("algo", {}))
    train = dict(colocate_all=False)
    train.update(over.pop("train", {}))
    return types.SimpleNamespace(
        vllm=types.SimpleNamespace(**vllm), algo=types.SimpleNamespace(**algo), train=types.SimpleNamespace(**train)
    )


@pytest.mark.parametrize(
    "over, named",
    [
        ({"vllm": {"max_restarts": -1}}, "--vllm.max_restarts must be >= 0"),
        ({"vllm": {"num_engines": 0}}, "it needs --vllm.num_engines >= 1"),
        ({"algo": {"prox_mode": "interrupt"}}, "Use --algo.prox_mode snapshot (exact as well, kept on the trainer)"),
        ({"algo": {"prox_mode": "dedicated"}}, "a dead engine's streams die with it"),
        ({"vllm": {"enable_sleep": True}}, "Drop --vllm.enable_sleep, or --vllm.max_restarts 0"),
        ({"vllm": {"sync_check_tol": 0.0}}, "Leave --vllm.sync_check_tol at its default, or --vllm.max_restarts 0"),
        ({"train": {"colocate_all": True}}, "Drop --train.colocate_all (engines on GPUs of their own), or --vllm."),
        ({"vllm": {"sync_backend": "nccl", "watchdog_s": 0.0}}, "Give --vllm.watchdog_s seconds (default 600), or"),
        ({"vllm": {"sync_backend": "gloo", "watchdog_s": 0.0}}, "turns off the bound that ends that wait"),
    ],
)
def test_replacement_outside_what_it_is_built_for_is_refused_naming_the_flag(over, named):
    from openrlhf_ess.config.validation import _validate_replacement

    with pytest.raises(ConfigError, match=re.escape(named)):
        _validate_replacement(_args(**over))
    _validate_replacement(_args())  # reload, check on: accepted (sync or async: the flag is not read)
    _validate_replacement(_args(algo={"prox_mode": "snapshot"}))
    _validate_replacement(_args(vllm={"max_restarts": 0, "sync_backend": "nccl"}))  # off: nothing to check
    _validate_replacement(_args(vllm={"watchdog_s": 0.0}))  # reload: no collective to wait in
    _validate_replacement(_args(vllm={"max_restarts": 0, "watchdog_s": 0.0, "sync_backend": "nccl"}))
    _validate_replacement(_args(vllm={"max_restarts": 0}, train={"colocate_all": True}))


def test_the_flag_defaults_to_upstreams_fail_fast():
    from openrlhf_ess.cli.train_ppo_ray import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "vllm.max_restarts")
    assert action.default == 0


def test_the_restart_deadline_flag_takes_auto_or_seconds():
    import argparse

    from openrlhf_ess.cli.train_ppo_ray import build_parser
    from openrlhf_ess.config.flags import restart_timeout

    action = next(a for a in build_parser()._actions if a.dest == "vllm.restart_timeout_s")
    assert action.default == "auto" and restart_timeout("auto") is None and restart_timeout("900") == 900.0
    for bad in ("0", "-5", "inf", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected seconds > 0 or 'auto'"):
            restart_timeout(bad)


def test_pre_flight_warns_a_joined_cluster_about_tp_restarts():
    from openrlhf_ess.checks.preflight.flags import _check_replacement_cluster

    def notices(address, tp=2, n=1):
        out = []
        args = types.SimpleNamespace(vllm=types.SimpleNamespace(max_restarts=n, tensor_parallel_size=tp))
        _check_replacement_cluster(args, out, address)
        return out

    [line] = notices("10.0.0.1:6379")
    assert "RAY_process_group_cleanup_enabled=true" in line and "--vllm.tensor_parallel_size 2" in line
    assert notices(None) == [] and notices("10.0.0.1:6379", tp=1) == [] and notices("10.0.0.1:6379", n=0) == []


def test_replacement_keeps_up_to_two_model_copies_on_rank_0s_host():
    """Rank 0's stated peak (checks/resources.py): with replacement the whole set stays in the object store, and a
    sync puts the new set before the keeper lets the last go: 2 M + 3 messages, instead of a message being built (3)
    plus Ray's copy per engine (E); a 10 GiB model, 2 engines."""
    from openrlhf_ess.checks.resources import host_memory_needs
    from openrlhf_ess.trainer.ray.vllm_worker_wrap import RELOAD_MESSAGE_BYTES

    model = 10 << 30
    m = min(model, RELOAD_MESSAGE_BYTES)

    def need(n):
        args = types.SimpleNamespace(
            vllm=types.SimpleNamespace(sync_backend="reload", num_engines=2, tensor_parallel_size=1, max_restarts=n),
            algo=types.SimpleNamespace(prox_mode="recompute"),
        )
        return host_memory_needs(args, model)["actor rank 0 (--vllm.sync_backend reload)"]

    assert need(0) == 5 * m and need(2) == 2 * model + 3 * m


# ---------------------------------------------------------------- the watchdog restarts a hung engine


class _FakeKeeper:
    """Stands in for the keeper actor's handle: ``.method.remote(...)`` returns the answer itself."""

    def __init__(self, budget):
        self.budget, self.causes, self.restarting_now = budget, [], []

        class _Call:
            def __init__(call, fn):
                call.remote = fn

        self.budget_left = _Call(lambda: self.budget)
        self.stopping = _Call(lambda index, cause: self.causes.append((index, cause)))
        self.restarting = _Call(lambda: list(self.restarting_now))
        self.overdue = _Call(lambda timeout_s: [])


def _stalled_watchdog(keeper, restarted, stopped):
    """One engine with one request in flight that never streams: the watchdog's calls answered at once."""
    now = [0.0]
    dog = engine_watchdog.EngineWatchdog(
        ["engine-0"],
        watchdog_s=10.0,
        poll_s=1.0,
        out=lambda msg: None,
        stop_engine=stopped.append,
        restart_engine=restarted.append,
        ask=lambda engine: ("ask", engine),
        wait=lambda refs, timeout: list(refs),
        get=lambda ref: {"pid": 7, "tokens": {"r1": 3}} if isinstance(ref, tuple) else ref,
        clock=lambda: now[0],
        keeper=keeper,
    )
    return dog, now


def test_a_hung_engine_is_restarted_while_the_budget_lasts_then_stops_the_run():
    keeper, restarted, stopped = _FakeKeeper(budget=1), [], []
    dog, now = _stalled_watchdog(keeper, restarted, stopped)
    for t in range(0, 12):
        now[0] = float(t)
        dog.tick()
    assert restarted == ["engine-0"] and stopped == [] and dog.hung is None
    assert keeper.causes[0][0] == 0 and "hung: it had 1 request(s) in flight" in keeper.causes[0][1]
    # the new instance is timed from its first answer: 10 s more without progress before the next verdict
    keeper.budget = 0
    for t in range(12, 21):  # restarted at 10 s, first answer of the new instance at 11 s
        now[0] = float(t)
        dog.tick()
    assert dog.hung is None
    now[0] = 21.0
    dog.tick()
    assert stopped == ["engine-0"] and dog.hung is not None and "--vllm.max_restarts N" in dog.hung


def test_an_engine_that_ray_is_restarting_is_not_timed():
    keeper, restarted, stopped = _FakeKeeper(budget=0), [], []
    dog, now = _stalled_watchdog(keeper, restarted, stopped)
    for t in range(0, 9):
        now[0] = float(t)
        dog.tick()
    keeper.restarting_now = [0]  # its new __init__ said hello: its clock starts again at its first answer
    for t in range(9, 19):
        now[0] = float(t)
        dog.tick()
    assert dog.hung is None and stopped == []


# ---------------------------------------------------------------- the real stack

N_PROMPTS = 24  # three steps of 8 prompts (4 samples each)
# The runs' --vllm.watchdog_s: past it, a request that streams nothing makes the engine a hung one. The engine's first
# request (the start-up canary's) once took over 10 s on a loaded 2-core machine, beside another real-stack run, and
# the watchdog replaced a healthy engine; 30 s leaves that margin (a SIGSTOPped engine is found 30 s after, idle).
WATCHDOG_S = 30


def _replacement_run(tiny_world, tmp_path, max_restarts: int, kills, flags=(), n_prompts=N_PROMPTS):
    """The tiny run (``n_prompts`` / 8 steps) with ``kills`` [(audit file, kind)] made by its reward function
    (``benchmarks/engine_restart.py::KILL_ENGINE_REWARD``)."""
    from benchmarks.engine_restart import write_kill_reward
    from tests.helpers.e2e import tiny_args
    from tests.helpers.faults import run_cli_tracked

    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    reward = write_kill_reward(run_dir, audit, kills)
    args = tiny_args(tiny_world, run_dir, steps_prompts=n_prompts)
    args[args.index("--reward.remote_url") + 1] = reward
    # responses of up to 48 tokens end at different steps, so some are still generating when the first are scored
    args[args.index("--rollout.max_new_tokens") + 1] = "48"
    args[args.index("--data.max_len") + 1] = "96"
    args += ["--vllm.max_restarts", str(max_restarts), "--algo.prox_audit_dir", audit, *flags]
    run = run_cli_tracked(args, run_dir, timeout=900)
    looks = os.path.join(run_dir, "looks")
    assert os.path.exists(looks), "the reward never looked for a kill point: " + run.log[-3000:]
    made = [os.path.join(run_dir, f"killed{n}") for n in range(len(kills))]
    assert all(map(os.path.exists, made)), (open(looks).read(), run.log[-3000:])
    return run, audit, [open(path).read().split() for path in made]


def _step_metrics(log: str) -> dict:
    """The last 'Global step' line's metrics."""
    lines = [line for line in log.splitlines() if "Global step" in line]
    assert lines, log[-3000:]
    return {k: float(v) for k, v in re.findall(r"'(faults/[a-z_]+)': ([0-9.]+)", lines[-1])}


@pytest.mark.real_stack
@pytest.mark.slow
def test_an_engine_killed_mid_rollout_twice_is_replaced_and_every_prompt_is_trained_once(tiny_world, tmp_path):
    """--vllm.max_restarts 2: the engine actor is SIGKILLed in the second rollout and its vLLM engine core in the
    third, each with requests in flight. Both are replaced (new pids, the last sync's version), the run completes
    its three steps with exit 0, the sync check passed on the new engines before their samples were trained, the
    audit trail shows each prompt trained exactly once (4 samples), calls were sent again, and no process is left."""
    from transformers import AutoTokenizer

    from tests.test_resume import _prompt_texts, _trained

    kills = [("batch_v0.pt", "actor"), ("batch_v1.pt", "core")]
    run, audit, killed = _replacement_run(tiny_world, tmp_path, max_restarts=2, kills=kills)
    assert not run.timed_out and run.rc == 0, run.log[-6000:]
    (kind0, pid0, inflight0, *_), (kind1, pid1, inflight1, *cores) = killed
    assert (kind0, kind1) == ("actor", "core") and int(inflight0) > 0 and int(inflight1) > 0 and cores, killed
    replaced = [line for line in run.log.splitlines() if "engine replaced: engine 0" in line]
    assert len(replaced) == 2, run.log[-6000:]
    assert f"(pid {pid0}): its actor process died" in replaced[0] and "at weight version 1 " in replaced[0]
    assert f"(pid {pid1}): its vLLM engine core died (EngineDeadError)" in replaced[1], replaced
    assert "at weight version 2 " in replaced[1], replaced
    checked = [line for line in run.log.splitlines() if "the weight sync check (checksums now, canary)" in line]
    assert len(checked) == 2, run.log[-6000:]
    faults = _step_metrics(run.log)
    assert faults["faults/engine_restarts"] == 2 and faults["faults/prompts_requeued"] >= 2, faults
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    prompts = _prompt_texts(tiny_world["prompts"], N_PROMPTS)
    trained = _trained(audit, tokenizer, list(prompts))
    assert trained == collections.Counter({p: 4 * n for p, n in prompts.items()}), trained
    assert not run.leftovers, run.leftovers
    assert not run.shm_left, f"/dev/shm files of the run left behind: {run.shm_left}"
    seconds = [float(re.search(r" in ([0-9.]+) s$", line).group(1)) for line in replaced]
    print(json.dumps({"restart_seconds": seconds, "requeued": faults["faults/prompts_requeued"]}))


@pytest.mark.real_stack
@pytest.mark.slow
def test_async_partial_rollouts_survive_a_kill_of_each_kind_and_a_hang_with_every_prompt_trained_once(
    tiny_world, tmp_path
):
    """The sync test's two kills (the actor, then the engine core, each mid-rollout) and then a hang (the engine's
    vLLM processes SIGSTOPped with requests in flight, found by the watchdog), in async training with partial
    rollouts and snapshot π_prox (our controllers, the generator in its own actor, syncs that pause the engine with
    requests in flight), four steps: the run completes, the three engines replaced (the hang named by the watchdog)
    and checked, each prompt trained exactly once, nothing left."""
    from transformers import AutoTokenizer

    from tests.test_resume import _prompt_texts, _trained

    kills = [("batch_v0.pt", "actor"), ("batch_v1.pt", "core"), ("batch_v2.pt", "stop")]
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.prox_mode", "snapshot"]
    flags += ["--vllm.watchdog_s", str(WATCHDOG_S)]
    run, audit, killed = _replacement_run(tiny_world, tmp_path, 3, kills, flags=flags, n_prompts=32)
    assert not run.timed_out and run.rc == 0, run.log[-6000:]
    replaced = [line for line in run.log.splitlines() if "engine replaced: engine 0" in line]
    assert len(replaced) == 3, run.log[-6000:]
    pid2 = killed[2][1]
    assert f"(pid {pid2}): the vLLM engine 0 (RolloutRayActorImpl, pid {pid2}) hung" in replaced[2], replaced
    assert len([line for line in run.log.splitlines() if "(checksums now, canary) passed" in line]) >= 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    prompts = _prompt_texts(tiny_world["prompts"], 32)
    assert _trained(audit, tokenizer, list(prompts)) == collections.Counter({p: 4 * n for p, n in prompts.items()})
    assert not run.leftovers, run.leftovers
    assert not run.shm_left, f"/dev/shm files of the run left behind: {run.shm_left}"


@pytest.mark.real_stack
def test_a_hang_is_replaced_then_a_death_past_the_budget_stops_the_run_naming_both(tiny_world, tmp_path):
    """--vllm.max_restarts 1 --vllm.watchdog_s 30: the engine's vLLM processes are SIGSTOPped in the second rollout
    with requests in flight; the watchdog finds the hang within its bound and a look and stops the engine for Ray to
    replace it (its calls sent again, the sync check passed on the new engine, step 2 trains). Then the new engine
    actor is SIGKILLed in the third rollout: the budget is used, Ray's restart is refused, and the run stops with
    exit 1 seconds later. Our one message names the dead engine, then both failures in order (the hang with its
    replacement, the death not replaced); the two steps trained each of their 16 prompts exactly once (the audit
    trail); no process is left (the stopped ones too)."""
    from transformers import AutoTokenizer

    from tests.test_resume import _prompt_texts, _trained

    kills = [("batch_v0.pt", "stop"), ("batch_v1.pt", "actor")]
    run, audit, killed = _replacement_run(tiny_world, tmp_path, 1, kills, flags=["--vllm.watchdog_s", str(WATCHDOG_S)])
    assert not run.timed_out and run.rc == 1, run.log[-6000:]
    (_, pid0, inflight0, *stopped), (_, pid1, *_) = killed
    assert int(inflight0) > 0 and stopped, killed
    stopped_at = os.stat(os.path.join(str(tmp_path), "killed0")).st_mtime
    hung = [line for line in run.log.splitlines() if "stopping it for Ray to replace it" in line]
    said = f"--vllm.watchdog_s {WATCHDOG_S}"
    assert len(hung) == 1 and f"pid {pid0}) hung" in hung[0] and said in hung[0], run.log[-6000:]
    assert "the weight sync check (checksums now, canary) passed on every engine at version 1" in run.log
    faults = _step_metrics(run.log)  # step 2's: after the replacement
    assert faults["faults/engine_restarts"] == 1 and faults["faults/prompts_requeued"] >= 1, faults
    ours = [line for line in run.log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1, run.log[-6000:]
    assert ours[0].startswith(
        "openrlhf-ess: error: a vLLM engine died again during the run and is not replaced: the run's "
        "--vllm.max_restarts 1 replacement(s) are used."
    ), ours
    assert f"[1] engine 0 (pid {pid0}): the vLLM engine 0 (RolloutRayActorImpl, pid {pid0}) hung" in ours[0], ours
    assert f"replaced by pid {pid1} at weight version 1 " in ours[0], ours
    assert f"[2] engine 0 (pid {pid1}): its actor process died" in ours[0], ours
    assert "not replaced: --vllm.max_restarts 1 restart(s) already used" in ours[0], ours
    assert run.ended_at - os.stat(os.path.join(str(tmp_path), "killed1")).st_mtime < 60, run.log[-3000:]
    assert stopped_at < os.stat(os.path.join(str(tmp_path), "killed1")).st_mtime
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    trained = _trained(audit, tokenizer, list(_prompt_texts(tiny_world["prompts"], N_PROMPTS)))
    assert len(trained) == 16 and set(trained.values()) == {4}, trained
    assert not run.leftovers, run.leftovers
    assert not run.shm_left, f"/dev/shm files of the run left behind: {run.shm_left}"
