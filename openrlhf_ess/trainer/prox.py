"""Where π_prox comes from (shared/DESIGN.md §4): weight snapshots per version, and PPO-EWMA weights.

Both are scored by the actor itself at experience-making time, by swapping the module's parameter
storage for the stored weights for one forward and swapping it back. The swap rebinds ``param.data``
(no copy of the live weights), so the optimizer state and DeepSpeed's views are untouched. It needs
full parameters on every rank, i.e. ZeRO stages 0-2 (validated in ``openrlhf_ess/config.py``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Dict, Iterator, Optional

import torch

State = Dict[str, torch.Tensor]


def cpu_state(module: torch.nn.Module) -> State:
    """A CPU copy of every parameter, by name."""
    return {name: p.detach().to("cpu", copy=True) for name, p in module.named_parameters()}


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@contextlib.contextmanager
def swapped_weights(module: torch.nn.Module, state: State) -> Iterator[None]:
    """Run the block with ``module``'s parameters replaced by ``state`` (same names, shapes)."""
    saved = {}
    try:
        for name, p in module.named_parameters():
            saved[name] = p.data
            p.data = state[name].to(device=p.device, dtype=p.dtype)
        yield
    finally:
        for name, p in module.named_parameters():
            if name in saved:
                p.data = saved[name]


class WeightSnapshots:
    """CPU copies of the weights of the last ``keep`` versions. Memory: keep × model size (host)."""

    def __init__(self, keep: int):
        self.keep = keep
        self._states: "OrderedDict[int, State]" = OrderedDict()

    def put(self, version: int, module: torch.nn.Module) -> None:
        self._states[version] = cpu_state(module)
        while len(self._states) > self.keep:
            self._states.popitem(last=False)

    def get(self, version: int) -> Optional[State]:
        return self._states.get(version)

    def versions(self):
        return list(self._states)

    def nbytes(self) -> int:
        return sum(state_bytes(s) for s in self._states.values())

    def state_dict(self) -> dict:
        return {"keep": self.keep, "states": dict(self._states)}

    def load_state_dict(self, d: dict) -> None:
        self.keep = d["keep"]
        self._states = OrderedDict(sorted(d["states"].items()))


class EwmaWeights:
    r"""PPO-EWMA proximal weights (Hilton et al., "Batch size-invariance for policy optimization",
    arXiv 2110.00641): θ̄_n = β θ̄_{n−1} + (1−β) θ_n after each optimizer step, θ̄_0 = 0, and the
    bias-corrected θ̂_n = θ̄_n / (1 − βⁿ) is the proximal policy. Kept on the host in fp32.
    """

    def __init__(self, decay: float):
        self.decay = decay
        self.n = 0
        self._avg: Optional[State] = None

    def update(self, module: torch.nn.Module) -> None:
        current = {name: p.detach().float().cpu() for name, p in module.named_parameters()}
        if self._avg is None:
            self._avg = {name: torch.zeros_like(t) for name, t in current.items()}
        for name, t in current.items():
            self._avg[name].mul_(self.decay).add_(t, alpha=1 - self.decay)
        self.n += 1

    def state(self) -> Optional[State]:
        if self._avg is None:
            return None
        correction = 1 - self.decay**self.n
        return {name: t / correction for name, t in self._avg.items()}

    def nbytes(self) -> int:
        return state_bytes(self._avg) if self._avg else 0

    def state_dict(self) -> dict:
        return {"decay": self.decay, "n": self.n, "avg": self._avg}

    def load_state_dict(self, d: dict) -> None:
        self.decay, self.n, self._avg = d["decay"], d["n"], d["avg"]
