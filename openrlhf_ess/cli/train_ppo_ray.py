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
from openrlhf_ess.runtime import run_lock, shm_cleanup, signals  # noqa: E402
from openrlhf_ess.trainer import eval_clock, resume, saving  # noqa: E402

# Environment variables forwarded to every Ray worker, with the defaults the CPU stack needs.
_FORWARDED_ENV = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": None,  # forwarded if set; the engine actor drops it (config._resolve_cpu_kv_cache)
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
    recipe = config.apply_vcpo_recipe(flat, config.given_dests(parser, argv))
    config.validate_before_upstream(flat)
    args = upstream.finish_args(flat)
    decided = resolve_accelerator(args)
    notices = [decided] + recipe + config.validate(args)
    return args, notices


def _runtime_env() -> dict:
    env = {}
    for key, default in _FORWARDED_ENV.items():
        value = os.environ.get(key, default)
        if value is not None:
            env[key] = value
    return {"env_vars": env, "worker_process_setup_hook": WORKER_SETUP_HOOK}


def _ray_address(args) -> Optional[str]:
    return args.ray.address or os.environ.get("RAY_ADDRESS") or None


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
    address = _ray_address(args)
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


def _probe_gpu_nodes(address: str, timeout_s: float = 120.0) -> dict:
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


def init_ray(args) -> Optional[shm_cleanup.ShmWatch]:
    """Start (or join) Ray with our worker set-up hook, so every worker applies the CPU patches; returns the watch
    of the run's /dev/shm files when it starts a private Ray instance (None when joining a cluster)."""
    import ray

    if ray.is_initialized():
        return None
    # What earlier runs killed with SIGKILL left in this node's /dev/shm (shm_cleanup.py: their ledgers).
    swept = shm_cleanup.sweep_dead_runs().message()
    if swept:
        print(f"[openrlhf-ess] {swept}", flush=True)
    address = _ray_address(args)
    if address:
        # Under `ray job submit` the job may carry its own runtime env; Ray refuses to merge two that
        # share keys unless told to (the driver's values win, so our worker set-up hook is kept).
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        with signals.ray_init():
            ray.init(address=address, runtime_env=_runtime_env())
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
            runtime_env=_runtime_env(),
        )
    return watch


class RunFailed(RuntimeError):
    """The run stopped on an error we explain: ``main()`` prints Ray's report (the ``__cause__``), then our message."""


class ActorDied(RunFailed):
    """A Ray actor of the run died (engine, trainer or controller): the run stops; the message says what to do."""


class StartupFailed(RunFailed):
    """An actor (or the driver) failed before training began: a bad input or the machine, never a resume case."""


class EngineDied(RunFailed):
    """A vLLM engine's own processes (EngineCore, its workers) died: vLLM raised ``EngineDeadError``."""


class OutputFailed(RunFailed):
    """An output (the final model, a checkpoint) could not be written; the message says why and where the work is."""


class RewardFailed(RunFailed):
    """The reward function timed out or raised a BaseException (``openrlhf_ess/utils/agent.py``) and
    --reward.failure_policy is not drop: the message names the file and the fix."""


def reward_failure(exc: BaseException) -> Optional[str]:
    """The message of a ``RewardFunctionError`` raised in a vLLM engine, under Ray's wrapping, or None."""
    import ray

    from openrlhf_ess.utils.agent import RewardFunctionError

    for e in _chain(exc):
        if isinstance(e, RewardFunctionError) and not isinstance(e, ray.exceptions.RayTaskError):
            return str(e)
    for e in _chain(exc):  # Ray kept only the text (a cause it could not rebuild)
        match = re.search(r"RewardFunctionError: (.*)", _ANSI.sub("", str(e)))
        if match:
            return match.group(1).strip()
    return None


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
    ("ProxScorer", "dedicated pi_prox model"),
    ("VLLMLock", "async engine lock"),
)

