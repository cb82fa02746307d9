"""The in-process vLLM CPU engine the tests and benchmarks sample the tiny models with (one builder for all).

Not the training path (that is ``trainer/ray/vllm_engine.py``, a Ray actor per engine): this is vLLM's offline
``LLM`` in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), sized for the tiny models: a 64 MiB KV
cache, no torch.compile (``enforce_eager``), seed 0, and log-probs of the distribution actually sampled from
(``processed_logprobs``: temperature and any top-k/top-p cut applied), as the rollout engines return μ.
"""

from __future__ import annotations

import os

KV_CACHE_BYTES = 64 << 20


def tiny_engine(model: str, dtype: str = "float32", max_model_len: int = 128, max_logprobs: int = 1, **extra):
    """vLLM ``LLM`` for a tiny model in this process; ``extra``: further engine kwargs (``hf_overrides``,
    ``worker_extension_cls``, ``enable_return_routed_experts``, ...)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    return LLM(
        model=model,
        dtype=dtype,
        seed=0,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        logprobs_mode="processed_logprobs",
        max_logprobs=max_logprobs,
        enforce_eager=True,
        **extra,
    )
