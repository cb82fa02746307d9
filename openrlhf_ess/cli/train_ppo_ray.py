"""``python -m openrlhf_ess.cli.train_ppo_ray``: upstream's PPO Ray job plus openrlhf-ess.

Accepts every flag of ``openrlhf.cli.train_ppo_ray`` (its parser and validation are upstream's own
code) plus ours, then runs upstream's ``train(args)`` with our actor and engine classes. Also works
under ``deepspeed --module openrlhf_ess.cli.train_ppo_ray`` (which appends ``--local_rank``) and
``ray job submit -- python -m openrlhf_ess.cli.train_ppo_ray``.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
from typing import List, Optional

from openrlhf_ess import cpu_compat

cpu_compat.apply()

from openrlhf_ess import config, preflight, upstream  # noqa: E402

# Environment variables forwarded to every Ray worker, with the defaults the CPU stack needs.
_FORWARDED_ENV = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": None,
    "TORCH_EXTENSIONS_DIR": None,
    "WANDB_MODE": None,
    "WANDB_DIR": None,
    "HF_HUB_OFFLINE": None,
    "HF_DATASETS_OFFLINE": None,
    "TRANSFORMERS_OFFLINE": None,
    "DS_ACCELERATOR": None,
    "OPENRLHF_ESS_FAULT_CORRUPT_WEIGHT_LOAD": None,  # tests only: see trainer/ray/vllm_worker_wrap.py
}


def build_parser():
    parser = upstream.build_parser()
    config.add_arguments(parser)
    return parser


def parse_args(argv: Optional[List[str]] = None):
    """Parse ``argv`` with upstream's parser + ours; run upstream's then our validation.

    Raises :class:`openrlhf_ess.config.ConfigError` (or upstream's ``AssertionError``) before any
    model or Ray process starts.
    """
    parser = build_parser()
    flat = parser.parse_args(argv)
    config.validate_before_upstream(flat)
    args = upstream.finish_args(flat)
    notices = config.validate(args)
    return args, notices


def _runtime_env() -> dict:
    env = {}
    for key, default in _FORWARDED_ENV.items():
        value = os.environ.get(key, default)
        if value is not None:
            env[key] = value
    return {"env_vars": env, "worker_process_setup_hook": "openrlhf_ess.cli.train_ppo_ray.setup_worker"}


def setup_worker() -> None:
    """Ray's worker set-up hook: the CPU patches, and no "Exception ignored" traceback at teardown.

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


def init_ray(args) -> None:
    """Start (or join) Ray with our worker set-up hook, so every worker applies the CPU patches."""
    import ray

    if ray.is_initialized():
        return
    address = args.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        # Under `ray job submit` the job may carry its own runtime env; Ray refuses to merge two that
        # share keys unless told to (the driver's values win, so our worker set-up hook is kept).
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        ray.init(address=address, runtime_env=_runtime_env())
        return
    temp_dir = args.ray.temp_dir
    if temp_dir is None:
        # Short path: Ray's unix sockets live under it and are limited to ~107 characters.
        temp_dir = tempfile.mkdtemp(prefix="ray_ess_", dir="/tmp")
        atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)
    # A worker that dies (OOM killer, segfault, ray.kill) takes its process group with it: without this a
    # vLLM engine actor's EngineCore and worker processes outlive it, holding (GPU) memory after the run.
    # Read by the raylet we start here; a cluster joined with --ray.address needs it set at `ray start`.
    os.environ.setdefault("RAY_process_group_cleanup_enabled", "true")
    num_gpus = None
    if not cpu_compat.cuda_available():
        num_gpus = args.ray.num_gpus or config.logical_gpus_needed(args)
        # The deepspeed launcher sets CUDA_VISIBLE_DEVICES=0 even without CUDA; Ray then refuses to
        # declare more logical GPUs than listed there. No CUDA device exists, so the list means nothing.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=max(8, os.cpu_count() or 1),
        num_gpus=num_gpus,
        _temp_dir=temp_dir,
        runtime_env=_runtime_env(),
    )


class ActorDied(RuntimeError):
    """A Ray actor of the run died (engine, trainer or controller): the run stops; the message says what to do."""


