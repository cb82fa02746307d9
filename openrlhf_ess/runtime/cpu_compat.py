"""Let upstream OpenRLHF run on a machine without CUDA. A no-op where CUDA exists.

Upstream assumes CUDA in a handful of places (measured on openrlhf 0.11.2):
it imports ``flash_attn`` at module level, calls ``torch.cuda.{set_device,current_device,synchronize}``
in the strategy, the actors and the replay buffer, and only knows bf16/fp16 parameters. Each patch
below is one :class:`Patch` with

- ``applies()``: the upstream code it works around is still there (so an upgrade that removes it
  fails a test instead of leaving a dead patch),
- ``needed()``: without the patch the call really fails on this machine,
- ``apply()``: the patch itself, idempotent,
- ``module``: the module it patches; the patch is applied the moment that module's code has run (at once if it
  already has), so a process that never imports it never pays for it.

``tests/test_cpu_compat.py`` checks the first two for every patch. Ray workers import modules fresh,
so :func:`apply` also runs in Ray's ``worker_process_setup_hook`` (``openrlhf_ess/runtime/worker_hook.py``). That hook
runs before Ray sets an actor's ``CUDA_VISIBLE_DEVICES``, so nothing here may initialise CUDA: the decision
CPU or CUDA is :func:`cuda_available`, which never calls into the CUDA runtime (``tests/test_worker_hook.py``).
It runs in every worker of a run, Ray's own small actors too (the async queue, the engine lock), which import
neither torch nor DeepSpeed: applying each patch when its module is imported (:func:`after_import`) keeps those
workers from importing the whole stack for nothing (~9 s of CPU each, measured; docs/tests.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable, Dict, List

from openrlhf_ess.runtime import quiet

_APPLIED = False


DEVICE_ENV = "OPENRLHF_ESS_DEVICE"  # "cuda" or "cpu": the run's decision, set by the CLI and forwarded to workers


def cuda_available() -> bool:
    """Whether this run uses CUDA. Never initialises CUDA (no ``cuInit``), so it is safe in Ray's worker set-up hook.

    The answer is the driver's decision when there is one (``OPENRLHF_ESS_DEVICE``, set by the CLI from the Ray
    cluster, ``cli/train_ppo_ray.py::resolve_accelerator``, and forwarded to every Ray worker), else
    :func:`node_has_cuda`. Why not ``torch.cuda.is_available()``: it calls ``cudaGetDeviceCount`` (``cuInit``),
    which fixes the process's device list; in a Ray worker that runs before Ray sets the actor's
    ``CUDA_VISIBLE_DEVICES``, so every actor of the node would then see the node's full list and upstream's
    ``set_device(0)`` would put them all on physical GPU 0.
    """
    decided = os.environ.get(DEVICE_ENV, "").strip().lower()
    if decided in ("cuda", "cpu"):
        return decided == "cuda"
    return node_has_cuda()


def node_has_cuda() -> bool:
    """Whether this node has an NVIDIA GPU that this torch can use, read without initialising CUDA.

    A CPU build of torch: no. Otherwise NVML's device count (``libnvidia-ml``, the driver's management library,
    which neither creates a context nor reads ``CUDA_VISIBLE_DEVICES``), and where NVML cannot be loaded, the
    driver's ``/proc/driver/nvidia/gpus`` listing. A process that already initialised CUDA gets torch's answer.
    """
    import torch

    if not hasattr(torch._C, "_cuda_getDeviceCount"):  # torch.cuda._is_compiled(): a CPU build
        return False
    if torch.cuda.is_initialized():
        return torch.cuda.is_available()
    try:
        count = torch.cuda._raw_device_count_nvml()
    except (AttributeError, OSError):  # no libnvidia-ml.so.1, or a torch without the helper
        count = -1
    if count >= 0:
        return count > 0
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.isdir(gpus) and bool(os.listdir(gpus))


def _source_of(module: str, attr: str) -> str:
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


def _raises(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except Exception:
        return True
    return False


@dataclass
class Patch:
    name: str
    why: str
    applies: Callable[[], bool]
    needed: Callable[[], bool]
    apply: Callable[[], None]
    module: str  # applied once this module has been imported ("" = at once)


# ---- patches applied when their module is imported ---------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a module's code has run, before the import statement that loaded it returns, so
    an importer's ``from module import name`` already sees the patched name (as if the patch had come first)."""

    def __init__(self):
        self.pending: Dict[str, List[Callable[[], None]]] = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:  # the spec the import would have found without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if not hasattr(loader, "exec_module"):
            raise ImportError(f"openrlhf-ess cannot patch {name} after its import: its loader {loader!r} is legacy")
        run_module = loader.exec_module  # each spec has a loader of its own: the wrapper is this module's only

        def exec_module(module):
            run_module(module)
            for callback in self.pending.pop(name, []):
                callback()

        loader.exec_module = exec_module
        return spec


