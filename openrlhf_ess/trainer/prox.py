"""Where π_prox comes from (docs/prox_modes.md): weight snapshots per version, and PPO-EWMA weights.

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

Cost of a swap: this rank's stored bytes copied host -> device (pinned host memory where a CUDA device exists, so
the copy runs at the link's DMA rate), and one such copy held on the device beside the live weights while the
block runs. The actor runs every micro-batch of a version inside one block (``ProxSources.grouped_forwards``), so a
make-experience moves each stale version once; :class:`SwapStats` counts the bytes and seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from openrlhf_ess.models import sampling_mask

State = Dict[str, torch.Tensor]
EWMA_STYLES = ("hilton", "batch")  # --algo.prox_ewma_style (EwmaWeights)


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


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU tensor) in page-locked memory where a CUDA device exists, so host -> device copies of it are DMA
    transfers that need no staging copy; ``t`` itself on CPU-only torch (nothing to pin for) or if pinning fails
    (the host's locked-memory limit): the copy is then pageable, slower, and still correct."""
    if not torch.cuda.is_available() or t.is_pinned():
        return t
    try:
        return t.pin_memory()
    except RuntimeError:
        return t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t``: written straight into page-locked memory where a CUDA device exists (no pageable copy
    in between), else (CPU-only torch, or pinning refused) an ordinary one."""
    if torch.cuda.is_available():
        try:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t.detach())
        except RuntimeError:
            pass
    return t.detach().to("cpu", copy=True)


def cpu_state(module: torch.nn.Module) -> State:
    """A CPU copy (pinned where a GPU exists) of every parameter (its ZeRO-3 partition on this rank, when
    partitioned), by name."""
    return {name: host_copy(storage(p)) for name, p in module.named_parameters()}


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class SwapStats:
    """What the swaps since the last reset moved: stored bytes bound into the module (copied host -> device on a
    GPU; rebound without a copy on CPU), the seconds until they were on the device, and how many swaps."""

    bytes: int = 0
    seconds: float = 0.0
    swaps: int = 0


def device_copy(state, name: str, device: torch.device, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
    """``state[name]`` on ``device`` in ``dtype``, and the stored bytes it was made from: a non-blocking copy (the
    caller synchronises once per swap), or the state's own ``device_copy`` where it computes its values on the
    device (the EWMA's scaling)."""
    own = getattr(state, "device_copy", None)
    if own is not None:
        return own(name, device, dtype)
    t = state[name]
    return t.to(device=device, dtype=dtype, non_blocking=True), t.numel() * t.element_size()


@contextlib.contextmanager
def swapped_weights(
    module: torch.nn.Module,
    state: State,
    release_gathered: Optional[Callable[[], None]] = None,
    stats: Optional[SwapStats] = None,
) -> Iterator[None]:
    """Run the block with ``module``'s parameters replaced by ``state`` (same names, shapes as ``storage``).

    ``release_gathered`` (ZeRO-3 only: the ZeRO-3 optimizer's ``empty_partition_cache``) returns every gathered
    parameter to its partition: called before the swap and after the block, on every rank. ``stats`` (if given)
    gets this swap's bytes and the seconds its copies took (synchronised, so they are the transfer's).
    """
    partitioned = release_gathered is not None
    if partitioned:
        release_gathered()
    saved = {}
    try:
        t0, moved, device = time.perf_counter(), 0, None
        for name, p in module.named_parameters():
            target = storage(p) if partitioned else p
            saved[name] = target.data
            target.data, nbytes = device_copy(state, name, target.device, target.dtype)
            moved += nbytes
            device = target.device
        if device is not None and device.type == "cuda":  # the non-blocking copies are done before the block
            torch.cuda.current_stream(device).synchronize()
        if stats is not None:
            stats.bytes += moved
            stats.seconds += time.perf_counter() - t0
            stats.swaps += 1
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
        states = sorted(d["states"].items())
        self._states = OrderedDict((v, {n: pinned(t) for n, t in s.items()}) for v, s in states)


class _Scaled(Mapping):
    """``{name: t * factor}`` computed per access (the EWMA's bias-corrected weights without a stored copy)."""

    def __init__(self, tensors: State, factor: float):
        self._tensors, self._factor = tensors, factor

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name] * self._factor

    def device_copy(self, name: str, device: torch.device, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
        """``self[name]`` on ``device`` and the bytes moved: the stored fp32 tensor copied as it is (non-blocking
        from pinned memory), scaled and cast there; the device holds one fp32 parameter beside the swapped copy
        meanwhile. Always a new tensor (never the stored average, which later updates change in place)."""
        stored = self._tensors[name]
        scaled = stored.to(device=device, non_blocking=True) * self._factor
        return scaled.to(dtype), stored.numel() * stored.element_size()

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class EwmaWeights:
    r"""PPO-EWMA proximal weights (Hilton et al., "Batch size-invariance for policy optimization",
    arXiv 2110.00641). Kept on the host in fp32: one copy of this rank's parameters (its ZeRO-3 partition: 2·M/R for
    16-bit weights; under ZeRO 0–2 the whole model, 2·M per rank), plus one parameter at a time while updating or
    swapping in (it once held three fp32 copies). Two styles (``--algo.prox_ewma_style``):

    - ``hilton`` (as published, openai/ppo-ewma): the average starts at θ₀ with weight W₀ = 1 and, after each
      optimizer step, W_n = β W_{n−1} + 1, θ̄_n = (β W_{n−1} θ̄_{n−1} + θ_n) / W_n: the weights β^{n−k}/W_n over
      θ_0..θ_n, with no bias correction. The trainer recomputes π_prox from θ̄ for every minibatch.
    - ``batch`` (the former default): θ̄_n = β θ̄_{n−1} + (1−β) θ_n from θ̄_0 = 0, bias-corrected
      θ̂_n = θ̄_n / (1 − βⁿ) (θ₀ gets no weight); π_prox computed once per rollout batch.

    ``decay="auto"`` (``--algo.prox_ewma_decay auto``): each update passes its own β_n; in ``batch`` the bias
    correction is then 1 − Π_k β_k (θ̄_n holds 1 − Π_k β_k of total weight). A fixed decay keeps the original βⁿ.
    """

    def __init__(self, decay, style: str = "batch"):
        if style not in EWMA_STYLES:
            raise ValueError(f"unknown EWMA style {style!r}; expected one of {EWMA_STYLES}")
        self.decay, self.style = decay, style
        self.n = 0
        self.kept = 1.0  # batch: Π_k β_k over the updates so far: the weight θ̄_0 = 0 still holds
        self.total = 1.0  # hilton: W_n, the sum of the (undecayed) weights β^{n-k} over θ_0..θ_n
        self._avg: Optional[State] = None

    def start(self, module: torch.nn.Module) -> None:
        """hilton: θ̄_0 = θ₀ (this rank's storage of every parameter, fp32 on the host), W_0 = 1."""
        self._avg = {name: pinned(storage(p).detach().float().cpu().clone()) for name, p in module.named_parameters()}
        self.total = 1.0

    def update(self, module: torch.nn.Module, decay: Optional[float] = None) -> None:
        """Average in the module's weights; ``decay`` is this update's β (required when ``self.decay`` is auto)."""
        beta = self.decay if decay is None else decay
        if beta == "auto":
            raise ValueError("EwmaWeights(decay='auto').update needs this step's decay")
        if self.style == "hilton":
            if self._avg is None:
                raise RuntimeError("EwmaWeights(style='hilton') needs start(module) with θ₀ before the first update")
            total = beta * self.total + 1.0
            keep, new = beta * self.total / total, 1.0 / total
        else:
            keep, new = beta, 1 - beta
        first = self._avg is None
        if first:
            self._avg = {}
        for name, p in module.named_parameters():  # one parameter's fp32 host copy at a time, not the model's
            t = storage(p).detach().float().cpu()
            if first:
                self._avg[name] = pinned(torch.zeros_like(t))
            self._avg[name].mul_(keep).add_(t, alpha=new)
            del t
        self.n += 1
        self.kept *= beta
        if self.style == "hilton":
            self.total = total

    def state(self) -> Optional["_Scaled"]:
        """The proximal weights by name (a read-only mapping, one tensor at a time on access: the swap reads each
        parameter once, so the host holds the average plus one parameter). batch: θ̂_n, bias-corrected; hilton: θ̄_n
        itself (θ₀ before the first update)."""
        if self._avg is None:
            return None
        if self.style == "hilton":
            return _Scaled(self._avg, 1.0)
        correction = 1 - (self.kept if self.decay == "auto" else self.decay**self.n)
        return _Scaled(self._avg, 1.0 / correction)

    def nbytes(self) -> int:
        return state_bytes(self._avg) if self._avg else 0

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "n": self.n,
            "kept": self.kept,
            "avg": self._avg,
            "style": self.style,
            "total": self.total,
        }

    def load_state_dict(self, d: dict) -> None:
        style = d.get("style", "batch")  # checkpoints written before the style existed hold the batch style
        if style != self.style:
            raise ValueError(
                f"the checkpoint's EWMA weights were averaged with --algo.prox_ewma_style {style}, this run asks for "
                f"{self.style}: resume with --algo.prox_ewma_style {style}."
            )
        self.decay, self.n = d["decay"], d["n"]
        self._avg = {name: pinned(t) for name, t in d["avg"].items()} if d["avg"] is not None else None
        # checkpoints written before "kept" existed had a fixed decay
        self.kept = d.get("kept", self.decay**self.n if self.decay != "auto" else 1.0)
        self.total = d.get("total", 1.0)


