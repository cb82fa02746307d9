"""Policy actor: upstream's ``PolicyModelActor`` / ``ActorPPOTrainer`` with a weight sync that needs no NCCL.

Mirrors ``openrlhf/trainer/ray/ppo_actor.py``.
"""

from __future__ import annotations

from openrlhf_ess import cpu_compat

cpu_compat.apply()

import contextvars  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import deepspeed  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from openrlhf.trainer.ray import ppo_actor as _upstream  # noqa: E402
from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync  # noqa: E402

from openrlhf_ess import config, upstream  # noqa: E402
from openrlhf_ess.config import RELOAD_BACKEND  # noqa: E402
from openrlhf_ess.models import corrections  # noqa: E402
from openrlhf_ess.models.loss import PolicyLoss  # noqa: E402
from openrlhf_ess.trainer import ess_lr, prox, sync_check  # noqa: E402

# (μ of the micro-batch in training_step, IS cap) for the off-policy k2 KL below.
_K2_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("openrlhf_ess_k2_context")
K2_DEFAULT_IS_CAP = 10.0
SYNC_CANARY_TOKENS = 32  # upstream's bound on its KL IS weight (KL_IS_WEIGHT_CLIP)


def _off_policy_k2_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1", unbiased_gradient=False):
    """Stands in for upstream's ``compute_approx_kl`` inside training_step with --algo.kl.off_policy_k2_enable."""
    rollout_log_probs, cap = _K2_CONTEXT.get()
    return corrections.kl_loss_k2(
        log_probs,
        log_probs_base,
        prox_log_probs=log_probs_old,
        rollout_log_probs=rollout_log_probs,
        tis_cap=cap,
        value_estimator=kl_estimator,
    )


