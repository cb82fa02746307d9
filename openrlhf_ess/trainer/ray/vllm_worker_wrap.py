"""vLLM worker extension: upstream's ``WorkerWrap`` plus a weight load that works without NCCL.

Mirrors ``openrlhf/trainer/ray/vllm_worker_wrap.py``. Upstream receives weights tensor by tensor over
NCCL (or CUDA IPC) and calls ``model.load_weights`` per tensor. On a CPU machine neither transport
exists (upstream's gloo path returns silently and leaves the engine on uninitialised memory), and
vLLM's CPU linears are repacked after loading, so per-tensor ``load_weights`` is rejected. Here the
trainer ships the weights as safetensors messages of at most :data:`RELOAD_MESSAGE_BYTES` each
(:func:`weight_messages`); every worker stages them (:class:`StagedWeights`) and, at the last one, loads the
whole set in one pass with vLLM's own ``reload_weights``, which re-runs the post-load processing (repacking)
correctly on every backend, but for a tied LM head, which it never reloads (:func:`refresh_tied_heads`).
"""

import json
import threading
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap as _UpstreamWorkerWrap

RELOAD_MESSAGE_BYTES = 1 << 30
"""The most bytes one message of a ``reload`` weight sync may hold, header included (1 GiB).

Each message crosses vLLM's engine-core client, which msgpack-encodes a utility call's arguments
(``vllm/v1/engine/core_client.py``); msgspec refuses a bytes object of 2**32 bytes or more, so one blob of a
bf16 model above ~2B parameters could never be sent. 1 GiB stays far below that and keeps every copy of a
message small. Peak host memory: on the trainer's rank 0, the message being built (its tensors, then their
serialisation: about 3 x this bound) plus Ray's copy of it for each engine while the engines take it, never
the whole model (``--algo.prox_mode dedicated`` keeps the sync's messages, one copy of the model, for the
dedicated model); in each engine worker, the staged weights (one copy of the model, handed to vLLM's loader
tensor by tensor and released as it goes) plus the message being staged and its decoded tensors (2 x this
bound). Tests lower it to send a tiny model in many messages."""

_HEADER_BYTES = 256  # a message's fixed header: its length prefix, metadata keys and part number, alignment padding
_DTYPE_BYTES = 64  # one tensor's header entry but its name and shape: '{"dtype":"F8_E4M3","shape":[],...[a,b]}'
_NUMBER_BYTES = 21  # one integer (shape dimension or offset) in a header, with its separator


def _entry_bytes(name: str, ndim: int) -> int:
    """An upper bound on the header bytes of one whole tensor of ``ndim`` dimensions in a message."""
    return len(json.dumps(name)) + _DTYPE_BYTES + _NUMBER_BYTES * (ndim + 2)


def _piece_bytes(name: str, ndim: int) -> int:
    """An upper bound on the header bytes of one piece of a split tensor: its 1-D entry, and its shape and first
    element in the ``split`` metadata (JSON inside a JSON string: every character may be escaped once)."""
    return _entry_bytes(name, 1) + 2 * (len(json.dumps(name)) + 8 + _NUMBER_BYTES * (ndim + 1))


class _Planner:
    """Places tensors, in order, into messages of at most ``bound`` bytes (see :func:`plan_messages`)."""

    def __init__(self, bound: int):
        self.capacity = bound - _HEADER_BYTES
        self.room = self.capacity  # what the current message has left
        self.empty = True

    def _open(self) -> None:
        self.room, self.empty = self.capacity, True

    def place(self, name: str, shape: Sequence[int], element_size: int) -> List[Tuple[bool, int, int, bool]]:
        """(starts a new message, first element, end element, split) of each piece of one tensor."""
        numel = 1
        for d in shape:
            numel *= int(d)
        whole = numel * element_size + _entry_bytes(name, len(shape))
        if whole <= self.capacity:  # never split a tensor that fits in a message of its own
            new = whole > self.room and not self.empty
            if new:
                self._open()
            self.room, self.empty = self.room - whole, False
            return [(new, 0, numel, False)]
        overhead = _piece_bytes(name, len(shape))
        if (self.capacity - overhead) // element_size < 1:
            raise ValueError(
                f"a reload message of {self.capacity + _HEADER_BYTES} bytes cannot hold one element of {name}"
            )
        pieces, start, new = [], 0, False
        while start < numel:
            fits = (self.room - overhead) // element_size
            if fits < 1:
                self._open()
                new = True
                continue
            end = min(numel, start + fits)
            pieces.append((new, start, end, True))
            self.room, self.empty, new, start = self.room - overhead - (end - start) * element_size, False, False, end
        return pieces


