"""``python -m openrlhf_ess.cli.train_ppo_ray``: upstream's PPO Ray job plus openrlhf-ess.

Accepts every flag of ``openrlhf.cli.train_ppo_ray`` (its parser and validation are upstream's own
code) plus ours, then runs upstream's ``train(args)`` with our actor and engine classes. Also works
under ``deepspeed --module openrlhf_ess.cli.train_ppo_ray`` (which appends ``--local_rank``) and
``ray job submit -- python -m openrlhf_ess.cli.train_ppo_ray``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import List, Optional

from openrlhf_ess.runtime import caches

# Before anything imports DeepSpeed (it creates Triton's cache folder under HOME at import): a HOME the run
# cannot write gets its caches moved, with a notice printed by main() (openrlhf_ess/runtime/caches.py).
_CACHE_NOTICES = caches.redirect_unwritable_caches()

from openrlhf_ess.runtime import cpu_compat  # noqa: E402

cpu_compat.apply()

from openrlhf_ess import config, upstream  # noqa: E402
from openrlhf_ess.checks import preflight, resources  # noqa: E402
from openrlhf_ess.cli import auto_resume, ray_start  # noqa: E402
from openrlhf_ess.cli.ray_start import WORKER_SETUP_HOOK, shm_account, watch_shared_memory  # noqa: E402, F401
from openrlhf_ess.cli.triage import (  # noqa: E402, F401  (also reached as names of this module)
    ActorDied,
    EngineDied,
    OutputFailed,
    RewardFailed,
    RunFailed,
    StartupFailed,
    _chain,
    actor_died_message,
    checkpoint_load_fix,
    classify_failure,
    dead_actor,
    engine_dead,
    engine_died_message,
    exception_line,
    failure_origin,
    reward_failure,
    startup_message,
    state_dict_detail,
)
from openrlhf_ess.runtime import run_lock, shm_cleanup, signals  # noqa: E402
from openrlhf_ess.trainer import eval_clock, resume  # noqa: E402

# Ray start-up (cli/ray_start.py), reached through these names: train() calls init_ray(), which passes
# _runtime_env, and resolve_accelerator() calls _probe_gpu_nodes (test launchers and tests replace them here).
_runtime_env = ray_start.runtime_env
_probe_gpu_nodes = ray_start.probe_gpu_nodes


def init_ray(args) -> Optional[shm_cleanup.ShmWatch]:
    """:func:`ray_start.init_ray` with this module's ``_runtime_env`` (looked up at each call)."""
    return ray_start.init_ray(args, _runtime_env)


def build_parser():
    parser = upstream.build_parser()
    config.add_arguments(parser)
    return parser


def parse_args(argv: Optional[List[str]] = None):
    """Parse ``argv`` with upstream's parser + ours; run upstream's then our validation. No I/O: Ray is not touched.

    Raises :class:`openrlhf_ess.config.ConfigError` (or upstream's ``AssertionError``) before any
    model or Ray process starts. A run that joins a Ray cluster (``--ray.address`` / ``RAY_ADDRESS``) with
    ``--ray.accelerator auto`` comes back undecided (``args.ray.accelerator == "auto"``) and not yet validated:
    :func:`check_with_cluster`, the CLI's next step, asks the cluster, then validates, in the same order.
    """
    parser = build_parser()
    flat = parser.parse_args(argv)
    given = config.given_dests(parser, argv)
    recipe = config.apply_vcpo_recipe(flat, given)
    config.default_output_paths(flat, given)  # --ckpt.path under --ckpt.output_dir unless passed
    config.validate_before_upstream(flat)
    args = upstream.finish_args(flat)
    if args.ray.accelerator not in ("cuda", "cpu") and ray_start.ray_address(args):
        return args, recipe  # the accelerator is the cluster's: check_with_cluster
    return args, _decide_and_validate(args, recipe)