# What each role loads at start-up, and so where a start-up error comes from (by class name, as above); the
# second text replaces the first when the error is about memory.
_STARTUP_FIX = (
    (
        "RolloutRayActor",
        "the vLLM engine loads --actor.model_name_or_path with vLLM and imports the reward file "
        "(--reward.remote_url) or agent (--train.agent_func_path): fix the one the error names",
        "lower --vllm.cpu_kv_cache_gb (CPU) or --vllm.gpu_memory_utilization (GPU), or --data.max_len",
    ),
    (
        "PolicyModelActor",
        "the policy rank loads --actor.model_name_or_path with DeepSpeed (--ds.* flags): check that folder (a "
        "config.json and weights that load)",
        "a higher --ds.zero_stage, a smaller --train.micro_batch_size, or more --actor.num_gpus_per_node",
    ),
    (
        "ReferenceModelActor",
        "the reference model loads --actor.model_name_or_path (upstream's choice): check that folder",
        "a higher --ds.zero_stage or --train.colocate_actor_ref",
    ),
    (
        "CriticModelActor",
        "the critic loads --critic.model_name_or_path (default: the policy's): check that folder",
        "a higher --ds.zero_stage or a smaller --train.micro_batch_size",
    ),
    (
        "RewardModelActor",
        "the reward model loads --reward.model_name_or_path: check that folder",
        "a higher --ds.zero_stage or more --reward.num_gpus_per_node",
    ),
    (
        "TrainingActor",
        "the async trainer sets up the weight sync and restores the checkpoint state (--ckpt.load_enable, "
        "--ckpt.path): check those",
        "a smaller --train.async_queue_size",
    ),
    (
        "ProxScorer",
        "the dedicated pi_prox model loads --actor.model_name_or_path: check that folder",
        "more --algo.prox_dedicated_num_gpus, or --algo.prox_mode interrupt (no extra model)",
    ),
    (
        "GenerateSamplesActor",
        "the rollout generator loads the tokenizer of --actor.model_name_or_path and the prompts "
        "(--data.prompt_dataset, --data.input_key, --data.label_key, --eval.dataset): fix the one the error names",
        "a smaller --data.max_samples",
    ),
    (
        "PPOTrainer",
        "the controller loads the tokenizer of --actor.model_name_or_path and the prompts (--data.prompt_dataset, "
        "--data.input_key, --data.label_key, --eval.dataset): fix the one the error names",
        "a smaller --data.max_samples",
    ),
)
_MEMORY = re.compile(r"out of memory|MemoryError|\bOOM\b|Cannot allocate memory|memory pressure", re.I)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADER = re.compile(r"ray::(\w+)\.[^\s(]+\(\)[^\n]*?\bpid=(\d+)")
# In Ray's text of a dead actor's error: its class, its pid, and Ray's reason ("The actor died because ...").
_CLASS_NAME = re.compile(r"class_name: (\S+)")
_PID = re.compile(r"\bpid: (\d+)")
_WHY = re.compile(r"The actor (?:is dead|died) because (.*?)(?: Some common causes|$)", re.S)


def _role(cls: str) -> str:
    return next((r for key, r in _ACTOR_ROLES if key in cls), "Ray actor")


def _logs_hint(args) -> str:
    if args.ray.temp_dir and not (args.ray.address or os.environ.get("RAY_ADDRESS")):
        return f"Ray's logs of every process are under {os.path.join(args.ray.temp_dir, 'session_latest', 'logs')}"
    return "pass --ray.temp_dir DIR to keep Ray's per-process logs"


def _chain(exc: Optional[BaseException]) -> List[BaseException]:
    """``exc`` and what it wraps, outermost first: Ray's ``RayTaskError.cause`` (one per caller the error
    passed through: engine -> generator -> controller -> driver), else Python's ``__cause__``."""
    out: List[BaseException] = []
    while exc is not None and all(exc is not seen for seen in out):
        out.append(exc)
        nxt = getattr(exc, "cause", None)
        exc = nxt if isinstance(nxt, BaseException) else exc.__cause__
    return out


def dead_actor(exc: BaseException):
    """The ``RayActorError`` (actor died or unreachable) at the root of ``exc``, or None.

    Ray wraps a dead actor's error in one ``RayTaskError`` per caller it passes through (engine ->
    generator -> controller -> driver); the innermost, non-task error describes the actor that died.
    """
    import ray

    for e in _chain(exc):
        if isinstance(e, ray.exceptions.RayActorError) and not isinstance(e, ray.exceptions.RayTaskError):
            return e
    return None