def plan_messages(entries: Iterable[Tuple[str, Sequence[int], int]], bound: int) -> List[List[Tuple[str, int, int]]]:
    """How :func:`weight_messages` packs tensors ``(name, shape, element size)`` into messages of at most ``bound``
    bytes: per message, its ``(name, first element, end element)`` pieces of the flattened tensors.

    Tensors go in order; one that does not fit in what is left of the current message starts the next, and one
    larger than a whole message is split by elements, its first piece filling the current message. A 0-element
    tensor is a piece of its own (its shape must arrive)."""
    planner, messages = _Planner(bound), [[]]
    for name, shape, element_size in entries:
        for new, start, end, _ in planner.place(name, shape, element_size):
            if new:
                messages.append([])
            messages[-1].append((name, start, end))
    return messages if messages[0] else []


def weight_messages(
    named: Iterable[Tuple[str, torch.Tensor]], bound: Optional[int] = None
) -> Iterator[Tuple[bytes, bool]]:
    """The tensors as safetensors messages of at most ``bound`` bytes (default :data:`RELOAD_MESSAGE_BYTES`), each
    with whether it is the last, in the plan of :func:`plan_messages`. Lazy: a tensor is copied to the host (only
    the part a message takes) when its message is built, so under ZeRO-3 the caller may gather one parameter at a
    time. A whole tensor keeps its name and shape; a piece of a split one is a 1-D tensor under the same name, its
    shape and first element in the message's ``split`` metadata; ``part`` numbers the messages of one sync."""
    from safetensors.torch import save

    bound = RELOAD_MESSAGE_BYTES if bound is None else bound
    planner, tensors, split, part = _Planner(bound), {}, {}, 0

    def message() -> bytes:
        blob = save(tensors, metadata={"part": str(part), "split": json.dumps(split)})
        if len(blob) > bound:  # the header bound above is wrong: a bug, never a message vLLM would refuse later
            raise RuntimeError(f"reload message {part} has {len(blob)} bytes, above its bound of {bound}")
        return blob

    for name, tensor in named:
        tensor = tensor.detach()
        for new, start, end, is_piece in planner.place(name, tuple(tensor.shape), tensor.element_size()):
            if new:
                yield message(), False
                tensors, split, part = {}, {}, part + 1
            if is_piece:
                tensors[name] = tensor.reshape(-1)[start:end].to("cpu", copy=True)
                split[name] = [list(tensor.shape), start]
            else:
                tensors[name] = tensor.to("cpu", copy=True).contiguous()
    yield message(), True


def _header(blob: bytes) -> dict:
    """A safetensors blob's metadata (its header's ``__metadata__``)."""
    n = int.from_bytes(blob[:8], "little")
    return json.loads(bytes(blob[8 : 8 + n])).get("__metadata__") or {}


class StagedWeights:
    """The messages of one sync received so far, reassembled into whole tensors by HF name.

    A message without a ``part`` (a plain safetensors file of whole tensors) or with part 0 starts a new sync;
    another part must follow the previous one, else a sync was interrupted and its remains would mix with this
    one. :meth:`complete` refuses a split tensor with pieces missing."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}
        self._missing: Dict[str, int] = {}  # split tensors: elements not yet received
        self._parts = 0

    def add(self, blob: bytes) -> int:
        """Stage one message; returns its tensor count."""
        from safetensors.torch import load

        meta = _header(blob)
        part = int(meta.get("part", 0))
        if part == 0:
            self._reset()
        elif part != self._parts:
            raise RuntimeError(
                f"weight sync message {part} arrived after {self._parts} of its sync: a sync was interrupted; "
                "send the whole sync again"
            )
        self._parts = part + 1
        split = json.loads(meta.get("split") or "{}")
        received = load(blob)
        for name, t in received.items():
            if name not in split:
                self.tensors[name] = t
                continue
            shape, start = split[name]
            if name not in self.tensors:
                self.tensors[name] = torch.empty(shape, dtype=t.dtype)
                self._missing[name] = self.tensors[name].numel()
            flat = self.tensors[name].view(-1)
            if start + t.numel() > flat.numel():
                raise RuntimeError(f"weight sync message {part}: a piece of {name} lies outside its shape {shape}")
            flat[start : start + t.numel()].copy_(t)
            self._missing[name] -= t.numel()
        return len(received)

    def complete(self) -> Dict[str, torch.Tensor]:
        """The staged tensors, every split one whole (else RuntimeError naming them)."""
        short = sorted(name for name, n in self._missing.items() if n != 0)
        if short:
            raise RuntimeError(f"weight sync: pieces of {', '.join(short[:5])} never arrived")
        return self.tensors


def assemble(messages: Iterable[bytes]) -> Dict[str, torch.Tensor]:
    """The whole tensors of one sync's messages (:func:`weight_messages`), in one process."""
    staged = StagedWeights()
    for blob in messages:
        staged.add(blob)
    return staged.complete()


