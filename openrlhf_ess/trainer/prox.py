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


# ---------------------------------------------------------------------------------------------------------
# Scoring at weight sync (interrupt and dedicated modes, shared/DESIGN.md §4)
#
# At the sync V -> V+1, every request that sampled tokens with V (in flight, or finished and not yet
# consumed) is reported by its engine as a token stream (prompt + output so far) with per-token versions.
# Its V tokens are scored with V's weights right then (the actor's one kept copy, or the dedicated model
# that still holds V) and kept in a ProxStore until the trainer consumes the sample.


@torch.no_grad()
def stream_log_probs(model: torch.nn.Module, streams, temperature: float = 1.0, micro_batch: int = 16):
    """log π(s_t | s_<t) for t >= 1 of each token stream, as the actor's forward computes it.

    The streams are right-padded (so position ids are 0..L-1, as upstream's Actor derives them from the
    attention mask) and the logits are divided by the sampling temperature in fp32 before the softmax.
    Returns one fp32 CPU tensor of length len(stream) - 1 per stream.
    """
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(streams), micro_batch):
        chunk = [torch.as_tensor(s, dtype=torch.long) for s in streams[start : start + micro_batch]]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        positions = torch.arange(width).expand(len(chunk), width)
        logits = model(
            input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device)
        ).logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu()
        out.extend(lp[i, : len(s) - 1] for i, s in enumerate(chunk))
    return out


class ProxStore:
    """π_prox of tokens scored at a weight sync, until the trainer consumes their sample.

    Keyed by content: (the token stream up to the last token of version v, v). Two samples with the same
    prefix and versions have the same π_prox, so content addressing is exact; a count per key lets each
    copy consume it once. Entries older than ``keep_versions`` syncs are dropped (their samples can no
    longer be consumed without exceeding the queue's lag), so the store stays bounded.
    """

    def __init__(self, keep_versions: int):
        self.keep_versions = keep_versions
        self._entries: Dict[tuple, list] = {}  # (stream prefix, version) -> [log-probs (len - 1,), count]

    def put(self, stream, versions, version: int, log_probs: torch.Tensor) -> None:
        """``versions``: per stream token (prompt tokens NO_VERSION); ``log_probs``: per token t >= 1."""
        end = max(i for i, v in enumerate(versions) if v == version) + 1
        key = (tuple(stream[:end]), version)
        if key in self._entries:
            self._entries[key][1] += 1
        else:
            self._entries[key] = [log_probs[: end - 1].clone(), 1]

    def take(self, stream, action_versions, version: int) -> Optional[torch.Tensor]:
        """π_prox for the action positions (token t -> column t - 1) of ``stream`` sampled by ``version``.

        ``action_versions`` is the sample's per-column version row. Returns the log-probs up to the last
        such column (a prefix of the columns), or None when nothing was stored for it.
        """
        columns = [c for c, v in enumerate(action_versions) if v == version]
        end = columns[-1] + 2  # token index of the last column, + 1
        key = (tuple(stream[:end]), version)
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry[1] -= 1
        if entry[1] == 0:
            del self._entries[key]
        return entry[0]

    def evict_before(self, version: int) -> int:
        """Drop entries of versions < ``version - keep_versions``; returns how many were dropped."""
        old = [k for k in self._entries if k[1] < version - self.keep_versions]
        for k in old:
            del self._entries[k]
        return len(old)

    def __len__(self) -> int:
        return len(self._entries)
