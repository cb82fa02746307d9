"""Failure triage: Ray's wrapped errors and traceback text, turned into the message the CLI prints.

Upstream's ``train()`` fails with Ray's own exceptions (``RayTaskError`` once per caller the error passed through,
``ActorDiedError``, vLLM's ``EngineDeadError``), often with only the remote traceback as text. :func:`classify_failure`
finds where it started (which actor, which role, the first line of the real cause) and returns our
:class:`RunFailed` with the fix, or None to let the error through. Used by ``cli/train_ppo_ray.py::train``.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional

from openrlhf_ess.trainer import resume, saving


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


def _replace_hint(engine: bool, args) -> str:
    """Why the run stops rather than replace the actor that died, and which flag would have gone on."""
    if engine:
        n = args.vllm.max_restarts
        if n > 0:
            return f"this run's --vllm.max_restarts {n} replacement(s) are used, or the new engine did not start"
        return (
            "a dead vLLM engine is replaced in place only with --vllm.max_restarts N (its in-flight rollouts "
            "generated again, checked before training)"
        )
    return (
        "a trainer rank cannot be replaced mid-run (its ZeRO shards and optimizer state die with it); "
        "--train.auto_resume N restarts the job from its newest complete checkpoint"
    )


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
        f"during the run: {why} The run stops here (fail fast): {_replace_hint(role == 'vLLM engine', args)}. "
        f"Find the cause in its output above (OOM killer, segfault, CUDA error; {_logs_hint(args)}), then restart; "
        "to continue from the last checkpoint pass --ckpt.load_enable (checkpoints are written every "
        "--ckpt.save_steps)."
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
        f"raised EngineDeadError). The run stops here (fail fast): {_replace_hint(True, args)}. Find the cause in "
        "the output above: the dying process's own error is on the lines tagged (EngineCore pid=...) or (Worker "
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
