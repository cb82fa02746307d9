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


class WorkerWrap(_UpstreamWorkerWrap):
    def load_weights_from_safetensors(self, blob: bytes) -> int:
        """Load every tensor in ``blob`` (safetensors bytes, HF names) into the model; return the count."""
        from safetensors.torch import load

        tensors = load(blob)
        if os.environ.get(FAULT_ENV) == "1":
            import torch

            tensors = {name: torch.randn_like(t) for name, t in tensors.items()}
        self.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)
