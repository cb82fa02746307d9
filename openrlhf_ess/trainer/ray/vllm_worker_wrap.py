"""vLLM worker extension: upstream's ``WorkerWrap`` plus a weight load that works without NCCL.

Mirrors ``openrlhf/trainer/ray/vllm_worker_wrap.py``. Upstream receives weights tensor by tensor over
NCCL (or CUDA IPC) and calls ``model.load_weights`` per tensor. On a CPU machine neither transport
exists (upstream's gloo path returns silently and leaves the engine on uninitialised memory), and
vLLM's CPU linears are repacked after loading, so per-tensor ``load_weights`` is rejected. Here the
trainer ships all tensors as one safetensors blob and vLLM's own ``reload_weights`` loads them in one
pass, which re-runs the post-load processing (repacking) correctly on every backend.
"""

import os
import threading
from typing import List

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap as _UpstreamWorkerWrap

# Fault injection for tests: load noise instead of the received weights, like the measured failure of a
# transport that returns without data (the engine then runs on uninitialised memory).
FAULT_ENV = "OPENRLHF_ESS_FAULT_CORRUPT_WEIGHT_LOAD"
# Fault injection for tests: add 1e-3 to one element of the named tensor, far below what the canary sees.
PERTURB_ENV = "OPENRLHF_ESS_FAULT_PERTURB_WEIGHT_LOAD"


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

    def load_weights_from_safetensors(self, blob: bytes) -> int:
        """Load every tensor in ``blob`` (safetensors bytes, HF names) into the model; return the count."""
        from safetensors.torch import load

        tensors = load(blob)
        if os.environ.get(FAULT_ENV) == "1":
            import torch

            tensors = {name: torch.randn_like(t) for name, t in tensors.items()}
        if os.environ.get(PERTURB_ENV) in tensors:
            t = tensors[os.environ[PERTURB_ENV]].clone()
            t.view(-1)[0] += 1e-3
            tensors[os.environ[PERTURB_ENV]] = t
        from openrlhf_ess.trainer.sync_check import trainer_checksums

        # What was handed to vLLM's loader, by the engine's (fused) names: the fallback for the checksum of a
        # weight vLLM's CPU backend repacks into a kernel handle and removes from the module.
        self._loaded_checksums = trainer_checksums(tensors.items())
        from openrlhf_ess.runtime.quiet import filter_vllm_reload_warning

        filter_vllm_reload_warning()  # vLLM's harmless "RotaryEmbedding: Failed to load weights" at every sync
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def weight_checksums(self):
        """(dtype, {name: (Σx, Σx², n)}) of this worker's weights, for the trainer's per-tensor sync check."""
        from openrlhf_ess.trainer.sync_check import checksum

        params = list(self.model_runner.model.named_parameters())
        dtype = str(params[0][1].dtype) if params else ""
        loaded = getattr(self, "_loaded_checksums", {})
        out = {}
        for name, p in params:
            if p.numel():
                out[name] = checksum(p)
            elif name in loaded:  # repacked away (vLLM CPU linears): what the loader received
                out[name] = loaded[name]
        return dtype, out