def exception_line(text: str) -> Optional[str]:
    """The header line (``Type: message``) of the last Python traceback in ``text``, module prefix dropped.

    Works on Ray's renderings too, where the ``Traceback (most recent call last):`` line is replaced by the
    process title (``ray::Class.method() (pid=..., ...)``): after the last such line come the indented frames,
    then the exception's first line.
    """
    lines = _ANSI.sub("", text).splitlines()
    heads = [
        i
        for i, line in enumerate(lines)
        if line.startswith("Traceback (most recent call last)") or re.search(r"(^|\s)ray::\w", line)
    ]
    if not heads:
        return None
    for line in lines[heads[-1] + 1 :]:
        if line.strip() and not line.startswith(" "):
            return re.sub(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*\.(\w+(?::|$))", r"\1", line.strip())
    return None


def _describe(e: BaseException) -> str:
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class Origin:
    """Where a failure started: the actor class and pid, and the first line of the real cause."""

    def __init__(self, cls: str = "", pid: str = "", error: str = "", died: bool = False, init: bool = False):
        self.cls, self.pid, self.error, self.died, self.init = cls, pid, error, died, init

    @property
    def role(self) -> str:
        return _role(self.cls) if self.cls else "driver (upstream's train() in this process)"

    def who(self) -> str:
        if not self.cls:
            return f"the {self.role}"
        return f"the {self.role} ({self.cls}{', pid ' + self.pid if self.pid else ''})"


def failure_origin(exc: BaseException) -> Origin:
    """Dig the failing actor and the innermost exception out of Ray's wrapped errors.

    - ``RayTaskError`` (an actor method raised), one per caller: the innermost names the actor (its process
      title, ``ray::Class.method() (pid=N, ...)``); its ``cause`` is the original exception.
    - ``ActorDiedError`` whose actor's ``__init__`` raised: Ray keeps only the text
      (``... raised in its creation task, ray::Class.__init__() (pid=...) <traceback>``).
    - ``ActorDiedError`` of a process that died: ``class_name:``, ``pid:`` and Ray's "because ..." reason.
    """
    import ray

    chain = _chain(exc)
    origin = Origin()
    for e in chain:
        if isinstance(e, ray.exceptions.RayTaskError):
            # The driver gets Ray's dual instances (``RayTaskError(X)``), which keep only the text: one header line
            # per actor the error passed through, ``ray::Class.method() (pid=N, ip=...)``, outermost first (Ray
            # also flattens the levels: measured, the controller's error holds the engine's EngineDeadError
            # itself, with the engine's header only in its text).
            headers = _HEADER.findall(_ANSI.sub("", str(e)))
            if headers:
                origin.cls, origin.pid = headers[-1]
    inner = next((e for e in reversed(chain) if not isinstance(e, ray.exceptions.RayTaskError)), chain[-1])
    if isinstance(inner, ray.exceptions.RayError):
        text = _ANSI.sub("", str(getattr(inner, "error_msg", None) or inner))
        origin.died = isinstance(inner, ray.exceptions.RayActorError)
        created = re.search(r"ray::(\w+)\.__init__\(\)[^\n]*?pid=(\d+)", text)
        cls, pid = _CLASS_NAME.search(text), _PID.search(text)
        if created:
            origin.cls, origin.pid, origin.init = created.group(1), created.group(2), True
        elif cls:
            origin.cls, origin.pid = cls.group(1), pid.group(1) if pid else ""
        why = _WHY.search(text)
        if created or not why:
            origin.error = exception_line(text) or " ".join(text.split())[:300]
        else:
            origin.error = " ".join(why.group(1).split())
    else:
        origin.error = _describe(inner)
    return origin


def actor_died_message(err, args) -> str:
    """What the user reads when an actor of the run died: which one, why (Ray's words), and what to do."""
    text = str(getattr(err, "error_msg", None) or err)
    cls = _CLASS_NAME.search(text) or re.search(r"ray::(\w+)\.", _ANSI.sub("", text))
    pid = _PID.search(text)
    cls = cls.group(1) if cls else "unknown"
    role = _role(cls)
    why = _WHY.search(text)
    why = " ".join(why.group(1).split()) if why else " ".join(text.split())[:300]
    return (
        f"the {role} ({cls}, pid {pid.group(1) if pid else '?'}, Ray actor {getattr(err, 'actor_id', '?')}) died "
        f"during the run: {why} The run stops here (fail fast): an engine or trainer cannot be replaced mid-run "
        "(its in-flight rollouts are lost and a new one would not hold the trained weights). Find the cause in "
        f"its output above (OOM killer, segfault, CUDA error; {_logs_hint(args)}), then restart; to continue from "
        "the last checkpoint pass --ckpt.load_enable (checkpoints are written every --ckpt.save_steps)."
    )


_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.I)
# A frame of upstream's or DeepSpeed's checkpoint loading in a start-up error's traceback (--ckpt.load_enable).
_CHECKPOINT_LOAD = re.compile(r"\bload_ckpt\b|\b_?load_(?:zero_)?checkpoint\b")


