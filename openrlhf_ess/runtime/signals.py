"""The driver's SIGTERM and SIGHUP: one clean exit from the first line of ``main()`` to the last.

What schedulers send: Slurm (``scancel``, a time limit) and Kubernetes send SIGTERM, then SIGKILL after a grace
period; a closed terminal sends SIGHUP. Each must take the path Ctrl-C takes: the exception unwinds ``train()``
(Ray shut down, its actors and vLLM's processes ended), the run lock is released, the run's /dev/shm files are
removed (``shm_cleanup``, at exit), and the exit code says which signal ended the run (128 + its number).

Why a module of its own: ``ray.init()`` replaces the driver's SIGTERM handler twice. First with a Python handler
(``sys.exit(15)``), then, when it creates the driver's core worker, with Abseil's C++ failure-signal handler, which
prints ``*** SIGTERM received at time=... ***``, calls the previous handler and arms ``alarm(3)``: a clean-up that
takes longer than 3 s (Ray's shutdown, waiting for the engines to exit) is cut by SIGALRM and the driver aborts
(exit 134) with the run's /dev/shm files left. Measured with Ray 2.55: a SIGTERM after ``ray.init`` followed by
5 s of clean-up exits 134; the same with our handler put back after ``ray.init`` exits 143 with the clean-up
done. Whether a run cleaned up therefore depended on when the signal came; :func:`ray_init` removes that.
"""

import contextlib
import signal
import sys

# The signals that stop a run cleanly. SIGINT keeps Python's own KeyboardInterrupt (same path, a traceback).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_state = {"received": None, "finished": False}
_at_stop: list = []  # what a stopped run must still do when Ray's shutdown cannot be relied on (at_stop)


class Stopped(SystemExit):
    """Raised in the main thread by the first SIGTERM/SIGHUP; its exit code is 128 + the signal's number (the
    shell's convention, what Slurm and Kubernetes report). A ``SystemExit``: no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _say(line: str) -> None:
    print(f"[openrlhf-ess] {line}", file=sys.stderr, flush=True)


def _handler(signum, frame) -> None:
    name = signal.Signals(signum).name
    if _state["received"] is not None or _state["finished"]:
        # A second signal (Slurm signals every process of the step; a user presses twice), or one during the
        # clean-up after main() returned: raising again would cut the clean-up short. SIGKILL remains.
        _say(f"{name} received while stopping: the clean-up goes on (SIGKILL ends it at once, leaving files).")
        return
    _state["received"] = signum
    _say(
        f"{name} received: stopping the run. Ray's actors and vLLM's processes are ended and the run's /dev/shm "
        "files removed; a checkpoint being written stays incomplete and --ckpt.load_enable resumes from the "
        "newest complete one."
    )
    raise Stopped(signum)


def install() -> None:
    """Our handler for SIGTERM and SIGHUP (main thread only; a no-op elsewhere, where Python cannot set one)."""
    if not _is_main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)


def finished() -> None:
    """``main()`` has returned or is unwinding: a signal from now on only says the clean-up goes on."""
    _state["finished"] = True


def at_stop(fn) -> None:
    """Register ``fn`` for :func:`exit_now` (e.g. the run lock's release): run in registration order."""
    _at_stop.append(fn)


def exit_now(before=()) -> None:
    """End this process after a stop signal without Ray: ``before`` (callables), then the :func:`at_stop`
    functions, then ``os._exit(128 + signal)``. Used when the run's processes have been ended by PID, so that
    ``ray.shutdown()`` (and Ray's atexit hook), which ends the process at once with exit code 1 and no further
    clean-up when its raylet is gone, never runs."""
    import os

    for fn in list(before) + _at_stop:
        try:
            fn()
        except Exception as e:  # one failed step must not keep the others from running
            _say(f"clean-up step {getattr(fn, '__name__', fn)} failed: {e}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + _state["received"])


def received():
    """The signal that stopped this run (``signal.Signals``), or None."""
    return None if _state["received"] is None else signal.Signals(_state["received"])


@contextlib.contextmanager
def ray_init():
    """Wrap every ``ray.init()`` of the driver: ours again as soon as it returns, however it returns.

    A signal that lands inside ``ray.init`` after Ray's core worker exists reaches Abseil's handler, which chains
    to Ray's Python one (``sys.exit(signum)``) and arms a 3-second alarm; the alarm is cancelled here and the exit
    becomes ours (message, exit code) before the clean-up starts."""
    try:
        yield
    except SystemExit as e:
        if not isinstance(e, Stopped) and e.code in STOP_SIGNALS:  # Ray's driver handler: sys.exit(signum)
            try:
                _handler(e.code, None)
            except Stopped as ours:
                raise ours from None
        raise
    finally:
        signal.alarm(0)  # Abseil's watchdog, armed if a signal reached its handler; we use no alarm ourselves
        install()


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
