"""Engine replacement (``--vllm.max_restarts N``): a dead or hung vLLM engine is restarted in place, given the
trainer's current weights, and verified before anything it generated is trained (docs/faults.md §1).

How, in four parts:

- **Ray restarts the actor.** The engines are created with Ray's ``max_restarts=N + 1`` (the keeper, not Ray, enforces
  the run's N) and ``max_task_retries=-1``.
  When an engine's actor process dies (killed, OOM, a segfault), or exits on purpose because its vLLM engine core
  died (``RolloutRayActorImpl`` exits on vLLM's ``EngineDeadError``), or the watchdog kills a hung one
  (``engine_watchdog.py``), Ray ends the process group (EngineCore and workers, their GPU memory with them), starts
  the actor again on the same placement bundle with the same arguments, and sends it again every call that was in
  flight on the dead one. The callers (upstream's generator, the weight sync) see no error: each prompt's
  ``generate_responses`` runs once more on the new engine, from its first token (a half-made response dies with the
  engine and is never trained), and returns once.
- **The keeper holds the weights a new engine needs.** With replacement on, the reload sync puts its safetensors
  messages in Ray's object store once (every engine loads the same objects) and gives them to this actor *before*
  the engines load them, with the version they become; upstream's NCCL/gloo sync keeps the same set before its
  broadcast (``WeightSync.broadcast_replaceable``) and forms its group again at the next sync after a restart. A
  restarted engine's ``__init__`` (Ray's ``was_current_actor_reconstructed``) loads them, and the version, before it
  serves a call. Cost: one host copy of the model in Ray's object store on the trainer's rank-0 node, kept from one
  sync to the next.
- **The budget.** ``N`` restarts for the whole run, over all engines. A restart past it is refused in the new engine's
  ``__init__``: the actor stays dead, its calls fail, and the run stops with every failure named in order. A restart
  whose new instance died during its own start (before it served) is closed as failed and uses one of the ``N``, as
  it used one of Ray's restarts.
- **The deadline.** From an engine's death or kill (for a death nobody announced, the start of the silence in which
  the watchdog found Ray restarting it, or its new instance's first word if that came first) to its rejoin, at most
  ``--vllm.restart_timeout_s``: the watchdog asks :meth:`EngineKeeperImpl.overdue` at each look and stops the run
  past it, naming the engine, the cause and what it waited for (:func:`overdue_message`).
- **The check.** A restarted engine compares its canary log-probs with the trainer's under the weights it loaded
  (kept here with them) before it serves a call, and fails its restart if they differ; and its samples are not
  trained until the weight sync check (per-tensor checksums taken now, and the canary's log-probs against the
  trainer's forward) has passed on every engine (the controller asks :meth:`EngineKeeperImpl.unverified` before each
  training step).

The keeper also counts the calls that ran again on a new engine (a retried call keeps its Ray task id), for
``faults/prompts_requeued``.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Dict, List, Optional

import ray

# The keeper's name in the run's Ray namespace (each job has its own unless one is given, so runs that share a
# cluster never share a keeper).
KEEPER_NAME = "openrlhf-ess-engine-keeper"

# The calls a restart sends again are those in flight on the dead engine: at most its actor's concurrency (Ray's
# default for an async actor: 1,000). The keeper remembers this many task ids per engine, the newest, so that its
# memory stays bounded over a long run.
SEEN_TASKS_PER_ENGINE = 4096

# What a restart waits for, by how far it got (the deadline's message).
WAITING_FOR_PLACEMENT = (
    "Ray to place and start its new instance (it never said hello: its placement bundle's node may be gone, or no "
    "GPU of the bundle is free)"
)


def restart_line(event: Dict[str, Any], requeued: bool = True) -> str:
    """One failure and its replacement, for the log and the final error (with the calls sent again, when
    ``requeued``: they are known only once they have started on the new engine)."""
    cause = event.get("cause") or "its actor process died (a signal, a crash, or the kernel's memory killer)"
    line = f"engine {event['engine']} (pid {event.get('old_pid', '?')}): {cause}"
    if event.get("new_pid") is None:
        return line + f"; not replaced: {event.get('refused', 'the restart failed')}"
    line += f"; replaced by pid {event['new_pid']} at weight version {event['version']} in {event['seconds']:.1f} s"
    if event.get("canary") is not None:
        line += f", its canary {event['canary']:.2e} nats from the trainer's"
    return line + (f" ({event['requeued']} request(s) sent again)" if requeued else "")


# In the error a restarted engine raises past the budget (``RolloutRayActorImpl._hello_keeper``); the driver finds it
# under Ray's creation-task error and names the run's failures instead (``cli/train_ppo_ray.py``).
REFUSED = "died again and is not replaced"


def used_up_message(engines_failures: str, max_restarts: int) -> str:
    """The run's last line when a restart past ``--vllm.max_restarts`` was refused."""
    return (
        f"a vLLM engine died again during the run and is not replaced: the run's --vllm.max_restarts {max_restarts} "
        "replacement(s) are used. The run stops here; the checkpoints written so far are kept. Engine failures of "
        f"this run, in order: {engines_failures}. Find their causes in the engines' output above, then restart; to "
        "continue from the last checkpoint pass --ckpt.load_enable; a larger --vllm.max_restarts allows more "
        "replacements."
    )