def _drain(tensors: Dict[str, torch.Tensor]) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield and forget each tensor, in order: the loader's copy replaces the staged one, not both kept."""
    for name in list(tensors):
        yield name, tensors.pop(name)


def checkpoint_files(model: str, revision: Optional[str] = None) -> List[str]:
    """The safetensors files of the checkpoint vLLM loaded an engine from: ``model`` (its ``model_config.model``) as
    a folder, or a Hugging Face repository in the local cache (vLLM downloaded it there at the engine's start; no
    download here). Empty when there is none (a ``.bin`` checkpoint, a cache cleared since)."""
    import glob
    import os

    folder = model
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(
                model, revision=revision, allow_patterns=["*.safetensors"], local_files_only=True
            )
        except Exception:  # noqa: BLE001 - no local copy: the check reports the coverage it has
            return []
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def received_checksums(worker, model: torch.nn.Module) -> dict:
    """A worker's sums of what vLLM's loader received, for the weights it emptied (repacked): those of the last
    sync's load; before any weight reached this engine, those of the checkpoint it loaded at its start (an engine that
    replaces a dead or hung one before the run's first sync holds the pretrained weights, loaded by vLLM itself:
    without them its repacked linears could not be compared, and the check after its replacement failed on
    coverage). Read once, only for emptied weights (vLLM's CPU backend; a GPU engine empties none)."""
    loaded = getattr(worker, "_loaded_checksums", None)
    if loaded is not None or getattr(worker, "_weights_received", False):
        return loaded or {}
    start = getattr(worker, "_start_checksums", None)
    if start is None:
        from openrlhf_ess.trainer.sync_check import checkpoint_checksums, emptied_names

        emptied, config = emptied_names(model), getattr(worker.model_runner, "model_config", None)
        files = checkpoint_files(config.model, getattr(config, "revision", None)) if emptied and config else []
        start = {}
        if files:
            dtype = config.dtype  # else the dtype the engine's weights hold
            if not isinstance(dtype, torch.dtype):
                dtype = next(p.dtype for _, p in model.named_parameters() if p.numel())
            start = checkpoint_checksums(files, emptied, dtype)
        worker._start_checksums = start
    return start


