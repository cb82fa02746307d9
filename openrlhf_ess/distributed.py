"""Every collective openrlhf-ess issues goes through this module.

On GPU clusters the default process group is NCCL, which takes only tensors on the current CUDA device:
a CPU tensor fails with "No backend type associated with device type cpu" — on every recipe, at the first
collective — while the gloo group of a CPU test accepts it silently. So the rule is one function,
:func:`device`, that says where a collective's tensors live, and two small collectives that put their
inputs there and hand the results back on the host. ``tests/test_device_discipline.py`` runs each caller
under a process group that, like NCCL, refuses tensors not moved to :func:`device`, and checks that no other
module of the package calls ``torch.distributed`` collectives directly.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


def device() -> torch.device:
    """The device a collective's tensors must be on: the current CUDA device (NCCL), else the CPU (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def stream():
    """The stream a PyNccl call (upstream's weight sync group) is given: the current CUDA stream, else None."""
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


def is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_max(values: Sequence[float]) -> List[float]:
    """Elementwise max of ``values`` over all ranks (every rank must call it with the same length)."""
    if not is_multi_rank():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """(ranks, *local.shape) on the host: every rank's ``local`` (same shape and dtype on every rank)."""
    if not is_multi_rank():
        return local.detach().cpu()[None]
    on_device = local.detach().to(device())
    gathered = [torch.empty_like(on_device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, on_device)
    return torch.stack(gathered).cpu()
