"""Where π_prox comes from (shared/DESIGN.md §4): weight snapshots per version, and PPO-EWMA weights.

Both are scored by the actor itself, by swapping the module's parameter storage for the stored weights
for one forward and swapping it back. The swap rebinds ``.data`` (no copy of the live weights), so the
optimizer state and DeepSpeed's views are untouched.

ZeRO-3 keeps only this rank's partition of each parameter (``param.ds_tensor``; ``param.data`` is empty
outside a gather, except for the small "persistent" parameters, which stay gathered). There the stored
states are partitions too (host memory per rank: model size / ranks per version), and the swap replaces
each partition: every gathered copy is released first (DeepSpeed's ``empty_partition_cache``), so the
forward's gathers read the swapped partitions, and released again after it, so no gathered copy of the
stored weights outlives the block. Every rank must run the same swapped forwards (the gathers are
collective); the actor agrees on them across ranks. This is the one place that touches ZeRO-3's
parameter internals (``ds_tensor``, ``ds_persist``, ``ds_secondary_tensor``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Dict, Iterator, Optional

import torch

from openrlhf_ess.models import sampling_mask

State = Dict[str, torch.Tensor]


def is_partitioned(module: torch.nn.Module) -> bool:
    """True when ZeRO-3 partitions ``module``'s parameters (each rank holds a ``ds_tensor`` shard)."""
    return any(hasattr(p, "ds_tensor") for p in module.parameters())


def storage(param: torch.nn.Parameter) -> torch.Tensor:
    """What holds this rank's values of ``param``: the parameter itself, or its ZeRO-3 partition."""
    shard = getattr(param, "ds_tensor", None)
    if shard is None:
        return param
    if getattr(param, "ds_secondary_tensor", None) is not None or hasattr(shard, "ds_quant_scale"):
        # ZeRO++ (hpZ, quantized weights) gathers from other copies than ds_tensor: a swap would be ignored
        raise RuntimeError(
            "π_prox weight swap under ZeRO-3 needs plain partitions: drop --ds.zpg (ZeRO++ hpZ) or use "
            "--algo.prox_mode dedicated."
        )
    return shard


def cpu_state(module: torch.nn.Module) -> State:
    """A CPU copy of every parameter (its ZeRO-3 partition on this rank, when partitioned), by name."""
    return {name: storage(p).detach().to("cpu", copy=True) for name, p in module.named_parameters()}


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@contextlib.contextmanager
def swapped_weights(
    module: torch.nn.Module, state: State, release_gathered: Optional[Callable[[], None]] = None
) -> Iterator[None]:
    """Run the block with ``module``'s parameters replaced by ``state`` (same names, shapes as ``storage``).

    ``release_gathered`` (ZeRO-3 only: the ZeRO-3 optimizer's ``empty_partition_cache``) returns every gathered
    parameter to its partition: called before the swap and after the block, on every rank.
    """
    partitioned = release_gathered is not None
    if partitioned:
        release_gathered()
    saved = {}
    try:
        for name, p in module.named_parameters():
            target = storage(p) if partitioned else p
            saved[name] = target.data
            target.data = state[name].to(device=target.device, dtype=target.dtype)
        yield
    finally:
        if partitioned:
            release_gathered()  # drop the gathered copies of ``state``
        persistent = []
        for name, p in module.named_parameters():
            if name in saved:
                (storage(p) if partitioned else p).data = saved[name]
                if partitioned and getattr(p, "ds_persist", False):
                    persistent.append(p)
        if persistent:  # as DeepSpeed leaves them after an optimizer step: gathered, from the live partitions
            persistent[0].all_gather(persistent)