def tied_heads(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of every unquantized vLLM LM head whose weight is another module's (tied input and output
    embeddings: ``ParallelLMHead.tie_weights`` registers the embedding's parameter on the head). A quantized head is
    left out: its processing transforms the weight, and its kernel's output is not the weight's columns."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    holders: Dict[int, int] = {}  # id(parameter) -> how many distinct modules register it
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    heads = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if isinstance(module, ParallelLMHead) else None
        if weight is not None and holders.get(id(weight), 0) > 1:
            if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
                heads.append((name, module))
    return heads


def refresh_tied_heads(model: torch.nn.Module) -> List[str]:
    """Re-run vLLM's post-load processing of every tied LM head (:func:`tied_heads`); returns their names.

    vLLM's models skip ``lm_head.*`` when they load a tied checkpoint, so ``reload_weights`` writes the new values
    into the shared parameter through the embedding but never processes the head ("ParallelLMHead: Failed to load
    weights"). On vLLM's CPU backend the head computes the logits from a kernel handle packed from the weight at
    start-up (``dispatch_cpu_unquantized_gemm``): every sync would leave the engine sampling from the trained body
    and the pretrained head, while the shared parameter holds the trained values. Re-running the processing repacks
    the handle from the trained weight (one transient copy of the head); on GPU it is a no-op. The sync check
    compares what the head computes with the trainer's embedding (``sync_check.applied_head_checksum``)."""
    names = []
    for name, module in tied_heads(model):
        module.quant_method.process_weights_after_loading(module)
        names.append(name)
    return names


_KEPT_RANK = threading.local()  # set while vLLM's Sampler.forward runs in this worker process


def install_kept_count_rank() -> bool:
    """--algo.sampling_mask keep: the sampled token's ``rank`` carries k_t = |S_t|, the size of the kept support.

    vLLM (``v1/sample/sampler.py``) returns the sampled token's rank next to its log-prob. With
    ``logprobs_mode="processed_logprobs"`` the row it ranks in is log_softmax of the temperature-scaled logits
    after top-k/top-p (and min-tokens) set every dropped token to -inf, so #finite of that row is |S_t|. The
    patch replaces the rank with that count, inside ``Sampler.forward`` only (prompt log-probs, which use the
    same ``gather_logprobs``, keep their rank): zero extra bytes per token, one ``isfinite().sum()`` over the
    [batch, V] row per step, on the device the row is on. Idempotent; returns True when it installed.
    docs/sampling_mask.md.
    """
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler, "_openrlhf_ess_kept_rank", False):
        return False
    forward, gather = Sampler.forward, Sampler.gather_logprobs

    def forward_reporting_kept(self, *args, **kwargs):
        _KEPT_RANK.calls = getattr(_KEPT_RANK, "calls", 0) + 1
        _KEPT_RANK.on = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            _KEPT_RANK.on = False

    def gather_logprobs(logprobs, num_logprobs, token_ids):
        out = gather(logprobs, num_logprobs, token_ids)
        if not getattr(_KEPT_RANK, "on", False):
            return out
        kept = torch.isfinite(logprobs).sum(dim=-1).to(out.selected_token_ranks.dtype)
        return LogprobsTensors(out.logprob_token_ids, out.logprobs, kept)

    Sampler.forward = forward_reporting_kept
    Sampler.gather_logprobs = staticmethod(gather_logprobs)
    Sampler._openrlhf_ess_kept_rank = True
    return True