def _error_text(exc: BaseException) -> str:
    """Every traceback and message in ``exc``'s chain (Ray keeps the remote traceback as text)."""
    return "\n".join(f"{e}\n{getattr(e, 'traceback_str', '') or ''}" for e in _chain(exc))


_KEYS = (
    ("missing", re.compile(r"Missing key\(s\) in state_dict: ([^\n]*)")),
    ("unexpected", re.compile(r"Unexpected key\(s\) in state_dict: ([^\n]*)")),
)
_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+)")


def state_dict_detail(text: str) -> str:
    """What PyTorch's ``load_state_dict`` said differs, counted, with the first three names of each kind (the
    start-up message keeps only the cause's first line, which cuts the key lists off); "" when it named none."""
    parts = []
    for kind, pattern in _KEYS:
        found = pattern.search(text)
        keys = list(dict.fromkeys(re.findall(r'"([^"]+)"', found.group(1)))) if found else []
        if keys:
            parts.append(f"{len(keys)} {kind} key(s), e.g. {', '.join(keys[:3])}")
    sizes = list(dict.fromkeys(_SIZE_MISMATCH.findall(text)))
    if sizes:
        parts.append(f"{len(sizes)} tensor(s) of another shape, e.g. {', '.join(sizes[:3])}")
    return "; ".join(parts)


def checkpoint_load_fix(args, role: str, text: str = "") -> str:
    """The fix for a checkpoint that passed the resume's checks (``trainer/resume.py``) but does not load;
    ``text``: the error's text, for the keys that differ."""
    folder = resume.actor_dir(args.ckpt.path)
    detail = state_dict_detail(text)
    detail = f" The checkpoint and the model differ: {detail}." if detail else ""
    return (
        f"the {role} loads the checkpoint that --ckpt.load_enable resumes from (--ckpt.path {args.ckpt.path}), and it "
        "does not load: it is damaged, or was written for another model (--actor.model_name_or_path "
        f"{args.actor.model_name_or_path}) or with other --ds.* or GPU-count flags (the cause above says which)."
        f"{detail} Move its global_step* folder out of {folder} (nothing else is needed: the resume then loads the "
        "newest complete one before it), resume with the model and flags it was written with, or drop "
        "--ckpt.load_enable to start fresh"
    )


def startup_message(exc: BaseException, args) -> str:
    """A failure before training began: which role, the first line of the real cause, and the fix."""
    origin = failure_origin(exc)
    fixes = next(((load, memory) for key, load, memory in _STARTUP_FIX if key in origin.cls), None)
    if not origin.cls:
        fix = "the traceback above shows where"
    elif fixes is None:
        fix = "its output above shows why"
    elif _MEMORY.search(origin.error):
        fix = f"out of memory in the {origin.role}: {fixes[1]}"
    elif _PORT_TAKEN.search(origin.error):
        fix = (
            "a port the rank had picked for torch.distributed's rendezvous was taken before it bound it (another "
            "job starting on this machine at the same moment?); nothing is wrong with the model or flags"
        )
    elif _CHECKPOINT_LOAD.search(_error_text(exc)) and args.ckpt.load_enable:
        fix = checkpoint_load_fix(args, origin.role, _error_text(exc))
    else:
        fix = fixes[0]
    verb = "failed to start" if origin.init else "died" if origin.died else "raised"
    return (
        f"start-up failed, before training began: {origin.who()} {verb}: {origin.error}. Fix: {fix}; then run the "
        f"same command again (nothing was trained yet; {_logs_hint(args)})."
    )


def engine_dead(exc: BaseException) -> bool:
    """Whether vLLM's ``EngineDeadError`` (its EngineCore or a worker process died) is in ``exc``'s chain."""
    for e in _chain(exc):
        if "EngineDeadError" in type(e).__name__:  # vLLM's class, or Ray's RayTaskError(EngineDeadError)
            return True
        if "EngineDeadError" in str(getattr(e, "traceback_str", "") or ""):
            return True
    return False


