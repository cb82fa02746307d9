"""TEST-ONLY: make every weight sync of an async partial-rollout run land inside a rollout batch.

An exactness test of partial rollouts needs responses that span a sync (tokens sampled under two versions). In an
async run that happens only if the engine is still generating the next batch when the trainer pauses it for the
sync, a race between generation and the training step: on a loaded 2-core machine the engine sometimes finished
the batch first, and the test found nothing to check. The gate orders the two by the run's progress instead:

- trainer (:func:`install_trainer`): the actor's rank 0 arms the gate (a file, ``OPENRLHF_ESS_TEST_SPAN_GATE``,
  holding a counter) at the start of its training step on batch k, once the check of the last sync (which talks
  to the engines) is done; the training actor releases it (removes the file) right before upstream's
  ``broadcast_to_vllm`` pauses the engines. Meanwhile the generator is working on batch k + 1 (it got its slot
  back when the trainer took batch k);
- engine worker (:func:`gate_worker`): while the gate is armed, the model runner runs one forward step that
  schedules tokens (the batch's first token, or a step of requests already running) and then waits at the start
  of the next one until the gate is released. The requests it holds are in flight at the pause, so their first
  tokens carry version v and the rest v + 1.

The release comes before the pause (the pause waits for the engine's current step, so a release after it would
deadlock). A gate not released within :data:`LIMIT_S` raises in the engine, naming the variable: a failed run,
never a hang. The last batch arms a gate that nothing waits at (the generator has no prompts left).

Two ways in, both test-only launchers of our CLI that forward the variable to the Ray workers (whose set-up hook
calls :func:`install_trainer`) and name a worker extension that calls :func:`gate_worker`:

- ``tests.helpers.gloo_broadcast`` (upstream's broadcast sync): the gate is on from the engine's start
  (``init_process_group``), so every sync with a next batch lands inside it;
- this module, ``python -m tests.helpers.span_gate openrlhf_ess.cli.train_ppo_ray ARGS`` (our reload sync): the
  worker is first reached at the first sync's weight load, so the gate holds from the second sync on (a run of
  three steps: the second sync lands inside the third batch; the first may or may not). Used by
  ``tests/test_prox_modes.py``'s exact pipeline runs and the resumed run of ``tests/test_resume.py``'s interrupt case.
"""

from __future__ import annotations

import os
import sys
import time

from tests.helpers import launch

ENV = "OPENRLHF_ESS_TEST_SPAN_GATE"
MODULE = "tests.helpers.span_gate"
LAUNCHER = launch.launcher(MODULE)
WORKER_EXTENSION = f"{MODULE}.SpanGateWorkerWrap"
CLI_MODULE = launch.CLI_MODULE
REPO = launch.REPO
LIMIT_S = 300.0
TRAINER_MODULE = "openrlhf.trainer.ppo_trainer_async"  # upstream's
WEIGHT_SYNC_MODULE = "openrlhf_ess.trainer.weight_sync"
MARKER = "_span_gate"  # set on the functions this module wrapped


def path() -> str:
    return os.environ.get(ENV, "")


def armed(gate: str):
    """The counter of the armed gate, or None when released."""
    try:
        with open(gate) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def release(gate: str) -> None:
    try:
        os.remove(gate)
    except FileNotFoundError:
        pass


def arm(gate: str) -> int:
    """Arm the gate with the next counter (atomically; ``<gate>.count`` keeps the counter across releases)."""
    try:
        with open(f"{gate}.count") as f:
            n = int(f.read() or 0) + 1
    except FileNotFoundError:
        n = 1
    with open(f"{gate}.count", "w") as f:
        f.write(str(n))
    tmp = f"{gate}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(n))
    os.replace(tmp, gate)
    return n


