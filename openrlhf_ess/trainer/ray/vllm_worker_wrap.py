"""vLLM worker extension: upstream's ``WorkerWrap`` plus a weight load that works without NCCL.

Mirrors ``openrlhf/trainer/ray/vllm_worker_wrap.py``. Upstream receives weights tensor by tensor over
NCCL (or CUDA IPC) and calls ``model.load_weights`` per tensor. On a CPU machine neither transport
exists (upstream's gloo path returns silently and leaves the engine on uninitialised memory), and
vLLM's CPU linears are repacked after loading, so per-tensor ``load_weights`` is rejected. Here the
trainer ships all tensors as one safetensors blob and vLLM's own ``reload_weights`` loads them in one
pass, which re-runs the post-load processing (repacking) correctly on every backend.
"""

import os

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap as _UpstreamWorkerWrap

# Fault injection for tests: load noise instead of the received weights, like the measured failure of a
# transport that returns without data (the engine then runs on uninitialised memory).
FAULT_ENV = "OPENRLHF_ESS_FAULT_CORRUPT_WEIGHT_LOAD"
# Fault injection for tests: add 1e-3 to one element of the named tensor, far below what the canary sees.
PERTURB_ENV = "OPENRLHF_ESS_FAULT_PERTURB_WEIGHT_LOAD"


class WorkerWrap(_UpstreamWorkerWrap):
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
        from openrlhf_ess.quiet import filter_vllm_reload_warning

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
