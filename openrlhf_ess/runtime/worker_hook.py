"""Ray's ``worker_process_setup_hook`` for every run of the CLI (``cli/train_ppo_ray.py::_runtime_env``).

The hook runs in each Ray worker process at start-up, **before** Ray sets the ``CUDA_VISIBLE_DEVICES`` of the
actor that the process will host. Anything that initialises CUDA here (``torch.cuda.is_available()``,
``device_count()``, importing DeepSpeed, whose accelerator probe calls both) fixes the process's device list
to the node's full set; upstream then sets ``LOCAL_RANK=0`` and ``set_device(0)``, and every actor of the node
lands on physical GPU 0 (issue 20, item 1). So this module imports only :mod:`openrlhf_ess.runtime.cpu_compat`, whose
decision never calls into CUDA and which imports nothing more on a CUDA run; ``tests/test_worker_hook.py``
runs the hook in a fresh process with every CUDA entry point instrumented and fails on any call.
"""

from __future__ import annotations

import sys

from openrlhf_ess.runtime import cpu_compat


def setup_worker() -> None:
    """The CPU patches (on a CPU run only), and no "Exception ignored" traceback at teardown.

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