_HOOK = _AfterImport()


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` once ``module`` has been imported: now if it has been, else right after its code runs."""
    if module in sys.modules:
        callback()
        return
    _HOOK.pending.setdefault(module, []).append(callback)
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


# ---- flash_attn import shim -------------------------------------------------------------------


def _flash_attn_missing(*_args, **_kwargs):
    raise RuntimeError(
        "flash-attn is not installed (it cannot be built without CUDA). This code path needs it: "
        "drop --ds.packing_samples / --ds.ring_attn_size on CPU, or install flash-attn on a GPU machine."
    )


def _install_flash_attn_shim() -> None:
    if "flash_attn" in sys.modules or not _flash_attn_needed():
        return
    root = types.ModuleType("flash_attn")
    root.__openrlhf_ess_shim__ = True
    root.__path__ = []  # a package, so submodule imports resolve to the entries below
    bert_padding = types.ModuleType("flash_attn.bert_padding")
    for name in ("index_first_axis", "pad_input", "unpad_input"):
        setattr(bert_padding, name, _flash_attn_missing)
    from einops import rearrange

    bert_padding.rearrange = rearrange
    utils = types.ModuleType("flash_attn.utils")
    utils.__path__ = []
    distributed = types.ModuleType("flash_attn.utils.distributed")
    distributed.all_gather = _flash_attn_missing
    root.bert_padding, root.utils, utils.distributed = bert_padding, utils, distributed
    shims = {
        "flash_attn": root,
        "flash_attn.bert_padding": bert_padding,
        "flash_attn.utils": utils,
        "flash_attn.utils.distributed": distributed,
    }
    for name, module in shims.items():
        # A spec but no version and no __file__: transformers' availability probe reports "not installed".
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=hasattr(module, "__path__"))
    sys.modules.update(shims)


def _flash_attn_needed() -> bool:
    # Search sys.path only: sys.modules holds our shim once applied.
    return importlib.machinery.PathFinder.find_spec("flash_attn") is None


def _flash_attn_applies() -> bool:
    # Located, not imported: importing openrlhf.models would need flash_attn (or the shim) already.
    root = os.path.dirname(importlib.util.find_spec("openrlhf").origin)
    with open(os.path.join(root, "models", "ring_attn_utils.py")) as f:
        return "from flash_attn" in f.read()


# ---- torch.cuda on a CPU machine --------------------------------------------------------------


def _noop(*_args, **_kwargs) -> None:
    return None


def _cpu_device(*_args, **_kwargs) -> str:
    return "cpu"


def _patch_torch_cuda(attr: str, replacement: Callable) -> Callable[[], None]:
    def apply() -> None:
        import torch

        original = getattr(torch.cuda, attr)
        if getattr(original, "__openrlhf_ess_patch__", False):
            return

        def patched(*args, **kwargs):
            return replacement(*args, **kwargs)

        patched.__openrlhf_ess_patch__ = True
        patched.__wrapped__ = original
        setattr(torch.cuda, attr, patched)

    return apply


def _cuda_call_fails(attr: str, *args) -> Callable[[], bool]:
    def needed() -> bool:
        import torch

        fn = getattr(torch.cuda, attr)
        return _raises(lambda: getattr(fn, "__wrapped__", fn)(*args))

    return needed


def _upstream_calls(module: str, attr: str, needle: str) -> Callable[[], bool]:
    return lambda: needle in _source_of(module, attr)


# ---- the replay buffer's device ---------------------------------------------------------------


def _patch_replay_buffer() -> None:
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    original = NaiveReplayBuffer.__init__
    if getattr(original, "__openrlhf_ess_patch__", False):
        return

    def __init__(self, *args, **kwargs):
        # Upstream builds torch.device(f"cuda:{current_device()}"), which is invalid on CPU.
        import torch

        # It formats current_device() into "cuda:N", which "cpu" would make invalid: answer 0 meanwhile.
        patched = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = patched
        self.target_device = torch.device("cpu")

    __init__.__openrlhf_ess_patch__ = True
    __init__.__wrapped__ = original
    NaiveReplayBuffer.__init__ = __init__


def _replay_buffer_needed() -> bool:
    import torch

    # What upstream builds when current_device() answers "cpu": not a device.
    return _raises(lambda: torch.empty(1, device=torch.device("cuda:0")))


# ---- fp32 parameters --------------------------------------------------------------------------


def _patch_fp32_dtype() -> None:
    import torch
    from openrlhf.utils import utils as upstream_utils

    original = upstream_utils.convert_to_torch_dtype
    if getattr(original, "__openrlhf_ess_patch__", False):
        return

    def convert_to_torch_dtype(param_dtype: str):
        # fp32 lets CPU runs compare vLLM and HF log-probs at 1e-5 (bf16 differs by ~0.1).
        return torch.float32 if param_dtype == "fp32" else original(param_dtype)

    convert_to_torch_dtype.__openrlhf_ess_patch__ = True
    convert_to_torch_dtype.__wrapped__ = original
    upstream_utils.convert_to_torch_dtype = convert_to_torch_dtype
    # actor.py and model.py import the function inside their constructors, from this module.


def _fp32_needed() -> bool:
    from openrlhf.utils import utils as upstream_utils

    fn = upstream_utils.convert_to_torch_dtype
    return _raises(lambda: getattr(fn, "__wrapped__", fn)("fp32"))


def _fp32_applies() -> bool:
    return "fp16" in _source_of("openrlhf.utils.utils", "convert_to_torch_dtype")


# ---- torch Adam instead of a JIT-built CPU Adam ------------------------------------------------


def _patch_torch_adam() -> None:
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy

    original = DeepspeedStrategy.get_ds_train_config
    if getattr(original, "__openrlhf_ess_patch__", False):
        return

    def get_ds_train_config(self, optim_dict=None, **kwargs):
        # DeepSpeed would JIT-compile its CPU Adam op (~95 s on 2 cores) for the "AdamW" config;
        # torch's AdamW computes the same update and needs no build.
        if optim_dict is not None and optim_dict.get("type") == "AdamW":
            optim_dict = {**optim_dict, "params": {**optim_dict["params"], "torch_adam": True}}
        return original(self, optim_dict, **kwargs)

    get_ds_train_config.__openrlhf_ess_patch__ = True
    get_ds_train_config.__wrapped__ = original
    DeepspeedStrategy.get_ds_train_config = get_ds_train_config


def _cpu_adam_not_prebuilt() -> bool:
    from deepspeed.git_version_info import installed_ops

    return not installed_ops.get("cpu_adam", False)


# ---- ZeRO-3 gathers wait for their collectives ------------------------------------------------


class _CompletedCollectives(types.ModuleType):
    """``deepspeed.comm`` as seen by ZeRO-3's partition code, with every async collective complete on return."""

    def __init__(self, comm):
        super().__init__(comm.__name__)
        self.__openrlhf_ess_patch__ = True
        self.__wrapped__ = comm

    def __getattr__(self, name):
        attr = getattr(self.__wrapped__, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args, **kwargs):
            handle = attr(*args, **kwargs)
            if kwargs.get("async_op") and handle is not None:
                handle.wait()
            return handle

        return call


def _patch_zero3_gathers() -> None:
    from deepspeed.runtime.zero import partition_parameters

    if getattr(partition_parameters.dist, "__openrlhf_ess_patch__", False):
        return
    # A handle that is waited on again later is simply complete then.
    partition_parameters.dist = _CompletedCollectives(partition_parameters.dist)


def _zero3_gathers_need_ordering() -> bool:
    # DeepSpeed calls the CPU a synchronised device (no stream ordering to wait for), but gloo runs async
    # collectives on worker threads: waiting for the last of several all-gathers does not finish the others.
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu" and get_accelerator().resolves_data_dependency()


PATCHES: List[Patch] = [
    Patch(
        "flash_attn shim",
        "openrlhf.models.ring_attn_utils imports flash_attn at module level; flash-attn needs CUDA to build",
        _flash_attn_applies,
        _flash_attn_needed,
        _install_flash_attn_shim,
        "",
    ),
    Patch(
        "torch.cuda.set_device",
        "DeepspeedStrategy.setup_distributed calls it whenever LOCAL_RANK is set",
        _upstream_calls("openrlhf.utils.deepspeed.deepspeed", "DeepspeedStrategy.setup_distributed", "set_device"),
        _cuda_call_fails("set_device", 0),
        _patch_torch_cuda("set_device", _noop),
        "torch",
    ),
    Patch(
        "torch.cuda.current_device",
        "actors, critic and strategy move tensors to torch.cuda.current_device()",
        _upstream_calls("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer.ppo_train", "torch.cuda.current_device()"),
        _cuda_call_fails("current_device"),
        _patch_torch_cuda("current_device", _cpu_device),
        "torch",
    ),
    Patch(
        "torch.cuda.synchronize",
        "torch_dist_barrier_and_cuda_sync and the actors' fit() call it",
        _upstream_calls(
            "openrlhf.utils.distributed_util", "torch_dist_barrier_and_cuda_sync", "torch.cuda.synchronize()"
        ),
        _cuda_call_fails("synchronize"),
        _patch_torch_cuda("synchronize", _noop),
        "torch",
    ),
    Patch(
        "replay buffer device",
        "NaiveReplayBuffer sets target_device = cuda:<current_device()>",
        _upstream_calls("openrlhf.trainer.ppo_utils.replay_buffer", "NaiveReplayBuffer.__init__", 'f"cuda:'),
        _replay_buffer_needed,
        _patch_replay_buffer,
        "openrlhf.trainer.ppo_utils.replay_buffer",
    ),
    Patch(
        "fp32 param dtype",
        "convert_to_torch_dtype knows bf16/fp16 only; exactness checks on CPU need fp32",
        _fp32_applies,
        _fp32_needed,
        _patch_fp32_dtype,
        "openrlhf.utils.utils",
    ),
    Patch(
        "torch AdamW on CPU",
        "the strategy asks DeepSpeed for AdamW by config, which JIT-builds the CPU Adam op on first use",
        _upstream_calls("openrlhf.utils.deepspeed.deepspeed", "DeepspeedStrategy._ds_init_train_model", '"AdamW"'),
        _cpu_adam_not_prebuilt,
        _patch_torch_adam,
        "openrlhf.utils.deepspeed.deepspeed",
    ),
    Patch(
        "ZeRO-3 all-gathers complete on CPU",
        "ZeRO-3's coalesced gather (GatheredParameters, weight sync) launches one async all-gather per "
        "parameter and waits for the last only, relying on stream order that gloo's threads do not give: "
        "with two CPU ranks some gathered weights were read before they arrived (garbage, NaN). Fixed upstream "
        "by deepspeedai/DeepSpeed#8539 (wait for every handle), not in the pinned release: when a bump brings "
        "it, applies() fails and this patch goes",
        _upstream_calls(
            "deepspeed.runtime.zero.partition_parameters",
            "Init._allgather_params_coalesced",
            "launch_handles[-1].wait()",
        ),
        _zero3_gathers_need_ordering,
        _patch_zero3_gathers,
        "deepspeed.runtime.zero.partition_parameters",
    ),
]


def apply() -> None:
    """Apply every patch, once per process, each as its module is imported (:func:`after_import`), and the filters
    of :mod:`openrlhf_ess.runtime.quiet`. When the run uses CUDA: the filters that hold on GPUs too, and nothing
    else (no patch, no import)."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cpu = not cuda_available()
    quiet.install(cpu, after_import)  # third-party noise, each message by its exact text (quiet.py)
    if not cpu:
        return
    if os.environ.get(DEVICE_ENV, "").strip().lower() == "cpu":
        # The run's decision (Ray workers, and the vLLM processes they start, inherit it): DeepSpeed need not guess
        # and warn "Setting accelerator to CPU" in each. Not on the driver before it has decided: it may yet
        # decide CUDA for a cluster, and it forwards this variable to every worker.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # The shim must come before anything imports openrlhf.models.
    _install_flash_attn_shim()
    for patch in PATCHES:
        if patch.module:
            after_import(patch.module, patch.apply)
        else:
            patch.apply()