def check_with_cluster(args, notices: List[str]) -> List[str]:
    """What :func:`parse_args` leaves to start-up for a run that joins a Ray cluster with ``--ray.accelerator auto``:
    the accelerator, decided by a probe of the cluster's GPU nodes (``ray.init`` to the cluster), then our validation
    of the flags against it. Returns the notices in parse_args' order; a decided run's come back unchanged."""
    if args.ray.accelerator in ("cuda", "cpu"):
        return notices
    return _decide_and_validate(args, notices)


def _decide_and_validate(args, recipe: List[str]) -> List[str]:
    decided = resolve_accelerator(args)
    return [decided] + recipe + config.validate(args)


def resolve_accelerator(args) -> str:
    """Decide once, on the driver, whether the run uses CUDA; set ``args.ray.accelerator`` to "cuda" or "cpu".

    Returns the log line that says what was decided and why. The driver's own ``torch.cuda`` is not the
    cluster's: a CPU-only head node, or ``ray job submit`` (Ray gives the job's driver
    ``CUDA_VISIBLE_DEVICES=""``), would make a GPU cluster run in CPU mode, rejecting every GPU recipe's
    flags, turning NCCL into reload and giving engines a 1 GiB KV cache. So with a cluster
    to join, each alive node that declares GPUs runs a zero-resource probe, pinned to it, that answers
    :func:`cpu_compat.cuda_available` there (NVML; no CUDA initialised); a private instance is this machine.
    Raises :class:`config.ConfigError` when the GPU nodes disagree or cannot be probed.
    """
    if args.ray.accelerator in ("cuda", "cpu"):
        return f"accelerator: {args.ray.accelerator} (--ray.accelerator)"
    address = ray_start.ray_address(args)
    if not address:
        args.ray.accelerator = "cuda" if cpu_compat.cuda_available() else "cpu"
        where = "this machine has an NVIDIA GPU" if args.ray.accelerator == "cuda" else "this machine has no CUDA"
        return f"accelerator: {args.ray.accelerator} ({where}; the run starts a private Ray instance here)"
    answers = _probe_gpu_nodes(address)
    if not answers:
        args.ray.accelerator = "cpu"
        return f"accelerator: cpu (the Ray cluster at {address} declares no GPU)"
    with_cuda = sorted(node for node, cuda in answers.items() if cuda)
    without = sorted(node for node, cuda in answers.items() if not cuda)
    if with_cuda and without:
        raise config.ConfigError(
            f"the Ray cluster's GPU nodes disagree: {', '.join(with_cuda)} have an NVIDIA GPU, {', '.join(without)} "
            "declare GPUs to Ray but have none (logical GPUs). Fix the cluster, or say which with "
            "--ray.accelerator cuda|cpu."
        )
    args.ray.accelerator = "cuda" if with_cuda else "cpu"
    if with_cuda:
        why = f"{len(with_cuda)} GPU node(s) of the cluster at {address} have an NVIDIA GPU"
    else:
        why = f"the cluster at {address} declares GPUs but none of its {len(without)} GPU node(s) has CUDA"
    return f"accelerator: {args.ray.accelerator} ({why}; decided by a probe on each node, not by this driver)"


class _FitWatch:
    """Driver-side stand-in for a controller class (``PPOTrainer`` / ``PPOTrainerAsync``, ours or upstream's):
    sets ``started`` when upstream's train() calls ``fit.remote()`` on the controller, i.e. when training
    begins, and runs ``before_fit(role -> actor handles)`` just before (the start-up self-checks: every model is
    placed and loaded by then, no rollout has run). Everything else passes through to the real class and handle;
    the actor itself is untouched."""

    def __init__(self, target, started: threading.Event, is_handle: bool = False, before_fit=None, groups=None):
        self._target, self._started, self._is_handle = target, started, is_handle
        self._before_fit, self._groups = before_fit, groups

    def remote(self, *args, **kwargs):
        handle = self._target.remote(*args, **kwargs)
        return _FitWatch(handle, self._started, True, self._before_fit, upstream.controller_groups(args))

    def options(self, **kwargs):
        return _FitWatch(self._target.options(**kwargs), self._started, before_fit=self._before_fit)

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if self._is_handle and name == "fit":
            return _FitCall(attr, self._started, self._before_fit, self._groups)
        return attr


