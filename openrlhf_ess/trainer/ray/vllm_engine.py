"""vLLM rollout engine: upstream's ``RolloutRayActor`` with our engine options and weight load.

Mirrors ``openrlhf/trainer/ray/vllm_engine.py``. Placement, scheduling and the engine kwargs stay
upstream's (``create_vllm_engines`` is upstream's function, re-bound to build this class); we only
add keyword arguments on top of the ones it passes.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

from openrlhf_ess import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor as _UpstreamRolloutRayActor  # noqa: E402

from openrlhf_ess import config, upstream  # noqa: E402

WORKER_EXTENSION = "openrlhf_ess.trainer.ray.vllm_worker_wrap.WorkerWrap"


class RolloutRayActorImpl(upstream.ray_actor_class(_UpstreamRolloutRayActor)):
    async def __init__(self, *args, force_logprobs: bool = False, **kwargs):
        """Extends upstream's init with ``force_logprobs``: always return the sampled token's log-prob."""
        self.force_logprobs = force_logprobs
        await super().__init__(*args, **kwargs)

    async def generate_responses(self, prompt, label, sampling_params, *args, **kwargs):
        """Wraps upstream's: with ``force_logprobs``, ask vLLM for the sampled token's log-prob (μ).

        Upstream requests it only for its own IS correction; our features need it too. The executors
        build ``rollout_log_probs`` whenever ``sampling_params.logprobs`` is set.
        """
        if self.force_logprobs and sampling_params.logprobs is None:
            sampling_params = copy.deepcopy(sampling_params)
            sampling_params.logprobs = 1
        return await super().generate_responses(prompt, label, sampling_params, *args, **kwargs)

    async def load_weights_from_safetensors(self, blob: bytes) -> None:
        """Load a full set of weights (safetensors bytes) into every worker, then drop the prefix cache.

        The prefix cache holds KV computed by the old weights; reusing it would make the new
        policy's log-probs wrong, so it is always reset here.
        """
        counts = await self.llm.collective_rpc("load_weights_from_safetensors", args=(blob,))
        await self.llm.reset_prefix_cache()
        return counts


RolloutRayActor = ray.remote(RolloutRayActorImpl)


class _WithEngineKwargs:
    """Stands in for the actor class inside upstream's ``create_vllm_engines``.

    Upstream calls ``RolloutRayActor.options(...).remote(**actor_kwargs)``; this adds (or overrides)
    keyword arguments such as the engine dtype, the KV-cache size and our worker extension.
    """

    def __init__(self, actor_cls: Any, extra: Dict[str, Any]):
        self._actor_cls, self._extra = actor_cls, extra

    def options(self, **options):
        bound = self._actor_cls.options(**options)
        extra = self._extra

        class _Bound:
            @staticmethod
            def remote(*args, **kwargs):
                return bound.remote(*args, **{**kwargs, **extra})

        return _Bound()


def engine_kwargs(args) -> Dict[str, Any]:
    """The vLLM engine arguments we set on top of upstream's, from our flags."""
    extra: Dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION}
    if config.needs_rollout_logprobs(args) and args.algo.advantage.is_correction_level == "off":
        # What upstream sets for its own IS correction: log-probs of the distribution sampled from
        # (temperature applied), top-1 only.
        extra.update(force_logprobs=True, logprobs_mode="processed_logprobs", max_logprobs=1)
    if args.vllm.dtype != "bfloat16":
        extra["dtype"] = args.vllm.dtype
    if not cpu_compat.cuda_available():
        # vLLM's CPU backend sizes its KV cache from this instead of gpu_memory_utilization.
        extra["kv_cache_memory_bytes"] = int(args.vllm.cpu_kv_cache_gb * (1 << 30))
    return extra


def create_vllm_engines(args):
    """A ``create_vllm_engines`` with upstream's signature that builds our engine actor."""
    return upstream.create_vllm_engines_with(_WithEngineKwargs(RolloutRayActor, engine_kwargs(args)))
