"""vLLM rollout engine: upstream's ``RolloutRayActor`` with our engine options and weight load.

Mirrors ``openrlhf/trainer/ray/vllm_engine.py``. Placement, scheduling and the engine kwargs stay
upstream's (``create_vllm_engines`` is upstream's function, re-bound to build this class); we only
add keyword arguments on top of the ones it passes.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor as _UpstreamRolloutRayActor  # noqa: E402

from openrlhf_ess import config, upstream  # noqa: E402
from openrlhf_ess.models.sampling_mask import NOT_TRUNCATED  # noqa: E402  (kept-count tag of unsampled tokens)
from openrlhf_ess.trainer.engine_contract import (  # noqa: E402
    CONTRACT_REQUESTS,
    CONTRACT_TOP_K,
    check_kept_count_contract,
    check_lm_head_contract,
)
from openrlhf_ess.trainer.ray.rollout_tags import (  # noqa: E402
    _EVALUATION,
    _GENERATE_CALLS,
    NO_VERSION,
    _Call,
    _Progress,
    _VersionTaggingExecutor,
    inflight_routes,
    is_evaluation,
)
from openrlhf_ess.utils.agent import SingleTurnAgentExecutor  # noqa: E402

WORKER_EXTENSION = "openrlhf_ess.trainer.ray.vllm_worker_wrap.WorkerWrap"

logger = logging.getLogger(__name__)


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

# The engine actor's Ray concurrency group for the watchdog's and the replacement's calls, and its size.
WATCH_GROUP = "watch"
WATCH_GROUP_CONCURRENCY = 4


class RolloutRayActorImpl(upstream.ray_actor_class(_UpstreamRolloutRayActor)):
    # Replacement (--vllm.max_restarts; set by __init__): this engine's place in the run's list, the run's keeper
    engine_index: int = 0
    _keeper: Any = None
    _restart: Optional[Dict[str, Any]] = None
    _held_set: Optional[int] = None  # the version of the last set load_weights_from_refs loaded
    _sync_paused: bool = False  # between pause_generation and resume_generation (the watchdog does not time it)

    async def __init__(self, *args, engine_index: int = 0, replaceable: bool = False, **kwargs):
        """Upstream's init with our options (:meth:`_start`).

        ``engine_index``, ``replaceable`` (--vllm.max_restarts > 0): this engine's place in the run's list, and
        replacement on (``trainer/ray/engine_keeper.py``): the keeper is told of each start; a restart by Ray loads
        the last sync's weights and version before serving, or, past the restart budget, raises (the actor stays
        dead); a dead vLLM engine core ends this actor's process, so that Ray restarts it and sends its calls again
        (every engine call: :data:`ENGINE_CALLS`). A restart whose start raises tells the keeper why first, so that
        its failure is closed and named (the actor stays dead)."""
        self.engine_index, self._keeper, self._restart = engine_index, None, None
        if replaceable:  # first of all: a restart's first seconds are visible to the watchdog (restarting)
            self._restart = await self._hello_keeper()
        try:
            await self._start(*args, **kwargs)
            if self._restart is not None:
                await self._rejoin(self._restart)
                # the kept set's refs pin the model in Ray's object store while anyone holds them: not this
                # engine, once it has loaded them (the keeper lets them go at the next sync)
                self._restart = {k: v for k, v in self._restart.items() if k != "refs"}
        except Exception as e:
            if self._restart is not None:
                why = f"its start failed ({type(e).__name__}: {str(e)[:300]})"
                await self._keeper.not_replaced.remote(self.engine_index, why)
            raise

    async def _start(
        self,
        *args,
        force_logprobs: bool = False,
        track_versions: bool = False,
        report_outgoing=False,
        report_kept_counts=False,
        reward_timeout_s: Optional[float] = None,
        reward_failure_policy: str = "off",
        fp32_lm_head: bool = False,
        report_routes: bool = False,
        selfcheck: bool = True,
        **kwargs,
    ):
        """Extends upstream's init.

        ``force_logprobs``: always return the sampled token's log-prob (μ).
        ``track_versions``: tag every response token with the weight version that sampled it
        (``response["rollout_versions"]``), across weight syncs inside one response.
        ``report_outgoing``: keep the token streams of the current version for ``outgoing_streams``
        (interrupt and dedicated π_prox modes).
        ``report_kept_counts`` (--algo.sampling_mask keep): every sampled token's kept-support size k_t
        (``response["rollout_kept_counts"]``, and ``"kept"`` in ``outgoing_streams``); needs the two above's
        tracking, so it implies ``track_versions``.
        ``reward_timeout_s`` (a reward .py file): each reward_func call is bounded by it and guarded against
        BaseException (``openrlhf_ess/utils/agent.py``); a failed call follows ``reward_failure_policy``.
        ``fp32_lm_head`` (--vllm.fp32_lm_head): vLLM's own fp32 LM head (``hf_overrides={"head_dtype":
        "float32"}``, vllm/config/model.py::head_dtype in 0.29 and 0.31), checked in every worker after start-up.
        ``report_routes`` (--algo.routing_replay): vLLM's ``enable_return_routed_experts`` (>= 0.29); each
        response gets ``response["rollout_routes"]``, the final output's ``routed_experts`` [P + G - 1, L, k],
        proved at start-up by one short request (``_check_routes_contract``).
        ``selfcheck`` (False with --selfcheck off): the vLLM version contract on this engine's own install, first of
        all: outside the tested (build, release) pairs a warning, or with ``selfcheck`` False an
        :class:`EngineContractError` (``engine_contract.check_engine_vllm``); :meth:`vllm_version` returns the report,
        which the driver logs (:func:`report_engine_versions`).
        """
        from openrlhf_ess.trainer.engine_contract import check_engine_vllm, engine_vllm_report

        self._vllm_version = check_engine_vllm(engine_vllm_report(), selfcheck)
        (logger.warning if self._vllm_version["level"] == "warning" else logger.info)(self._vllm_version["line"])
        if fp32_lm_head:
            kwargs["hf_overrides"] = {**(kwargs.get("hf_overrides") or {}), "head_dtype": "float32"}
        if report_routes:  # --algo.routing_replay: vLLM >= 0.29 returns routed_experts on a request's final output
            kwargs["enable_return_routed_experts"] = True
        self.report_routes = report_routes
        self.force_logprobs = force_logprobs
        self.report_outgoing = report_outgoing
        self.report_kept_counts = report_kept_counts
        track_versions = track_versions or report_kept_counts or report_routes
        self.weight_version = 0
        self._inflight: Dict[str, _Progress] = {}
        self._finished: List[_Progress] = []  # requests finished since the last outgoing_streams()
        if report_kept_counts:
            # vLLM 0.29 (what openrlhf[vllm]==0.11.2 installs) runs Model Runner V2 by default on GPU
            # (config/vllm.py: use_v2_model_runner), whose sampler ignores the V1 Sampler patch that reports k_t.
            # Set before the engine is built: the engine core and its workers inherit the environment (Ray TP
            # workers get every VLLM_* variable). Cost: V1's runner instead of V2's, for mask runs only.
            os.environ[V2_RUNNER_ENV] = "0"
        if kwargs.get("kv_cache_memory_bytes") is not None:
            # vLLM CPU lets this variable replace kv_cache_memory_bytes (platforms/cpu.py, "legacy setting"): the
            # size is --vllm.cpu_kv_cache_gb's, resolved from the variable in the driver when the flag is unset.
            os.environ.pop(config.KV_CACHE_ENV, None)
        if reward_timeout_s is None:
            await super().__init__(*args, **kwargs)
        else:  # upstream's init, building our single-turn executor (the reward call's seam)
            executor = functools.partial(
                SingleTurnAgentExecutor, timeout_s=reward_timeout_s, failure_policy=reward_failure_policy
            )
            await upstream.rollout_actor_init_with(executor)(self, *args, **kwargs)
        # The sync check's canary (prompt_log_probs) is no rollout: it must not be tagged, nor reported to the
        # interrupt/dedicated π_prox modes as a stream to score at the next sync.
        self._untracked_generate = self.llm.generate
        if report_kept_counts:
            installed = await self.llm.collective_rpc("install_kept_count_rank")
            logger.info("sampling mask: kept-count rank patch installed in %d worker(s)", sum(map(bool, installed)))
            await self._check_kept_count_contract()
        if fp32_lm_head:
            heads = await self.llm.collective_rpc("lm_head_dtypes")
            check_lm_head_contract(heads)
            print(f"start-up self-check passed: --vllm.fp32_lm_head: LM head dtypes per worker {heads}", flush=True)
        if report_routes:
            await self._check_routes_contract()
        if track_versions:
            self.executor = _VersionTaggingExecutor(
                self.executor, kept_counts=report_kept_counts, routes=report_routes
            )
            self.llm.generate = self._tracking_stream(self.llm.generate)

    def _tracking_stream(self, generate):
        """Wrap AsyncLLM.generate: count streamed tokens per request and record their versions."""

        keep_tokens = self.report_outgoing or self.report_kept_counts or self.report_routes

        async def tracked(prompt, sampling_params, request_id, *args, **kwargs):
            min_tokens = getattr(sampling_params, "min_tokens", 0) or 0
            if self.report_kept_counts and min_tokens and getattr(sampling_params, "stop_token_ids", None):
                # vLLM bans these with EOS in the first min_tokens positions; the trainer knows only the model's
                # EOS ids (trainer/sampling_mask.stop_token_ids), so the kept support would be misdescribed
                raise ValueError(
                    f"--algo.sampling_mask keep: a request sets stop_token_ids {sampling_params.stop_token_ids} "
                    f"with min_tokens {min_tokens}; vLLM bans those tokens too in the first min_tokens positions, "
                    "which the kept count does not describe. Drop stop_token_ids or min_tokens from the agent's "
                    "sampling params, or run without --algo.sampling_mask."
                )
            progress = _Progress(self.weight_version, min_tokens)
            evaluation = _EVALUATION.get()  # an eval request: tagged, but neither in flight nor finished rollouts
            if not evaluation:
                self._inflight[request_id] = progress
            try:
                async for output in generate(prompt, sampling_params, *args, request_id=request_id, **kwargs):
                    progress.streamed = len(output.outputs[0].token_ids)
                    if keep_tokens:
                        progress.prompt, progress.tokens = output.prompt_token_ids, output.outputs[0].token_ids
                        progress.logprobs = output.outputs[0].logprobs
                    if self.report_routes:
                        # Only a request's final output carries routed_experts (vLLM 0.29 concatenates the
                        # per-step rows when it finishes). A partial rollout's request persists across weight
                        # syncs, so its final output covers every token, each routed by the weights that
                        # forwarded it: like its mu, a partial rollout's routes come from several versions.
                        progress.routes = getattr(output.outputs[0], "routed_experts", None)
                    yield output
            finally:
                self._inflight.pop(request_id, None)
                if self.report_outgoing and progress.streamed and not evaluation:
                    self._finished.append(progress)
            calls = _GENERATE_CALLS.get()
            if calls is not None:
                n = progress.streamed
                kept = progress.kept_counts(n) if self.report_kept_counts else []
                calls.append(
                    _Call(progress.token_versions(n), kept, progress.routes, progress.prompt, progress.tokens[:n])
                )

        return tracked

    async def _check_kept_count_contract(self) -> None:
        """Start-up self-check of --algo.sampling_mask keep, on the user's engine: one short top-k generation.

        Whatever vLLM version or model runner the user has, the engine must report k_t (the kept support's
        size) as the sampled token's rank: with top-k K every rank must be >= K. A runner that ignores our patch
        (vLLM's Model Runner V2) reports the rank inside the kept set instead (1 when the argmax is sampled),
        which the trainer would read as k_t and renormalise over ~1 token, silently. Cost: one 8-token request.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        params = SamplingParams(max_tokens=8, temperature=1.0, top_k=CONTRACT_TOP_K, logprobs=0, ignore_eos=True)

        async def one(prompt):
            final = None
            async for output in self._untracked_generate(
                TokensPrompt(prompt_token_ids=prompt), params, request_id=random_uuid()
            ):
                final = output
            return [step[token].rank for step, token in zip(final.outputs[0].logprobs, final.outputs[0].token_ids)]

        # a batch, as training sends: on CUDA, vLLM 0.29 samples batches of 8 or more with its Triton kernel, which
        # one request never reaches
        batches = await asyncio.gather(*(one([1 + i, 2, 3]) for i in range(CONTRACT_REQUESTS)))
        calls = await self.llm.collective_rpc("kept_count_rank_calls")
        vocab = self.llm.model_config.get_vocab_size()
        check_kept_count_contract([r for ranks in batches for r in ranks], CONTRACT_TOP_K, calls, vocab)

    async def _check_routes_contract(self) -> None:
        """Start-up self-check of --algo.routing_replay, on the user's engine: one 4-token request after a 3-token
        prompt must return ``routed_experts`` [3 + 4 - 1, num_hidden_layers, num_experts_per_tok]
        (``routing_replay.check_routes_contract``). An engine that ignores enable_return_routed_experts, or
        returns another layout, would otherwise have the trainer replay nothing or the wrong rows. With scoring
        at a weight sync (``report_outgoing``) the request is 32 tokens and its routes are also read at its first
        streamed output (:func:`inflight_routes`), which must cover the tokens so far. Only that row count informs:
        on vLLM 0.29-0.31 the mid-generation rows are the same chunks the final output concatenates, so their
        equality with its first rows holds by construction (still checked, as a layout guard)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        from openrlhf_ess.trainer.routing_replay import check_inflight_routes_contract, check_routes_contract

        # scoring at a sync reads routes mid-generation: a longer request, read at its first streamed output
        prompt, max_tokens = [1, 2, 3], (32 if self.report_outgoing else 4)
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        final, mid, needed, request_id = None, None, 0, random_uuid()
        async for output in self._untracked_generate(
            TokensPrompt(prompt_token_ids=prompt), params, request_id=request_id
        ):
            if self.report_outgoing and needed == 0 and not output.finished:
                mid, needed = inflight_routes(self.llm, request_id), len(prompt) + len(output.outputs[0].token_ids) - 1
            final = output
        routes = getattr(final.outputs[0], "routed_experts", None)
        model_config = self.llm.model_config
        hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
        rows = len(prompt) + len(final.outputs[0].token_ids) - 1
        check_routes_contract(
            None if routes is None else routes.shape, hf.num_hidden_layers, hf.num_experts_per_tok, rows
        )
        line = f"routed_experts {list(routes.shape)} {routes.dtype}"
        if self.report_outgoing:
            same = mid is not None and bool((routes[: len(mid)] == mid).all())
            check_inflight_routes_contract(None if mid is None else len(mid), needed, same, max_tokens)
            line += (
                f"; read mid-generation: {len(mid)} rows after {needed + 1} tokens (they cover the tokens so far; "
                "they are the final output's own chunks, so only their count is a check)"
            )
        print(f"start-up self-check passed: --algo.routing_replay: {line}", flush=True)

    async def vllm_version(self) -> Dict[str, Any]:
        """This engine's vLLM against the version contract, as checked at start-up: distribution, version, build,
        node, host, ``tested``, ``level`` and ``line`` (``engine_contract.check_engine_vllm``)."""
        return self._vllm_version

    async def contract_sample(self, token_ids: List[int], temperature, top_p, top_k, max_tokens) -> Dict[str, Any]:
        """The start-up self-check's generation (``weight_sync.py::startup_canary``): ``max_tokens`` tokens after
        ``token_ids`` with the run's sampling settings and a fixed seed (the same tokens for every caller), their
        log-probs μ as the engine returns them and their ranks (k_t with the sampling mask). Not a rollout."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k if top_k and top_k > 0 else 0,
            logprobs=0,
            seed=1234,
            ignore_eos=True,
        )
        final = None
        async for output in self._untracked_generate(
            TokensPrompt(prompt_token_ids=token_ids), params, request_id=random_uuid()
        ):
            final = output
        out = final.outputs[0]
        steps = [step[token] for step, token in zip(out.logprobs, out.token_ids)]
        return {
            "tokens": list(out.token_ids),
            "logprobs": [s.logprob for s in steps],
            "ranks": [s.rank for s in steps],
        }

    async def prompt_log_probs(self, token_ids: List[int]) -> List[float]:
        """log p(token_i | tokens_<i) for i >= 1 under the engine's current weights (temperature 1).

        The weight-sync check compares these with the trainer's on a fixed canary sequence.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        final = None
        async for output in self._untracked_generate(
            TokensPrompt(prompt_token_ids=token_ids), params, request_id=random_uuid()
        ):
            final = output
        return [step[token].logprob for step, token in zip(final.prompt_logprobs[1:], token_ids[1:])]

    async def weight_checksums(self):
        """The engine's per-tensor checksums ``(dtype, {name: (Σx, Σx², n)})``; with tensor parallelism
        ``(dtype, [one dict per worker], [replicas per worker])``, merged on the trainer against its own tensor sizes
        (``sync_check.merge_tensor_parallel``: a worker's shard is smaller than the trainer's tensor, and a KV head
        may sit on several workers, as ``replicas`` says)."""
        results = await self.llm.collective_rpc("weight_checksums", args=(True,))
        if len(results) == 1:
            return results[0][:2]
        return results[0][0], [sums for _, sums, _ in results], [replicas for _, _, replicas in results]

    async def inflight_tokens(self) -> List[int]:
        """Output tokens streamed so far by each in-flight request (introspection for tests and logs)."""
        return [p.streamed for p in self._inflight.values()]

    async def outgoing_streams(self) -> List[Dict[str, Any]]:
        """Every request that sampled tokens with the current weights, for scoring before they change.

        Called by the trainer at a weight sync while generation is paused (partial rollouts) or idle:
        in-flight requests (their output so far) and requests finished since the last call. Each is
        ``{"stream": prompt + output token ids, "versions": per stream token (prompt: NO_VERSION),
        "finished": bool}`` (and ``"kept"``, k_t per stream token, prompt 0, with ``report_kept_counts``; and
        ``"routes"``, the engine's routed_experts of the stream's tokens but the last [len(stream) - 1, L, k], with
        ``report_routes``: read mid-generation for in-flight requests, :func:`inflight_routes`).
        Finished requests are reported once.
        """
        out = []
        entries = [(p, False, rid) for rid, p in self._inflight.items()] + [(p, True, None) for p in self._finished]
        for progress, finished, request_id in entries:
            n = progress.streamed
            versions = progress.token_versions(n)
            if self.weight_version not in versions:
                continue
            prompt = list(progress.prompt)
            report = {
                "stream": prompt + list(progress.tokens[:n]),
                "versions": [NO_VERSION] * len(prompt) + versions,
                "finished": finished,
            }
            if self.report_kept_counts:
                report["kept"] = [NOT_TRUNCATED] * len(prompt) + progress.kept_counts(n)
            if self.report_routes:
                routes = progress.routes if finished else inflight_routes(self.llm, request_id)
                rows = len(report["stream"]) - 1
                if routes is None or len(routes) < rows:
                    raise RuntimeError(
                        f"--algo.routing_replay: a stream of {rows + 1} tokens to score at this weight sync has "
                        f"{'no' if routes is None else len(routes)} rows of routes from the engine (the start-up "
                        "self-check proved the mid-generation read); this is a bug, please report it."
                    )
                report["routes"] = routes[:rows]
            out.append(report)
        self._finished = []
        return out

    @ray.method(concurrency_group=WATCH_GROUP)
    async def watchdog_progress(self) -> Dict[str, Any]:
        """This engine's pid, whether it is paused for a weight sync, and, per request in flight in vLLM, its output
        tokens so far, for the driver's engine watchdog (``trainer/ray/engine_watchdog.py``). Read from vLLM's output
        processor, which every streamed token passes through, so it covers every request (rollouts, evals, the
        canary), versions tracked or not. In its own concurrency group: never queued behind generation calls."""
        states = self.llm.output_processor.request_states
        tokens = {rid: state.detokenizer.num_output_tokens() for rid, state in list(states.items())}
        return {"pid": os.getpid(), "tokens": tokens, "paused": self._sync_paused}

    async def pause_generation(self):
        """Upstream's (vLLM's ``pause_generation(mode="keep")``), marked for the watchdog until
        :meth:`resume_generation`: a paused engine streams nothing by design, for as long as the weight sync lasts."""
        self._sync_paused = True
        await super().pause_generation()

    async def resume_generation(self):
        """Upstream's; the watchdog times this engine's requests again from its next answer."""
        try:
            await super().resume_generation()
        finally:
            self._sync_paused = False

    @ray.method(concurrency_group=WATCH_GROUP)
    async def held_weight_version(self) -> int:
        """The weight version the engine holds: the last one :meth:`set_weight_version` gave it (0 before)."""
        return self.weight_version

    async def set_weight_version(self, version: int) -> int:
        """Called by the trainer after a complete weight sync, while generation is paused (or idle)."""
        self.weight_version = int(version)
        for progress in self._inflight.values():
            progress.switch(self.weight_version)
        return len(self._inflight)

    # ---- replacement (--vllm.max_restarts; trainer/ray/engine_keeper.py) ----------------------------------------

    async def probe_sync_group(self, numel: int) -> List[str]:
        """Start-up self-check of a re-formed weight sync group (replacement with NCCL/gloo): each worker's digest
        of one broadcast probe (``vllm_worker_wrap.WorkerWrap.probe_sync_group``)."""
        return await self.llm.collective_rpc("probe_sync_group", args=(numel,))

    async def _hello_keeper(self) -> Optional[Dict[str, Any]]:
        """Tell the keeper this engine is starting; on a restart by Ray, what to load (None on a first start).
        Raises past the run's restart budget, so that Ray leaves the actor dead and the run stops."""
        import warnings

        from openrlhf_ess.trainer.ray import engine_keeper

        self._keeper = engine_keeper.find()
        with warnings.catch_warnings():  # Ray deprecates the call's internals, not the call
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        told = await self._keeper.hello.remote(self.engine_index, os.getpid(), restarted)
        if not told["allowed"]:
            raise RuntimeError(
                f"vLLM engine {self.engine_index} {engine_keeper.REFUSED}: --vllm.max_restarts "
                f"{told['max_restarts']} restart(s) of the run are used. Engine failures in order: {told['history']}"
            )
        return told if restarted else None

    async def _rejoin(self, told: Dict[str, Any]) -> None:
        """A restarted engine, before it serves a call: load the last sync's weights, take its version, and check
        itself with the canary against the trainer's log-probs under those weights (:meth:`_check_rejoined`)."""
        from openrlhf_ess.trainer.eval_clock import process_start_time

        if told["refs"]:
            await self.load_weights_from_refs(told["refs"], version=int(told["version"]))
        self.weight_version = int(told["version"])
        canary = await self._check_rejoined(told.get("canary"))
        seconds = time.time() - process_start_time()
        await self._keeper.rejoined.remote(self.engine_index, os.getpid(), self.weight_version, seconds, canary)

    async def _check_rejoined(self, reference: Optional[Dict[str, Any]]) -> Optional[float]:
        """The sync check's canary on a restarted engine, before it serves: its log-probs of the fixed canary
        against the trainer's under the weights it loaded (``WeightSync.canary_reference``, taken by the trainer at
        that sync), within the check's bounds. Returns the mean |Δ log p|; None before the first sync (no reference:
        the engine holds the model it was started with, as at the run's start). A failure ends this restart: the
        keeper names it, and the actor stays dead, so the run stops before anything it generated is trained."""
        if not reference:
            return None
        import torch

        from openrlhf_ess.trainer import canary

        theirs = torch.tensor(await self.prompt_log_probs(reference["ids"]))
        diff, rel = canary.distance(theirs, torch.tensor(reference["log_probs"]))
        if canary.within_bounds(diff, rel, reference["tol"], reference["rel_tol"]):
            return diff
        why = (
            f"its canary log-probs at weight version {self.weight_version} are {diff:.3f} nats (mean |diff|; "
            f"{rel:.3f} of their spread) from the trainer's, above --vllm.sync_check_tol {reference['tol']} or "
            f"--vllm.sync_check_rel_tol {reference['rel_tol']}: the weights it loaded are not the trainer's"
        )
        await self._keeper.not_replaced.remote(self.engine_index, why)
        raise RuntimeError(f"vLLM engine {self.engine_index} restarted and {why}; it does not serve.")

    async def load_weights_from_refs(
        self, refs: List[Any], with_checksums: bool = False, version: Optional[int] = None
    ) -> Dict[str, Any]:
        """A whole reload sync in one call (replacement on): ``refs`` are its safetensors messages in Ray's object
        store, all staged but the last, which loads; ``version`` is the version they become. Idempotent, so Ray may
        send it again to a restarted engine, and a restarted engine that already loaded this version in its
        ``__init__`` (the keeper had it) does not load it again.

        A restarted engine can meet the trainer's load while it serves calls sent again: with partial rollouts the
        sync paused the dead engine, not this one. It pauses as upstream's sync does (``mode="keep"``: requests
        preempted, prefix cache cleared), loads, and is resumed by that sync's ``resume_generation``, after the
        trainer told it the new version, so every token is tagged with the weights that sampled it. Without partial
        rollouts no request is in flight during a sync (sync training, or upstream's lock in async training)."""
        if version is not None and version == self._held_set:
            checksums = await self.weight_checksums() if with_checksums else None
            return {"counts": [], "checksums": checksums, "checksum_seconds": 0.0}
        await self.pause_if_serving()
        for ref in refs[:-1]:
            await self.stage_weights_from_safetensors(await ref)
        loaded = await self.load_weights_from_safetensors(await refs[-1], with_checksums)
        self._held_set = version
        return loaded

    async def pause_if_serving(self) -> bool:
        """Before a weight sync reaches this engine (replacement on): if it serves requests and is not paused, pause it
        as upstream's sync pauses the others (``mode="keep"``), so that no token is sampled while the weights change.
        Only a restarted engine meets a sync that way: with partial rollouts the controller paused the dead one, and
        the calls Ray sent again run on its unpaused successor; that sync's ``resume_generation`` resumes it after
        the trainer told it the new version. Without partial rollouts no request is in flight during a sync. Returns
        whether it paused."""
        if self.llm.output_processor.get_num_unfinished_requests() and not await self.llm.is_paused():
            await self.pause_generation()
            return True
        return False

    def _exit_if_engine_dead(self, error: BaseException) -> None:
        """Replacement on: a dead vLLM engine core (``AsyncLLM.errored``) ends this actor's process, so that Ray
        restarts the actor and sends its calls in flight again; off, the error reaches the caller (fail fast). Every
        engine call reaches it (:func:`_engine_call`, :data:`ENGINE_CALLS`), whichever call first meets the death."""
        if self._keeper is None or not getattr(self.llm, "errored", False):
            return
        cause = f"its vLLM engine core died ({type(error).__name__})"
        print(
            f"[openrlhf-ess] vLLM engine {self.engine_index} (pid {os.getpid()}): {cause}: {error}; ending the actor "
            "for Ray to replace it",
            file=sys.stderr,
            flush=True,
        )
        try:  # the keeper names the cause in the failure's line; the actor ends either way
            ray.get(self._keeper.stopping.remote(self.engine_index, cause), timeout=5)
        finally:
            os._exit(1)

    async def generate_responses(self, prompt, label, sampling_params, *args, **kwargs):
        """Wraps upstream's: with ``force_logprobs``, ask vLLM for the sampled token's log-prob (μ).

        Upstream requests it only for its own IS correction; our features need it too. The executors
        build ``rollout_log_probs`` whenever ``sampling_params.logprobs`` is set. With ``report_kept_counts``
        the request is ``logprobs=0`` (the sampled token only): with top-N requested, vLLM merges a sampled
        token that is also in the top N into that entry, whose rank is its top-N position, not our k_t.
        A held-out eval's request (:func:`is_evaluation`) is generated and tagged alike but kept out of the rollouts
        ``outgoing_streams`` reports: its executor's generate() calls run with :data:`_EVALUATION` set.
        """
        if self.report_kept_counts and sampling_params.logprobs != 0:
            sampling_params = copy.deepcopy(sampling_params)
            sampling_params.logprobs = 0
        elif self.force_logprobs and sampling_params.logprobs is None:
            sampling_params = copy.deepcopy(sampling_params)
            sampling_params.logprobs = 1
        if self._keeper is not None:  # counts the calls Ray sends again after a restart (same task id)
            self._keeper.started.remote(self.engine_index, ray.get_runtime_context().get_task_id())
        token = _EVALUATION.set(is_evaluation(sampling_params))
        try:
            return await super().generate_responses(prompt, label, sampling_params, *args, **kwargs)
        finally:
            _EVALUATION.reset(token)

    async def stage_weights_from_safetensors(self, blob: bytes) -> List[int]:
        """One message of a weight sync that spans several, but its last (``vllm_worker_wrap.weight_messages``, at
        most ``RELOAD_MESSAGE_BYTES``): every worker stages it until :meth:`load_weights_from_safetensors` brings the
        last. Returns the per-worker tensor counts."""
        return await self.llm.collective_rpc("stage_weights_from_safetensors", args=(blob,))

    async def load_weights_from_safetensors(self, blob: bytes, with_checksums: bool = False) -> Dict[str, Any]:
        """Load a full set of weights into every worker, then drop the prefix cache: ``blob`` is the last message of
        a sync whose others were staged (:meth:`stage_weights_from_safetensors`), or a whole safetensors set.

        vLLM msgpack-encodes every argument on its way to the engine core, which refuses a bytes object of 4 GiB
        or more: a whole set larger than ``RELOAD_MESSAGE_BYTES`` (a caller that sends one blob; the trainer's
        sync never does) is cut into messages here, at the cost of one decoded copy of it in this process.
        The prefix cache holds KV computed by the old weights; reusing it would make the new policy's log-probs
        wrong, so it is always reset here. Returns the per-worker tensor counts and the engine's weight checksums
        taken right after the load, while the engine is idle (the sync check compares them at the next step
        without another engine request).
        """
        import time

        from openrlhf_ess.trainer.ray import vllm_worker_wrap as wire

        if len(blob) > wire.RELOAD_MESSAGE_BYTES:
            from safetensors.torch import load

            for message, last in wire.weight_messages(load(blob).items()):
                if not last:
                    await self.stage_weights_from_safetensors(message)
            blob = message
        counts = await self.llm.collective_rpc("load_weights_from_safetensors", args=(blob,))
        await self.reset_prefix_cache()
        t0 = time.time()
        checksums = await self.weight_checksums() if with_checksums else None
        return {"counts": counts, "checksums": checksums, "checksum_seconds": time.time() - t0}

    async def reset_prefix_cache(self) -> bool:
        """Overrides upstream's, which ignores vLLM's answer: drop the prefix cache around a weight sync, and stop if
        vLLM refuses.

        vLLM's ``reset_prefix_cache`` (``v1/core/sched/scheduler.py``, 0.29 and 0.31) returns False, with a warning
        only, while any request holds KV blocks. A sync never meets that on its own: generation is idle, or paused
        with ``mode="keep"``, whose default ``clear_cache=True`` preempts every running request (back to the waiting
        queue, blocks freed) and resets the cache itself, so a paused request recomputes its whole prefix with the new
        weights when it resumes (docs/off_policy.md). A refusal means requests still hold KV computed by the old
        weights: their next tokens would attend to it while tagged with the new version, so μ would be neither
        version's log-prob. Called after our ``reload`` sync's load, and by upstream before its NCCL broadcast."""
        if await self.llm.reset_prefix_cache():
            return True
        raise RuntimeError(
            f"weight sync after version {self.weight_version}: vLLM refused to reset its prefix cache, so "
            f"{len(self._inflight)} in-flight request(s) still hold KV blocks computed by the old weights; their next "
            "tokens would attend to that KV under the new version's tag (μ would be neither version's log-prob). "
            "Generation must be idle or paused with vLLM's default clear_cache=True during a sync; something paused "
            "it without clearing the cache (a patched pause_generation, or a vLLM version whose pause keeps the KV)."
        )