def held(gate: str) -> list:
    """The counters of the gates at which the engine held a step (``<gate>.held``): evidence the gate worked."""
    try:
        with open(f"{gate}.held") as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def arming_after_check(check_if_due):
    """``WeightSync.check_if_due``, after which rank 0 of the actor arms the gate: the sync check talks to the
    engines (checksums, the canary's log-probs) through their engine loop, which a held step would block."""

    def check_then_arm(self, *args, **kwargs):
        import torch.distributed as dist

        out = check_if_due(self, *args, **kwargs)
        if not dist.is_initialized() or dist.get_rank() == 0:
            arm(path())
        return out

    return check_then_arm


def releasing_before_pause(call):
    """Upstream's async training actor pauses the engines for a sync with its module's ``batch_vllm_engine_call(
    engines, "pause_generation")``: release the gate just before. (Not a method patch: Ray ships an actor class's
    methods inside the class it pickles, so patching the class in the actor's process changes nothing.)"""

    def releasing_call(engines, method_name, *args, **kwargs):
        if method_name == "pause_generation":
            release(path())
        return call(engines, method_name, *args, **kwargs)

    return releasing_call


PATCHES = (  # (module, attribute in it, wrapper)
    (TRAINER_MODULE, "batch_vllm_engine_call", releasing_before_pause),
    (WEIGHT_SYNC_MODULE, "WeightSync.check_if_due", arming_after_check),
)


def install_trainer() -> None:
    """In a Ray worker (set-up hook): patch the training actor's module and the weight sync's class once they are
    imported (importing them here would load DeepSpeed and OpenRLHF into every Ray worker)."""
    if not path():
        return
    for module, attribute, wrap in PATCHES:
        launch.wrap_after_import(module, attribute, wrap, MARKER)


def gate_worker(model_runner) -> None:
    """In the engine's worker: the model runner's ``execute_model`` waits at the gate (module docstring)."""
    gate = path()
    if not gate or getattr(model_runner, "_span_gated", False):
        return
    execute = model_runner.execute_model
    state = {"arm": None, "steps": 0}

    def gated(scheduler_output, *args, **kwargs):
        n = armed(gate)
        if n is not None and getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0:
            if n != state["arm"]:
                state["arm"], state["steps"] = n, 0
            if state["steps"] >= 1:
                deadline = time.monotonic() + LIMIT_S
                while armed(gate) == n:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{ENV}: gate {n} not released in {LIMIT_S:.0f} s (tests only)")
                    time.sleep(0.01)
                with open(f"{gate}.held", "a") as f:
                    f.write(f"{n}\n")
            state["steps"] += 1
        return execute(scheduler_output, *args, **kwargs)

    model_runner.execute_model = gated
    model_runner._span_gated = True


def setup_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` under this launcher: the CLI's own hook, then the trainer's patches."""
    launch.setup_worker(install_trainer)


def _worker_extension_class(WorkerWrap):
    class SpanGateWorkerWrap(WorkerWrap):
        """TEST-ONLY vLLM worker extension: our ``WorkerWrap``, whose reload-sync entry points put the span gate
        on the model runner (once) before loading."""

        def stage_weights_from_safetensors(self, blob):
            gate_worker(self.model_runner)
            return super().stage_weights_from_safetensors(blob)

        def load_weights_from_safetensors(self, blob):
            gate_worker(self.model_runner)
            return super().load_weights_from_safetensors(blob)

    return SpanGateWorkerWrap


# built on first use, in the engine's worker: importing vLLM here would load it into every Ray worker
__getattr__ = launch.lazy_worker_extension("SpanGateWorkerWrap", _worker_extension_class)


def main(argv) -> None:
    """``python -m tests.helpers.span_gate openrlhf_ess.cli.train_ppo_ray ARGS`` with ``OPENRLHF_ESS_TEST_SPAN_GATE``
    set: our CLI with the gate in the training actor, the actor's rank 0 and the engine's worker."""
    launch.run_cli(
        argv,
        MODULE,
        forward=(ENV,),
        worker_extension=WORKER_EXTENSION,
        ready=bool(path()),
        usage_prefix=f"{ENV}=<file> ",
        banner=lambda: f"[span_gate] TEST-ONLY: weight syncs land inside a rollout batch, {ENV}={path()}",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