# ---------------------------------------------------------------------------------------------------------
# Scoring at weight sync (interrupt and dedicated modes, docs/prox_modes.md)
#
# At the sync V -> V+1, every request that sampled tokens with V (in flight, or finished and not yet
# consumed) is reported by its engine as a token stream (prompt + output so far) with per-token versions.
# Its V tokens are scored with V's weights right then (the actor's one kept copy, or the dedicated model
# that still holds V) and kept in a ProxStore until the trainer consumes the sample.
#
# Memory of scoring at a sync (--algo.prox_score_memory_mb = B MiB; docs/prox_modes.md): one forward per group
# of g ≤ 16 streams of width W, and the LM head applied r positions at a time, so beyond the weights
#     peak ≈ r·V·b  +  g·W·H·s  +  one body forward's activations over g·W tokens  +  2·g·V·s
# with r = max(1, ⌊B / (V·b)⌋) (b = 8 fp32 bytes per logit, 32 with kept counts), g·W·H·4 ≤ B (or g = 1), s the
# model dtype's bytes. [streams, T, V] logits never exist (the old scorer held three fp32 copies of them).


MICRO_BATCH = 16  # most streams per body forward when scoring at a sync
SCORE_MEMORY_MB = 2048  # --algo.prox_score_memory_mb: the fp32 logits-derived working memory of scoring at a sync
# Bytes held per logit of a chunk at the peak: the chunk's fp32 logits + exp(x - max) of its logsumexp (plain: 8,
# measured 8.0); with kept counts also sampling_mask.apply_to_log_probs's row copy, the copy with banned stop
# tokens, top-k values and int64 indices (k up to V), then the support mask, masked copy and logsumexp temporaries
# (measured 20-24 at worst on CPU; 32 leaves room for a GPU top-k's sort buffers). tests/test_prox_scoring_memory.py.
PLAIN_BYTES_PER_LOGIT = 8
MASKED_BYTES_PER_LOGIT = 32
HIDDEN_BYTES = 4  # a group's final hidden states are budgeted as fp32 (bf16 ones take half)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM in ``model``: itself, a DeepSpeed engine's (``.module``), or the one an upstream ``Actor``
    wraps (``.model``, itself maybe an engine). Anything else is returned as it is (scored from its full logits)."""
    while True:
        inner = getattr(model, "module", None)  # a DeepSpeed engine (which also forwards its module's attributes)
        if not isinstance(inner, torch.nn.Module) and not hasattr(model, "get_output_embeddings"):
            inner = getattr(model, "model", None)  # upstream's Actor (an HF causal LM's .model is its body: kept)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def output_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The LM head (hidden -> [V] logits) that ``model``'s forward calls on its final hidden states, if any."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(getattr(head, "weight", None), torch.Tensor) else None


def head_shape(head: Optional[torch.nn.Module]) -> Tuple[int, int]:
    """(V, hidden size) of the LM head's weight (its full shape under ZeRO-3, where ``weight`` is a partition);
    (0, 0) without a head."""
    if head is None:
        return 0, 0
    shape = getattr(head.weight, "ds_shape", head.weight.shape)
    return int(shape[0]), int(shape[-1])


def rows_per_chunk(vocab: int, memory_mb: int = SCORE_MEMORY_MB, masked: bool = False) -> int:
    """Positions whose [V] logits are scored at once: r = max(1, ⌊budget / (V · b)⌋), b = the fp32 bytes held
    per logit at the peak (:data:`PLAIN_BYTES_PER_LOGIT`, or :data:`MASKED_BYTES_PER_LOGIT` with kept counts)."""
    per_row = vocab * (MASKED_BYTES_PER_LOGIT if masked else PLAIN_BYTES_PER_LOGIT)
    return max(1, memory_mb * 2**20 // max(per_row, 1))


def stream_groups(lengths, hidden_size: int = 0, memory_mb: int = SCORE_MEMORY_MB, micro_batch: int = MICRO_BATCH):
    """The streams of each body forward: consecutive runs of at most ``micro_batch`` streams whose padded hidden
    states, counted in fp32 (g · W · hidden_size · 4 bytes, W = the group's longest stream), fit the budget; a
    stream alone always forms a group. A pure function of the lengths and of settings every rank shares."""
    budget = memory_mb * 2**20
    groups, start, width = [], 0, 0
    for i, n in enumerate(lengths):
        grown = max(width, n)
        if i > start and (
            i - start + 1 > micro_batch or (i - start + 1) * grown * hidden_size * HIDDEN_BYTES > budget
        ):
            groups.append(range(start, i))
            start, grown = i, n
        width = grown
    if len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


def forwards_needed(
    streams, micro_batch: int = MICRO_BATCH, model: Optional[torch.nn.Module] = None, memory_mb: int = SCORE_MEMORY_MB
) -> int:
    """The model forwards ``stream_log_probs(model, streams, micro_batch=..., memory_mb=...)`` runs for these
    streams (one per :func:`stream_groups` group). ``streams`` may also be a count: then only the micro-batch
    bound applies (exact while no group is cut by the hidden-state budget). Under ZeRO-3 each rank computes it for
    its own streams and the ranks take the maximum (``ProxSources.score_streams``), so all run that many."""
    if isinstance(streams, int):
        return -(-streams // micro_batch)
    _, hidden = head_shape(output_head(causal_lm(model))) if model is not None else (0, 0)
    return len(stream_groups([len(s) for s in streams], hidden, memory_mb, micro_batch))


def _softcap(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The final-logit soft-capping some causal LMs (Gemma 2/3) apply after the head, in place, as they do it."""
    cap = getattr(model.config, "final_logit_softcapping", None) if hasattr(model, "config") else None
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    return logits


def chunked_log_probs(project, n_rows: int, labels, counts, temperature: float, rows: int, stop_ids=()):
    """log softmax(z_j / T)(y_j) of ``n_rows`` positions, ``rows`` at a time (at most ``rows`` · V · b bytes).

    ``project(part)`` gives the [len(part), V] logits z of the positions in the slice ``part`` (a fresh tensor,
    modified in place here); ``labels`` [n_rows] the tokens y; ``counts`` [n_rows] the kept counts (None: no
    sampling mask). log-prob = z_y/T − logsumexp(z/T), computed as (z_y/T − m) − log Σ exp(z/T − m), m = max: one
    [rows, V] temporary, no log-softmax copy. Against an fp64 reduction it is within ~2e-6 over V = 151,936, where
    fp32 ``log_softmax`` (the old scorer) is up to ~2e-5 off (tests/test_prox_scoring_memory.py).
    """
    out = None
    for start in range(0, n_rows, rows):
        part = slice(start, min(start + rows, n_rows))
        x = project(part)
        x = x.float()  # a copy unless the model is fp32 (then the fresh projection itself)
        if temperature != 1.0:
            x.div_(temperature)
        top = x.amax(-1, keepdim=True)
        log_norm = (x - top).exp_().sum(-1, keepdim=True).log_()
        y = labels[part]
        lp = (x.gather(-1, y[:, None]) - top - log_norm)[:, 0]
        del top, log_norm
        if counts is not None:
            lp, _, _ = sampling_mask.apply_to_log_probs(x, y, lp, counts[part], stop_ids)
        del x
        if out is None:
            out = torch.empty(n_rows, dtype=torch.float32, device=lp.device)
        out[part] = lp
    return out if out is not None else torch.empty(0, dtype=torch.float32)


@torch.no_grad()
def stream_log_probs(
    model: torch.nn.Module,
    streams,
    temperature: float = 1.0,
    micro_batch: int = MICRO_BATCH,
    forwards: int = 0,
    kept=None,
    stop_ids=(),
    memory_mb: int = SCORE_MEMORY_MB,
    routes=None,
):
    """log π(s_t | s_<t) for t >= 1 of each token stream, as the actor's forward computes it.

    The streams are right-padded (so position ids are 0..L-1, as upstream's Actor derives them from the
    attention mask) and the logits are divided by the sampling temperature in fp32 before the softmax.
    Returns one fp32 CPU tensor of length len(stream) - 1 per stream. ``model``: an HF causal LM, or an
    upstream ``Actor`` / DeepSpeed engine around one. ``forwards``: run at least this many forwards (padding
    with a one-token one), so ZeRO-3 ranks with fewer streams join every gather. ``kept``
    (--algo.sampling_mask keep): per stream, the engine's kept count of each token (0 for prompt tokens);
    token t's log-prob is then renormalised over its kept support (``models/sampling_mask.py``). ``routes``
    (--algo.routing_replay): per stream, the engine's routed_experts of its tokens but the last [len − 1, L, k];
    the MoE layers then use those experts (``trainer/routing_replay.py``), as every other π forward does.

    Memory (``memory_mb``, --algo.prox_score_memory_mb; docs/prox_modes.md): one model forward per group of
    :func:`stream_groups` (≤ ``micro_batch`` streams, hidden states ≤ the budget in fp32), and the LM head is
    applied to the final hidden states :func:`rows_per_chunk` positions at a time, inside the head's own call
    (so under ZeRO-3 its weight is gathered once per forward, as before) — the model's own head call then gets
    only the last position. The [streams, T, V] logits are never materialised. A model without a separable head
    (no ``get_output_embeddings``) is scored from its full logits, in the same chunks.
    """
    model = causal_lm(model)
    device = next(model.parameters()).device
    head = output_head(model)
    vocab, hidden = head_shape(head)
    groups = stream_groups([len(s) for s in streams], hidden, memory_mb, micro_batch)
    masked = kept is not None
    out = []
    for group in groups:
        chunk = [torch.as_tensor(streams[i], dtype=torch.long) for i in group]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        positions = torch.arange(width).expand(len(chunk), width)
        # the scored positions, stream-major: (stream b, position t) predicts ids[b, t + 1], t < len - 1
        sizes = [max(len(s) - 1, 0) for s in chunk]
        b_index = torch.repeat_interleave(torch.arange(len(chunk)), torch.tensor(sizes, dtype=torch.long))
        t_index = torch.cat([torch.arange(n) for n in sizes])
        labels = ids[b_index, t_index + 1].to(device)
        counts = None
        if masked:
            full = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, j in enumerate(group):
                full[i, : len(kept[j])] = torch.as_tensor(kept[j], dtype=torch.long)
            counts = full[b_index, t_index + 1].to(device)
        b_index, t_index = b_index.to(device), t_index.to(device)

        def score(logits_of, rows):
            def project(part):
                return logits_of(b_index[part], t_index[part])

            return chunked_log_probs(project, len(labels), labels, counts, temperature, rows, stop_ids)

        inputs = dict(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device))
        replay = contextlib.nullcontext()
        if routes is not None:
            from openrlhf_ess.trainer import routing_replay

            replayed = routing_replay.stream_routes([routes[i] for i in group], [len(s) for s in chunk], width)
            replay = routing_replay.applied(model, replayed)
        with replay:
            lp, logits = _forward_scoring_in_head(model, head, inputs, score, rows_per_chunk(vocab, memory_mb, masked))
        if lp is None:  # no separable head: its full logits, scored in the same chunks
            lp = score(lambda b, t, full=logits: full[b, t], rows_per_chunk(logits.shape[-1], memory_mb, masked))
        logits = None
        out.extend(torch.split(lp.cpu(), sizes))
    for _ in range(forwards - len(groups)):
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    return out


