"""Ray start-up: the driver's ``ray.init`` (a private instance, or a cluster to join) and what every Ray worker gets.

- :func:`runtime_env`: the environment variables forwarded to every worker (:data:`_FORWARDED_ENV`) and the worker
  set-up hook (:data:`WORKER_SETUP_HOOK`).
- :func:`init_ray`: starts a private Ray instance (with the watch of the run's /dev/shm files) or joins the cluster
  of ``--ray.address`` / ``RAY_ADDRESS``.
- :func:`probe_gpu_nodes`: joins a cluster to ask its GPU nodes whether they have CUDA (the CLI's accelerator
  decision, ``cli/train_ppo_ray.py::resolve_accelerator``), then leaves it.

The CLI reaches :func:`runtime_env` and :func:`probe_gpu_nodes` through its own names (``_runtime_env``,
``_probe_gpu_nodes``), which test launchers replace.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Callable, List, Optional

from openrlhf_ess import config
from openrlhf_ess.runtime import cpu_compat, shm_cleanup, signals
from openrlhf_ess.trainer import eval_clock

# Environment variables forwarded to every Ray worker, with the defaults the CPU stack needs.
_FORWARDED_ENV = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": None,  # forwarded if set; the engine actor drops it (config.resolve.cpu_kv_cache)
    "VLLM_ENABLE_V1_MULTIPROCESSING": None,
    "TORCH_EXTENSIONS_DIR": None,
    "WANDB_MODE": None,
    "WANDB_DIR": None,
    "HF_HUB_OFFLINE": None,
    "HF_DATASETS_OFFLINE": None,
    "TRANSFORMERS_OFFLINE": None,
    "DS_ACCELERATOR": None,
    "TRITON_CACHE_DIR": None,  # set by caches.py when HOME is not writable, or by the user
    "VLLM_CACHE_ROOT": None,
    cpu_compat.DEVICE_ENV: None,  # the run's accelerator, decided once on the driver (resolve_accelerator)
    eval_clock.LAUNCH_TIME_ENV: None,  # the CLI's start, set by _main: evals log the wall-clock since it
}
# Ray's worker set-up hook: a module that never initialises CUDA (it runs before Ray sets CUDA_VISIBLE_DEVICES).
WORKER_SETUP_HOOK = "openrlhf_ess.runtime.worker_hook.setup_worker"


def runtime_env() -> dict:
    env = {}
    for key, default in _FORWARDED_ENV.items():
        value = os.environ.get(key, default)
        if value is not None:
            env[key] = value
    return {"env_vars": env, "worker_process_setup_hook": WORKER_SETUP_HOOK}


def ray_address(args) -> Optional[str]:
    return args.ray.address or os.environ.get("RAY_ADDRESS") or None


def probe_gpu_nodes(address: str, timeout_s: float = 120.0) -> dict:
    """{node IP and id: has CUDA} for every alive node of the cluster that declares GPU resources."""
    import logging

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with signals.ray_init():  # Ray's SIGTERM handlers replaced by ours again (signals.py)
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
        probe = ray.remote(num_cpus=0)(cpu_compat.cuda_available)
        refs = {
            f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})": probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote()
            for n in nodes
        }
        try:
            return dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s)))
        except ray.exceptions.GetTimeoutError:
            raise config.ConfigError(
                f"could not probe the GPU nodes of the Ray cluster at {address} within {timeout_s:.0f} s (a probe "
                "needs no CPU or GPU, only a worker process). Check the nodes, or skip the probe with "
                "--ray.accelerator cuda|cpu."
            ) from None
    finally:
        ray.shutdown()


def shm_account(removed: List[str], used: int, said: bool) -> Optional[str]:
    """The run's line about its /dev/shm files at a clean-up: those removed, or, when the watch saw files but none
    was left (a group SIGTERM also reaches vLLM's processes, and some unlink their queues before they die), that
    none was, once per run. None when there is nothing to say."""
    if removed:
        shown = ", ".join(removed[:6]) + (f" and {len(removed) - 6} more" if len(removed) > 6 else "")
        return (
            f"[openrlhf-ess] removed {len(removed)} shared-memory file(s) this run's processes left in "
            f"{shm_cleanup.SHM_DIR}: {shown}"
        )
    if used and not said:
        return (
            f"[openrlhf-ess] none of the {used} shared-memory file(s) this run's processes used is left in "
            f"{shm_cleanup.SHM_DIR}: their processes removed them"
        )
    return None


def watch_shared_memory() -> shm_cleanup.ShmWatch:
    """Record the /dev/shm files this run's processes use (vLLM's psm_* message queues, multiprocessing's sem.mp-*)
    and remove those still there when the CLI exits: exit 0, an error, SIGTERM/SIGHUP (``signals.py``), SIGINT
    (``openrlhf_ess/runtime/shm_cleanup.py``; Ray ends the engines' processes with signals, so vLLM never unlinks
    them)."""
    watch = shm_cleanup.ShmWatch().start()
    said = []

    def cleanup(wait_s: float = 10.0) -> None:
        removed = watch.cleanup(wait_s)
        line = shm_account(removed, len(watch.files), bool(said))
        if line:
            print(line, flush=True)
            said.append(line)

    atexit.register(cleanup)
    watch.sweep = cleanup  # train() calls it once more before ray.shutdown(), which may end the process at once
    return watch


def init_ray(args, make_env: Callable[[], dict] = runtime_env) -> Optional[shm_cleanup.ShmWatch]:
    """Start (or join) Ray with our worker set-up hook, so every worker applies the CPU patches; returns the watch
    of the run's /dev/shm files when it starts a private Ray instance (None when joining a cluster). ``make_env``:
    the workers' runtime env, called at ``ray.init`` (the CLI passes its ``_runtime_env``)."""
    import ray

    if ray.is_initialized():
        return None
    # What earlier runs killed with SIGKILL left in this node's /dev/shm (shm_cleanup.py: their ledgers).
    swept = shm_cleanup.sweep_dead_runs().message()
    if swept:
        print(f"[openrlhf-ess] {swept}", flush=True)
    address = ray_address(args)
    if address:
        # Under `ray job submit` the job may carry its own runtime env; Ray refuses to merge two that
        # share keys unless told to (the driver's values win, so our worker set-up hook is kept).
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        with signals.ray_init():
            ray.init(address=address, runtime_env=make_env())
        return None
    temp_dir = args.ray.temp_dir
    if temp_dir is None:
        # Short path: Ray's unix sockets live under it and are limited to ~107 characters.
        temp_dir = tempfile.mkdtemp(prefix="ray_ess_", dir="/tmp")
        atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)
        signals.at_stop(lambda: shutil.rmtree(temp_dir, ignore_errors=True))
    # Before ray.init: the hook that removes the run's /dev/shm files then runs after Ray's own atexit shutdown.
    watch = watch_shared_memory()
    # A worker that dies (OOM killer, segfault, ray.kill) takes its process group with it: without this a
    # vLLM engine actor's EngineCore and worker processes outlive it, holding (GPU) memory after the run.
    # Read by the raylet we start here; a cluster joined with --ray.address needs it set at `ray start`.
    os.environ.setdefault("RAY_process_group_cleanup_enabled", "true")
    num_gpus = None
    if not config.on_cuda(args):
        num_gpus = args.ray.num_gpus or config.logical_gpus_needed(args)
        # The deepspeed launcher sets CUDA_VISIBLE_DEVICES=0 even without CUDA; Ray then refuses to
        # declare more logical GPUs than listed there. No CUDA device exists, so the list means nothing.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    with signals.ray_init():
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=max(8, os.cpu_count() or 1),
            num_gpus=num_gpus,
            _temp_dir=temp_dir,
            runtime_env=make_env(),
        )
    return watch
