"""The engine watchdog: a vLLM engine with requests in flight that makes no progress for ``--vllm.watchdog_s``
is declared hung, named, and the run stops (docs/faults.md §1).

Ray raises nothing for an engine that hangs without dying (a stopped or deadlocked EngineCore or worker, a kernel
that never returns): the controller's wait for its rollouts (upstream's ``ray.wait(..., timeout=10)`` loop, and the
weight sync's ``ray.get``) would last forever. The watchdog is a daemon thread on the driver, beside upstream's
``train()``, so it watches every mode alike (sync and async, upstream's controllers and ours). Every ``poll_s`` it
asks each engine for its requests in flight in vLLM and the output tokens each has streamed so far
(``RolloutRayActorImpl.watchdog_progress``). Progress is a request that finished or streamed a token since the last
answer; a new request alone is not. An engine that stops answering the watchdog's call (its actor process stopped,
its event loop blocked) makes no progress either, once it has answered at least once: before its first answer it is
still starting (model load, compile), which the watchdog leaves to the start-up checks.

A silent engine is not always a stopped one: with replacement on, Ray holds the calls of an engine actor that died
(SIGKILL, the kernel's memory killer, a lost node) until its new instance serves, so a dead engine is as silent as
a stopped one. Before it calls a silent engine hung the watchdog asks Ray for the actor's state (:func:`actor_state`):
one that Ray is restarting or has ended died, and did not hang. Its death is the keeper's to name (the new instance is
replaced, or refused past the budget, which stops the run naming every failure); the watchdog tells the keeper when
the silence began (``EngineKeeperImpl.died``), from which the restart's deadline runs, and times the engine again
from the new instance's first answer.

An engine paused for a weight sync (``RolloutRayActorImpl.pause_generation`` marks it until ``resume_generation``;
with partial rollouts the whole sync runs inside that pause) streams nothing by design: its requests in flight are not
timed while it says so, only its silence is (an engine that stops answering). The sync itself is bounded elsewhere
(a death during an NCCL/gloo sync: ``trainer/replacement_sync.py``). The watchdog's call runs in the engine actor's
own Ray concurrency group (``watch``), so it never queues behind the engine's generation calls.

With replacement on (``--vllm.max_restarts``) the same thread holds every restart to its deadline
(``--vllm.restart_timeout_s``, :func:`restart_deadline`): an engine down longer than that, from its death or kill to
its rejoin, is stopped for good and the run stops naming it (``engine_keeper.overdue_message``).

A hung engine is stopped with ``ray.kill``: Ray ends its actor process, and with it the actor's process group
(EngineCore and its workers, ``RAY_process_group_cleanup_enabled``), and fails every pending call on it, so the
controller's wait ends within seconds; ``train()`` then raises ``EngineHung`` (``cli/train_ppo_ray.py``) with the
watchdog's message, like a dead engine's (fail fast, checkpoint intact).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

# The watchdog's look at one engine: how often, from the bound (a tenth of it, within these limits).
POLL_MIN_S = 0.5
POLL_MAX_S = 10.0
WAIT_SLICE_S = 0.5  # the longest the thread waits without looking at its stop flag

# --vllm.restart_timeout_s auto: this many times the slowest first start of the run's engines (from their creation to
# their first answer: vLLM's start-up, model load, KV-cache profiling, CUDA graphs), and at least the floor (which is
# also the deadline before any first start was measured). A restart is such a start plus the last sync's weights
# (docs/faults.md: 15.5-17.1 s restarts against a 13-16 s first start on the CPU tiny run).
RESTART_TIMEOUT_FACTOR = 3.0
RESTART_TIMEOUT_FLOOR_S = 300.0


def restart_deadline(timeout_s: Optional[float], first_starts: Sequence[float]) -> float:
    """Seconds a restart may take from an engine's death or kill to its rejoin: ``--vllm.restart_timeout_s`` when
    given (> 0), else (``auto``, None or 0) :data:`RESTART_TIMEOUT_FACTOR` times the slowest measured first start,
    at least :data:`RESTART_TIMEOUT_FLOOR_S`."""
    if timeout_s:
        return float(timeout_s)
    return max(RESTART_TIMEOUT_FLOOR_S, RESTART_TIMEOUT_FACTOR * max(first_starts, default=0.0))


def actor_state(engine: Any) -> Optional[str]:
    """Ray's state of an engine's actor (``ALIVE``, ``RESTARTING``, ``DEAD``, ...), read from Ray's control store
    with the call Ray's own ``was_current_actor_reconstructed`` makes; None when it cannot be read (then the
    engine's clock alone decides, as before this look)."""
    try:
        from ray._private.state import actors

        return actors(actor_id=engine._actor_id.hex()).get("State") or None
    except Exception:
        return None


