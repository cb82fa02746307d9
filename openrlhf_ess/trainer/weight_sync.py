"""Weight sync to the vLLM engines and its check, on the actor side (``--vllm.sync_backend``, ``--vllm.sync_check_*``).

One object per actor rank, called by ``ActorPPOTrainer`` at three points: the sync itself (``reload`` backend:
:meth:`WeightSync.push`; other backends are upstream's broadcast), right after any sync
(:meth:`WeightSync.after_sync`), and at the start of the next training step (:meth:`WeightSync.check_if_due`).
The check of a sync runs at the start of the next training step, or, with ``--vllm.enable_sleep``, right after
the sync, while the engines' weights are awake (:meth:`WeightSync.after_sync` says why).

Memory discipline under ZeRO-3: every pass over the weights here gathers one parameter at a time
(:func:`gathered_one_by_one`), like upstream's broadcast, so the peak extra device memory is the largest
parameter, never the model. On rank 0's host, the reload sync holds one message at a time (at most
``vllm_worker_wrap.RELOAD_MESSAGE_BYTES``, :meth:`WeightSync.push`); the dedicated model's weights and the audit
trail need the whole model once.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import deepspeed
import ray
import torch

from openrlhf_ess.trainer import canary, sync_check
from openrlhf_ess.trainer.replacement_sync import ReplacementSync

SYNC_CANARY_TOKENS = 32


def rel_tolerance(args) -> float:
    """The canary's relative bound: --vllm.sync_check_rel_tol, or by the two sides' dtypes (trainer/canary.py)."""
    if args.vllm.sync_check_rel_tol is not None:
        return args.vllm.sync_check_rel_tol
    return canary.default_rel_tol(args.vllm.dtype, args.ds.param_dtype)


def gathered_one_by_one(
    named_params: Iterable[Tuple[str, torch.nn.Parameter]], zero3: bool
) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """Yield each (name, parameter) with its full value, gathering one parameter at a time under ZeRO-3.

    The parameter is released (back to its partition) as soon as the consumer asks for the next one. Every
    rank must iterate over the same parameters in the same order (each gather is a collective).
    """
    for name, param in named_params:
        with deepspeed.zero.GatheredParameters([param], enabled=zero3):
            yield name, param


def sync_advice(backend: str) -> str:
    """What to try when the sync check finds the engines on other weights than the trainer's: never the backend in
    use. After ``reload`` the engines took every tensor through vLLM's own ``reload_weights``, so what remains is
    how that vLLM loads them."""
    if backend == "reload":
        return (
            "the weights reached the engines through vLLM's reload_weights, which left them on others: a vLLM "
            "version or model layout this reload path does not handle; use the pinned vLLM (docs/vllm_versions.md), "
            "or on GPUs --vllm.sync_backend nccl"
        )
    return "on machines without working NCCL use --vllm.sync_backend reload"


class WeightSync:
    """The actor side of the weight sync: the ``reload`` transport, the weights it sends, and the check."""

    def __init__(self, trainer):
        self.trainer = trainer  # upstream's ActorPPOTrainer (ours): actor, args, vllm_engines, strategy
        self.args = trainer.args
        self.metrics: Dict[str, float] = {}
        self._blob_for_dedicated = None  # (messages,) the reload sync just sent, kept for the dedicated model
        self._loaded_engine_checksums = None  # reload: the engines' checksums taken right after the load
        self._to_check, self._syncs_checked = False, 0
        self._checked_metrics: Dict[str, float] = {}  # --vllm.enable_sleep: the check's, for the next step
        self.replacement = ReplacementSync(self)  # --vllm.max_restarts: the weights kept, the group formed again

    # ---- what is synced ------------------------------------------------------------------------------

    @property
    def _zero3(self) -> bool:
        return self.args.ds.zero_stage == 3

    def synced_params(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """The parameters a sync sends, by HF name (upstream's rule: a VLM's frozen vision tower is not sent)."""
        actor = self.trainer.actor
        return [
            (n, p)
            for n, p in actor.model.module.named_parameters()
            if p.requires_grad or not getattr(actor, "is_vlm", False)
        ]

    def gathered_on_rank0(self) -> Optional[Iterator[Tuple[str, torch.Tensor]]]:
        """The synced weights' (name, full tensor) pairs, gathered one parameter at a time, for rank 0 to consume; on
        other ranks None, after taking part in every gather (all ranks must call it)."""
        named = ((name, param.data) for name, param in gathered_one_by_one(self.synced_params(), self._zero3))
        if torch.distributed.get_rank() == 0:
            return named
        for _ in named:
            pass
        return None

    def synced_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """The weights a sync sends, as contiguous CPU copies by HF name, on rank 0 (None on other ranks).

        All ranks must call it (ZeRO-3 gathers, one parameter at a time). Shared by the reload sync, the
        dedicated model's weights and the audit trail, so all three see the same tensors."""
        rank0 = torch.distributed.get_rank() == 0
        state = {}
        for name, param in gathered_one_by_one(self.synced_params(), self._zero3):
            if rank0:
                state[name] = param.data.detach().to("cpu", copy=True).contiguous()
        return state if rank0 else None

    def weights_blob(self) -> Optional[List[bytes]]:
        """The full HF weights as safetensors messages (``vllm_worker_wrap.weight_messages``) on rank 0 (None on other
        ranks; all ranks must call): one host copy of the model, gathered one parameter at a time. For the dedicated
        model, which gets them through Ray alone (never vLLM's msgpack-encoded engine calls) and reassembles them
        (``prox_scorer.ProxScorerImpl.load_weights``)."""
        from openrlhf_ess.trainer.ray.vllm_worker_wrap import weight_messages

        named = self.gathered_on_rank0()
        return None if named is None else [blob for blob, _ in weight_messages(named)]

    def blob_for_dedicated(self) -> Optional[List[bytes]]:
        """dedicated mode, right after a sync: the messages the reload backend has just sent to the engines (no
        second gather and serialisation); after other backends, gathered now. Every rank must call it (each holds
        the same decision: kept messages, None on ranks other than 0, or a gather)."""
        kept, self._blob_for_dedicated = self._blob_for_dedicated, None
        return kept[0] if kept is not None else self.weights_blob()

    def audit(self, version: int) -> None:
        """--algo.prox_audit_dir: the weights of ``version``, as the engines received them (rank 0 writes)."""
        folder = self.args.algo.prox_audit_dir
        if not folder:
            return
        from safetensors.torch import save_file

        state = self.synced_state()
        if state is not None:
            os.makedirs(folder, exist_ok=True)
            save_file(state, os.path.join(folder, f"weights_v{version}.safetensors"))

    # ---- the reload transport ------------------------------------------------------------------------

    def push(self) -> None:
        """``--vllm.sync_backend reload``, replacing upstream's per-tensor NCCL/gloo broadcast.

        Rank 0 collects the full weights (gathered one parameter at a time under ZeRO-3) into safetensors messages
        of at most ``vllm_worker_wrap.RELOAD_MESSAGE_BYTES`` (vLLM msgpack-encodes each call to its engine core and
        refuses a bytes object of 4 GiB or more), sent to every engine as they fill: each worker stages them, and
        the last one loads the whole set with vLLM's ``reload_weights``. A model that fits in one message takes
        one call per engine. Cost on rank 0's host: one message at a time (its tensors while it is built, then its
        bytes and Ray's copies while the engines take it), never the model (``--algo.prox_mode dedicated`` keeps
        the messages, one copy of the model, for the dedicated model)."""
        from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

        from openrlhf_ess.trainer.ray.vllm_worker_wrap import weight_messages

        dedicated = self.args.algo.prox_mode == "dedicated"  # the dedicated model is sent the same messages next
        reference = self.canary_reference() if self.args.vllm.max_restarts > 0 else None
        named = self.gathered_on_rank0()
        if named is None:
            if dedicated:
                self._blob_for_dedicated = (None,)
        elif self.args.vllm.max_restarts > 0:
            self._push_kept(named, dedicated, reference)
        else:
            engines, checks, kept = self.trainer.vllm_engines, self.args.vllm.sync_check_tol > 0, []
            for blob, last in weight_messages(named):
                if dedicated:
                    kept.append(blob)
                if not last:
                    ray.get([engine.stage_weights_from_safetensors.remote(blob) for engine in engines])
                    continue
                loaded = ray.get([engine.load_weights_from_safetensors.remote(blob, checks) for engine in engines])
                if checks:  # the engines' checksums right after the load, for the check at the next step
                    self._loaded_engine_checksums = [(r["checksums"], r["checksum_seconds"]) for r in loaded]
            if dedicated:
                self._blob_for_dedicated = (kept,)
        torch_dist_barrier_and_cuda_sync()

    def _push_kept(self, named, dedicated: bool, reference: Optional[Dict[str, object]]) -> None:
        """The reload sync with engine replacement on (rank 0; ``trainer/ray/engine_keeper.py``): the messages are
        kept for a restarted engine (:meth:`_keep`), then every engine loads the whole set in one call that Ray may
        send again to a restarted engine (``load_weights_from_refs``)."""
        refs, version = self._keep(named, reference, dedicated)
        checks, engines = self.args.vllm.sync_check_tol > 0, self.trainer.vllm_engines
        loaded = ray.get([engine.load_weights_from_refs.remote(refs, checks, version) for engine in engines])
        if checks:
            self._loaded_engine_checksums = [(r["checksums"], r["checksum_seconds"]) for r in loaded]

    # ---- engine replacement (trainer/replacement_sync.py) ------------------------------------------

    def _keep(
        self, named, reference: Optional[Dict[str, object]], dedicated: bool = False
    ) -> Tuple[List[object], int]:
        return self.replacement.keep(named, reference, dedicated)

    def keep_for_restarts(self) -> None:
        self.replacement.keep_for_restarts()

    def broadcast_replaceable(self, broadcast) -> None:
        self.replacement.broadcast_replaceable(broadcast)

    def regroup_if_replaced(self) -> bool:
        return self.replacement.regroup_if_replaced()

    def regroup(self) -> None:
        self.replacement.regroup()

    def startup_regroup_probe(self) -> str:
        return self.replacement.startup_regroup_probe()

    def check_replaced(self) -> Dict[str, float]:
        return self.replacement.check_replaced()

    # ---- the check -----------------------------------------------------------------------------------

    @property
    def engines_sleep(self) -> bool:
        """``--vllm.enable_sleep``: the engines sleep between generations (upstream allows it only with
        ``--train.colocate_all`` and without ``--train.async_enable``)."""
        return bool(getattr(self.args.vllm, "enable_sleep", False))

    def after_sync(self) -> None:
        """Any backend, right after the weights reached the engines (all ranks): check them.

        Default: at the start of the next training step (:meth:`check_if_due`), not here: with partial
        rollouts the engines are paused until the sync returns, and a paused engine would never answer the
        canary.

        ``--vllm.enable_sleep``: here, now. Upstream puts the engines to sleep after every generation (vLLM
        level 1: weights offloaded to the host and their device memory unmapped, KV cache discarded, scheduler
        paused until nothing is asleep), so by the next training step the checksums would read unmapped memory
        and the canary would wait forever in a paused scheduler. Now the controller has just woken their
        weights for this sync, and nothing generates (sleep mode is synchronous: no async training, no partial
        rollouts). The metrics are reported by the next training step, as by default. The trainer's side is
        fine here with ``--ds.enable_sleep`` too: upstream's ``offload_deepspeed_states`` (after ``fit``) moves the
        optimizer states, fp32 master weights and gradients to the host, not the 16-bit weights that the checksums
        and the canary forward read, as upstream's own sync and experience-making forward do in the same state.
        """
        if self.args.vllm.sync_check_tol <= 0:
            return
        if self.engines_sleep:
            self.metrics = {}
            self.check()
            self._checked_metrics = self.metrics
        else:
            self._to_check = True

    def check_if_due(self) -> Dict[str, float]:
        """At the start of a training step: check the last sync (all ranks), unless ``--vllm.enable_sleep``
        checked it at the sync already; returns the check's metrics."""
        self.metrics, self._checked_metrics = self._checked_metrics, {}
        if self._to_check:  # the engines still hold the weights of the last sync, and are running
            self._to_check = False
            self.check()
        return self.metrics

    def trainer_checksums(self) -> Optional[Dict[str, sync_check.Checksum]]:
        """Per-tensor checksums of the synced weights, by the engine's (fused) names, on rank 0 (None elsewhere).

        All ranks must call it: under ZeRO-3 each parameter is gathered, one at a time, and summed on its device
        (float64, one parameter's worth of extra memory) before the next is gathered. With tied embeddings the
        shared weight is sent once, as the input embedding; its probe columns are also reported as the LM head's
        (``sync_check.applied_name``), which the engine computes through its head's kernel."""
        rank0 = torch.distributed.get_rank() == 0
        tied = sync_check.tied_head(self.trainer.actor.model.module)
        sums = []
        for name, param in gathered_one_by_one(self.synced_params(), self._zero3):
            if rank0:
                sums.append((name, sync_check.checksum(param.data)))
                if tied is not None and param is tied[1]:
                    sums.append((sync_check.applied_name(tied[0]), sync_check.head_columns_checksum(param.data)))
        return sync_check.combine_checksums(sums) if rank0 else None

    def check(self) -> None:
        """Compare the trainer's and every engine's weights (per-tensor checksums, every sync) and log-probs
        on a fixed canary (the first sync, then every --vllm.sync_check_canary_every syncs).

        All ranks take part (ZeRO-3 gathers), rank 0 compares. A mismatch stops the run: training on rollouts
        from wrong weights fails silently. The last sync of a run is not checked, except with --vllm.enable_sleep
        (checked at the sync).
        """
        canary = self._syncs_checked % self.args.vllm.sync_check_canary_every == 0
        self._syncs_checked += 1
        self._compare(canary)

    def _compare(self, canary: bool) -> None:
        """The check itself (all ranks): per-tensor checksums against every engine's, then the canary if asked. With
        --train.stale_k the trainer's side is the version the engines were sent (``stale_lag.py``), not its own."""
        stale = getattr(self.trainer, "stale", None)
        with stale.engine_weights() if stale is not None else contextlib.nullcontext():
            self._compare_held(canary)

    def _compare_held(self, canary: bool) -> None:
        ours = self.trainer_checksums()
        if torch.distributed.get_rank() == 0:
            dtype = str(next(self.trainer.actor.model.module.parameters()).dtype)
            self._check_checksums(ours, dtype)
        if canary:
            self._check_canary()

    def _eval_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The policy's logits of ``ids`` [1, T] in eval mode, without gradients (all ranks: ZeRO-3 gathers)."""
        model = self.trainer.actor.model
        device = torch.cuda.current_device()
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device)).logits
        if was_training:
            model.train()
        return logits

    def startup_canary(self) -> Optional[Dict[str, object]]:
        """The start-up self-check's engine contract (all ranks; rank 0 returns the worst mean |Δ log p|):
        before any sync, engines and trainer hold the same pretrained weights, so the engines' log-probs of the
        fixed canary must match the trainer's own forward within --vllm.sync_check_tol. Catches an engine whose
        numerics differ from the trainer's (dtype, kernels, a wrong LM head) before the first rollout."""
        self.metrics = {}
        self._check_canary(startup=True)
        sampled = self._check_sampled_contract()
        canary, self.metrics = self.metrics.get("sync/canary_mean_abs_diff"), {}
        return None if canary is None else {"canary": canary, "sampled": sampled}

    def _check_sampled_contract(self):
        """Start-up: one short generation with the run's own sampling settings (temperature, top-p, top-k; a fixed
        seed, so every rank gets the same tokens from engine 0), and μ, as the engine returns it, against the
        trainer's own forward of those tokens: log softmax(z/T), over the engine's kept support (k_t) with
        --algo.sampling_mask keep. Without the mask, truncated sampling (top-p < 1 or top-k) makes μ the
        renormalised probability, which the trainer does not model: then only untruncated runs are compared."""
        from openrlhf_ess import config
        from openrlhf_ess.models import sampling_mask as maths

        args, engines = self.args, self.trainer.vllm_engines
        masked = config.sampling_mask_on(args)
        truncated = args.rollout.top_p < 1.0 or (getattr(args.rollout, "top_k", 0) or 0) > 0
        if not config.needs_rollout_logprobs(args):
            return "not run: the engine returns no mu for this run (no off-policy flag)"
        if truncated and not masked:
            return "not run: truncated sampling without --algo.sampling_mask (mu is renormalised)"
        temperature = float(args.rollout.temperature)
        model = self.trainer.actor.model
        vocab = model.module.config.vocab_size
        g = torch.Generator().manual_seed(4321)
        prompt = torch.randint(min(4, vocab - 1), vocab, (8,), generator=g).tolist()
        sample = ray.get(
            engines[0].contract_sample.remote(
                prompt, temperature, args.rollout.top_p, getattr(args.rollout, "top_k", 0) or 0, SYNC_CANARY_TOKENS
            )
        )
        logits = self._eval_logits(torch.tensor([prompt + sample["tokens"]]))
        if torch.distributed.get_rank() != 0 or not sample["tokens"]:
            return None
        n = len(sample["tokens"])
        rows = logits[0, len(prompt) - 1 : len(prompt) - 1 + n].float()
        tokens = torch.tensor(sample["tokens"], device=rows.device)
        if masked:
            kept = torch.tensor(sample["ranks"], device=rows.device)

            def log_probs_at(t):
                return maths.masked_log_probs(rows, tokens, kept, t).cpu()

        else:

            def log_probs_at(t):
                return (rows / t).log_softmax(-1).gather(-1, tokens[:, None])[:, 0].cpu()

        mu = torch.tensor(sample["logprobs"])
        # Which distribution mu is (trainer/canary.py): scale-free, where the bound below misses a temperature
        # or logprobs-mode error on a flat model (0.07 nats at T 0.6 on the tiny one, docs/canary_faults.md).
        hypotheses = canary.temperature_hypotheses(log_probs_at, temperature)
        rel_tol = rel_tolerance(args)
        named = canary.other_distribution(mu, hypotheses, rel_tol)
        if named:
            d = canary.closest_distribution(mu, hypotheses)["distances"]
            raise RuntimeError(
                f"start-up self-check failed (engine contract): {n} tokens sampled by vLLM engine 0 at temperature "
                f"{temperature} have log-probs mu closest to the trainer's {canary.HYPOTHESIS_NAMES[named]}"
                f" (mean |diff| {d[named]:.2e} nats) and {d['at T']:.2e} nats from log softmax(z/T), the "
                "distribution the engine sampled from. "
                + canary.HYPOTHESIS_FIXES[named]
                + " Every importance weight would be off. Or skip with --selfcheck off."
            )
        ours = hypotheses["at T"]
        diff, rel = canary.distance(mu, ours)
        tol = args.vllm.sync_check_tol
        if not canary.within_bounds(diff, rel, tol, rel_tol):
            raise RuntimeError(
                f"start-up self-check failed (engine contract): {n} tokens sampled by vLLM engine 0 with the run's "
                f"settings (temperature {temperature}, top-p {args.rollout.top_p}, top-k "
                f"{getattr(args.rollout, 'top_k', 0)}) have log-probs mu {diff:.3f} nats (mean |diff|; {rel:.3f} of "
                f"their spread) away from the trainer's forward of the same tokens"
                f"{' over the kept support' if masked else ''}, above --vllm.sync_check_tol {tol} or "
                f"--vllm.sync_check_rel_tol {rel_tol}. The engine does not return the log-probs of the distribution "
                "it sampled from as the trainer computes them (logprobs mode, temperature handling, or the sampler's "
                "kept counts): every importance weight would be off. Check the vLLM version (pinned: 0.29 on GPU), "
                "or skip with --selfcheck off."
            )
        return diff

    def _canary_log_probs(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The fixed canary's ids [1, T] and the trainer's log-probs of them under the weights it holds now (all ranks:
        ZeRO-3 gathers; None on ranks other than 0)."""
        vocab = self.trainer.actor.model.module.config.vocab_size
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(min(4, vocab - 1), vocab, (1, SYNC_CANARY_TOKENS), generator=g)
        logits = self._eval_logits(ids)
        if torch.distributed.get_rank() != 0:
            return ids, None
        return ids, logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None].to(logits.device))[:, 0].cpu()

    def canary_reference(self) -> Optional[Dict[str, object]]:
        """Replacement on, at each sync (all ranks), before the weights leave: the canary's ids and the trainer's
        log-probs of them under the weights being synced, with the check's bounds, for the keeper (rank 0; None
        elsewhere). A restarted engine checks itself against them before it serves (``RolloutRayActorImpl._rejoin``).
        Cost: one forward of 32 tokens per sync."""
        ids, ours = self._canary_log_probs()
        if ours is None:
            return None
        tol, rel_tol = self.args.vllm.sync_check_tol, rel_tolerance(self.args)
        return {"ids": ids[0].tolist(), "log_probs": ours.tolist(), "tol": tol, "rel_tol": rel_tol}

    def _check_canary(self, startup: bool = False) -> None:
        t0 = time.time()
        ids, ours = self._canary_log_probs()
        if ours is None:
            return
        engines = self.trainer.vllm_engines
        with self._engines_can_generate(engines):
            theirs = ray.get([engine.prompt_log_probs.remote(ids[0].tolist()) for engine in engines])
        diffs, rels = zip(*(canary.distance(torch.tensor(lp), ours) for lp in theirs))
        self.metrics.update(
            {
                "sync/canary_mean_abs_diff": max(diffs),
                "sync/canary_rel_diff": max(rels),
                "sync/canary_seconds": time.time() - t0,
            }
        )
        tol, rel_tol = self.args.vllm.sync_check_tol, rel_tolerance(self.args)
        # The relative bound (trainer/canary.py) is what separates another function from bf16 noise on a flat
        # model, where every fault stays far below the absolute one (docs/canary_faults.md).
        bad = [i for i, (d, r) in enumerate(zip(diffs, rels)) if not canary.within_bounds(d, r, tol, rel_tol)]
        worst = f"{max(diffs):.3f} nats (mean |diff|; {max(rels):.3f} of the log-probs' own spread)"
        if bad and startup:
            raise RuntimeError(
                f"start-up self-check failed (engine contract): before any weight sync, vLLM engine(s) {bad} give "
                f"canary log-probs {worst} away from the trainer's forward of the same tokens, above "
                f"--vllm.sync_check_tol {tol} or --vllm.sync_check_rel_tol {rel_tol} (rounding measured at <= "
                f"{canary.BF16_NOISE_REL} of the spread with bf16, {canary.FP32_NOISE_REL} in fp32), although "
                "both loaded the same model. The engine computes another function than the trainer (another LM "
                "head, positional or attention kernel, or quantisation): check the engine's model config and "
                "quantisation, raise the tolerance if the gap is expected (an fp8 engine), or skip with "
                "--selfcheck off."
            )
        if bad:
            raise RuntimeError(
                f"weight sync check failed after version {self.trainer.weight_version}: vLLM engine(s) {bad} give "
                f"canary log-probs {worst} away from the trainer's, above --vllm.sync_check_tol {tol} or "
                f"--vllm.sync_check_rel_tol {rel_tol}. The engines are not generating with the trained weights "
                f"(sync backend {self.args.vllm.sync_backend!r}): {sync_advice(self.args.vllm.sync_backend)}; "
                "raise the tolerance only if engine and trainer dtypes differ a lot."
            )

    @contextlib.contextmanager
    def _engines_can_generate(self, engines):
        """Rank 0, around the canary, a generate request: it needs the engines' KV cache and a running scheduler.

        Default: the engines are awake. ``--vllm.enable_sleep`` (the check runs at the sync): only their weights
        are awake, and vLLM keeps the scheduler paused while anything is asleep. Wake the KV cache (vLLM then
        resumes the scheduler), and afterwards put the engines back to sleep as upstream does after generating
        (level 1), so that until the next generation they hold no KV cache, as upstream intends (a checkpoint
        save may come first); that generation's ``wake_up()`` wakes both. Cost, on canary syncs only: one more
        offload and reload of the engine weights (host <-> device copies)."""
        if not self.engines_sleep:
            yield
            return
        ray.get([engine.wake_up.remote(tags=["kv_cache"]) for engine in engines])
        try:
            yield
        finally:
            ray.get([engine.sleep.remote() for engine in engines])

    def _check_checksums(self, ours, dtype: str) -> None:
        """Per-tensor check (rank 0): every engine's weight sums against the trainer's, by tensor name."""
        t0 = time.time()
        compared_all, notes = 0, []
        loaded, self._loaded_engine_checksums = self._loaded_engine_checksums, None
        if loaded is not None:  # reload backend: taken by the engines right after the load, while idle
            results, engine_seconds = [r for r, _ in loaded], sum(sec for _, sec in loaded)
        else:  # other backends: ask the engines now
            results = ray.get([engine.weight_checksums.remote() for engine in self.trainer.vllm_engines])
            engine_seconds = 0.0
        covered = []  # (fraction of the trainer's elements the engine's names cover, engine index, its names)
        for i, result in enumerate(results):
            engine_dtype, theirs, *replicas = result  # replicas: per worker, with tensor parallelism
            names = theirs[0] if isinstance(theirs, list) else theirs
            mine = sync_check.fold_parts(sync_check.align_experts(ours, names), names)
            if isinstance(theirs, list):  # tensor-parallel engine: one dict per worker
                theirs = sync_check.merge_tensor_parallel(theirs, mine, replicas[0] if replicas else None)
            theirs = sync_check.fold_parts(theirs, mine)
            tol = sync_check.SAME_DTYPE_TOL if engine_dtype == dtype else sync_check.CAST_TOL
            bad, compared = sync_check.mismatched(mine, theirs, tol)
            compared_all += compared
            covered.append((sync_check.coverage(mine, theirs), i, theirs))
            if compared == 0:  # a check that compared nothing must not pass
                notes.append(
                    f"engine {i}: none of its {len(theirs)} tensor names matches one of the trainer's "
                    f"{len(ours)} (e.g. engine {sorted(theirs)[:2]}, trainer {sorted(ours)[:2]}): nothing could be "
                    "compared"
                )
            elif bad:
                notes.append(
                    f"engine {i}: {len(bad)} of {compared} tensors differ ({', '.join(bad[:5])}"
                    f"{', ...' if len(bad) > 5 else ''})"
                )
        low, worst, names = min(covered, key=lambda c: c[0]) if covered else (1.0, 0, {})
        self.metrics.update(
            {
                "sync/checksum_tensors_compared": float(compared_all),
                "sync/checksum_coverage": low,
                "sync/checksum_seconds": time.time() - t0 + engine_seconds,
            }
        )
        floor = self.args.vllm.sync_check_min_coverage
        if low < floor and not notes:
            left = sorted(name for name in sync_check.align_experts(ours, names) if name not in names)
            raise RuntimeError(
                f"weight sync check after version {self.trainer.weight_version}: only {100 * low:.1f}% of the "
                f"trainer's weight elements have a tensor of the same name in engine {worst} (below "
                f"--vllm.sync_check_min_coverage {floor:g}), so the rest cannot be compared: "
                f"{', '.join(left[:8])}{', ...' if len(left) > 8 else ''} ({len(left)} tensors left out). The name "
                "map (trainer/sync_check.py) does not know this engine's layout; --vllm.sync_check_min_coverage "
                f"{max(0.0, math.floor(100 * low) / 100 - 0.01):.2f} accepts it (the canary still checks the engine "
                "end to end)."
            )
        tied_note = ""
        if any(sync_check.applied_name("") in note for note in notes):
            tied_note = (
                "A name ending in .weight[applied] is a tied LM head checked by what it computes (its logits for "
                "one-hot hidden states, against the trained embedding's columns): the engine's head computes with "
                "other weights than the embedding it shares, so it samples from a head that is not the policy's. "
            )
        if notes:
            raise RuntimeError(
                f"weight sync check failed after version {self.trainer.weight_version}: the engines do not hold "
                f"the trained weights: {'; '.join(notes)}. {tied_note}Sync backend {self.args.vllm.sync_backend!r}: "
                f"{sync_advice(self.args.vllm.sync_backend)}; --vllm.sync_check_tol 0 disables the check."
            )