# Ray actor classes of a run, by role (class names: upstream's and our subclasses, which append "Impl").
_ACTOR_ROLES = (
    ("RolloutRayActor", "vLLM engine"),
    ("PolicyModelActor", "DeepSpeed policy (actor) model rank"),
    ("ReferenceModelActor", "reference model rank"),
    ("CriticModelActor", "critic model rank"),
    ("RewardModelActor", "reward model rank"),
    ("GenerateSamplesActor", "async rollout generator"),
    ("TrainingActor", "async training controller"),
    ("PPOTrainer", "PPO controller"),
)


def dead_actor(exc: BaseException):
    """The ``RayActorError`` (actor died or unreachable) at the root of ``exc``, or None.

    Ray wraps a dead actor's error in one ``RayTaskError`` per caller it passes through (engine ->
    generator -> controller -> driver); the innermost, non-task error describes the actor that died.
    """
    import ray

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ray.exceptions.RayActorError) and not isinstance(exc, ray.exceptions.RayTaskError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def actor_died_message(err, args) -> str:
    """What the user reads when an actor of the run died: which one, why (Ray's words), and what to do."""
    text = str(getattr(err, "error_msg", None) or err)
    cls = re.search(r"class_name: (\S+)", text)
    pid = re.search(r"\bpid: (\d+)", text)
    cls = cls.group(1) if cls else "unknown"
    role = next((r for key, r in _ACTOR_ROLES if key in cls), "Ray actor")
    why = re.search(r"The actor (?:is dead|died) because (.*?)(?: Some common causes|$)", text, re.S)
    why = " ".join(why.group(1).split()) if why else " ".join(text.split())[:300]
    logs = (
        f"Ray's logs of every process are under {os.path.join(args.ray.temp_dir, 'session_latest', 'logs')}"
        if args.ray.temp_dir and not (args.ray.address or os.environ.get("RAY_ADDRESS"))
        else "pass --ray.temp_dir DIR to keep Ray's per-process logs"
    )
    return (
        f"the {role} ({cls}, pid {pid.group(1) if pid else '?'}, Ray actor {getattr(err, 'actor_id', '?')}) died "
        f"during the run: {why} The run stops here (fail fast): an engine or trainer cannot be replaced mid-run "
        "(its in-flight rollouts are lost and a new one would not hold the trained weights). Find the cause in "
        f"its output above (OOM killer, segfault, CUDA error; {logs}), then restart; to continue from the last "
        "checkpoint pass --ckpt.load_enable (checkpoints are written every --ckpt.save_steps)."
    )


def train(args) -> None:
    """Run upstream's Ray job with our classes.

    Raises :class:`ActorDied` if an actor of the run (e.g. a vLLM engine) dies: Ray's own error reaches
    the driver within seconds (Ray fails every pending call on a dead actor), and is re-raised here with
    a message naming the actor and the way forward.
    """
    from openrlhf_ess.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf_ess.trainer.ray.vllm_engine import create_vllm_engines

    classes = {"PolicyModelActor": PolicyModelActor, "create_vllm_engines": create_vllm_engines(args)}
    if config.needs_our_controllers(args):
        # Off: upstream's controllers run untouched.
        from openrlhf_ess.trainer.ppo_trainer import PPOTrainer
        from openrlhf_ess.trainer.ppo_trainer_async import PPOTrainerAsync

        classes.update(PPOTrainer=PPOTrainer, PPOTrainerAsync=PPOTrainerAsync)
    init_ray(args)
    try:
        upstream.run_train(args, classes)
    except Exception as e:
        died = dead_actor(e)
        if died is None:
            raise
        raise ActorDied(actor_died_message(died, args)) from e
    finally:
        import ray

        ray.shutdown()


def main(argv: Optional[List[str]] = None) -> None:
    upstream.check_version()
    try:
        args, notices = parse_args(argv)
        # Every input (models, prompt files, reward file, output folders, float flags) checked before Ray starts.
        notices += preflight.check(args)
    except config.ConfigError as e:
        print(f"openrlhf-ess: error: {e}", file=sys.stderr)
        sys.exit(2)
    for notice in notices:
        print(f"[openrlhf-ess] {notice}")
    try:
        train(args)
    except ActorDied as e:
        import traceback

        traceback.print_exception(e.__cause__)  # Ray's own report, in full
        print(f"openrlhf-ess: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