# Every call of the engine actor that reaches vLLM's engine core (Ray calls from the controller, the weight sync, the
# sync check, the start-up checks; and the loads a restart makes in its __init__): each goes through
# :func:`_engine_call`, so that whichever meets a dead engine core first turns it into a replacement.
ENGINE_CALLS = (
    "generate_responses",
    "pause_generation",
    "resume_generation",
    "init_process_group",
    "update_weight",
    "update_weight_cuda_ipc",
    "reset_prefix_cache",
    "stage_weights_from_safetensors",
    "load_weights_from_safetensors",
    "load_weights_from_refs",
    "pause_if_serving",
    "weight_checksums",
    "prompt_log_probs",
    "contract_sample",
    "probe_sync_group",
    "sleep",
    "wake_up",
)


def _engine_call(method):
    """One engine call, made replaceable: an error raised while vLLM's engine core is dead ends this actor's process
    for Ray to replace (:meth:`RolloutRayActorImpl._exit_if_engine_dead`, replacement on); any other error, or with
    replacement off, reaches the caller as it is."""

    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        try:
            return await method(self, *args, **kwargs)
        except Exception as e:
            self._exit_if_engine_dead(e)
            raise

    call.engine_call = True
    return call


for _name in ENGINE_CALLS:
    setattr(RolloutRayActorImpl, _name, _engine_call(getattr(RolloutRayActorImpl, _name)))