class ActorPPOTrainer(_upstream.ActorPPOTrainer):
    def __init__(self, *args, **kwargs):
        """Extends upstream's init with what our flags need: the weight-version counter, the sequence-level
        TIS loss, the π_prox weight store (snapshot/ewma), and the ESS LR hook on the innermost optimizer."""
        super().__init__(*args, **kwargs)
        # Weight syncs applied to the engines; tokens are tagged with it (shared/DESIGN.md §4).
        self.weight_version = 0
        algo = self.args.algo
        if algo.tis_cap is not None and algo.tis_level == "seq":
            self.actor_loss_fn = PolicyLoss.from_upstream(self.actor_loss_fn, algo.tis_cap, algo.tis_level)
        # π_prox sources (shared/DESIGN.md §4): host copies per version, or EWMA weights
        self.snapshots = self.ewma = None
        self._prox_seconds, self._prox_forwards, self._prox_missing = 0.0, 0, 0
        self._optimizer_steps_seen = 0
        # ZeRO-3: snapshots and EWMA weights are this rank's partitions, swapped in on every rank at once
        self._partitioned = prox.is_partitioned(self.actor.model.module)
        if algo.prox_mode in ("snapshot", "interrupt"):
            # interrupt scores at each sync, so only the version the engines hold must be kept
            self.snapshots = prox.WeightSnapshots(algo.prox_snapshots if algo.prox_mode == "snapshot" else 1)
            self.snapshots.put(self.weight_version, self.actor.model.module)
        elif algo.prox_mode == "ewma":
            self.ewma = prox.EwmaWeights(algo.prox_ewma_decay)
        self._audit_weights()
        self._blob_for_dedicated = None  # (blob,) the reload sync just sent, kept for the dedicated model
        self.sync_check_metrics, self._sync_to_check, self._syncs_checked = {}, False, 0
        self.lr_scale_hook = None
        if self.args.algo.ess_lr_enable:
            # After deepspeed.initialize (done by strategy.prepare), which takes a dummy step.
            self.lr_scale_hook = ess_lr.LrScaleHook(ess_lr.innermost_optimizer(self.actor.model))

    # Upstream's training_step with its KL estimator replaced by the off-policy k2 one.
    _k2_training_step = upstream.rebind(
        _upstream.ActorPPOTrainer.training_step, {"compute_approx_kl": _off_policy_k2_kl}
    )

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        """Overrides upstream's only with --algo.kl.off_policy_k2_enable: the KL-loss gradient becomes
        the k2 surrogate's weighted by (π_θ/π_prox)·min(π_prox/μ, C). The rest of the step is upstream's."""
        if not self.args.algo.kl.off_policy_k2_enable and self.ewma is None:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        if self.args.algo.kl.off_policy_k2_enable:
            cap = self.args.algo.tis_cap if self.args.algo.tis_cap is not None else K2_DEFAULT_IS_CAP
            token = _K2_CONTEXT.set((experience.rollout_log_probs, cap))
            try:
                status = self._k2_training_step(experience, kl_ctl, step, loss_batch_info)
            finally:
                _K2_CONTEXT.reset(token)
        else:
            status = super().training_step(experience, kl_ctl, step, loss_batch_info)
        if self.ewma is not None and self.actor.model.global_steps > self._optimizer_steps_seen:
            # PPO-EWMA averages the weights after every optimizer step (accumulation boundaries only)
            self._optimizer_steps_seen = self.actor.model.global_steps
            self.ewma.update(self.actor.model.module)
        return status

    def checkpoint_state(self) -> dict:
        """What a restart needs to continue exactly: the PPO-EWMA average (snapshots need nothing: the
        rollouts in flight at a checkpoint do not survive a restart, and versions restart consistently at 0).
        Under ZeRO-3 the average is this rank's partition; DeepSpeed writes one client state per rank."""
        if self.ewma is None:
            return {}
        return {"ewma": self.ewma.state_dict(), "partition_of": self._partition_owner()}

    def load_checkpoint_state(self, state: dict) -> None:
        if self.ewma is not None and "ewma" in state:
            saved_owner = state.get("partition_of")
            if saved_owner != self._partition_owner():
                raise RuntimeError(
                    f"--algo.prox_mode ewma: this rank ({self._partition_owner()}) was given the EWMA weights saved "
                    f"by {saved_owner} (rank, ranks; None = unpartitioned). Resume with the same --ds.zero_stage and "
                    "number of actor ranks (--actor.num_nodes x --actor.num_gpus_per_node)."
                )
            self._check_partition_layout(state["ewma"]["avg"])
            self.ewma.load_state_dict(state["ewma"])
            self._optimizer_steps_seen = self.actor.model.global_steps

    def _partition_owner(self):
        """(rank, ranks) whose partition this rank's stored weights are under ZeRO-3; None otherwise."""
        if not self._partitioned:
            return None
        return (torch.distributed.get_rank(), torch.distributed.get_world_size())

    def _check_partition_layout(self, saved) -> None:
        """EWMA weights saved under ZeRO-3 are this rank's partitions: they only fit the same layout."""
        if not saved:
            return
        for name, p in self.actor.model.module.named_parameters():
            if name not in saved or saved[name].shape != prox.storage(p).shape:
                raise RuntimeError(
                    f"--algo.prox_mode ewma: the checkpoint's EWMA weights do not fit this run's parameters "
                    f"({name}: saved {tuple(saved[name].shape) if name in saved else 'nothing'}, here "
                    f"{tuple(prox.storage(p).shape)}). Under ZeRO-3 they are per-rank partitions: resume with the "
                    "same --ds.zero_stage and number of actor ranks (--actor.num_nodes x --actor.num_gpus_per_node)."
                )

    def _swapped(self, state):
        """The module with ``state``'s weights for one block (all ranks together under ZeRO-3)."""
        release = self.actor.model.optimizer.empty_partition_cache if self._partitioned else None
        return prox.swapped_weights(self.actor.model.module, state, release)

    def _agree(self, local: list, candidates: list) -> list:
        """ZeRO-3: the candidates that any rank needs (each swapped forward gathers on every rank)."""
        if not self._partitioned or not candidates:
            return [c for c in candidates if c in local]
        flags = torch.tensor([float(c in local) for c in candidates], device=torch.cuda.current_device())
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return [c for c, f in zip(candidates, flags.tolist()) if f > 0]

    def _audit_weights(self):
        """--algo.prox_audit_dir: the weights of the current version, as the engines received them.

        Every rank calls it (ZeRO-3 gathers the shards); rank 0 writes."""
        folder = self.args.algo.prox_audit_dir
        if not folder:
            return
        from safetensors.torch import save_file

        state = self._synced_state()
        if state is not None:
            os.makedirs(folder, exist_ok=True)
            save_file(state, os.path.join(folder, f"weights_v{self.weight_version}.safetensors"))

    def proximal_log_probs(self, current: torch.Tensor, versions: torch.Tensor, forward) -> torch.Tensor:
        """π_prox per token for snapshot/ewma modes; ``current`` is the forward with the live weights.

        snapshot: tokens of version v get the forward with v's weights (live weights for the current
        version); a version no longer kept gives NaN, which the controller masks and counts (or stops
        on, per --algo.prox_missing). ewma: one forward with the bias-corrected EWMA weights.
        """
        t0 = time.time()
        if self.ewma is not None:
            state = self.ewma.state()
            if state is None:  # no optimizer step yet: the EWMA equals the initial weights
                return current
            with self._swapped(state):
                out = forward()
            self._prox_forwards += 1
        else:
            out = current.clone()
            stale = sorted(set(versions[versions >= 0].unique().tolist()) - {self.weight_version})
            kept = self.snapshots.versions()  # the same on every rank
            for version in stale:
                if version not in kept:
                    selected = versions == version
                    out[selected] = float("nan")
                    self._prox_missing += int(selected.sum())
            # under ZeRO-3 a rank without tokens of a version still joins that version's forward
            for version in self._agree(stale, [v for v in kept if v != self.weight_version]):
                with self._swapped(self.snapshots.get(version)):
                    scored = forward()
                selected = versions == version
                out[selected] = scored[selected]
                self._prox_forwards += 1
        self._prox_seconds += time.time() - t0
        return out

    def score_streams(self, version: int, streams) -> list:
        """interrupt mode, at the sync version -> version + 1: π_version of each token stream, scored with the
        kept copy of ``version``'s weights (the live weights are already the next version's). Every actor rank
        is called, some with no streams; under ZeRO-3 all of them run the same number of forwards."""
        state = self.snapshots.get(version)
        if state is None:
            raise RuntimeError(f"interrupt mode: no copy of version {version} (kept: {self.snapshots.versions()})")
        forwards = prox.forwards_needed(len(streams))
        if self._partitioned:
            count = torch.tensor([float(forwards)], device=torch.cuda.current_device())
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            forwards = int(count.item())
        if forwards == 0:
            return []
        t0 = time.time()
        model = self.actor.model.module
        was_training = model.training
        model.eval()
        try:
            with self._swapped(state):
                out = prox.stream_log_probs(model, streams, self.args.rollout.temperature, forwards=forwards)
        finally:
            model.train(was_training)
        self._prox_seconds += time.time() - t0
        self._prox_forwards += 1
        return out

    def prox_metrics(self) -> dict:
        """Cost of the π_prox mode since the last call: extra forward time and count, host memory."""
        stored = self.snapshots.nbytes() if self.snapshots is not None else self.ewma.nbytes()  # this rank's
        out = {
            "prox/extra_forward_seconds": self._prox_seconds,
            "prox/extra_forwards": float(self._prox_forwards),
            "prox/missing_version_tokens": float(self._prox_missing),
            "prox/host_memory_mb": stored / 2**20,
        }
        if self.ewma is not None:
            out["prox/ewma_updates"] = float(self.ewma.n)
        self._prox_seconds, self._prox_forwards, self._prox_missing = 0.0, 0, 0
        return out

    def ppo_train(self, kl_ctl: float):
        """Wraps upstream's ppo_train: with ESS LR, this rollout's optimizer steps run at the scaled LR.

        Without our flags upstream's method runs untouched; only metrics are added (the weight-sync
        check of the sync before this rollout, the π_prox mode's cost).
        """
        self.sync_check_metrics = {}
        if self._sync_to_check:  # the engines still hold the weights of the last sync, and are running
            self._sync_to_check = False
            self.check_sync()
        if self.lr_scale_hook is None:
            status = super().ppo_train(kl_ctl)
        else:
            algo = self.args.algo
            scale, metrics = ess_lr.global_lr_scale(
                self.replay_buffer.items, algo.ess_lr_weight, algo.ess_lr_rule, algo.ess_lr_floor
            )
            with self.lr_scale_hook.applied(scale):
                status = super().ppo_train(kl_ctl)
            status.update(metrics)
            # engine.get_lr() / the scheduler report the unscaled LR; log what the optimizer really used.
            status["actor_lr_effective"] = self.actor_scheduler.get_last_lr()[0] * scale
        if self.snapshots is not None or self.ewma is not None:
            status.update(self.prox_metrics())
        status.update(self.sync_check_metrics)
        return status

    def _init_vllm_sync_group(self, backend: str):
        """Overrides upstream's NCCL/gloo group set-up: the ``reload`` backend needs no process group."""
        if backend == RELOAD_BACKEND:
            return
        super()._init_vllm_sync_group(backend)

    def broadcast_to_vllm(self):
        """Sync weights to the engines, then tell them the new weight version.

        The version is set while generation is paused (partial rollouts) or idle (otherwise), so the
        engines can tag every token with the weights that sampled it. Without a feature that needs
        versions, nothing is sent beyond the weights.
        """
        if self.strategy.args.vllm.sync_backend == RELOAD_BACKEND:
            self._reload_to_vllm()
        else:
            super().broadcast_to_vllm()
        self.advance_version()
        # Checked at the start of the next training step, not here: with partial rollouts the engines are
        # paused until this method returns, and a paused engine would never answer the canary.
        self._sync_to_check = self.args.vllm.sync_check_tol > 0

    def check_sync(self):
        """Compare the trainer's and every engine's weights (per-tensor checksums, every sync) and log-probs
        on a fixed canary (the first sync, then every --vllm.sync_check_canary_every syncs).

        Runs at the start of the training step after the sync (all ranks), so the last sync of a run
        is not checked. All ranks take part (ZeRO-3 gathers), rank 0 compares. A mismatch stops the run:
        training on rollouts from wrong weights fails silently.
        """
        canary = self._syncs_checked % self.args.vllm.sync_check_canary_every == 0
        self._syncs_checked += 1
        params = list(self.actor.model.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=self.args.ds.zero_stage == 3):
            ours_sums = sync_check.trainer_checksums(params) if torch.distributed.get_rank() == 0 else None
        if torch.distributed.get_rank() == 0:
            self._check_checksums(ours_sums, str(params[0][1].dtype))
        if canary:
            self._check_canary()

    def _check_canary(self):
        t0 = time.time()
        vocab = self.actor.model.module.config.vocab_size
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(min(4, vocab - 1), vocab, (1, SYNC_CANARY_TOKENS), generator=g)
        device = torch.cuda.current_device()
        was_training = self.actor.model.training
        self.actor.model.eval()
        with torch.no_grad():
            logits = self.actor.model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device)).logits
        if was_training:
            self.actor.model.train()
        if torch.distributed.get_rank() != 0:
            return
        ours = logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None].to(logits.device))[:, 0].cpu()
        theirs = ray.get([engine.prompt_log_probs.remote(ids[0].tolist()) for engine in self.vllm_engines])
        diffs = [(ours - torch.tensor(lp)).abs().mean().item() for lp in theirs]
        self.sync_check_metrics.update(
            {"sync/canary_mean_abs_diff": max(diffs), "sync/canary_seconds": time.time() - t0}
        )
        # NaN compares False with everything: a NaN diff (NaN weights on either side) must fail too
        bad = [i for i, d in enumerate(diffs) if not (math.isfinite(d) and d <= self.args.vllm.sync_check_tol)]
        if bad:
            raise RuntimeError(
                f"weight sync check failed after version {self.weight_version}: vLLM engine(s) {bad} give canary "
                f"log-probs {max(diffs):.3f} nats (mean |diff|) away from the trainer's, above "
                f"--vllm.sync_check_tol {self.args.vllm.sync_check_tol}. The engines are not generating with the "
                f"trained weights (sync backend {self.args.vllm.sync_backend!r}): on machines without working NCCL "
                "use --vllm.sync_backend reload; raise the tolerance only if engine and trainer dtypes differ a lot."
            )

    def _check_checksums(self, ours, dtype: str) -> None:
        """Per-tensor check (rank 0): every engine's weight sums against the trainer's, by tensor name."""
        t0 = time.time()
        compared_all, notes = 0, []
        loaded, self._loaded_engine_checksums = getattr(self, "_loaded_engine_checksums", None), None
        if loaded is not None:  # reload backend: taken by the engines right after the load, while idle
            results, engine_seconds = [r for r, _ in loaded], sum(sec for _, sec in loaded)
        else:  # other backends: ask the engines now
            results = ray.get([engine.weight_checksums.remote() for engine in self.vllm_engines])
            engine_seconds = 0.0
        for i, result in enumerate(results):
            if result is None:
                continue  # tensor-parallel engine: the canary alone checks it
            engine_dtype, theirs = result
            tol = sync_check.SAME_DTYPE_TOL if engine_dtype == dtype else sync_check.CAST_TOL
            bad, compared = sync_check.mismatched(ours, theirs, tol)
            compared_all += compared
            if bad:
                notes.append(
                    f"engine {i}: {len(bad)} of {compared} tensors differ ({', '.join(bad[:5])}"
                    f"{', ...' if len(bad) > 5 else ''})"
                )
        self.sync_check_metrics = {
            "sync/checksum_tensors_compared": float(compared_all),
            "sync/checksum_seconds": time.time() - t0 + engine_seconds,
        }
        if notes:
            raise RuntimeError(
                f"weight sync check failed after version {self.weight_version}: the engines do not hold the "
                f"trained weights: {'; '.join(notes)}. Sync backend {self.args.vllm.sync_backend!r}: on machines "
                "without working NCCL use --vllm.sync_backend reload; --vllm.sync_check_tol 0 disables the check."
            )

    def advance_version(self):
        """After a complete weight sync: count it, snapshot the weights (snapshot mode), tell the engines."""
        self.weight_version += 1
        if self.snapshots is not None:
            self.snapshots.put(self.weight_version, self.actor.model.module)
        self._audit_weights()
        if self.vllm_engines and config.needs_versions(self.args) and torch.distributed.get_rank() == 0:
            ray.get([engine.set_weight_version.remote(self.weight_version) for engine in self.vllm_engines])

    def _reload_to_vllm(self):
        """``--vllm.sync_backend reload``, replacing upstream's per-tensor NCCL/gloo broadcast.

        Rank 0 gathers the full weights (ZeRO-3 shards included), serialises them once as a
        safetensors blob, and every engine loads the blob with vLLM's ``reload_weights``. Cost: one
        host copy of the model per sync.
        """
        blob = self.weights_blob()
        if self.args.algo.prox_mode == "dedicated":  # the dedicated model is sent the same bytes next
            self._blob_for_dedicated = (blob,)
        if blob is not None:
            checks = self.args.vllm.sync_check_tol > 0
            loaded = ray.get(
                [engine.load_weights_from_safetensors.remote(blob, checks) for engine in self.vllm_engines]
            )
            if checks:  # the engines' checksums right after the load, for the check at the next step
                self._loaded_engine_checksums = [(r["checksums"], r["checksum_seconds"]) for r in loaded]
        torch_dist_barrier_and_cuda_sync()

    def weights_blob(self):
        """The full HF weights as safetensors bytes on rank 0 (None on other ranks; all ranks must call:
        ZeRO-3 gathers). What the reload backend sends to the engines and the dedicated π_prox model."""
        from safetensors.torch import save

        state = self._synced_state()
        return save(state) if state is not None else None

    def weights_blob_for_dedicated(self):
        """dedicated mode, right after a sync: the blob the reload backend has just sent to the engines (no second
        gather and serialisation of the weights); after other backends, gathered now. Every rank must call it
        (each holds the same decision: a kept blob, None on ranks other than 0, or a gather)."""
        kept, self._blob_for_dedicated = self._blob_for_dedicated, None
        return kept[0] if kept is not None else self.weights_blob()

    def _synced_state(self):
        """The weights a sync sends, as contiguous CPU copies by HF name, on rank 0 (None on other ranks).

        All ranks must call it: with ZeRO-3 the shards are gathered. Shared by the reload sync, the
        dedicated model's weights and the audit trail, so all three see the same tensors."""
        model = self.actor.model.module
        params = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad or not getattr(self.actor, "is_vlm", False)
        ]
        with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=self.strategy.args.ds.zero_stage == 3):
            if torch.distributed.get_rank() != 0:
                return None
            return {name: param.data.detach().to("cpu", copy=True).contiguous() for name, param in params}