def poll_interval(watchdog_s: float) -> float:
    """Seconds between two looks at the engines: a tenth of the bound, within [POLL_MIN_S, POLL_MAX_S]."""
    return min(POLL_MAX_S, max(POLL_MIN_S, watchdog_s / 10.0))


def progressed(before: Dict[str, int], after: Dict[str, int]) -> bool:
    """Whether an engine made progress between two answers (``{request id: output tokens so far}`` each): a
    request of ``before`` finished (gone from ``after``) or streamed more tokens. A request that only appeared in
    ``after`` is work handed to the engine, not work it did."""
    return any(rid not in after or after[rid] > n for rid, n in before.items())


class EngineClock:
    """The watchdog's view of one engine: since when its requests in flight have made no progress.

    ``since`` is the start of the current stretch without progress while the engine has requests in flight (or has
    stopped answering after it first did), else None. ``answer(now, progress)`` takes one answer of
    ``watchdog_progress``; ``silent(asked_at)`` records that the call sent at ``asked_at`` is still unanswered."""

    def __init__(self, index: int):
        self.index = index
        self.pid: Optional[int] = None
        self.tokens: Optional[Dict[str, int]] = None  # the last answer's requests in flight (None: no answer yet)
        self.since: Optional[float] = None
        self.silent_since: Optional[float] = None  # the unanswered call's send time, while one is unanswered
        self.paused = False  # the last answer said: paused for a weight sync

    def answer(self, now: float, progress: Dict[str, Any]) -> None:
        tokens = {str(rid): int(n) for rid, n in progress["tokens"].items()}
        self.pid = progress.get("pid", self.pid)
        self.paused = bool(progress.get("paused", False))
        if not tokens or self.paused:
            self.since = None  # idle, or paused for a sync: nothing it could be doing meanwhile
        elif self.since is None or not self.tokens or progressed(self.tokens, tokens):
            self.since = now
        self.tokens, self.silent_since = tokens, None

    def silent(self, asked_at: float) -> None:
        if self.tokens is None:
            return  # never answered: still starting (its __init__ runs before any call)
        self.silent_since = asked_at if self.silent_since is None else self.silent_since
        if self.since is None:
            self.since = asked_at

    def stalled_for(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since


def hang_cause(clock: EngineClock, stalled_s: float, watchdog_s: float, now: float) -> str:
    """What the watchdog saw of a hung engine: which (index, pid), how long, what it was doing."""
    tokens = clock.tokens or {}
    doing = f"{len(tokens)} request(s) in flight, {sum(tokens.values())} output token(s) streamed by them so far"
    if clock.silent_since is not None:
        what = (
            f"has not answered the watchdog for {now - clock.silent_since:.0f} s (its actor process stopped or its "
            f"event loop blocked); at its last answer it had {doing}"
        )
    else:
        what = f"had {doing}, and none of them streamed a token or finished for {stalled_s:.0f} s"
    return (
        f"the vLLM engine {clock.index} (RolloutRayActorImpl, pid {clock.pid}) hung: it {what}, past "
        f"--vllm.watchdog_s {watchdog_s:g}"
    )


def hang_message(clock: EngineClock, stalled_s: float, watchdog_s: float, now: float) -> str:
    """Our message for a hung engine that stops the run: :func:`hang_cause`, then what to do."""
    return (
        f"{hang_cause(clock, stalled_s, watchdog_s, now)}. The watchdog stopped it (its process group with it) "
        "and the run stops here (fail fast); its in-flight rollouts are lost, the checkpoints written so far are "
        "kept. Find the cause in the engine's output (a deadlocked collective, a stuck kernel, a stopped process; "
        "py-spy dump --pid shows where a live one waits), then restart; to continue from the last checkpoint pass "
        "--ckpt.load_enable. If the engine was only slow (a very long prefill; an engine paused for a weight sync is "
        "not timed), raise --vllm.watchdog_s; with --vllm.max_restarts N a hung engine is replaced instead."
    )


class EngineWatchdog:
    """A daemon thread on the driver: polls ``engines`` every ``poll_s`` and, when one has made no progress for
    ``watchdog_s``, prints our message, stores it in ``hung`` and calls ``stop_engine(engine)`` (``ray.kill``).
    It fires once; a watchdog whose own calls fail (Ray shutting down) never stops the run; a silent engine whose
    actor Ray is restarting or has ended died and is not hung (:meth:`_died`). ``ask``, ``wait``, ``get``, ``state``
    (:func:`actor_state`) and ``clock`` (Ray's calls and the time) are injectable for tests. ``watchdog_s`` 0 with a
    ``keeper``: no hang is timed, only the restarts' deadline (``restart_timeout_s``: seconds, or None for
    :func:`restart_deadline`'s auto)."""

    def __init__(
        self,
        engines: Sequence[Any],
        watchdog_s: float,
        poll_s: Optional[float] = None,
        out: Callable[[str], None] = lambda msg: print(f"[openrlhf-ess] {msg}", flush=True),
        stop_engine: Optional[Callable[[Any], None]] = None,
        ask: Optional[Callable[[Any], Any]] = None,
        wait: Optional[Callable[[List[Any], float], List[Any]]] = None,
        get: Optional[Callable[[Any], Any]] = None,
        clock: Callable[[], float] = time.monotonic,
        keeper: Any = None,
        restart_engine: Optional[Callable[[Any], None]] = None,
        restart_timeout_s: Optional[float] = None,
        state: Optional[Callable[[Any], Optional[str]]] = None,
    ):
        import ray

        self.engines, self.watchdog_s = list(engines), float(watchdog_s)
        self.restart_timeout_s = restart_timeout_s
        bound = self.watchdog_s or restart_deadline(restart_timeout_s, [])
        self.poll_s = poll_interval(bound) if poll_s is None else poll_s
        self.out, self.clock = out, clock
        self.stop_engine = stop_engine or (lambda engine: ray.kill(engine, no_restart=True))
        # --vllm.max_restarts (engine_keeper.py): a hung engine is killed for Ray to restart while the budget lasts
        self.keeper = keeper
        self.restart_engine = restart_engine or (lambda engine: ray.kill(engine, no_restart=False))
        self.ask = ask or (lambda engine: engine.watchdog_progress.remote())
        self.wait = wait or (lambda refs, timeout: ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
        self.get = get or ray.get
        self.state = state or actor_state
        self.clocks = [EngineClock(i) for i in range(len(self.engines))]
        self.created = clock()  # the engines' creation (the watchdog starts right after it)
        self.first_starts: Dict[int, float] = {}  # engine -> seconds from creation to its first answer
        self.hung: Optional[str] = None
        self._pending: Dict[int, tuple] = {}  # engine index -> (ref, asked_at)
        self._gone: set = set()  # engines whose calls fail (dead: Ray's own error stops the run)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="openrlhf-ess-engine-watchdog", daemon=True)

    def start(self) -> "EngineWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=WAIT_SLICE_S + 5)

    def _run(self) -> None:
        while not self._stop.is_set() and self.hung is None:
            started = self.clock()
            try:
                self.tick()
            except Exception as e:  # Ray shutting down: the watchdog never stops a run by its own failure
                if not self._stop.is_set():
                    self.out(f"engine watchdog: a look at the engines failed ({type(e).__name__}: {e}); watching on")
            self._stop.wait(max(0.0, self.poll_s - (self.clock() - started)))

    def tick(self) -> Optional[str]:
        """One look at every engine (waits up to ``poll_s`` for their answers); returns the message if one hung."""
        if self.keeper is not None:
            overdue = self._overdue()
            if overdue is not None:
                return overdue
            # an engine Ray is restarting is starting again: its hang clock waits for its answer (the deadline above
            # bounds the restart itself)
            for index in self.get(self.keeper.restarting.remote()):
                self.clocks[index] = EngineClock(index)
        for index, engine in enumerate(self.engines):
            if index not in self._pending and index not in self._gone:
                self._pending[index] = (self.ask(engine), self.clock())
        ready = self._answered(self.clock() + self.poll_s)
        now = self.clock()
        for index, (ref, asked_at) in list(self._pending.items()):
            if id(ref) not in ready:
                self.clocks[index].silent(asked_at)
                continue
            del self._pending[index]
            try:
                self.clocks[index].answer(now, self.get(ref))
                self.first_starts.setdefault(index, now - self.created)
            except Exception as e:
                self._gone.add(index)  # dead (Ray's error reaches the controller) or no introspection: say so
                if not _actor_gone(e):
                    self.out(f"engine watchdog: engine {index} cannot be watched ({type(e).__name__}: {e})")
        return self._fire(now)

    def _answered(self, deadline: float) -> set:
        """ids of the pending calls answered by ``deadline``, waited for in slices of at most WAIT_SLICE_S so that
        :meth:`stop` (the run's end) never waits a whole look."""
        refs = [ref for ref, _ in self._pending.values()]
        ready: list = []
        while refs:
            ready = self.wait(refs, max(0.0, min(WAIT_SLICE_S, deadline - self.clock())))
            if len(ready) == len(refs) or self.clock() >= deadline or self._stop.is_set():
                break
        return set(map(id, ready))

    def deadline(self) -> float:
        """This run's restart deadline now (:func:`restart_deadline` over the first starts measured so far)."""
        return restart_deadline(self.restart_timeout_s, list(self.first_starts.values()))

    def _overdue(self) -> Optional[str]:
        """A restart past its deadline: the engine stopped for good (Ray fails its calls, the run stops) and the
        message kept in ``hung``."""
        from openrlhf_ess.trainer.ray import engine_keeper

        timeout_s = self.deadline()
        overdue = self.get(self.keeper.overdue.remote(timeout_s))
        if not overdue or self.hung is not None:
            return None
        entry = max(overdue, key=lambda e: e["waited"])
        self.hung = engine_keeper.overdue_message(entry, timeout_s)
        self.out(f"engine watchdog: {self.hung}")
        self.stop_engine(self.engines[entry["engine"]])
        return self.hung

    def _fire(self, now: float) -> Optional[str]:
        if self.watchdog_s <= 0:  # replacement's deadline only (--vllm.watchdog_s 0)
            return None
        stalled = [(c.stalled_for(now), c) for c in self.clocks if c.index not in self._gone]
        due = [(s, c) for s, c in stalled if s >= self.watchdog_s]
        if not due or self.hung is not None:
            return None
        due = [(s, c) for s, c in due if not self._died(c, now)]
        if not due:
            return None
        stalled_s, clock = max(due, key=lambda item: item[0])
        if self.keeper is not None and self.get(self.keeper.budget_left.remote()) > 0:
            cause = hang_cause(clock, stalled_s, self.watchdog_s, now)
            self.out(f"engine watchdog: {cause}; stopping it for Ray to replace it (--vllm.max_restarts)")
            self.get(self.keeper.stopping.remote(clock.index, cause))
            self.restart_engine(self.engines[clock.index])
            self.clocks[clock.index] = EngineClock(clock.index)  # its new instance is starting until it answers
            return None
        self.hung = hang_message(clock, stalled_s, self.watchdog_s, now)
        self.out(f"engine watchdog: {self.hung}")
        self.stop_engine(self.engines[clock.index])
        return self.hung

    def _died(self, clock: EngineClock, now: float) -> bool:
        """Whether an engine due for a hang verdict died instead: it is silent and Ray says its actor is not alive.
        ``RESTARTING``: its new instance is on its way (Ray holds the unanswered calls for it), to be replaced or,
        past the budget, refused by the keeper, whose refusal names every failure; the keeper learns when the silence
        began (the restart's deadline runs from it) and the engine is timed again from its new instance's first
        answer. ``DEAD``: Ray's error reaches the controller and stops the run. An engine that answers without
        progress, or that Ray says is alive (or whose state cannot be read), is left to its clock."""
        if clock.silent_since is None:
            return False
        state = self.state(self.engines[clock.index])
        if state not in ("RESTARTING", "DEAD"):
            return False
        if state == "RESTARTING" and self.keeper is not None:
            self.get(self.keeper.died.remote(clock.index, max(0.0, now - clock.silent_since)))
        self.clocks[clock.index] = EngineClock(clock.index)
        return True


def _actor_gone(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, RayActorError)


class WatchedEngines:
    """Wraps the run's ``create_vllm_engines`` so that the engines it returns are watched from then on
    (``watchdog_s`` > 0; 0 leaves them unwatched for hangs), and, with ``max_restarts`` > 0, creates the run's engine
    keeper first (replacement) and holds every restart to ``restart_timeout_s`` (None: auto). ``hung`` is the
    watchdog's message once it fired; :meth:`failures` the engines' failures before the run's end, in order."""

    def __init__(
        self,
        create: Callable[..., Any],
        watchdog_s: float,
        max_restarts: int = 0,
        restart_timeout_s: Optional[float] = None,
    ):
        self._create, self.watchdog_s, self.max_restarts = create, float(watchdog_s), int(max_restarts)
        self.restart_timeout_s = restart_timeout_s
        self.watchdog: Optional[EngineWatchdog] = None
        self.keeper: Any = None  # --vllm.max_restarts: the run's engine keeper (engine_keeper.py)

    def __call__(self, *args, **kwargs):
        from openrlhf_ess.trainer.ray import engine_keeper

        self.keeper = engine_keeper.create(self.max_restarts)  # before the engines: each tells it of its start
        engines = self._create(*args, **kwargs)
        if engines and (self.watchdog_s > 0 or self.keeper is not None):  # hangs, and every restart's deadline
            self.watchdog = EngineWatchdog(
                engines, self.watchdog_s, keeper=self.keeper, restart_timeout_s=self.restart_timeout_s
            ).start()
        return engines

    @property
    def hung(self) -> Optional[str]:
        return None if self.watchdog is None else self.watchdog.hung

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def failures(self) -> Optional[str]:
        """The engines' failures and replacements so far, in order (replacement on), or None."""
        from openrlhf_ess.trainer.ray import engine_keeper

        return engine_keeper.history_or_none(self.keeper)
