"""Policy actor: upstream's ``PolicyModelActor`` / ``ActorPPOTrainer`` with our features plugged in.

Mirrors ``openrlhf/trainer/ray/ppo_actor.py``. The trainer only routes: each feature lives in its own module,
found from its flag in one hop:

- weight sync and its check (``--vllm.sync_backend reload``, ``--vllm.sync_check_*``): ``trainer/weight_sync.py``
- π_prox sources (``--algo.prox_mode snapshot | interrupt | ewma``): ``trainer/prox_sources.py``
- ESS-guided LR (``--algo.ess_lr_*``): ``trainer/ess_lr.py``
- k2 KL loss (``--algo.kl.off_policy_k2_enable``): ``trainer/kl_k2.py``
- sequence-level TIS (``--algo.tis_level seq``): ``models/loss.py``
- truncated-support log-probs (``--algo.sampling_mask keep``): ``trainer/sampling_mask.py``
- MoE routing replay (``--algo.routing_replay``): ``trainer/routing_replay.py``
- VCPO's optimal baseline (``--algo.advantage.baseline opob``): ``trainer/opob.py``
- a version lag set exactly (``--train.stale_k``): ``trainer/stale_lag.py``
- M2PO (``--algo.m2po_tau``): ``trainer/m2po.py`` (the batch's mask, made by the experience maker) and
  ``models/loss.py``
"""

from __future__ import annotations

import contextlib

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

import ray  # noqa: E402
import torch  # noqa: E402
from openrlhf.trainer.ray import ppo_actor as _upstream  # noqa: E402

from openrlhf_ess import config, upstream  # noqa: E402
from openrlhf_ess.models.loss import PolicyLoss  # noqa: E402
from openrlhf_ess.trainer import (  # noqa: E402
    carried,
    ess_lr,
    kl_k2,
    m2po,
    opob,
    prox,
    resume,
    routing_replay,
    sampling_mask,
    saving,
    stale_lag,
)
from openrlhf_ess.trainer.prox_sources import ProxSources  # noqa: E402
from openrlhf_ess.trainer.ray.rendezvous import RendezvousPort, rendezvous_port  # noqa: E402
from openrlhf_ess.trainer.weight_sync import WeightSync  # noqa: E402