_UpstreamPolicyModelActor = upstream.ray_actor_class(_upstream.PolicyModelActor)


CHECKPOINT_KEY = "openrlhf_ess"  # our entry in DeepSpeed's client_state


class PolicyModelActorImpl(_UpstreamPolicyModelActor):
    # Upstream's init, building our ActorPPOTrainer instead of upstream's.
    _upstream_init = upstream.with_actor_trainer(_UpstreamPolicyModelActor.init_model_from_pretrained, ActorPPOTrainer)

    def init_model_from_pretrained(self, *args, **kwargs):
        """Upstream's init, then our trainer state from the checkpoint it loaded (if any).

        Our entry is taken out of ``checkpoint_states``, which upstream ships to the controller.
        """
        self._upstream_init(*args, **kwargs)
        ours = self.checkpoint_states.pop(CHECKPOINT_KEY, None)
        if ours:
            self.trainer.load_checkpoint_state(ours)

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """Extends upstream's: our trainer state (e.g. the EWMA weights) goes into the same checkpoint."""
        client_states = dict(client_states or {})
        ours = self.trainer.checkpoint_state()
        if ours:
            client_states[CHECKPOINT_KEY] = ours
        return super().save_checkpoint(tag, client_states, metric_value, metric_key)

    def score_streams(self, version: int, streams) -> list:
        """interrupt mode: π_version of token streams (see ActorPPOTrainer.score_streams)."""
        return self.trainer.score_streams(version, streams)

    def weights_blob(self):
        """dedicated mode: the weights for the old-log-prob model (rank 0; every rank must call)."""
        return self.trainer.weights_blob_for_dedicated()

    def forward(
        self,
        sequences,
        action_mask=None,
        attention_mask=None,
        packed_seq_lens=None,
        mm_train_inputs_list=None,
        rollout_versions=None,
    ):
        """Extends upstream's: with ``rollout_versions`` (snapshot/ewma modes) return π_prox per token."""
        current = super().forward(sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list)
        if rollout_versions is None:
            return current

        def forward_again():
            return super(PolicyModelActorImpl, self).forward(
                sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list
            )

        return self.trainer.proximal_log_probs(current, rollout_versions, forward_again)


PolicyModelActor = ray.remote(num_gpus=1)(PolicyModelActorImpl)