class WorkerWrap(_UpstreamWorkerWrap):
    def install_kept_count_rank(self) -> bool:
        """See :func:`install_kept_count_rank` (called on every worker through ``collective_rpc``).

        Refuses on vLLM's Model Runner V2 (the GPU default from vLLM 0.29 when Triton is usable): its sampler
        (``vllm/v1/worker/gpu/sample/sampler.py``) never instantiates V1's ``Sampler``, so the patch would never
        run and ``rank`` would be the sampled token's rank inside the kept set, not k_t. The engine actor
        asks for the V1 runner with the mask on (``vllm_engine.RolloutRayActorImpl``); this is the guard.
        """
        if getattr(self, "use_v2_model_runner", False):
            raise RuntimeError(
                "--algo.sampling_mask keep: this vLLM worker runs Model Runner V2, whose sampler the kept-count "
                "patch cannot reach (it patches V1's Sampler). The engine sets VLLM_USE_V2_MODEL_RUNNER=0 for the "
                "mask; something overrode it. Unset VLLM_USE_V2_MODEL_RUNNER, or run without --algo.sampling_mask."
            )
        return install_kept_count_rank()

    def kept_count_rank_calls(self) -> int:
        """How many times the patched ``Sampler.forward`` ran in this worker (the engine's start-up check)."""
        return getattr(_KEPT_RANK, "calls", 0)

    def lm_head_dtypes(self) -> List[str]:
        """The compute dtype of every vLLM ``LogitsProcessor`` in this worker's model (``head_dtype``, what
        --vllm.fp32_lm_head sets; the model dtype when vLLM keeps none), for the engine's start-up check."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        model = self.model_runner.model
        return [
            str(m.head_dtype if getattr(m, "head_dtype", None) is not None else self.model_runner.model_config.dtype)
            for m in model.modules()
            if isinstance(m, LogitsProcessor)
        ]

    def init_process_group(self, *args, **kwargs):
        """Upstream's join of the trainer's weight sync group, leaving the group this worker was in first.

        Upstream overwrites the old group without tearing it down. With engine replacement the group is formed
        again after a restart (``WeightSync.regroup``), and the old one holds a dead member: its NCCL communicator
        is aborted first (vLLM's ``PyNcclCommunicator.destroy``, ``ncclCommAbort`` bounded at 5 s, safe with a dead
        peer), as rank 0 aborts its own, so that no stale communicator stays beside the new one."""
        old = getattr(self, "_model_update_group", None)
        destroy = getattr(old, "destroy", None)
        if callable(destroy):
            destroy()
        return super().init_process_group(*args, **kwargs)

    def probe_sync_group(self, numel: int) -> str:
        """Start-up self-check of a re-formed weight sync group (``WeightSync.startup_regroup_probe``): receive one
        broadcast of ``numel`` float32 values from the trainer's rank 0 as ``update_weight`` receives a weight, without
        loading it; return the sha256 of the bytes received."""
        from openrlhf_ess import distributed
        from openrlhf_ess.trainer.sync_check import bytes_digest

        received = torch.empty(numel, dtype=torch.float32, device=distributed.device())
        self._model_update_group.broadcast(received, src=0, stream=distributed.stream())
        return bytes_digest(received)  # its copy to the host waits for the broadcast on that stream

    def stage_weights_from_safetensors(self, blob: bytes) -> int:
        """Stage one message of a sync that spans several (all but its last); returns its tensor count."""
        staged = getattr(self, "_staged_weights", None)
        if staged is None:
            staged = self._staged_weights = StagedWeights()
        return staged.add(blob)

    def load_weights_from_safetensors(self, blob: bytes) -> int:
        """Stage ``blob`` (a whole safetensors set, or the last message of a sync) and load every staged tensor (HF
        names) into the model through vLLM's ``reload_weights``; return the count."""
        self.stage_weights_from_safetensors(blob)
        tensors, self._staged_weights = self._staged_weights.complete(), None
        from openrlhf_ess.trainer.sync_check import trainer_checksums

        # What was handed to vLLM's loader, by the engine's (fused) names: the fallback for the checksum of a
        # weight vLLM's CPU backend repacks into a kernel handle and removes from the module.
        self._loaded_checksums = trainer_checksums(tensors.items())
        from openrlhf_ess.runtime.quiet import filter_vllm_reload_warning

        # vLLM's harmless "<X>RotaryEmbedding: Failed to load weights" at every sync, and a tied head's (refreshed)
        filter_vllm_reload_warning(tied_head=bool(tied_heads(self.model_runner.model)))
        count = len(tensors)
        self.reload_weights(weights_iterator=_drain(tensors))
        refresh_tied_heads(self.model_runner.model)  # a tied LM head is never reloaded by vLLM itself
        return count

    def weight_checksums(self, with_replicas: bool = False):
        """(dtype, {name: (Σx, Σx², n)}) of this worker's weights, for the trainer's per-tensor sync check; with
        ``with_replicas``, (dtype, sums, replicas): how many consecutive TP workers hold each name's data
        (``sync_check.engine_checksums``: ``qkv_proj`` by its q, k and v parts, repacked weights by what the
        loader received, a tied LM head also by what it computes)."""
        from openrlhf_ess.trainer.sync_check import engine_checksums

        model = self.model_runner.model
        params = list(model.named_parameters())
        dtype = str(params[0][1].dtype) if params else ""
        tp_size = 1
        if with_replicas:
            from vllm.distributed import get_tensor_model_parallel_world_size

            tp_size = get_tensor_model_parallel_world_size()
        heads = [name for name, _ in tied_heads(model)]  # checked by what they compute, too
        sums, replicas = engine_checksums(model, tp_size, received_checksums(self, model), heads)
        return (dtype, sums, replicas) if with_replicas else (dtype, sums)

    def update_weight(self, *args, **kwargs):
        """Upstream's per-tensor load (a broadcast sync); marks this engine's weights as no longer its checkpoint's."""
        self._weights_received = True
        return super().update_weight(*args, **kwargs)

    def update_weight_cuda_ipc(self, *args, **kwargs):
        """Upstream's CUDA IPC load; marks this engine's weights as no longer its checkpoint's."""
        self._weights_received = True
        return super().update_weight_cuda_ipc(*args, **kwargs)