class ActorPPOTrainer(_upstream.ActorPPOTrainer):
    routing_replay = False  # --algo.routing_replay, set by __init__ (a trainer built without it: off)
    stale = None  # --train.stale_k: the engines' older weights (stale_lag.py), set by __init__ when on
    m2po_style = None  # --algo.m2po_style with --algo.m2po_tau, set by __init__ (None: off)

    def __init__(self, *args, **kwargs):
        """Extends upstream's init with what our flags need: the weight-version counter, the sequence-level
        TIS loss, the π_prox sources, the weight sync and its check, and the ESS LR hook."""
        super().__init__(*args, **kwargs)
        # Weight syncs applied to the engines; tokens are tagged with it (docs/prox_modes.md).
        self.weight_version = 0
        algo = self.args.algo
        self.m2po_style = algo.m2po_style if config.m2po_on(self.args) else None
        if algo.tis_cap is not None or self.m2po_style:  # TIS (and the check that μ reached the loss), or M2PO
            self.actor_loss_fn = PolicyLoss.from_upstream(
                self.actor_loss_fn, algo.tis_cap, algo.tis_level, self.m2po_style
            )
        self.prox = ProxSources(self.args, self.actor.model, self.weight_version)
        self.stale = self._stale_engine_weights()
        self.weight_sync = WeightSync(self)
        self.weight_sync.audit(self.weight_version)
        self.stop_ids = None  # --algo.sampling_mask keep: the engine's stop tokens (banned at min_tokens positions)
        if config.sampling_mask_on(self.args):
            sampling_mask.install(self.actor)
            self.stop_ids = sampling_mask.stop_token_ids(self.args.actor.model_name_or_path)
        self.routing_replay = config.routing_replay_on(self.args)
        if config.sampling_mask_on(self.args) or self.routing_replay or self.m2po_style:
            # the kept counts / routes / M2PO mask ride as Experience attributes, which upstream's buffer would drop
            carried.adopt_replay_buffer(self.replay_buffer)
        self.lr_scale_hook = None
        if algo.ess_lr_enable:
            # After deepspeed.initialize (done by strategy.prepare), which takes a dummy step.
            self.lr_scale_hook = ess_lr.LrScaleHook(ess_lr.innermost_optimizer(self.actor.model))

    def _stale_engine_weights(self):
        """--train.stale_k K: the weights the engines are sent, K versions behind (trainer/stale_lag.py); None off."""
        k = config.stale_k(self.args)
        if k <= 0:
            return None
        partitioned = prox.is_partitioned(self.actor.model.module)
        cuda_ipc = bool(getattr(self, "use_cuda_ipc", False))
        keeps = stale_lag.keeps_copies(partitioned, cuda_ipc, torch.distributed.get_rank())
        snapshots = self.prox.snapshots  # --algo.prox_mode snapshot: every version from v - K is kept there already
        shared = snapshots if snapshots is not None and snapshots.keep >= stale_lag.host_copies(k) else None
        return stale_lag.StaleEngineWeights(k, self.actor.model, partitioned, keeps, shared)

    # π_prox stores, as tests and the checkpoint code see them
    snapshots = property(lambda self: self.prox.snapshots)
    ewma = property(lambda self: self.prox.ewma)

    # Upstream's training_step with its KL estimator replaced by the off-policy k2 one.
    _k2_training_step = upstream.rebind(
        _upstream.ActorPPOTrainer.training_step, {"compute_approx_kl": kl_k2.off_policy_k2_kl}
    )

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        """Overrides upstream's only with --algo.routing_replay (the whole step, forward and backward, replays the
        engine's experts; metrics routing/replayed_frac, routing/disagree_frac), then as below."""
        if not self.routing_replay:
            return self._masked_training_step(experience, kl_ctl, step, loss_batch_info)
        with routing_replay.replayed_step(self.actor, experience) as stats:
            status = self._masked_training_step(experience, kl_ctl, step, loss_batch_info)
        routing_replay.add_metrics(status, stats[0])
        return status

    def _masked_training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        """Overrides upstream's only with --algo.kl.off_policy_k2_enable (the KL term's gradient becomes the
        k2 surrogate's, see kl_k2.py), PPO-EWMA (the average is updated after each optimizer step) or
        --algo.sampling_mask keep (π_θ over each token's kept support; metric sampling_mask/log_kept_mass)."""
        if self.stop_ids is None:
            return self._training_step(experience, kl_ctl, step, loss_batch_info)
        kept = getattr(experience, "rollout_kept_counts", None)
        if kept is None:
            raise RuntimeError(
                "--algo.sampling_mask keep: a training batch has no kept counts (rollout_kept_counts), so pi_theta "
                "cannot be computed over the support its tokens were sampled from; this is a bug, please report it."
            )
        with sampling_mask.applied(kept, experience.sequences, experience.attention_mask, self.stop_ids) as state:
            status = self._training_step(experience, kl_ctl, step, loss_batch_info)
        if state.tokens:
            log_kept_mass = torch.as_tensor(state.log_z_sum / state.tokens).detach().float().cpu()
            status["metrics"]["sampling_mask/log_kept_mass"] = log_kept_mass
            status["weights"]["sampling_mask/log_kept_mass"] = "token"
        return status

    def _training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        """Overrides upstream's only with --algo.m2po_tau (the loss gets this micro-batch's part of the batch's M2PO
        mask or clip bound, trainer/m2po.py), then as below."""
        if not self.m2po_style:
            return self._upstream_step(experience, kl_ctl, step, loss_batch_info)
        with m2po.applied(self.actor_loss_fn, experience, self.m2po_style):
            return self._upstream_step(experience, kl_ctl, step, loss_batch_info)

    def _upstream_step(self, experience, kl_ctl, step, loss_batch_info=None):
        if not self.args.algo.kl.off_policy_k2_enable and self.prox.ewma is None:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        if self.prox.per_minibatch:  # PPO-EWMA as published: π_prox from the average as it is now (prox_sources.py)
            experience.action_log_probs = self.prox.minibatch_log_probs(lambda: self._no_grad_log_probs(experience))
        if self.args.algo.kl.off_policy_k2_enable:
            with kl_k2.context(experience.rollout_log_probs, self.args.algo, experience.action_mask):
                status = self._k2_training_step(experience, kl_ctl, step, loss_batch_info)
        else:
            status = super().training_step(experience, kl_ctl, step, loss_batch_info)
        self.prox.after_optimizer_step()
        return status

    @torch.no_grad()
    def _no_grad_log_probs(self, experience) -> torch.Tensor:
        """The actor's log-probs of ``experience``'s actions, as upstream's training_step's forward computes them
        (same call, no gradient): the per-minibatch π_prox forward of --algo.prox_ewma_style hilton."""
        return self.actor(
            experience.sequences,
            experience.action_mask,
            attention_mask=experience.attention_mask,
            ring_attn_group=self.strategy.ring_attn_group,
        )

    def ppo_train(self, kl_ctl: float):
        """Wraps upstream's ppo_train: with ESS LR, this rollout's optimizer steps run at the scaled LR.

        Without our flags upstream's method runs untouched; only metrics are added (the weight-sync
        check of the sync before this rollout, run here or, with --vllm.enable_sleep, at that sync; the
        π_prox mode's cost).
        """
        sync_metrics = self.weight_sync.check_if_due()
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
        if self.prox.active:
            status.update(self.prox.metrics())
        if self.stale is not None:
            status.update(self.stale.metrics())
        status.update(sync_metrics)
        return status

    # ---- π_prox (prox_sources.py) --------------------------------------------------------------------

    def proximal_log_probs(self, current: torch.Tensor, versions: torch.Tensor, forward) -> torch.Tensor:
        return self.prox.log_probs(current, versions, forward, self.weight_version)

    def score_streams(self, version: int, streams, kept=None, routes=None) -> list:
        return self.prox.score_streams(version, streams, kept, self.stop_ids or (), routes)

    def prox_metrics(self) -> dict:
        return self.prox.metrics()

    def checkpoint_state(self) -> dict:
        return self.prox.state_dict()

    def load_checkpoint_state(self, state: dict) -> None:
        self.prox.load_state_dict(state)

    # ---- weight sync (weight_sync.py) ----------------------------------------------------------------

    def _init_vllm_sync_group(self, backend: str):
        """Upstream's NCCL/gloo group set-up, its port drawn as the rendezvous port is (trainer/ray/rendezvous.py:
        outside the ephemeral range, which the engines' own connections draw from while rank 0's port waits to be
        bound; a replacement forms the group again mid-run). The ``reload`` backend needs no process group."""
        if backend == config.RELOAD_BACKEND:
            return
        upstream.vllm_sync_group_init_drawing(rendezvous_port)(self, backend)

    def broadcast_to_vllm(self):
        """Sync weights to the engines (ours with reload, upstream's broadcast otherwise), then advance the
        weight version. The version is set while generation is paused (partial rollouts) or idle (otherwise),
        so the engines can tag every token with the weights that sampled it. With --vllm.enable_sleep the sync
        check runs here too, while the controller holds the engines' weights awake (WeightSync.after_sync).
        With --train.stale_k K the weights sent are those of K versions before the new one (trainer/stale_lag.py),
        swapped into the actor for the transport, and the engines are told that version."""
        if self.stale is None:
            self._send_weights()
            self.advance_version()
        else:
            sent = self.stale.to_send(self.weight_version + 1)
            with self.stale.weights_of(sent):
                self._send_weights()
            self.advance_version(sent)
            self.stale.after_sync(self.weight_version, sent)
        self.weight_sync.after_sync()

    def _send_weights(self):
        """The actor's weights as they are now to every engine, by the configured transport."""
        if self.strategy.args.vllm.sync_backend == config.RELOAD_BACKEND:
            self.weight_sync.push()
        elif self.args.vllm.max_restarts > 0:  # replacement with upstream's broadcast (trainer/ray/engine_keeper.py)
            self.weight_sync.broadcast_replaceable(super().broadcast_to_vllm)
        else:
            super().broadcast_to_vllm()

    def advance_version(self, engine_version=None):
        """After a complete weight sync: count it, snapshot the weights (snapshot mode), tell the engines the version
        they now hold (``engine_version``: the trainer's own unless --train.stale_k sent an older one)."""
        self.weight_version += 1
        self.prox.after_sync(self.weight_version)
        self.weight_sync.audit(self.weight_version)  # each version once, when the trainer first holds it
        self._tell_engines(self.weight_version if engine_version is None else engine_version)

    def _tell_engines(self, held: int) -> None:
        """Rank 0: every engine is told the version it holds (the tag of the tokens it samples from now on)."""
        if self.vllm_engines and config.needs_versions(self.args) and torch.distributed.get_rank() == 0:
            ray.get([engine.set_weight_version.remote(held) for engine in self.vllm_engines])

    def eval_weights(self, live: bool) -> None:
        """--train.stale_k (trainer/stale_lag.py), all ranks, around an eval: ``live`` sends the engines the trainer's
        own weights and version, so the eval measures the policy being trained; then ``live=False`` sends them back
        the version K behind. Each of the two syncs is checked now (checksums, the canary on its cadence) when
        --vllm.sync_check_tol > 0; the engines are idle (synchronous training)."""
        if live:
            self._send_weights()
            held = self.stale.lend()
        else:
            held = self.stale.give_back()
            with self.stale.weights_of(held):
                self._send_weights()
        self._tell_engines(held)
        if self.args.vllm.sync_check_tol > 0:
            self.weight_sync.check()

    def weights_blob(self):
        return self.weight_sync.weights_blob()

    def weights_blob_for_dedicated(self):
        return self.weight_sync.blob_for_dedicated()


