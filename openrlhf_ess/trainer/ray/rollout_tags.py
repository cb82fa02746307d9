"""What the rollout engine attaches to each response: every sampled token's weight version (and, with
--algo.sampling_mask, its kept-support size; with --algo.routing_replay, the engine's routes), and the held-out eval
mark that keeps an eval's requests out of the rollouts scored at a sync.

The engine actor (``trainer/ray/vllm_engine.py``) records each generate() call's tags while it streams
(:class:`_Progress`, one per in-flight request, switched to the new version by ``set_weight_version`` at a sync);
:class:`_VersionTaggingExecutor` wraps the agent executor and lays the calls' tags onto the response's observation
tokens (:func:`align_to_observation`). Upstream's single- and multi-turn executors run unchanged inside it.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from openrlhf_ess.models.sampling_mask import NOT_TRUNCATED  # kept-count tag of unsampled tokens

NO_VERSION = -1  # version tag of tokens the engine did not sample (prompt, environment feedback)

logger = logging.getLogger(__name__)


class _Call(NamedTuple):
    """One engine.generate() call made by an executor.execute() call."""

    versions: List[int]  # the weight version that sampled each output token
    kept: List[int]  # --algo.sampling_mask: each output token's kept count k_t (else empty)
    routes: Any  # --algo.routing_replay: the final output's routed_experts [P + G - 1, L, k] (else None)
    prompt: Sequence[int]  # prompt token ids (kept with --algo.routing_replay, to place the routes)
    tokens: Sequence[int]  # output token ids (idem)


_GENERATE_CALLS: contextvars.ContextVar[Optional[List[_Call]]] = contextvars.ContextVar(
    "openrlhf_ess_generate_calls", default=None
)
# A held-out eval's requests carry this key in ``SamplingParams.extra_args`` (set by our SamplesGenerator); the
# engine serves them like any other but never reports them as rollouts to score (``outgoing_streams``).
EVAL_MARK = "openrlhf_ess_eval"
_EVALUATION: contextvars.ContextVar[bool] = contextvars.ContextVar("openrlhf_ess_evaluation", default=False)


def is_evaluation(sampling_params) -> bool:
    """Whether ``sampling_params`` belong to a held-out eval request (:data:`EVAL_MARK`)."""
    return bool((getattr(sampling_params, "extra_args", None) or {}).get(EVAL_MARK))


class _Progress:
    """Output tokens streamed so far for one request, and the weight version of each stretch of them."""

    __slots__ = ("streamed", "starts", "versions", "prompt", "tokens", "logprobs", "min_tokens", "routes")

    def __init__(self, version: int, min_tokens: int = 0):
        self.streamed = 0
        self.starts, self.versions = [0], [version]
        self.prompt, self.tokens = (), ()  # prompt token ids, output token ids so far (outgoing scoring)
        self.logprobs = None  # vLLM's per-token log-prob dicts so far (kept counts, --algo.sampling_mask)
        self.min_tokens = min_tokens
        self.routes = None  # --algo.routing_replay: the final output's routed_experts [P + G - 1, L, k]

    def switch(self, version: int) -> None:
        # Generation is paused during a weight sync, so every token streamed so far was sampled by
        # the outgoing weights and every later token by the new ones.
        if self.streamed == self.starts[-1]:
            self.versions[-1] = version
        else:
            self.starts.append(self.streamed)
            self.versions.append(version)

    def token_versions(self, n_tokens: int) -> List[int]:
        ends = self.starts[1:] + [n_tokens]
        out: List[int] = []
        for start, end, version in zip(self.starts, ends, self.versions):
            out.extend([version] * (min(end, n_tokens) - start))
        return out

    def kept_counts(self, n_tokens: int) -> List[int]:
        """--algo.sampling_mask: per output token, k_t = |S_t| from the rank the sampler patch wrote
        (``vllm_worker_wrap.install_kept_count_rank``), negated where vLLM banned the stop tokens
        (the first ``min_tokens`` tokens of a request: docs/sampling_mask.md)."""
        return kept_counts(self.tokens, self.logprobs, n_tokens, self.min_tokens)


def kept_counts(tokens: Sequence[int], logprobs, n_tokens: int, min_tokens: int) -> List[int]:
    """k_t per sampled token (see ``_Progress.kept_counts``); raises if the engine returned no log-probs."""
    if n_tokens and not logprobs:
        raise RuntimeError(
            "--algo.sampling_mask keep: the engine returned no log-probs for a request, so the kept support of its "
            "tokens is unknown. The rollout engines request them; an agent (--train.agent_func_path) must pass "
            "the sampling params it is given (logprobs set) to llm_engine.generate."
        )
    return [
        -lp[token].rank if i < min_tokens else lp[token].rank
        for i, (token, lp) in enumerate(zip(tokens[:n_tokens], logprobs[:n_tokens]))
    ]


def inflight_routes(llm, request_id: str):
    """The routed_experts of a request still generating, as vLLM has accumulated them so far: [P + g' - 1, L, k]
    for g' >= the tokens streamed to the caller (``--algo.routing_replay`` with scoring at a weight sync), or None.

    vLLM >= 0.29 returns routes only on a request's final output, but its ``OutputProcessor`` (in this process,
    the AsyncLLM front end) appends each engine step's rows to the request's state as they arrive
    (``RequestState.routed_experts_chunks``: the prompt's rows when its prefill completes, then one row per
    decoded token) and concatenates them at the end (v1/engine/output_processor.py, 0.29 and 0.31). This reads
    those chunks for the request the caller named ``request_id`` (vLLM keys its state by an internal id:
    ``external_req_ids`` maps one to the other). Proved on the user's engine at start-up
    (``_check_routes_contract``)."""
    import numpy as np

    processor = llm.output_processor
    internal = [i for i in processor.external_req_ids.get(request_id, []) if i in processor.request_states]
    if len(internal) != 1:
        raise RuntimeError(
            f"--algo.routing_replay: vLLM holds {len(internal)} states for request {request_id!r} (expected 1: one "
            "completion per request, n=1, as OpenRLHF sends)."
        )
    chunks = processor.request_states[internal[0]].routed_experts_chunks
    return np.concatenate(chunks, axis=0) if chunks else None


def align_to_observation(
    n_tokens: int,
    action_ranges: Sequence[Tuple[int, int]],
    calls: Sequence[Sequence[int]],
    fill: int = NO_VERSION,
    what: str = "rollout versions",
) -> List[int]:
    """Per observation token: the value the i-th generate() call recorded for it, or ``fill`` for
    prompt/environment tokens (versions: NO_VERSION; kept counts: NOT_TRUNCATED).

    The i-th action range of a response is the output of the executor's i-th generate() call (true for
    upstream's single- and multi-turn executors). A mismatch leaves the tokens untagged (never guessed).
    """
    values = [fill] * n_tokens
    if len(action_ranges) != len(calls):
        logger.warning(
            "executor made %d generate() calls for %d action ranges; %s left untagged",
            len(calls),
            len(action_ranges),
            what,
        )
        return values
    for (start, end), call in zip(action_ranges, calls):
        if len(call) != end - start:
            logger.warning("action range of %d tokens but %d tokens generated; left untagged", end - start, len(call))
            continue
        values[start:end] = call
    return values


def versions_for_observation(
    n_tokens: int, action_ranges: Sequence[Tuple[int, int]], calls: Sequence[Sequence[int]]
) -> List[int]:
    """Per observation token: the version that sampled it, or NO_VERSION for prompt/environment tokens."""
    return align_to_observation(n_tokens, action_ranges, calls)


class _VersionTaggingExecutor:
    """Wraps an agent executor: collects the versions (and, with --algo.sampling_mask, the kept counts) of its
    generate() calls into the response."""

    def __init__(self, inner, kept_counts: bool = False, routes: bool = False):
        self._inner, self._kept_counts, self._routes = inner, kept_counts, routes

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def execute(self, *args, **kwargs):
        calls: List[_Call] = []
        token = _GENERATE_CALLS.set(calls)
        try:
            response = await self._inner.execute(*args, **kwargs)
        finally:
            _GENERATE_CALLS.reset(token)
        n, ranges = len(response["observation_tokens"]), response["action_ranges"]
        response["rollout_versions"] = versions_for_observation(n, ranges, [c.versions for c in calls])
        if self._kept_counts:
            response["rollout_kept_counts"] = align_to_observation(
                n, ranges, [c.kept for c in calls], NOT_TRUNCATED, "kept counts"
            )
        if self._routes:
            # --algo.routing_replay: one call (single turn) or one per agent turn, each a prefix of the observation
            # (routing_replay.agent_routes); a call without routes leaves None, refused by the samples generator
            from openrlhf_ess.trainer.routing_replay import agent_routes

            if calls and all(c.routes is not None for c in calls):
                response["rollout_routes"] = agent_routes(
                    response["observation_tokens"], [(c.prompt, c.tokens, c.routes) for c in calls]
                )
            else:
                response["rollout_routes"] = None
        return response
