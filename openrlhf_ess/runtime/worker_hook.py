"""Ray's ``worker_process_setup_hook`` for every run of the CLI (``cli/ray_start.py::runtime_env``).

The hook runs in each Ray worker process at start-up, **before** Ray sets the ``CUDA_VISIBLE_DEVICES`` of the
actor that the process will host. Anything that initialises CUDA here (``torch.cuda.is_available()``,
``device_count()``, importing DeepSpeed, whose accelerator probe calls both) fixes the process's device list
to the node's full set; upstream then sets ``LOCAL_RANK=0`` and ``set_device(0)``, and every actor of the node
lands on physical GPU 0. So this module imports only :mod:`openrlhf_ess.runtime.cpu_compat`, whose
decision never calls into CUDA and which imports nothing more on a CUDA run; ``tests/test_worker_hook.py``
runs the hook in a fresh process with every CUDA entry point instrumented and fails on any call.
"""

from __future__ import annotations

import functools
import sys

from openrlhf_ess.runtime import cpu_compat


def setup_worker() -> None:
    """The CPU patches (on a CPU run only), and no "Exception ignored" traceback at teardown: neither Ray's
    SystemExit in a finalizer (below) nor wandb's service teardown (:func:`end_wandb_service_with_its_run`).

    Ray's worker SIGTERM handler raises SystemExit. At the end of a run (upstream's trainer actor going out
    of scope, then ray.shutdown()) it can land inside a finalizer such as ``ActorHandle.__del__``, where Python
    cannot raise it: it prints "Exception ignored in ... SystemExit: 1" with a traceback instead, and the
    process exits all the same. Measured: 1 in ~7 async runs with two actor ranks ended with that traceback.
    """
    cpu_compat.apply()
    previous = sys.unraisablehook

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, SystemExit):
            previous(unraisable)

    sys.unraisablehook = hook
    cpu_compat.after_import("wandb", end_wandb_service_with_its_run)  # nothing imported until a run imports wandb


def end_wandb_service_with_its_run() -> None:
    """Make ``Run.finish()`` also end wandb's service process (``wandb.teardown()``) once no run of the process is
    left, instead of leaving that to wandb's atexit hook.

    Why: when upstream's trainer actor ends (its handle released at the end of ``train()``), Ray's core worker
    SIGKILLs the actor's child processes and only then lets Python exit (measured: a child of an actor is dead
    with -9 when the actor's atexit hooks run). wandb-core is such a child, so wandb's atexit teardown writes to a
    dead socket and prints "Exception ignored in atexit callback ... ConnectionResetError: Connection lost". It
    happens whenever the actor's exit wins the race with ``ray.shutdown()`` (seen in CI; GPU clusters alike).
    Ending the service while the run still holds it flushes everything first and unregisters that atexit hook
    (``wandb.teardown``'s documented use where atexit "is not reliable"). What the run logged is unchanged."""
    import wandb
    from wandb.sdk import wandb_run

    original = wandb_run.Run.finish
    if getattr(original, "__openrlhf_ess_patch__", False):
        return

    @functools.wraps(original)
    def finish(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        # No run of this process is left to log (wandb's own list of active runs, which also holds runs made with
        # reinit="create_new"; wandb.run where that list is gone): the service has no more work.
        left = getattr(getattr(self, "_wl", None), "most_recent_active_run", wandb.run)  # a property
        if left is None:
            wandb.teardown()
        return result

    finish.__openrlhf_ess_patch__ = True
    wandb_run.Run.finish = finish
