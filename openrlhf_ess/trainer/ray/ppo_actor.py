"""Policy actor: upstream's ``PolicyModelActor`` / ``ActorPPOTrainer`` with a weight sync that needs no NCCL.

Mirrors ``openrlhf/trainer/ray/ppo_actor.py``.
"""

from __future__ import annotations

import time

from openrlhf_ess import cpu_compat

cpu_compat.apply()

import deepspeed  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from openrlhf.trainer.ray import ppo_actor as _upstream  # noqa: E402
from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync  # noqa: E402

from openrlhf_ess import upstream  # noqa: E402

RELOAD_BACKEND = "reload"


class ActorPPOTrainer(_upstream.ActorPPOTrainer):
    def _init_vllm_sync_group(self, backend: str):
        """Overrides upstream's NCCL/gloo group set-up: the ``reload`` backend needs no process group."""
        if backend == RELOAD_BACKEND:
            return
        super()._init_vllm_sync_group(backend)

    def broadcast_to_vllm(self):
        """Overrides upstream's per-tensor broadcast when ``--vllm.sync_backend reload`` is chosen.

        Rank 0 gathers the full weights (ZeRO-3 shards included), serialises them once as a
        safetensors blob, and every engine loads the blob with vLLM's ``reload_weights``. Cost: one
        host copy of the model per sync. Other backends run upstream's code untouched.
        """
        if self.strategy.args.vllm.sync_backend != RELOAD_BACKEND:
            return super().broadcast_to_vllm()
        from safetensors.torch import save

        t0 = time.time()
        model = self.actor.model.module
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not getattr(self.actor, "is_vlm", False)]
        state = {}
        with deepspeed.zero.GatheredParameters(
            [p for _, p in params], enabled=self.strategy.args.ds.zero_stage == 3
        ):
            if torch.distributed.get_rank() == 0:
                for name, param in params:
                    state[name] = param.data.detach().to("cpu", copy=True).contiguous()
        if torch.distributed.get_rank() == 0:
            blob = save(state)
            ray.get([engine.load_weights_from_safetensors.remote(blob) for engine in self.vllm_engines])
        torch_dist_barrier_and_cuda_sync()
        self.last_sync_seconds = time.time() - t0


_UpstreamPolicyModelActor = upstream.ray_actor_class(_upstream.PolicyModelActor)


class PolicyModelActorImpl(_UpstreamPolicyModelActor):
    # Overrides upstream's init only to build our ActorPPOTrainer instead of upstream's.
    init_model_from_pretrained = upstream.with_actor_trainer(
        _UpstreamPolicyModelActor.init_model_from_pretrained, ActorPPOTrainer
    )


PolicyModelActor = ray.remote(num_gpus=1)(PolicyModelActorImpl)