# The watchdog's and the replacement's calls (``watchdog_progress``, ``held_weight_version``) run in their own group,
# so that they never wait behind the default group's generation calls (up to Ray's 1,000 at once).
RolloutRayActor = ray.remote(concurrency_groups={WATCH_GROUP: WATCH_GROUP_CONCURRENCY})(RolloutRayActorImpl)


class _WithEngineKwargs:
    """Stands in for the actor class inside upstream's ``create_vllm_engines``.

    Upstream calls ``RolloutRayActor.options(...).remote(**actor_kwargs)``; this adds (or overrides)
    keyword arguments such as the engine dtype, the KV-cache size and our worker extension.
    """

    def __init__(self, actor_cls: Any, extra: Dict[str, Any], max_restarts: int = 0):
        self._actor_cls, self._extra, self._max_restarts = actor_cls, extra, max_restarts
        self._created = 0

    def options(self, **options):
        if self._max_restarts > 0:  # replacement (trainer/ray/engine_keeper.py): Ray restarts it, resends its calls
            # One more than the run's budget: the keeper, not Ray, refuses the restart past it (in the new engine's
            # __init__), so that failure is recorded and named with the others.
            options = {**options, "max_restarts": self._max_restarts + 1, "max_task_retries": -1}
        bound = self._actor_cls.options(**options)
        extra = dict(self._extra)
        if self._max_restarts > 0:
            extra.update(engine_index=self._created, replaceable=True)
        self._created += 1

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
    if config.needs_versions(args):
        extra["track_versions"] = True
    if args.algo.prox_mode in config.SCORE_AT_SYNC_MODES:
        extra["report_outgoing"] = True
    if config.sampling_mask_on(args):
        extra["report_kept_counts"] = True
    if config.reward_file(args):  # each reward_func call bounded and guarded (openrlhf_ess/utils/agent.py)
        extra.update(reward_timeout_s=args.reward.timeout_s, reward_failure_policy=args.reward.failure_policy)
    if args.vllm.dtype != "bfloat16":
        extra["dtype"] = args.vllm.dtype
    if args.vllm.fp32_lm_head:
        extra["fp32_lm_head"] = True
    if config.routing_replay_on(args):  # the engine returns each request's expert ids (routed_experts)
        extra["report_routes"] = True
    if getattr(args, "selfcheck", "on") != "on":  # the version contract: an untested vLLM is an error, not a warning
        extra["selfcheck"] = False
    if not config.on_cuda(args):
        # vLLM's CPU backend sizes its KV cache from this instead of gpu_memory_utilization.
        extra["kv_cache_memory_bytes"] = int(args.vllm.cpu_kv_cache_gb * (1 << 30))
    return extra