class _FitCall:
    def __init__(self, method, started: threading.Event, before_fit=None, groups=None):
        self._method, self._started, self._before_fit, self._groups = method, started, before_fit, groups

    def remote(self, *args, **kwargs):
        if self._before_fit is not None:
            self._before_fit(self._groups or {})
        self._started.set()
        auto_resume.mark_training_began()  # for a supervising --train.auto_resume process (cli/auto_resume.py)
        return self._method.remote(*args, **kwargs)


def _cluster_source(args) -> str:
    """Where the cluster's numbers in a resource error come from."""
    if args.ray.address or os.environ.get("RAY_ADDRESS"):
        return "(The cluster is the one joined with --ray.address / RAY_ADDRESS.)"
    if config.on_cuda(args):
        return "(The cluster is this machine's GPUs and CPUs, in a private Ray instance.)"
    return (
        "(This machine has no CUDA: the private Ray instance declares --ray.num_gpus logical GPUs, by default as "
        f"many as the flags ask for, and max(8, cores) = {max(8, os.cpu_count() or 1)} CPU slots; to run more "
        "ranks on CPU, start Ray yourself (ray start --head --num-cpus N --num-gpus M) and pass --ray.address.)"
    )


def check_resources(args) -> List:
    """Compare what the run asks for with the running Ray cluster; raise :class:`resources.ResourceError` if
    it can never be placed. Returns the per-role requests (for the placement watchdog)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    resources.check(args, ray.cluster_resources(), nodes, where=_cluster_source(args))
    resources.check_host_memory(args, nodes, resources.model_bytes(args.actor.model_name_or_path))
    return resources.requests(args)


def train(args) -> None:
    """Run upstream's Ray job with our classes.

    Raises :class:`resources.ResourceError` before anything is placed if the run's requests exceed the
    cluster; :class:`StartupFailed` if a model, the data or the reward file fails to load (before training
    began); :class:`ActorDied` if an actor of the run (e.g. a vLLM engine) dies during the run; and
    :class:`EngineDied` if a vLLM engine's own processes die; :class:`EngineHung` if the engine watchdog stopped a
    hung engine. Ray's own error reaches the driver within
    seconds (Ray fails every pending call on a dead actor) and is re-raised with our message.
    """
    from openrlhf_ess.trainer.ray.engine_watchdog import WatchedEngines
    from openrlhf_ess.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf_ess.trainer.ray.rendezvous import role_classes
    from openrlhf_ess.trainer.ray.vllm_engine import create_vllm_engines

    # The engines are watched from their creation on (--vllm.watchdog_s; trainer/ray/engine_watchdog.py).
    # Replacement (--vllm.max_restarts): the engine keeper is created with them (trainer/ray/engine_keeper.py).
    engines = WatchedEngines(
        create_vllm_engines(args),
        args.vllm.watchdog_s,
        args.vllm.max_restarts,
        getattr(args.vllm, "restart_timeout_s", None),
    )
    # Every trainer role draws its rendezvous port outside the ephemeral range (trainer/ray/rendezvous.py).
    classes = {
        **role_classes(),
        "PolicyModelActor": PolicyModelActor,
        "create_vllm_engines": engines,
    }
    if config.sampling_mask_on(args) or config.routing_replay_on(args):  # π_ref over the kept support / replayed
        from openrlhf_ess.trainer.ray.ref_actor import ReferenceModelActor

        classes["ReferenceModelActor"] = ReferenceModelActor
    if config.needs_our_controllers(args):
        from openrlhf_ess.trainer.ppo_trainer import PPOTrainer
        from openrlhf_ess.trainer.ppo_trainer_async import PPOTrainerAsync
    elif config.eval_on(args):  # upstream's controllers with our eval schedule only (trainer/eval_schedule.py)
        from openrlhf_ess.trainer.ppo_trainer import PPOTrainerEval as PPOTrainer
        from openrlhf_ess.trainer.ppo_trainer_async import PPOTrainerAsyncEval as PPOTrainerAsync
    else:  # off: upstream's controllers run untouched (watched on the driver only, for the start of fit())
        from openrlhf.trainer.ppo_trainer import PPOTrainer
        from openrlhf.trainer.ppo_trainer_async import PPOTrainerAsync
    if args.ckpt.load_enable:  # the newest complete checkpoint only, sync and async; says what it loads or why not
        restored = resume.prepare(args.ckpt.path, need_sidecar=resume.applies(args))
        if restored is not None and resume.applies(args):
            print(resume.restored_message(restored), flush=True)
    started = threading.Event()  # set when training begins: start-up failures before, "died during the run" after
    before_fit = None
    if args.selfcheck == "on":
        from openrlhf_ess.checks import selfcheck

        def before_fit(groups):
            selfcheck.run(args, groups)

    classes.update(
        PPOTrainer=_FitWatch(PPOTrainer, started, before_fit=before_fit),
        PPOTrainerAsync=_FitWatch(PPOTrainerAsync, started, before_fit=before_fit),
    )
    watch = init_ray(args)
    watchdog = None
    try:
        watchdog = resources.PlacementWatchdog(check_resources(args)).start()
        upstream.run_train(args, classes)
    except config.ConfigError:  # resources.ResourceError: nothing was placed, main() prints it
        raise
    except Exception as e:
        from openrlhf_ess.checks.selfcheck import SelfCheckError

        if isinstance(e, SelfCheckError):  # our message names the contract and the fix
            raise StartupFailed(str(e)) from e
        if engines.hung is not None:  # the watchdog stopped a hung engine: Ray's error is that engine's death
            raise EngineHung(with_failures(engines.hung, engines)) from e
        used_up = replacements_used_up(e, engines, args)
        if used_up is not None:  # a restart past --vllm.max_restarts was refused: Ray reports a start-up error
            raise ActorDied(used_up) from e
        ours = classify_failure(e, args, started.is_set())
        if ours is None:
            raise
        told = with_failures(str(ours), engines)
        raise (ours if told == str(ours) else type(ours)(told)) from e
    finally:
        import ray

        if watchdog is not None:
            watchdog.stop()
        engines.stop()
        if watch is not None and signals.received() is not None:
            end_after_a_signal(watch)  # does not return
        if watch is not None:  # one last look before Ray ends the processes: files made since the last look
            watch.sample()
        ray.shutdown()


def replacements_used_up(exc: BaseException, engines, args) -> Optional[str]:
    """Our message when the run stopped because a restarted engine was refused past ``--vllm.max_restarts`` (its
    ``__init__`` raised, so Ray's error reads as a start-up failure), else None."""
    from openrlhf_ess.trainer.ray import engine_keeper

    if engines.keeper is None or not any(engine_keeper.REFUSED in str(e) for e in _chain(exc)):
        return None
    return engine_keeper.used_up_message(engines.failures() or "(not recorded)", args.vllm.max_restarts)


def with_failures(message: str, engines) -> str:
    """``message``, followed by the engines' earlier failures and replacements in order (--vllm.max_restarts)."""
    earlier = engines.failures()
    if not earlier or earlier in message:
        return message
    return f"{message} Engine failures of this run, in order: {earlier}"


class EngineHung(RunFailed):
    """A vLLM engine had requests in flight and made no progress for ``--vllm.watchdog_s``: the watchdog stopped
    it and the run stops; the message names the engine, how long and what it was doing (engine_watchdog.py)."""


# How long a signalled run's own processes get to exit on SIGTERM before SIGKILL. The whole clean-up must fit in the
# scheduler's grace period (docker stop: 10 s, then SIGKILL); with 10 s here the run took 10.3-11.9 s from the signal
# to its exit (measured, idle and beside two busy processes), since a Ray process always used the whole wait, and
# what followed it (the /dev/shm files, the lock, the temp folder) was cut short.
STOP_GRACE_S = 3.0


def end_after_a_signal(watch: shm_cleanup.ShmWatch) -> None:
    """A run on its private Ray instance, stopped by SIGTERM/SIGHUP: end it without relying on Ray.

    When the whole process group was signalled (Slurm, Kubernetes), Ray's raylet may already be gone; then
    ``ray.shutdown()`` ends this process at once (Ray's core worker: "the local Raylet is dead", exit 1) and no
    atexit hook runs after it, and the vLLM engine processes, in their actor's own process group, outlive the run
    (both seen: a psm_* file and an EngineCore left). So: every process of the run is ended by PID (SIGTERM, then
    SIGKILL after :data:`STOP_GRACE_S`), the run's /dev/shm files are removed, the run lock released, the Ray temp
    folder removed, and the process exits with 128 + the signal (``signals.exit_now``)."""
    ended = watch.end_processes(grace_s=STOP_GRACE_S)
    print(f"[openrlhf-ess] ended the run's {ended} other process(es) (Ray, its workers, vLLM), by PID", flush=True)
    signals.exit_now(before=[lambda: watch.sweep(wait_s=0.0)])


def main(argv: Optional[List[str]] = None) -> None:
    # SIGTERM/SIGHUP take Ctrl-C's path from here to the last line, whatever Ray installs meanwhile (signals.py).
    signals.install()
    try:
        _main(argv)
    except BaseException:
        stopped = signals.received()
        if stopped is None:
            error = sys.exc_info()[1]
            if isinstance(error, Exception):  # not classified by _main (a traceback follows): say it to a supervisor
                auto_resume.record_failure(type(error).__name__, exception_line(str(error)) or str(error)[:500])
            raise
        # The clean-up has run (train's and _main's finally blocks). Ray turns a SystemExit raised inside
        # ray.get into its own SystemExit(1), and the actors' ends raise as Ray shuts down: the exit code says
        # the signal, as schedulers expect (128 + its number).
        sys.exit(128 + stopped)
    finally:
        signals.finished()


def _main(argv: Optional[List[str]]) -> None:
    eval_clock.export_launch_time()  # forwarded to every Ray worker (_runtime_env)
    for line in _CACHE_NOTICES:  # a HOME the run cannot write (caches.py)
        print(line, flush=True)
    upstream.check_version()
    try:
        args, notices = parse_args(argv)
        # A cluster to join (--ray.address) is asked for its accelerator here, not while parsing; then validation.
        notices = check_with_cluster(args, notices)
        # Every input (models, prompt files, reward file, output folders, float flags) checked before Ray starts.
        notices += preflight.check(args)
    except config.ConfigError as e:
        print(f"openrlhf-ess: error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.train.auto_resume > 0:  # this process supervises the run in a child process (cli/auto_resume.py)
        sys.exit(
            auto_resume.supervise(
                sys.argv[1:] if argv is None else argv,
                args.train.auto_resume,
                args.ckpt.path,
                need_sidecar=resume.applies(args),
            )
        )
    for notice in notices:
        print(f"[openrlhf-ess] {notice}")
    try:  # one run per output folder (run_lock.py): held until this process exits, however it exits
        command = None if argv is None else ["-m", "openrlhf_ess.cli.train_ppo_ray", *argv]
        locks = run_lock.acquire_all(args, log=print, argv=command, saves_best=preflight.outputs.saves_best(args))
    except config.ConfigError as e:
        print(f"openrlhf-ess: error: {e}", file=sys.stderr)
        sys.exit(2)
    atexit.register(run_lock.release_all, locks)
    signals.at_stop(lambda: run_lock.release_all(locks))
    os.environ[cpu_compat.DEVICE_ENV] = args.ray.accelerator  # forwarded to every Ray worker (_runtime_env)
    try:
        train(args)
    except config.ConfigError as e:  # e.g. resources.ResourceError: found before anything was placed
        print(f"openrlhf-ess: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RunFailed as e:
        import traceback

        traceback.print_exception(e.__cause__)  # Ray's own report, in full
        print(f"openrlhf-ess: error: {e}", file=sys.stderr, flush=True)
        auto_resume.record_failure(type(e).__name__, str(e))
        sys.exit(1)
    finally:
        run_lock.release_all(locks)  # Ray is shut down by now (train's finally); atexit covers the rest


if __name__ == "__main__":
    main()
