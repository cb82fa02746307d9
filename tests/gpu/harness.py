"""What the GPU checks of tests/gpu/ share: hidden modules and stubs for what the device image lacks, the
DeepSpeed stack's shims, the single-rank environment, and the collective log."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import List, Optional

from tests.helpers.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLACK_BYTES = 256 << 10  # reduction outputs and allocator rounding on top of a memory bound
FORCED_MULTI_RANK = (
    "on a machine with one GPU (checks 1 and 6): openrlhf_ess.distributed.is_multi_rank forced to True on a world "
    "of one rank, NCCL refusing two ranks on one GPU; on the CPU (two gloo ranks) and on two or more GPUs the "
    "collectives run on two or more ranks"
)


# ---- environment: hidden modules, stubs, shims -------------------------------------------------------------


class _Hidden:
    """Wraps a meta-path finder so that the hidden top-level packages are simply not found (as if not installed)."""

    def __init__(self, finder, hidden):
        self.finder, self.hidden = finder, hidden

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.hidden:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


def hide_modules(names: List[str]) -> None:
    """``GPU_CHECK_WITHOUT`` (the runner's ``--without``): make these packages unimportable in this process (to
    exercise the SKIP and stub paths)."""
    hidden = {n for n in names if n}
    if hidden:
        sys.meta_path[:] = [_Hidden(f, hidden) for f in sys.meta_path]


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class _StubMeta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _stub_class(f"{cls.__qualname__}.{attr}")

    def __getitem__(cls, _item):
        return cls


class _StubObject(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__qualname__} was called, but it is a stub of gpu_check (the package is not installed "
            "here): this check must not use it"
        )


def _stub_class(qualname: str) -> type:
    return _StubMeta(qualname.rsplit(".", 1)[-1], (_StubObject,), {"__qualname__": qualname})


def _remote(*args, **kwargs):
    """``ray.remote``: the class or function itself (``@ray.remote`` and ``@ray.remote(num_gpus=1)``)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda target: target


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "remote" and self.__name__ == "ray":
            return _remote
        return _stub_class(f"{self.__name__}.{attr}")


class _StubFinder:
    """Imports of ``<stubbed>.anything`` give stub modules."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__gpu_check_stub__ = True
        return module

    def exec_module(self, module):
        pass


def install_stubs(roots: List[str]) -> None:
    """Module-level imports of ``roots`` succeed; any call into them raises. For packages the checks import
    (openrlhf.trainer.ray imports ray and vllm at module level) but never call."""
    if roots:
        sys.meta_path.append(_StubFinder(roots))


def uninstall_stubs() -> None:
    """Undo ``install_stubs`` (the end of a module of tests/gpu/: the rest of a pytest session sees no stubs)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _StubFinder)]
    for name in [n for n, m in list(sys.modules.items()) if isinstance(m, _StubModule)]:
        del sys.modules[name]


def stub_missing(info: dict) -> List[str]:
    """Stub ray/vllm where missing (after the ``GPU_CHECK_WITHOUT`` packages were hidden); returns notes (also
    recorded in ``info``, with the stubbed packages)."""
    notes = info.setdefault("import_notes", [])
    stubs = info.setdefault("stubs", [name for name in ("ray", "vllm") if not available(name)])
    if stubs:
        install_stubs(stubs)
    if stubs and not any(n.startswith(f"{', '.join(stubs)} not installed") for n in notes):
        notes.append(
            f"{', '.join(stubs)} not installed: stubbed (openrlhf.trainer.ray and openrlhf_ess.trainer.ray / "
            "weight_sync import them at module level; this check never calls them, and a call would raise)"
        )
    return notes


def prepare_deepspeed_stack(args, info: dict) -> List[str]:
    """For the checks that build the DeepSpeed actor: cpu_compat on CPU or its flash_attn shim on CUDA; returns
    notes (also recorded in ``info``)."""
    notes = info.setdefault("import_notes", [])
    if args.device == "cpu" and available("openrlhf"):
        from openrlhf_ess.runtime import cpu_compat

        try:
            cpu_compat.apply()  # as the tests do: the flash_attn shim and every CPU patch
        except ImportError as err:  # openrlhf incomplete: the checks that need it say so
            notes.append(f"cpu_compat.apply() stopped: {missing_reason(err)}")
    elif args.device == "cuda" and available("openrlhf") and not available("flash_attn"):
        from openrlhf_ess.runtime import cpu_compat

        # cpu_compat.apply() is a no-op where CUDA exists, but openrlhf.models imports flash_attn at module level:
        # the same shim, on its own (the sdpa attention used here never calls flash_attn).
        cpu_compat._install_flash_attn_shim()
        info["flash_attn_shim"] = True
        notes.append(
            "flash_attn not installed: cpu_compat's flash_attn shim installed (openrlhf.models imports it at "
            "module level; the sdpa attention used here never calls it)"
        )
    return notes


def torch_adam_on_cuda(args) -> Optional[str]:
    """On CUDA, unless --fused-adam: torch's AdamW instead of DeepSpeed's JIT-built FusedAdam (no nvcc build)."""
    if args.device != "cuda" or args.fused_adam:
        return None
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat._patch_torch_adam()
    return (
        "optimizer: torch AdamW (cpu_compat's torch_adam patch, also on CUDA) instead of DeepSpeed's FusedAdam, "
        "which would be JIT-built with nvcc first; --fused-adam uses FusedAdam"
    )


def single_rank_env() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def missing_reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ---- check 1: collectives on the real backend -------------------------------------------------------------


class CollectiveLog:
    """Records every torch.distributed collective issued inside the block: name and its tensors' placement."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self._saved = dist, [], {}

    def __enter__(self):
        import torch

        for name in self.NAMES:
            original = getattr(self.dist, name)
            self._saved[name] = original

            def wrapped(*args, _name=name, _original=original, **kwargs):
                tensors = []

                def walk(x):
                    if isinstance(x, torch.Tensor):
                        tensors.append(f"{x.device}/{str(x.dtype).replace('torch.', '')}")
                    elif isinstance(x, (list, tuple)):
                        for y in x:
                            walk(y)

                walk((args, tuple(kwargs.values())))
                self.calls.append({"op": _name, "tensors": sorted(set(tensors))})
                return _original(*args, **kwargs)

            setattr(self.dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(self.dist, name, original)
        return False

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def _on_device(calls: list, device) -> bool:
    return bool(calls) and all(t.split("/")[0] == str(device) for c in calls for t in c["tensors"])


def _hand_items(device):
    """Replay-buffer items of tests/helpers/ess_ds.py's fixed rollout (8 trajectories, weights 1 and 5 alternately:
    rho = 9/13, scale = sqrt(9/13) by hand), on ``device``."""
    from openrlhf.trainer.ppo_utils.experience import split_experience_batch

    from tests.helpers.ess_ds import make_rollout

    return [it.to_device(device) for it in split_experience_batch(make_rollout(100, 8))]


def _build_model_dir(root: str, spec: Optional[dict]) -> dict:
    from openrlhf_ess.tiny.world import TinyModelSpec, build_model, build_prompts

    model_dir = os.path.join(root, "model")
    build_model(model_dir, seed=0, spec=TinyModelSpec(**(spec or {})))
    return {"model": model_dir, "prompts": build_prompts(os.path.join(root, "prompts.jsonl"), n=16, seed=0)}
