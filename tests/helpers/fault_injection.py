"""TEST-ONLY: faults injected into a real run of our CLI from outside the package.

Each fault is switched on by its environment variable; unset, the run is the CLI's own:

- :data:`CORRUPT_ENV` (``1``): at every reload weight sync, each engine worker loads noise (``torch.randn_like`` of
  every received tensor) instead of the weights, like the measured failure of a transport that returns without data
  (the engine then runs on uninitialised memory). The sync check must stop the run at the first sync.
- :data:`PERTURB_ENV` (a tensor name, e.g. ``model.layers.1.mlp.down_proj.weight``): at every reload sync, 1e-3 is
  added to the first element of that tensor before the load, far below what the canary's log-prob tolerance sees;
  the per-tensor checksums must name it.
- :data:`STALE_TIED_HEAD_ENV` (``1``): at every reload sync, a tied LM head is not re-processed after vLLM's
  ``reload_weights`` (``vllm_worker_wrap.refresh_tied_heads`` skipped), so on vLLM's CPU backend it keeps computing
  with the pretrained embedding while the shared parameter holds the trained one; the sync check must name it.
- :data:`FINAL_SAVE_ENV` (an errno name: ``EACCES``, ``ENOSPC``, ...): rank 0's ``save_pretrained`` of the final
  model raises that ``OSError`` in its first attempt (into ``--ckpt.output_dir``'s staging folder, after the ZeRO-3
  gather), as an output folder that became unwritable or full makes it raise. The fallback folders are not
  affected.
- :data:`HOLD_ENV` (``<point>:<n>``, point one of :data:`HOLD_POINTS`): the run waits at that point of its progress
  until it is stopped, so that a kill-and-resume test's signal lands there on any machine speed (a look at the
  run's progress that came ~1 s late once found it already past its last step's save). ``sidecar:<step>``: after
  every rank's DeepSpeed save of that step, before our resume sidecar is written; ``audit:<version>``: right after
  the trainer wrote that batch to ``--algo.prox_audit_dir``, before its update. A signal ends the wait (Ray's
  worker handler raises SystemExit inside the sleep), or the file :data:`HOLD_RELEASE_ENV` names, once it exists (the
  run goes on: a test that killed one of the run's processes at the point lets the run meet the death); not stopped
  within :data:`HOLD_LIMIT_S`, the run fails naming the variable, never a silent hang.

Use: ``python -m tests.helpers.fault_injection openrlhf_ess.cli.train_ppo_ray ARGS`` with the variables set
(``tests.helpers.e2e.run_cli(..., launcher=LAUNCHER)``, ``tests.helpers.faults.run_cli_tracked(..., launcher=
LAUNCHER)``). This launcher, in the driver only, (a) replaces the CLI's Ray worker set-up hook with
:func:`setup_ray_worker` (the CLI's own hook, then :func:`install`) and forwards the variables to every Ray worker,
(b) names :data:`WORKER_EXTENSION` as the engines' ``worker_extension_cls`` (vLLM's worker process is not a Ray
worker: the weight faults live in that class). In the Ray workers, :func:`install` wraps product functions where
they are (or once they are) imported: ``saving.save_final_model`` (final save), ``resume.write_sidecar`` (hold
before it) and ``experience_maker.write_audit_batch`` (hold after it). Another test launcher can combine these
faults with its own by calling :func:`install` in its set-up hook and forwarding :data:`ENVS`. Nothing here is
imported by the package.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import os
import re
import sys
import time
from typing import Callable, Dict

from tests.helpers import launch

CORRUPT_ENV = "OPENRLHF_ESS_TEST_FAULT_CORRUPT_WEIGHT_LOAD"
PERTURB_ENV = "OPENRLHF_ESS_TEST_FAULT_PERTURB_WEIGHT_LOAD"
FINAL_SAVE_ENV = "OPENRLHF_ESS_TEST_FAULT_FINAL_SAVE"
HOLD_ENV = "OPENRLHF_ESS_TEST_FAULT_HOLD_AT"
HOLD_RELEASE_ENV = "OPENRLHF_ESS_TEST_FAULT_HOLD_RELEASE"
STALE_TIED_HEAD_ENV = "OPENRLHF_ESS_TEST_FAULT_STALE_TIED_HEAD"
ENVS = (CORRUPT_ENV, PERTURB_ENV, FINAL_SAVE_ENV, HOLD_ENV, HOLD_RELEASE_ENV, STALE_TIED_HEAD_ENV)
HOLD_POINTS = ("sidecar", "audit")
HOLD_LIMIT_S = 600.0
PERTURBATION = 1e-3

MODULE = "tests.helpers.fault_injection"
LAUNCHER = launch.launcher(MODULE)
WORKER_EXTENSION = f"{MODULE}.FaultInjectionWorkerWrap"
CLI_MODULE = launch.CLI_MODULE
REPO = launch.REPO

SAVING_MODULE = "openrlhf_ess.trainer.saving"
RESUME_MODULE = "openrlhf_ess.trainer.resume"
EXPERIENCE_MAKER_MODULE = "openrlhf_ess.trainer.ppo_utils.experience_maker"
MARKER = "_fault_injection"  # set on the product functions this launcher wrapped


# ---- the hold ------------------------------------------------------------------------------------------------------


def hold_at(point: str, n: int, limit_s: float = HOLD_LIMIT_S, sleep: Callable[[float], None] = time.sleep) -> None:
    """With ``HOLD_ENV=<point>:<n>``, at that point: wait until the process is stopped (a signal ends the wait: Ray's
    worker handler raises SystemExit inside ``sleep``) or until the file ``HOLD_RELEASE_ENV`` names exists. Not
    stopped within ``limit_s``: an error naming the variable. Another point or ``n``, or the variable unset: returns
    at once; a value of another form: an error, not a hold that silently never comes."""
    held = os.environ.get(HOLD_ENV, "")
    if held and not re.fullmatch(rf"(?:{'|'.join(HOLD_POINTS)}):\d+", held):
        raise ValueError(f"{HOLD_ENV}={held!r}: expected <point>:<n>, point one of {', '.join(HOLD_POINTS)}")
    if held != f"{point}:{n}":
        return
    release = os.environ.get(HOLD_RELEASE_ENV)
    if release and os.path.exists(release):
        return
    print(f"[fault_injection] {HOLD_ENV}={held}: holding the run here until it is stopped", flush=True)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if release and os.path.exists(release):
            print(f"[fault_injection] {HOLD_ENV}={held}: released ({release} exists)", flush=True)
            return
        sleep(0.05)
    raise RuntimeError(f"{HOLD_ENV}={held}: the run was held {limit_s:.0f} s and not stopped; unset it (tests only)")


def holding_before_sidecar(write_sidecar):
    """``resume.write_sidecar`` (called once every rank's DeepSpeed save of the step returned), held before."""

    @functools.wraps(write_sidecar)
    def wrapped(ckpt_path, global_step, *args, **kwargs):
        hold_at("sidecar", global_step)
        return write_sidecar(ckpt_path, global_step, *args, **kwargs)

    return wrapped


def holding_after_audit(write_audit_batch):
    """``experience_maker.write_audit_batch`` (the trainer's batch of that version, before its update), held after."""

    @functools.wraps(write_audit_batch)
    def wrapped(folder, version, *args, **kwargs):
        out = write_audit_batch(folder, version, *args, **kwargs)
        hold_at("audit", version)
        return out

    return wrapped


# ---- the final save ------------------------------------------------------------------------------------------------


def injected_os_error(name: str, folder: str) -> OSError:
    code = getattr(errno, name)
    return OSError(code, f"{os.strerror(code)} (injected by {FINAL_SAVE_ENV})", os.path.join(folder, "config.json"))


@contextlib.contextmanager
def failing_save_pretrained(name: str, model_class=None):
    """While open, ``model_class.save_pretrained`` (default: transformers' ``PreTrainedModel``, whose method the
    model upstream's ``DeepspeedStrategy.save_model`` writes with on rank 0 resolves to) raises the ``OSError`` of
    errno ``name``; the tokenizer's ``save_pretrained`` is another class's and still writes."""
    if model_class is None:
        from transformers import PreTrainedModel as model_class
    getattr(errno, name)  # an unknown errno name fails here, not inside the run's save

    def failing(self, folder, *args, **kwargs):
        raise injected_os_error(name, str(folder))

    original = model_class.__dict__["save_pretrained"]
    model_class.save_pretrained = failing
    try:
        yield
    finally:
        model_class.save_pretrained = original


def failing_final_save(save_final_model, model_class=None):
    """``saving.save_final_model`` whose first write (rank 0, into the staging folder inside the target) runs under
    :func:`failing_save_pretrained` when :data:`FINAL_SAVE_ENV` is set; as is otherwise."""
    signature = inspect.signature(save_final_model)

    @functools.wraps(save_final_model)
    def wrapped(*args, **kwargs):
        name = os.environ.get(FINAL_SAVE_ENV)
        bound = signature.bind(*args, **kwargs)
        if not name or not bound.arguments["rank0"]:
            return save_final_model(*args, **kwargs)
        from openrlhf_ess.trainer import saving

        save, staging = bound.arguments["save"], os.path.join(bound.arguments["target"], saving.STAGING)

        def save_with_fault(folder):
            if folder != staging:
                return save(folder)
            with failing_save_pretrained(name, model_class):
                return save(folder)

        bound.arguments["save"] = save_with_fault
        return save_final_model(*bound.args, **bound.kwargs)

    return wrapped


# ---- the weight load (vLLM's worker process) -----------------------------------------------------------------------


def faulty_weights(tensors: Dict[str, "torch.Tensor"]) -> Dict[str, "torch.Tensor"]:  # noqa: F821
    """The tensors of a reload sync as the faults make the engine load them (unchanged without a fault set)."""
    import torch

    if os.environ.get(CORRUPT_ENV) == "1":
        tensors = {name: torch.randn_like(t) for name, t in tensors.items()}
    name = os.environ.get(PERTURB_ENV)
    if name in tensors:
        t = tensors[name].clone()
        t.view(-1)[0] += PERTURBATION
        tensors = {**tensors, name: t}
    return tensors


def _worker_extension_class(WorkerWrap):
    class FaultInjectionWorkerWrap(WorkerWrap):
        """TEST-ONLY vLLM worker extension: our ``WorkerWrap``, whose staged weights are handed to the load (the
        checksums, then vLLM's ``reload_weights``) through :func:`faulty_weights`."""

        def stage_weights_from_safetensors(self, blob: bytes) -> int:
            count = super().stage_weights_from_safetensors(blob)
            staged = self._staged_weights
            if "complete" not in vars(staged):  # once per sync: its StagedWeights is new
                complete = staged.complete
                staged.complete = lambda: faulty_weights(complete())
            return count

        def load_weights_from_safetensors(self, blob: bytes) -> int:
            if os.environ.get(STALE_TIED_HEAD_ENV) != "1":
                return super().load_weights_from_safetensors(blob)
            from openrlhf_ess.trainer.ray import vllm_worker_wrap

            shipped, vllm_worker_wrap.refresh_tied_heads = vllm_worker_wrap.refresh_tied_heads, lambda model: []
            try:
                return super().load_weights_from_safetensors(blob)
            finally:
                vllm_worker_wrap.refresh_tied_heads = shipped

    return FaultInjectionWorkerWrap


# Built on first use (by vLLM, in the engine's worker): importing vLLM here would load it into every Ray worker.
__getattr__ = launch.lazy_worker_extension("FaultInjectionWorkerWrap", _worker_extension_class)


# ---- the Ray workers and the launcher ------------------------------------------------------------------------------


def install() -> None:
    """In this process (a Ray worker): the faults whose variable is set, on the product functions named in the
    module docstring. The weight faults need nothing here (they are in :data:`WORKER_EXTENSION`)."""
    if os.environ.get(FINAL_SAVE_ENV):
        launch.wrap_after_import(SAVING_MODULE, "save_final_model", failing_final_save, MARKER)
    if os.environ.get(HOLD_ENV):
        launch.wrap_after_import(RESUME_MODULE, "write_sidecar", holding_before_sidecar, MARKER)
        launch.wrap_after_import(EXPERIENCE_MAKER_MODULE, "write_audit_batch", holding_after_audit, MARKER)


def setup_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` under this launcher: the CLI's own hook, then :func:`install`."""
    launch.setup_worker(install)


def _faults() -> str:
    return ", ".join(f"{key}={os.environ[key]}" for key in ENVS if os.environ.get(key)) or "none set"


def main(argv) -> None:
    """``python -m tests.helpers.fault_injection openrlhf_ess.cli.train_ppo_ray ARGS``: our CLI with the faults
    whose variables are set in every process of the run (Ray worker set-up hook, worker extension)."""
    launch.run_cli(
        argv,
        MODULE,
        forward=ENVS,
        worker_extension=WORKER_EXTENSION,
        banner=lambda: f"[fault_injection] TEST-ONLY faults: {_faults()}",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
