"""The dedicated old-log-prob model (``--algo.prox_mode dedicated``; docs/prox_modes.md).

A Ray actor holding an HF copy of the policy at the version the vLLM engines hold. At every weight sync
the trainer first has it score the outgoing version's tokens (it still holds that version), then sends
it the new weights together with the engines. The actor's ranks never swap weights or keep copies, so
this works with every ZeRO stage; the cost is one more device and one host copy of the weights per sync.
"""

from __future__ import annotations

import time
from typing import List

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402
import torch  # noqa: E402

from openrlhf_ess import config  # noqa: E402
from openrlhf_ess.trainer import prox  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # --ds.param_dtype
READY_TIMEOUT_S = 600  # model load included; a scorer that cannot be placed fails instead of hanging


class ProxScorerImpl:
    def __init__(
        self,
        pretrain: str,
        dtype: str,
        attn_implementation: str,
        temperature: float,
        mask: bool = False,
        memory_mb: int = prox.SCORE_MEMORY_MB,
    ):
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            pretrain, dtype=DTYPES[dtype], attn_implementation=attn_implementation
        ).to(self.device)
        self.model.eval()
        self.temperature = temperature
        self.memory_mb = memory_mb  # --algo.prox_score_memory_mb
        self.version = 0
        self.stop_ids = ()
        if mask:  # --algo.sampling_mask keep: the engine's stop tokens, banned where the kept count is < 0
            from openrlhf_ess.trainer.sampling_mask import stop_token_ids

            self.stop_ids = stop_token_ids(pretrain)

    def ready(self) -> int:
        return self.version

    def score(self, version: int, streams: List[List[int]], kept=None, routes=None) -> List[torch.Tensor]:
        """log π_version(s_t | s_<t) per stream (over each token's kept support when ``kept`` is given, with the
        engine's experts when ``routes`` are: as ``prox.stream_log_probs``); refuses to score a version it does not
        hold."""
        if version != self.version:
            raise RuntimeError(
                f"dedicated old-log-prob model holds version {self.version}, asked to score version {version}: "
                "a weight sync reached it out of order."
            )
        return prox.stream_log_probs(
            self.model,
            streams,
            self.temperature,
            kept=kept,
            stop_ids=self.stop_ids,
            memory_mb=self.memory_mb,
            routes=routes,
        )

    def load_weights(self, version: int, blob) -> float:
        """Take version ``version``'s weights: safetensors bytes of the actor's HF parameters, or the messages of a
        sync (``vllm_worker_wrap.weight_messages``). They come through Ray alone, which carries objects of any size
        (no vLLM engine call, whose msgpack encoding refuses bytes of 4 GiB or more)."""
        from openrlhf_ess.trainer.ray.vllm_worker_wrap import assemble

        t0 = time.time()
        state = assemble([blob] if isinstance(blob, (bytes, bytearray, memoryview)) else blob)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
            raise RuntimeError(f"dedicated model: weights do not match (missing {missing}, unexpected {unexpected})")
        self.version = int(version)
        return time.time() - t0


ProxScorer = ray.remote(ProxScorerImpl)


def create(args, pretrain: str):
    """Start the dedicated model on its own device slot and wait until it is loaded (or fail clearly)."""
    scorer = ProxScorer.options(num_gpus=args.algo.prox_dedicated_num_gpus, num_cpus=1).remote(
        pretrain,
        args.ds.param_dtype,
        args.ds.attn_implementation,
        args.rollout.temperature,
        config.sampling_mask_on(args),
        args.algo.prox_score_memory_mb,
    )
    try:
        ray.get(scorer.ready.remote(), timeout=READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.kill(scorer)
        raise RuntimeError(
            f"the dedicated old-log-prob model (--algo.prox_mode dedicated) could not start within "
            f"{READY_TIMEOUT_S} s: no free device for --algo.prox_dedicated_num_gpus "
            f"{args.algo.prox_dedicated_num_gpus}? Add a GPU to the Ray cluster, or use --algo.prox_mode interrupt "
            "(the actor scores with one kept copy)."
        ) from None
    return scorer