_UpstreamPolicyModelActor = upstream.ray_actor_class(_upstream.PolicyModelActor)


CHECKPOINT_KEY = "openrlhf_ess"  # our entry in DeepSpeed's client_state


class PolicyModelActorImpl(RendezvousPort, _UpstreamPolicyModelActor):
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

    def eval_weights(self, live: bool):
        """--train.stale_k: the engines' weights around an eval (``ActorPPOTrainer.eval_weights``)."""
        return self.trainer.eval_weights(live)

    def check_replaced_engines(self):
        """Engine replacement (all ranks): the sync check on every engine now (``WeightSync.check_replaced``)."""
        return self.trainer.weight_sync.check_replaced()

    def selfcheck_regroup(self):
        """Start-up self-check (rank 0; ``selfcheck.py``): the weight sync group formed again and probed, as after an
        engine replacement with NCCL/gloo (``WeightSync.startup_regroup_probe``)."""
        return self.trainer.weight_sync.startup_regroup_probe()

    def selfcheck_canary(self):
        """Start-up self-check (all ranks; ``selfcheck.py``): engines vs trainer on the canary before any sync."""
        return self.trainer.weight_sync.startup_canary()

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """Extends upstream's: our trainer state (e.g. the EWMA weights) goes into the same checkpoint."""
        client_states = dict(client_states or {})
        ours = self.trainer.checkpoint_state()
        if ours:
            client_states[CHECKPOINT_KEY] = ours
        args = self.strategy.args
        max_num = args.ckpt.max_num
        try:
            # Upstream's rotation deletes the oldest checkpoint *before* writing the new one: with --ckpt.max_num 1
            # a failed save (a full disk) left none. One more is kept while the new one is written; the surplus
            # goes only once it is complete (saving.prune_checkpoints).
            args.ckpt.max_num = max_num + 1
            saved = super().save_checkpoint(tag, client_states, metric_value, metric_key)
            if self.strategy.is_rank_0():  # which run wrote it: a resume refuses another run's (trainer/resume.py)
                resume.write_identity(args.ckpt.path, tag, resume.run_identity(args))
                saving.prune_checkpoints(self.strategy, resume.actor_dir(args.ckpt.path), max_num, keep=tag)
            return saved
        except (OSError, RuntimeError) as e:  # a folder that cannot be written: say why (torch's words hide it)
            ours = saving.checkpoint_write_error(e, args.ckpt.path, tag)
            if ours is None:
                raise
            raise ours from e
        finally:
            args.ckpt.max_num = max_num

    def save_model(self):
        """Overrides upstream's final save (upstream's train() calls it once, after fit): the same weights and files
        (upstream's ``strategy.save_model``), written under a temporary name inside --ckpt.output_dir and renamed
        into place, or, if that folder cannot be written, to a fallback folder with an error naming both
        (``trainer/saving.py``)."""
        strategy, args = self.strategy, self.strategy.args
        model = self.ema_model if args.train.enable_ema else self.actor
        saving.save_final_model(
            lambda folder: strategy.save_model(model, self.tokenizer, folder),
            args.ckpt.output_dir,
            rank0=strategy.is_rank_0(),
            agree=lambda ok: strategy.all_reduce(0.0 if ok else 1.0, "max") == 0.0,
            barrier=upstream.save_model_barrier,
        )

    def score_streams(self, version: int, streams, kept=None, routes=None) -> list:
        """interrupt mode: π_version of token streams (see ActorPPOTrainer.score_streams); ``kept``: their
        kept counts (--algo.sampling_mask keep); ``routes``: the engine's expert ids (--algo.routing_replay)."""
        return self.trainer.score_streams(version, streams, kept, routes)

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
        rollout_kept_counts=None,
        rollout_routes=None,
    ):
        """Extends upstream's: with ``rollout_versions`` (snapshot/ewma modes) return π_prox per token; with
        ``rollout_kept_counts`` (--algo.sampling_mask keep) every forward scores over the kept support; with
        ``rollout_routes`` (--algo.routing_replay) every forward replays the engine's experts."""
        if rollout_routes is None and self.trainer.routing_replay:
            raise routing_replay.missing_routes_error("an old-log-prob forward")
        scoring = (sequences, attention_mask, rollout_kept_counts, rollout_routes)
        if self._opob_full():  # θ's log-probs and norms from one pass: upstream's no-grad forward does not run
            with self._scoring(*scoring):
                current, full = self._opob_full_pass(sequences, action_mask, attention_mask)
            norms = [full]
        else:
            with self._scoring(*scoring), self._opob_norms(sequences, action_mask) as norms:
                current = super().forward(
                    sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list
                )
        if rollout_versions is not None:

            def forward_again():  # self-contained: execute_batch runs it after this call, grouped by version
                with self._scoring(*scoring):
                    return super(PolicyModelActorImpl, self).forward(
                        sequences, action_mask, attention_mask, packed_seq_lens, mm_train_inputs_list
                    )

            current = self.trainer.proximal_log_probs(current, rollout_versions, forward_again)
        # --algo.advantage.baseline opob: θ's per-sample gradient norms ride as one last column (opob.py)
        return current if norms is None else opob.with_norms(current, norms[0])

    @contextlib.contextmanager
    def _scoring(self, sequences, attention_mask, rollout_kept_counts, rollout_routes):
        """What every old-log-prob forward of a micro-batch runs in: the engine's experts replayed, the kept
        support applied (each a no-op when its flag is off)."""
        with (
            routing_replay.applied(self.actor, rollout_routes, attention_mask=attention_mask),
            sampling_mask.applied(rollout_kept_counts, sequences, attention_mask, self.trainer.stop_ids),
        ):
            yield

    def execute_batch(self, method_name, all_data, start_idx, end_idx):
        """Overrides upstream's loop over this rank's micro-batches only for the forward with token versions
        (snapshot/ewma modes): the π_prox forwards run after the loop, grouped by weight version, each stored
        version swapped in once for all micro-batches instead of once per micro-batch (``prox_sources.py``)."""
        run = super().execute_batch
        if method_name != "forward" or all_data.get("rollout_versions") is None:
            return run(method_name, all_data, start_idx, end_idx)
        return self.trainer.prox.grouped_forwards(
            lambda: run(method_name, all_data, start_idx, end_idx), self.trainer.weight_version
        )

    def _opob_full(self) -> bool:
        return config.opob_on(self.strategy.args) and self.strategy.args.algo.advantage.opob_norm == "full"

    def _opob_full_pass(self, sequences, action_mask, attention_mask):
        """--algo.advantage.opob_norm full: θ's action log-probs (on the host, as upstream's forward returns them) and
        the whole model's per-sample norms, from one forward with autograd and one backward that writes no
        parameter gradient per pass (``trainer/opob.py::full_norms``), as many rows per pass as
        --algo.advantage.opob_pass_tokens allows; under ZeRO-3 every rank makes as many passes as the rank that
        needs most."""
        device = torch.cuda.current_device()
        batch = [t.to(device) for t in (sequences, action_mask, attention_mask)]
        agree = opob.passes_on_every_rank(prox.causal_lm(self.actor.model))
        log_probs, norms = opob.full_norms(
            self.actor, *batch, max_tokens=opob.pass_tokens(self.strategy.args), agree=agree
        )
        return log_probs.to("cpu"), norms

    def _opob_norms(self, sequences, action_mask):
        """--algo.advantage.baseline opob: capture the LM head's norms in this forward (``trainer/opob.py``); else
        (off) nothing. (The whole model's norms replace this forward: ``_opob_full_pass``.)"""
        if not config.opob_on(self.strategy.args) or self._opob_full():
            return contextlib.nullcontext()
        head = prox.output_head(prox.causal_lm(self.actor.model))
        return opob.norms_captured(head, sequences, action_mask, self.actor.temperature)


PolicyModelActor = ray.remote(num_gpus=1)(PolicyModelActorImpl)
