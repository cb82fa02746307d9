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


# ---------------------------------------------------------------- pre-flight


def _args(**over):
    vllm = dict(max_restarts=1, num_engines=1, sync_backend="reload", sync_check_tol=0.05, enable_sleep=False)
    vllm.update(over.pop("vllm", {}))
    algo = dict(prox_mode="recompute")
    algo.update(over.pop("algo", {}))
    return types.SimpleNamespace(vllm=types.SimpleNamespace(**vllm), algo=types.SimpleNamespace(**algo))


@pytest.mark.parametrize(
    "over, named",
    [
        ({"vllm": {"max_restarts": -1}}, "--vllm.max_restarts must be >= 0"),
        ({"vllm": {"num_engines": 0}}, "it needs --vllm.num_engines >= 1"),
        ({"algo": {"prox_mode": "interrupt"}}, "Use --algo.prox_mode snapshot (exact as well, kept on the trainer)"),
        ({"algo": {"prox_mode": "dedicated"}}, "a dead engine's streams die with it"),
        ({"vllm": {"enable_sleep": True}}, "Drop --vllm.enable_sleep, or --vllm.max_restarts 0"),
        ({"vllm": {"sync_check_tol": 0.0}}, "Leave --vllm.sync_check_tol at its default, or --vllm.max_restarts 0"),
    ],
)
def test_replacement_outside_what_it_is_built_for_is_refused_naming_the_flag(over, named):
    from openrlhf_ess.config.validation import _validate_replacement

    with pytest.raises(ConfigError, match=re.escape(named)):
        _validate_replacement(_args(**over))
    _validate_replacement(_args())  # reload, check on: accepted (sync or async: the flag is not read)
    _validate_replacement(_args(algo={"prox_mode": "snapshot"}))
    _validate_replacement(_args(vllm={"max_restarts": 0, "sync_backend": "nccl"}))  # off: nothing to check


def test_the_flag_defaults_to_upstreams_fail_fast():
    from openrlhf_ess.cli.train_ppo_ray import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "vllm.max_restarts")
    assert action.default == 0


def test_replacement_keeps_one_model_copy_on_rank_0s_host():
    """Rank 0's stated peak (checks/resources.py): with replacement the whole set stays in the object store, M + 3
    messages, instead of a message being built (3) plus Ray's copy per engine (E); a 10 GiB model, 2 engines."""
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

    assert need(0) == 5 * m and need(2) == model + 3 * m


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
    flags += ["--vllm.watchdog_s", "10"]
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
    """--vllm.max_restarts 1 --vllm.watchdog_s 10: the engine's vLLM processes are SIGSTOPped in the second rollout
    with requests in flight; the watchdog finds the hang within its bound and a look and stops the engine for Ray to
    replace it (its calls sent again, the sync check passed on the new engine, step 2 trains). Then the new engine
    actor is SIGKILLed in the third rollout: the budget is used, Ray's restart is refused, and the run stops with
    exit 1 seconds later. Our one message names the dead engine, then both failures in order (the hang with its
    replacement, the death not replaced); the two steps trained each of their 16 prompts exactly once (the audit
    trail); no process is left (the stopped ones too)."""
    from transformers import AutoTokenizer

    from tests.test_resume import _prompt_texts, _trained

    kills = [("batch_v0.pt", "stop"), ("batch_v1.pt", "actor")]
    run, audit, killed = _replacement_run(tiny_world, tmp_path, 1, kills, flags=["--vllm.watchdog_s", "10"])
    assert not run.timed_out and run.rc == 1, run.log[-6000:]
    (_, pid0, inflight0, *stopped), (_, pid1, *_) = killed
    assert int(inflight0) > 0 and stopped, killed
    stopped_at = os.stat(os.path.join(str(tmp_path), "killed0")).st_mtime
    hung = [line for line in run.log.splitlines() if "stopping it for Ray to replace it" in line]
    assert len(hung) == 1 and f"pid {pid0}) hung" in hung[0] and "--vllm.watchdog_s 10" in hung[0], run.log[-6000:]
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