def _forward_scoring_in_head(model, head, inputs, score, rows):
    """One forward of ``model``, in which the LM head's call scores every position (``score``) from its input,
    the final hidden states, and passes on only the last position. Returns (log-probs, None), or (None, the full
    logits) when there is no head or the forward did not call it. Checks that the model's logits are the head's
    output (+ soft-capping): a model that transforms them further is refused, not scored differently."""
    if head is None:
        return None, model(**inputs).logits
    taken = {}

    def on_head(module, args):
        if not args or "lp" in taken:  # a keyword or second call: left as it is (the first is the final states)
            return None
        hidden = args[0]  # [B, W, H], in the head's own call: under ZeRO-3 its weight is gathered now
        taken["lp"] = score(lambda b, t: _softcap(model, module.forward(hidden[b, t])), rows)
        last = hidden[:, -1:]
        taken["last"] = _softcap(model, module.forward(last))
        return (last,) + tuple(args[1:])

    handle = head.register_forward_pre_hook(on_head)
    try:
        logits = model(**inputs).logits
    finally:
        handle.remove()
    if "lp" not in taken:
        return None, logits
    if logits.shape != taken["last"].shape or not torch.allclose(logits.float(), taken["last"].float()):
        raise RuntimeError(
            f"prox.stream_log_probs: {type(model).__name__}'s logits are not its LM head's output (+ soft-capping), "
            "so scoring from the head would differ from its forward; extend prox._softcap with its logit transform."
        )
    return taken["lp"], None


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
