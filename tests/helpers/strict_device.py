"""A virtual accelerator for CPU tests: collectives that, like NCCL, refuse tensors not on the current device.

On a GPU cluster the default process group is NCCL, which takes only tensors on the current CUDA device and
fails on a CPU tensor ("No backend type associated with device type cpu"). On a CPU machine with gloo every
tensor is a CPU tensor and every collective succeeds, so that bug cannot be seen. Here the accelerator gets an
identity of its own: ``openrlhf_ess.distributed.device()`` returns ``cpu:0`` (:data:`VIRTUAL`), and a
``TorchFunctionMode`` tracks which tensors are "on" it, as CUDA's device tags would:

- created with ``device=VIRTUAL`` or moved there with ``.to(VIRTUAL)``: on it;
- ``.cpu()`` / ``.to("cpu")`` / a factory without a device: off it (a host tensor);
- any other op: on it if any tensor input is (results of CUDA ops stay on CUDA).

Collectives called from the package under test (``openrlhf_ess``; other callers, e.g. DeepSpeed's own gathers,
are not ours to check) verify every tensor argument and raise NCCL's error for the others. Each checked call is
recorded, so a test can assert that its collectives really ran.
"""

from __future__ import annotations

import contextlib
import sys
from typing import List

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

VIRTUAL = torch.device("cpu", 0)
_TAG = "_ess_on_virtual_accelerator"
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)
NCCL_ERROR = "No backend type associated with device type cpu"


def on_accelerator(t: torch.Tensor) -> bool:
    return bool(getattr(t, _TAG, False))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _as_device(x):
    if isinstance(x, torch.device):
        return x
    if isinstance(x, str):
        try:
            return torch.device(x)
        except RuntimeError:
            return None
    return None


def _target_device(func, args, kwargs):
    """The device an op explicitly puts its result on, or None when it does not say."""
    if func is torch.Tensor.cpu:
        return torch.device("cpu")
    if "device" in kwargs and kwargs["device"] is not None:
        return _as_device(kwargs["device"]) or torch.device("cpu")
    if func is torch.Tensor.to:
        for a in args[1:]:
            d = _as_device(a)
            if d is not None:
                return d
            if isinstance(a, torch.Tensor):  # .to(other): the other tensor's placement
                return VIRTUAL if on_accelerator(a) else torch.device("cpu")
    return None


class _Placement(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = list(_tensors((args, kwargs)))
        target = _target_device(func, args, kwargs)
        mark = target == VIRTUAL if target is not None else any(on_accelerator(t) for t in inputs)
        if target is not None and any(out is t for t in inputs) and on_accelerator(out) != mark:
            out = out.clone()  # a same-device .to() returns its input; on a GPU a move is a copy
        for t in _tensors(out):
            try:
                setattr(t, _TAG, mark)
            except (AttributeError, RuntimeError):
                pass
        return out


def _caller_module(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    return frame.f_globals.get("__name__", "")


@contextlib.contextmanager
def strict_collectives(checked_prefixes=("openrlhf_ess",)):
    """Run the block with the virtual accelerator; yields the list of checked collective calls (name, caller)."""
    import openrlhf_ess.distributed as ours

    calls: List[tuple] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def checking(name, original):
        def collective(*args, **kwargs):
            caller = _caller_module()
            if caller.startswith(tuple(checked_prefixes)):
                bad = [tuple(t.shape) for t in _tensors((args, kwargs)) if not on_accelerator(t)]
                if bad:
                    raise RuntimeError(
                        f"{NCCL_ERROR} (virtual NCCL: {name} from {caller} got host tensors of shapes {bad}; "
                        "put them on openrlhf_ess.distributed.device())"
                    )
                calls.append((name, caller))
            return original(*args, **kwargs)

        return collective

    saved_device = ours.device
    for name, original in originals.items():
        setattr(dist, name, checking(name, original))
    ours.device = lambda: VIRTUAL
    try:
        with _Placement():
            yield calls
    finally:
        ours.device = saved_device
        for name, original in originals.items():
            setattr(dist, name, original)