class WeightSnapshots:
    """CPU copies of the weights of the last ``keep`` versions. Host memory: keep × model size, per rank
    (keep × model size / ranks under ZeRO-3, which stores each rank's partition)."""

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

    ``decay="auto"`` (``--algo.prox_ewma_decay auto``): each update passes its own β_n, and the bias correction
    is 1 − Π_k β_k (the same identity: θ̄_n holds 1 − Π_k β_k of total weight). A fixed decay keeps the
    original βⁿ arithmetic.
    """

    def __init__(self, decay):
        self.decay = decay
        self.n = 0
        self.kept = 1.0  # Π_k β_k over the updates so far: the weight θ̄_0 = 0 still holds
        self._avg: Optional[State] = None

    def update(self, module: torch.nn.Module, decay: Optional[float] = None) -> None:
        """Average in the module's weights; ``decay`` is this update's β (required when ``self.decay`` is auto)."""
        beta = self.decay if decay is None else decay
        if beta == "auto":
            raise ValueError("EwmaWeights(decay='auto').update needs this step's decay")
        current = {name: storage(p).detach().float().cpu() for name, p in module.named_parameters()}
        if self._avg is None:
            self._avg = {name: torch.zeros_like(t) for name, t in current.items()}
        for name, t in current.items():
            self._avg[name].mul_(beta).add_(t, alpha=1 - beta)
        self.n += 1
        self.kept *= beta

    def state(self) -> Optional[State]:
        if self._avg is None:
            return None
        correction = 1 - (self.kept if self.decay == "auto" else self.decay**self.n)
        return {name: t / correction for name, t in self._avg.items()}

    def nbytes(self) -> int:
        return state_bytes(self._avg) if self._avg else 0

    def state_dict(self) -> dict:
        return {"decay": self.decay, "n": self.n, "kept": self.kept, "avg": self._avg}

    def load_state_dict(self, d: dict) -> None:
        self.decay, self.n, self._avg = d["decay"], d["n"], d["avg"]
        # checkpoints written before "kept" existed had a fixed decay
        self.kept = d.get("kept", self.decay**self.n if self.decay != "auto" else 1.0)


# ---------------------------------------------------------------------------------------------------------
# Scoring at weight sync (interrupt and dedicated modes, shared/DESIGN.md §4)
#
# At the sync V -> V+1, every request that sampled tokens with V (in flight, or finished and not yet
# consumed) is reported by its engine as a token stream (prompt + output so far) with per-token versions.
# Its V tokens are scored with V's weights right then (the actor's one kept copy, or the dedicated model
# that still holds V) and kept in a ProxStore until the trainer consumes the sample.


MICRO_BATCH = 16  # streams per forward when scoring at a sync


@torch.no_grad()
def stream_log_probs(
    model: torch.nn.Module,
    streams,
    temperature: float = 1.0,
    micro_batch: int = MICRO_BATCH,
    forwards: int = 0,
    kept=None,
    stop_ids=(),
):
    """log π(s_t | s_<t) for t >= 1 of each token stream, as the actor's forward computes it.

    The streams are right-padded (so position ids are 0..L-1, as upstream's Actor derives them from the
    attention mask) and the logits are divided by the sampling temperature in fp32 before the softmax.
    Returns one fp32 CPU tensor of length len(stream) - 1 per stream. ``forwards``: run at least this many
    forwards (padding with a one-token one), so ZeRO-3 ranks with fewer streams join every gather.
    ``kept`` (--algo.sampling_mask keep): per stream, the engine's kept count of each token (0 for prompt
    tokens); token t's log-prob is then renormalised over its kept support (``models/sampling_mask.py``).
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
        labels = ids[:, 1:].to(device)
        lp = logits[:, :-1].log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        if kept is not None:
            counts = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, k in enumerate(kept[start : start + micro_batch]):
                counts[i, : len(k)] = torch.as_tensor(k, dtype=torch.long)
            lp, _, _ = sampling_mask.apply_to_log_probs(logits[:, :-1], labels, lp, counts[:, 1:].to(device), stop_ids)
        lp = lp.cpu()
        out.extend(lp[i, : len(s) - 1] for i, s in enumerate(chunk))
    for _ in range(forwards - forwards_needed(len(streams), micro_batch)):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    return out


def forwards_needed(n_streams: int, micro_batch: int = MICRO_BATCH) -> int:
    return -(-n_streams // micro_batch)


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