def create_vllm_engines(args):
    """A ``create_vllm_engines`` with upstream's signature that builds our engine actor; each engine's vLLM version
    report reaches the driver's log once it has started (:func:`report_engine_versions`)."""
    create = upstream.create_vllm_engines_with(
        _WithEngineKwargs(RolloutRayActor, engine_kwargs(args), max_restarts=args.vllm.max_restarts)
    )

    @functools.wraps(create)
    def create_and_report(*positional, **named):
        engines = create(*positional, **named)
        report_engine_versions(engines)
        return engines

    return create_and_report


def report_engine_versions(engines: Sequence[Any], log=print) -> None:
    """Log each engine's vLLM version, build and node on the driver (``log``) as soon as that engine has started,
    without waiting for it: one :meth:`RolloutRayActorImpl.vllm_version` call per engine, printed by a callback
    (the engines' own output does not reach the driver: Ray runs with log_to_driver off). An engine that failed to
    start logs nothing here: its error reaches the driver at the first call made to it (the start-up failure)."""
    from openrlhf_ess.trainer.engine_contract import installed_vllm

    driver = installed_vllm()
    for index, engine in enumerate(engines):
        engine.vllm_version.remote().future().add_done_callback(
            functools.partial(_log_engine_version, index, driver, log)
        )


def _log_engine_version(index: int, driver, log, future) -> None:
    from openrlhf_ess.trainer.engine_contract import engine_version_line

    try:
        checked = future.result()
    except Exception:  # the engine did not start (or died): reported by the run's start-up failure path
        return
    log(engine_version_line(index, checked, driver), flush=True)
