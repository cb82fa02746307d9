"""The reward file of ``tests/cluster/test_replacement_on_cluster.py`` (``--reward.remote_url``): a constant reward
that, called inside a vLLM engine actor (upstream calls ``reward_func`` there), makes the test's faults at points
of the run's own progress, as the CPU replacement test's reward does (``benchmarks/engine_restart.py::
KILL_ENGINE_REWARD``), adapted to two engines of tensor-parallel size 2 on GPUs.

The test copies this file into the run's inputs folder with ``plan.json`` beside it: ``{"run_dir", "audit", "tp",
"kills": [[audit file, kind], ...]}``. Kill ``n`` happens once (``killed<n>`` in ``run_dir``, created with
``O_EXCL``: two engines call their rewards at once), after kill ``n - 1``, once the audit trail has ``audit file``
(``batch_v<k>.pt``: step k + 1's batch made, so the next reward calls are rollout k + 2's), and only while this
engine has requests in flight in its vLLM (counted in vLLM's output processor, found by the garbage collector:
test-only). Every later kill happens on another engine than the earlier ones (Ray's actor id, which a restarted
engine keeps).

The engine's processes are found by PID, never by name: vLLM's EngineCore is the engine actor's child process
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, which the test sets); with tensor parallelism upstream builds the engine with
vLLM's "ray" executor, so its GPU workers are Ray actors that the EngineCore creates as a Ray driver of its own:
the actors of the Ray job whose driver's PID is a child of this actor, alive, on this node (Ray's control store:
``ray._private.state``; :func:`select_workers`). Kinds:

- ``worker``: SIGKILL of one of those tensor-parallel workers (a GPU process dies: a crash in a kernel, an Xid, the
  kernel's memory killer); the actor and its EngineCore live on, and find out;
- ``stop``: SIGSTOP of the EngineCore and every one of its workers (a stuck kernel or a deadlocked collective as the
  engine's own processes see it): the actor still answers, its requests stop streaming, only the watchdog finds it.

Each kill's marker holds JSON: kind, the engine actor's pid and Ray actor id, its requests in flight, the EngineCore
pid(s), the worker pids and the pids signalled. ``looks`` gets one JSON line per look at a due kill (what it found,
and why it did not act).
"""

import gc
import json
import os
import signal

HERE = os.path.dirname(os.path.abspath(__file__))
PLAN_FILE = "plan.json"

_ENGINE = []
_PLAN = []


def plan() -> dict:
    if not _PLAN:
        with open(os.path.join(HERE, PLAN_FILE)) as f:
            _PLAN.append(json.load(f))
    return _PLAN[0]


def _inflight() -> int:
    if not _ENGINE:  # found once, at the first call in an engine (a search of the heap takes longer than a rollout)
        _ENGINE.extend(obj for obj in gc.get_objects() if type(obj).__name__ == "AsyncLLM")
    return _ENGINE[0].output_processor.get_num_unfinished_requests() if _ENGINE else 0  # 0: pre-flight's dry call


def _engine_children() -> list:
    """The live child processes of this engine actor, multiprocessing's resource tracker left out (with the CPU
    test's rule): vLLM's EngineCore."""
    import psutil

    out = []
    for p in psutil.Process().children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def select_workers(below, jobs, actors, node_id) -> list:
    """The PIDs of the Ray actors owned by a Ray driver among ``below`` (PIDs under this engine actor): the alive
    actors, on ``node_id``, of the jobs whose driver PID is in ``below``. ``jobs``: ``ray._private.state.jobs()``
    (dicts with JobID, DriverPid, IsDead); ``actors``: ``ray._private.state.actors()`` (actor id -> dict with
    JobID, State, Pid, Address.NodeID)."""
    below = set(below)
    owned = {j["JobID"] for j in jobs if j.get("DriverPid") in below and not j.get("IsDead")}
    return sorted(
        a["Pid"]
        for a in actors.values()
        if a.get("JobID") in owned
        and a.get("State") == "ALIVE"
        and a.get("Pid")
        and (a.get("Address") or {}).get("NodeID") == node_id
    )


def _workers(below) -> list:
    import ray
    from ray._private import state

    return select_workers(below, state.jobs(), state.actors(), ray.get_runtime_context().get_node_id())


def _pid() -> int:
    return os.getpid()


def _actor_id() -> str:
    import ray

    return ray.get_runtime_context().get_actor_id() or ""


def _send(pid: int, sig: int) -> None:
    os.kill(pid, sig)


def _look(run_dir: str, entry: dict) -> None:
    with open(os.path.join(run_dir, "looks"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def _claim(path: str):
    try:
        return os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None


def _maybe_kill() -> None:
    p = plan()
    run_dir, earlier = p["run_dir"], []
    for n, (after, kind) in enumerate(p["kills"]):
        marker = os.path.join(run_dir, f"killed{n}")
        if os.path.exists(marker):
            earlier.append(marker)
            continue
        if not os.path.exists(os.path.join(p["audit"], after)):
            return  # not due yet (and no later kill before this one)
        entry = {"kill": n, "kind": kind, "pid": _pid(), "inflight": _inflight()}
        actor = entry["actor_id"] = _actor_id()
        done_here = []
        for path in earlier:
            try:
                with open(path) as f:
                    done_here.append(json.load(f)["actor_id"] == actor)
            except (OSError, ValueError, KeyError):
                done_here.append(True)  # being written by the engine that made it: not this one's turn yet
        if any(done_here):
            return _look(run_dir, {**entry, "skipped": "an earlier kill was made on this engine (or is being made)"})
        if not entry["inflight"]:
            return _look(run_dir, {**entry, "skipped": "no request in flight"})
        core = entry["core"] = _engine_children()
        workers = entry["workers"] = _workers(core)
        if not core or len(workers) != p["tp"]:
            return _look(
                run_dir,
                {**entry, "skipped": f"expected one EngineCore child and {p['tp']} Ray worker actor(s) of its job"},
            )
        fd = _claim(marker)
        if fd is None:
            return _look(run_dir, {**entry, "skipped": "another engine claimed this kill"})
        entry["signalled"] = [workers[-1]] if kind == "worker" else core + workers
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        _look(run_dir, entry)
        for pid in entry["signalled"]:
            _send(pid, signal.SIGKILL if kind == "worker" else signal.SIGSTOP)
        return


def reward_func(queries, prompts, labels):
    import torch

    _inflight()  # the engine found at the first call, as the CPU test's reward does
    _maybe_kill()
    rewards = torch.tensor([0.5] * len(queries))
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