def engine_died_message(exc: BaseException, args, started: bool) -> str:
    """Our paragraph for an engine whose own processes died (the Ray actor itself is alive and reports it)."""
    origin = failure_origin(exc)
    engine = f"{origin.cls}, pid {origin.pid}" if origin.cls else "engine actor"
    when = "during the run" if started else "at start-up, before training began"
    then = (
        "then restart; to continue from the last checkpoint pass --ckpt.load_enable (checkpoints are written every "
        "--ckpt.save_steps)"
        if started
        else "then run the same command again (nothing was trained yet)"
    )
    return (
        f"a vLLM engine's own processes died {when}: its EngineCore or a worker process is gone ({engine}; vLLM "
        "raised EngineDeadError). The run stops here (fail fast): an engine cannot be replaced mid-run (its "
        "in-flight rollouts are lost and a new one would not hold the trained weights). Find the cause in the "
        "output above: the dying process's own error is on the lines tagged (EngineCore pid=...) or (Worker "
        "pid=...); if there is none, it was killed from outside (the OOM killer: see `dmesg`; a lower "
        f"--vllm.cpu_kv_cache_gb or --vllm.gpu_memory_utilization uses less memory; {_logs_hint(args)}); {then}."
    )


def classify_failure(exc: BaseException, args, started: bool) -> Optional[RunFailed]:
    """Our error for a failure of upstream's train(), or None to let it through unchanged.

    ``started``: upstream's train() had called the controller's ``fit()`` (training began). Before that,
    every failure is a start-up failure (models, data, reward file, placement); after it, a dead actor gets
    the "died during the run" message with resume advice. An actor whose ``__init__`` raised never started,
    whenever its error reaches the driver (an engine's is first seen at the first call made to it).
    """
    written = next((e for e in _chain(exc) if type(e) is saving.OutputWriteError), None)
    if written is not None:  # the original exception (Ray's cause), whose text is our message
        return OutputFailed(str(written))
    if engine_dead(exc):
        return EngineDied(engine_died_message(exc, args, started))
    reward = reward_failure(exc)
    if reward is not None:
        return RewardFailed(reward)
    died = dead_actor(exc)
    creation = died is not None and (
        getattr(died, "actor_init_failed", False) or "raised in its creation task" in str(died)
    )
    if not started or creation:
        return StartupFailed(startup_message(exc, args))
    if died is not None:
        return ActorDied(actor_died_message(died, args))
    return None


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
    :class:`EngineDied` if a vLLM engine's own processes die. Ray's own error reaches the driver within
    seconds (Ray fails every pending call on a dead actor) and is re-raised with our message.
    """
    from openrlhf_ess.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf_ess.trainer.ray.rendezvous import role_classes
    from openrlhf_ess.trainer.ray.vllm_engine import create_vllm_engines

    # Every trainer role draws its rendezvous port outside the ephemeral range (trainer/ray/rendezvous.py).
    classes = {
        **role_classes(),
        "PolicyModelActor": PolicyModelActor,
        "create_vllm_engines": create_vllm_engines(args),
    }
    if config.sampling_mask_on(args) or config.routing_replay_on(args):  # π_ref over the kept support / replayed
        from openrlhf_ess.trainer.ray.ref_actor import ReferenceModelActor

        classes["ReferenceModelActor"] = ReferenceModelActor
    if config.needs_our_controllers(args):
        from openrlhf_ess.trainer.ppo_trainer import PPOTrainer
        from openrlhf_ess.trainer.ppo_trainer_async import PPOTrainerAsync
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
        ours = classify_failure(e, args, started.is_set())
        if ours is None:
            raise
        raise ours from e
    finally:
        import ray

        if watchdog is not None:
            watchdog.stop()
        if watch is not None and signals.received() is not None:
            end_after_a_signal(watch)  # does not return
        if watch is not None:  # one last look before Ray ends the processes: files made since the last look
            watch.sample()
        ray.shutdown()


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
        # Every input (models, prompt files, reward file, output folders, float flags) checked before Ray starts.
        notices += preflight.check(args)
    except config.ConfigError as e:
        print(f"openrlhf-ess: error: {e}", file=sys.stderr)
        sys.exit(2)
    for notice in notices:
        print(f"[openrlhf-ess] {notice}")
    try:  # one run per output folder (run_lock.py): held until this process exits, however it exits
        command = None if argv is None else ["-m", "openrlhf_ess.cli.train_ppo_ray", *argv]
        locks = run_lock.acquire_all(args, log=print, argv=command)
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
        sys.exit(1)
    finally:
        run_lock.release_all(locks)  # Ray is shut down by now (train's finally); atexit covers the rest


if __name__ == "__main__":
    main()