def overdue_message(entry: Dict[str, Any], timeout_s: float) -> str:
    """The run's last line when a restart is past its deadline (``--vllm.restart_timeout_s``): the engine, the cause
    of its restart, how long it has been down and what the run waited for."""
    cause = entry.get("cause") or "its actor process died (a signal, a crash, the kernel's memory killer, or its node)"
    return (
        f"vLLM engine {entry['engine']} was not back {entry['waited']:.0f} s after it went down, past "
        f"--vllm.restart_timeout_s {timeout_s:g}: {cause}; the run waited for {entry['waiting']}. The watchdog "
        "stopped it for good and the run stops here; the checkpoints written so far are kept. Look for what holds "
        "the engine's placement (a lost node, GPUs a stuck process still holds, vLLM's start-up log of the new "
        "instance), then restart; to continue from the last checkpoint pass --ckpt.load_enable; a larger "
        "--vllm.restart_timeout_s waits longer for a slow start."
    )


def history_text(events: List[Dict[str, Any]]) -> str:
    """Every engine failure of the run, in order, numbered."""
    return "; ".join(f"[{i}] {restart_line(e)}" for i, e in enumerate(events, 1))


class EngineKeeperImpl:
    """The run's record of its engines for replacement: the last sync's weights (object refs) and version, each
    engine's pid, the restart budget, the failures in order, the calls sent again, and which replaced engines the
    trainer has not verified yet. One small actor, called by the engines, rank 0's weight sync, the watchdog and the
    controller; its calls are short, so it never holds a caller up."""

    def __init__(self, max_restarts: int, clock: Callable[[], float] = time.time):
        self.max_restarts = int(max_restarts)
        self.clock = clock
        self.version = 0
        self.refs: List[Any] = []  # the last sync's safetensors messages, in order (the last one loads)
        self.canary: Optional[Dict[str, Any]] = None  # the trainer's canary log-probs of those weights, and bounds
        self.pids: Dict[int, int] = {}
        self.events: List[Dict[str, Any]] = []  # failures in order (restart_line)
        self.causes: Dict[int, str] = {}  # engine -> why it was stopped (the watchdog's message), until it is back
        self.unchecked: List[int] = []  # replaced engines whose weights the trainer has not checked yet
        # engine -> Ray task ids of the calls started on it (any instance), the last SEEN_TASKS_PER_ENGINE only
        self.seen_tasks: Dict[int, "collections.OrderedDict[str, None]"] = {}
        self.requeued = 0
        # engine -> since when it is down (its death or kill as first known), why, and its new instance's pid once
        # that said hello; until it rejoins or its restart ends (the deadline, :meth:`overdue`)
        self.down: Dict[int, Dict[str, Any]] = {}

    # ---- weights ----------------------------------------------------------------------------------------------

    def put_weights(self, version: int, refs: List[Any], canary: Optional[Dict[str, Any]] = None) -> None:
        """Rank 0's sync, before the engines get them: the messages of ``version`` (their refs, in a list so Ray
        hands them over as refs) and the trainer's canary under them (``WeightSync.canary_reference``)."""
        self.version, self.refs, self.canary = int(version), list(refs), canary

    # ---- engines ----------------------------------------------------------------------------------------------

    def hello(self, engine: int, pid: int, reconstructed: bool) -> Dict[str, Any]:
        """An engine's ``__init__`` starts (first start or restart). A restart within the budget is told the weights
        to load and their version; past it, it is told why not (it raises, and Ray leaves the actor dead)."""
        if not reconstructed:
            self.pids[engine] = pid
            return {"allowed": True}
        # An earlier restart of this engine still open: its new instance died during its start (Ray restarts it
        # again): closed as failed, so that the engine is watched again once this one serves.
        for stale in self._open(engine):
            self._close_failed(
                stale,
                "its new instance (pid {}) died during its start, before it served".format(
                    stale.get("pid_started", "?")
                ),
            )
        old_pid = self.pids.get(engine)
        self.pids[engine] = pid
        now = self.clock()
        event = {"engine": engine, "old_pid": old_pid, "cause": self.causes.pop(engine, None), "new_pid": None}
        event["hello_at"] = now  # a death the watchdog reports later is this one (:meth:`died`)
        self.events.append(event)
        if self._used() >= self.max_restarts:  # the new event is neither begun nor done yet
            event["refused"] = f"--vllm.max_restarts {self.max_restarts} restart(s) already used"
            self.down.pop(engine, None)  # the actor stays dead: Ray's error stops the run
            return {"allowed": False, "history": history_text(self.events), "max_restarts": self.max_restarts}
        event.update(restarting=True, started=now, pid_started=pid)
        down = self.down.setdefault(engine, {"since": now, "cause": event["cause"]})
        down.update(pid=pid, hello_at=now)
        return {"allowed": True, "version": self.version, "refs": self.refs, "canary": self.canary}

    def rejoined(self, engine: int, pid: int, version: int, seconds: float, canary: Optional[float] = None) -> str:
        """A restarted engine holds ``version``, passed the canary (its mean |Δ log p| against the trainer's, None
        before the first sync) and is about to serve: its event is complete."""
        event = next(e for e in reversed(self.events) if e["engine"] == engine and e.get("restarting"))
        event.update(new_pid=pid, version=int(version), seconds=float(seconds), requeued=0, restarting=False)
        event["canary"] = canary
        self.down.pop(engine, None)
        self.unchecked.append(engine)
        line = restart_line(event, requeued=False)
        print(f"[openrlhf-ess] engine replaced: {line}", flush=True)
        return line

    def started(self, engine: int, task_id: str) -> None:
        """A ``generate_responses`` call started on ``engine``. A task id seen before on it is a call Ray sent again
        after a restart: counted against the engine's last replacement."""
        seen = self.seen_tasks.setdefault(engine, collections.OrderedDict())
        if task_id in seen:
            self.requeued += 1
            for event in reversed(self.events):
                if event["engine"] == engine and "requeued" in event:
                    event["requeued"] += 1
                    break
        else:
            seen[task_id] = None
            while len(seen) > SEEN_TASKS_PER_ENGINE:
                seen.popitem(last=False)

    def not_replaced(self, engine: int, why: str) -> None:
        """A restarted engine's ``__init__`` failed (its canary, or any error of its start): its restart is closed as
        failed and named in its failure's line. A second call for the same restart changes nothing."""
        for event in self._open(engine):
            self._close_failed(event, why)
        self.down.pop(engine, None)  # the actor is dead for good (its __init__ raised): Ray's error stops the run

    def stopping(self, engine: int, cause: str) -> None:
        """Why an engine is about to go (the watchdog kills a hung one; an engine whose core died ends itself), for
        its failure's line; its restart's deadline runs from now."""
        self.causes[engine] = cause
        self.down.setdefault(engine, {"since": self.clock()})["cause"] = cause

    def died(self, engine: int, silent_s: float) -> None:
        """The watchdog found ``engine`` silent for ``silent_s`` seconds and Ray restarting its actor: a death nobody
        announced (a signal, the kernel's memory killer, a lost node). Its restart's deadline runs from the start of
        that silence, also when its new instance never says hello (a placement never made). Nothing changes when the
        engine is already down, or a new instance of it said hello since (that restart is already known: admitted,
        refused past the budget, or done)."""
        since = self.clock() - float(silent_s)
        if engine in self.down or any(e["engine"] == engine and e["hello_at"] >= since for e in self.events):
            return
        self.down[engine] = {"since": since, "cause": None}

    def overdue(self, timeout_s: float) -> List[Dict[str, Any]]:
        """Engines down for ``timeout_s`` or more without rejoining (``--vllm.restart_timeout_s``), each with how long
        (``waited``), the cause and what the run waits for (``waiting``), for :func:`overdue_message`."""
        now, out = self.clock(), []
        for engine, down in sorted(self.down.items()):
            waited = now - down["since"]
            if waited < timeout_s:
                continue
            if down.get("pid") is None:
                waiting = WAITING_FOR_PLACEMENT
            else:
                waiting = (
                    f"its new instance (pid {down['pid']}, started {now - down['hello_at']:.0f} s ago) to serve: "
                    "vLLM's start-up (with tensor parallelism, its worker actors placed and started), the last "
                    "sync's weights loaded and its canary checked"
                )
            out.append({"engine": engine, "cause": down.get("cause"), "waited": waited, "waiting": waiting})
        return out

    def _open(self, engine: int) -> List[Dict[str, Any]]:
        return [e for e in self.events if e["engine"] == engine and e.get("restarting")]

    @staticmethod
    def _close_failed(event: Dict[str, Any], why: str) -> None:
        event.update(restarting=False, failed=True)
        event.setdefault("refused", why)

    # ---- the trainer and the driver ---------------------------------------------------------------------------

    def _used(self) -> int:
        """Restarts begun, done or failed (a new instance that died or raised during its start used one of Ray's
        restarts, so it uses one of the run's: Ray's limit, one above, then still leaves the last refusal to the
        keeper, which names it); a refused one is not a restart used."""
        return sum(1 for e in self.events if e.get("new_pid") is not None or e.get("restarting") or e.get("failed"))

    def budget_left(self) -> int:
        return self.max_restarts - self._used()

    def used(self) -> int:
        """Restarts begun or done so far: rank 0 forms its NCCL/gloo group again when this grew since it last did
        (``WeightSync.regroup_if_replaced``)."""
        return self._used()

    def unverified(self) -> List[int]:
        """Replaced engines the trainer has not checked since; the list is emptied (the caller checks them now)."""
        out, self.unchecked = sorted(set(self.unchecked)), []
        return out

    def restarting(self) -> List[int]:
        """Engines whose restart has begun (their new ``__init__`` said hello) and not finished."""
        return [e["engine"] for e in self.events if e.get("restarting")]

    def metrics(self) -> Dict[str, float]:
        done = [e for e in self.events if e.get("new_pid") is not None]
        return {
            "faults/engine_restarts": float(len(done)),
            "faults/restart_seconds": float(sum(e["seconds"] for e in done)),
            "faults/prompts_requeued": float(self.requeued),
            "faults/restarts_failed": float(sum(1 for e in self.events if e.get("failed"))),
        }

    def history(self) -> List[Dict[str, Any]]:
        return list(self.events)


EngineKeeper = ray.remote(num_cpus=0)(EngineKeeperImpl)


def create(max_restarts: int):
    """The run's keeper (driver, before the engines are created), or None with replacement off."""
    if max_restarts <= 0:
        return None
    return EngineKeeper.options(name=KEEPER_NAME).remote(max_restarts)


def find() -> Any:
    """The run's keeper, from an actor of the run (an engine, rank 0)."""
    return ray.get_actor(KEEPER_NAME)


def history_or_none(keeper, timeout_s: float = 5.0) -> Optional[str]:
    """The run's failures so far, for the driver's final error; None when there were none or the keeper is gone."""
    if keeper is None:
        return None
    try:
        events = ray.get(keeper.history.remote(), timeout=timeout_s)
    except Exception:
        return None
    return history_text(events) if events else None
