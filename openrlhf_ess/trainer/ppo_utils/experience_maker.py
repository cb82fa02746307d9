"""Experience maker: upstream's ``RemoteExperienceMaker`` plus rollout versions, lag masking and metrics.

Mirrors ``openrlhf/trainer/ppo_utils/experience_maker.py``. Runs on the controller, which holds the
whole rollout batch, so the metrics here are global over it.
"""

from __future__ import annotations

import os
from typing import Dict, List

import ray
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as _UpstreamRemoteExperienceMaker
from openrlhf.utils.utils import zero_pad_sequences

from openrlhf_ess.config import (
    BYPASS_PROX_MODE,
    EXACT_PROX_MODES,
    m2po_on,
    opob_on,
    routing_replay_on,
    sampling_mask_on,
)
from openrlhf_ess.models import corrections
from openrlhf_ess.models.sampling_mask import NOT_TRUNCATED
from openrlhf_ess.trainer import m2po, opob, reward_check, routing_replay
from openrlhf_ess.trainer.ppo_utils.samples_generator import kept_or_untruncated, versions_or_untagged
from openrlhf_ess.trainer.ray.rollout_tags import NO_VERSION

LAG_BUCKETS = (0, 1, 2, 3)  # version-lag histogram: lag 0, 1, 2, and >= 3


class RemoteExperienceMaker(_UpstreamRemoteExperienceMaker):
    # Built only by from_upstream(); weight_version is set by the trainer before each batch (syncs so far).
    @classmethod
    def from_upstream(cls, maker: _UpstreamRemoteExperienceMaker) -> "RemoteExperienceMaker":
        """Adopt the state of the maker upstream's trainer built (same collaborators, our methods)."""
        ours = cls.__new__(cls)
        ours.__dict__.update(vars(maker))
        ours.weight_version = 0
        ours.last_metrics: Dict[str, float] = {}
        ours.prox_store = ours.consumed = None  # set by the controller in interrupt / dedicated modes
        ours._samples_in_flight, ours._actor_forwards = None, 0
        ours._opob_norms = None  # --algo.advantage.baseline opob: per micro-batch (B,) norms of the last forward
        ours._opob_theta = None  # ... and, in bypass mode, that forward's log-probs (B, A) at θ
        return ours

    def split_rollout_samples(self, rollout_samples):
        """Extends upstream's split: carry the per-token versions (and kept counts) into each micro-batch.

        Upstream records each sample's position in ``index`` and right-pads step fields, so the
        versions are padded the same way (with NO_VERSION; kept counts with NOT_TRUNCATED). Routes
        (--algo.routing_replay) follow ``sequences``: right-padded to its width with the "no route" sentinel.
        """
        samples_list = super().split_rollout_samples(rollout_samples)
        mask = sampling_mask_on(self.args)
        for batch in samples_list:
            width = batch.action_mask.shape[1]
            rows = [versions_or_untagged(rollout_samples[i])[0] for i in batch.index]
            batch.rollout_versions = zero_pad_sequences(rows, side="right", value=NO_VERSION, stack=True)[:, :width]
            if mask:
                rows = [kept_or_untruncated(rollout_samples[i])[0] for i in batch.index]
                kept = zero_pad_sequences(rows, side="right", value=NOT_TRUNCATED, stack=True)
                batch.rollout_kept_counts = kept[:, :width]
            if routing_replay_on(self.args):
                rows = [rollout_samples[i].rollout_routes[0] for i in batch.index]
                batch.rollout_routes = routing_replay.pad_routes(rows, batch.sequences.shape[1])
        return samples_list

    def _dispatch_forward(self, group, sync_condition, **kwargs):
        """Extends upstream's: the actor's forward also gets the token versions (snapshot/ewma modes).

        bypass mode (π_prox = μ): the actor's old-log-prob forward is not dispatched at all; upstream's
        ``make_experience`` gets, where it expects that forward's results, each micro-batch's μ in the same
        layout (a one-tensor list per micro-batch, repeated for ring-attention / tensor-parallel copies), and
        computes the KL, rewards and advantages from it unchanged. With --algo.advantage.baseline opob the actor's
        forward still runs, for θ's per-sample gradient norms alone (its log-probs are dropped: π_prox = μ).
        """
        bypass = group is self.actor_model_group and self.args.algo.prox_mode == BYPASS_PROX_MODE
        if bypass and not opob_on(self.args):
            return ray.put(bypass_prox_results(self._samples_in_flight, self._duplicate_factor()))
        if group is self.actor_model_group and not bypass:
            self._actor_forwards += 1
        if group is self.actor_model_group and self.args.algo.prox_mode in ("snapshot", "ewma"):
            kwargs["rollout_versions"] = [s.rollout_versions for s in self._samples_in_flight]
        if sampling_mask_on(self.args) and group in (self.actor_model_group, self.initial_model_group):
            # π_prox and π_ref over the support each token was sampled from (trainer/sampling_mask.py)
            kwargs["rollout_kept_counts"] = [s.rollout_kept_counts for s in self._samples_in_flight]
        if routing_replay_on(self.args) and group in (self.actor_model_group, self.initial_model_group):
            # π_prox and π_ref forwards replay the engine's experts (trainer/routing_replay.py)
            kwargs["rollout_routes"] = [s.rollout_routes for s in self._samples_in_flight]
        refs = super()._dispatch_forward(group, sync_condition, **kwargs)
        if group is self.actor_model_group and opob_on(self.args):
            # the actor's forward appended θ's per-sample gradient norms as a last column (trainer/opob.py)
            stripped, self._opob_norms = opob.split_norms(ray.get(refs), self._duplicate_factor())
            if bypass:  # θ's log-probs weigh b* as the bypass loss weighs the gradient (π_θ/μ)
                self._opob_theta = opob.first_copies(stripped, self._duplicate_factor())
                return ray.put(bypass_prox_results(self._samples_in_flight, self._duplicate_factor()))
            refs = [ray.put(results) for results in stripped]
        return refs

    def compute_advantages_and_returns(self, experiences):
        """Extends upstream's only with --algo.advantage.baseline opob: the group baseline becomes VCPO's b*
        (trainer/opob.py); its metrics join this batch's (opob/*). Then, with --algo.m2po_tau, M2PO's mask or clip
        bound over the whole batch, from its advantages (trainer/m2po.py; metrics m2po/*)."""
        if opob_on(self.args):
            experiences, metrics = opob.replace_baseline(
                self, experiences, super().compute_advantages_and_returns, self._opob_norms, self._opob_theta
            )
            self._opob_norms = self._opob_theta = None
            self.last_metrics.update(metrics)
        else:
            experiences = super().compute_advantages_and_returns(experiences)
        if m2po_on(self.args):
            algo = self.args.algo
            self.last_metrics.update(m2po.mark_batch(experiences, algo.m2po_tau, algo.m2po_style))
        return experiences

    def _duplicate_factor(self) -> int:
        """Upstream's ``duplicate_factor``: copies of each result returned by ring-attention / TP ranks."""
        return self.args.ds.ring_attn_size * self.args.ds.tensor_parallel_size

    @torch.no_grad()
    def make_experience(self, samples_list: List):
        """Extends upstream's: mask too-stale tokens and compute the batch's off-policy metrics.

        Tokens whose version lag exceeds ``--algo.max_version_lag`` get action_mask 0 before advantages
        are computed (and are counted); they never reach the loss.
        """
        self._samples_in_flight = samples_list
        self._actor_forwards = 0
        try:
            experiences = super().make_experience(samples_list)
        finally:
            self._samples_in_flight = None
        reward_check.check_run_rewards(experiences, self.args)  # a reward model's, now set
        algo = self.args.algo
        max_lag = algo.max_version_lag
        lags, masks, prox, mu, tis, seq_weights = [], [], [], [], [], []
        stale = torch.zeros((), dtype=torch.float64)
        prox_missing = actor_nonfinite = 0
        exact = algo.prox_mode in EXACT_PROX_MODES
        for exp in experiences:
            if self.prox_store is not None:
                fill_prox_from_store(exp, self.prox_store, self.consumed, self.weight_version)
            exp.action_mask, lag, sampled, n_stale = mask_stale_tokens(
                exp.action_mask, exp.rollout_versions, self.weight_version, max_lag
            )
            stale += n_stale
            lags.append(lag[sampled])
            if algo.prox_mode == "loglinear" and exp.rollout_log_probs is not None:
                tagged = exp.rollout_versions != NO_VERSION
                interpolated = corrections.loglinear_prox_log_probs(exp.rollout_log_probs, exp.action_log_probs, lag)
                exp.action_log_probs = torch.where(tagged, interpolated, exp.action_log_probs)
            # NaN on a stale token is the exact modes' "no weights of that version" marker (below); any other
            # non-finite pi_prox is the actor's fault: the whole sample leaves the loss, as on the engine side
            bad_rows = nonfinite_rows(exp.action_log_probs, exp.action_mask, lag if exact else None)
            if bad_rows.any():
                if algo.nonfinite_logprobs == "stop":
                    raise RuntimeError(
                        f"the actor's log-probs (pi_prox) are NaN/inf on response tokens of {int(bad_rows.sum())} "
                        f"samples at weight version {self.weight_version}: the weights or the forward's numerics "
                        "diverged. Lower the LR, check --ds.param_dtype, or resume from the last checkpoint; "
                        "--algo.nonfinite_logprobs drop trains on without those samples."
                    )
                actor_nonfinite += int(bad_rows.sum())
                exp.action_mask = exp.action_mask & ~bad_rows[:, None]
            missing = torch.isnan(exp.action_log_probs) & exp.action_mask.bool()
            if missing.any():  # exact modes: no weights of that version (never scored with other weights)
                if algo.prox_missing == "error":
                    fix = (
                        f"(--algo.prox_snapshots {algo.prox_snapshots}); raise it or bound --algo.max_version_lag"
                        if algo.prox_mode == "snapshot"
                        else "at the weight sync (their stream was not reported or was truncated by --data.max_len)"
                    )
                    raise RuntimeError(
                        f"{int(missing.sum())} tokens have no pi_prox from the weight version that sampled them "
                        f"{fix}, or use --algo.prox_missing mask."
                    )
                prox_missing += int(missing.sum())
                exp.action_mask = exp.action_mask & ~missing
            if exp.kl is not None:  # upstream's KL-in-reward saw the non-finite values too; masked now
                exp.kl = torch.where(torch.isfinite(exp.kl), exp.kl, torch.zeros_like(exp.kl))
            # not nan_to_num: it would keep ±inf as ±3.4e38
            finite = torch.isfinite(exp.action_log_probs)
            exp.action_log_probs = torch.where(finite, exp.action_log_probs, torch.zeros_like(exp.action_log_probs))
            if exp.rollout_log_probs is not None:
                mask = exp.action_mask.bool()
                masks.append(mask.flatten())
                prox.append(exp.action_log_probs.flatten())
                mu.append(exp.rollout_log_probs.flatten())
                seq_weights.append(corrections.sequence_log_weights(exp.action_log_probs, exp.rollout_log_probs, mask))
                if algo.tis_cap is not None:
                    w = corrections.tis_weights(
                        exp.action_log_probs, exp.rollout_log_probs, mask, algo.tis_cap, algo.tis_level
                    )
                    tis.append(w[mask])
        if not any(bool(exp.action_mask.any()) for exp in experiences):
            raise RuntimeError(
                f"every sample of this rollout batch left the loss ({actor_nonfinite} with non-finite actor "
                f"log-probs, {prox_missing} tokens without their version's pi_prox, "
                f"{int(stale.item())} tokens beyond --algo.max_version_lag); an update over zero tokens is NaN "
                "(0/0) and would corrupt the weights."
            )
        if algo.prox_audit_dir:
            write_audit_batch(algo.prox_audit_dir, self.weight_version, experiences)
        self.last_metrics = rollout_metrics(torch.cat(lags), stale, prox, mu, masks, seq_weights)
        self.last_metrics["actor_logprob_nonfinite"] = float(actor_nonfinite)
        if algo.prox_mode != "recompute":
            self.last_metrics["prox/masked_missing_tokens"] = float(prox_missing)
            # upstream's old-log-prob forwards over the batch dispatched by this make_experience (0 in bypass)
            self.last_metrics["prox/recompute_forwards"] = float(self._actor_forwards)
        if tis:
            w = torch.cat(tis)
            self.last_metrics.update(
                {
                    "tis/clip_frac": corrections.tis_truncated(w, algo.tis_cap).float().mean().item()
                    if w.numel()
                    else 0.0,
                    "tis/mean_weight": w.mean().item() if w.numel() else 1.0,
                    "tis/max_weight": w.max().item() if w.numel() else 1.0,
                }
            )
        return experiences


def bypass_prox_results(samples_list, duplicate_factor: int) -> list:
    """bypass mode: μ in the layout upstream's ``_flatten_results`` reads from the actor group's forward.

    Returns one single-element list per micro-batch, repeated ``duplicate_factor`` times, holding a copy of
    its ``rollout_log_probs`` (B, A) (a copy: later in-place edits of π_prox must not change μ). Raises if a
    micro-batch has no μ: its tokens would otherwise be trained against a π_prox nobody computed.
    """
    missing = sum(s.rollout_log_probs is None for s in samples_list)
    if missing:
        raise RuntimeError(
            f"--algo.prox_mode bypass: {missing} of {len(samples_list)} micro-batches came without rollout "
            "log-probs (mu) from the engines, so they have no pi_prox. The engines return mu whenever the "
            "off-policy features are on; an agent (--train.agent_func_path) must return them too, or use "
            "--algo.prox_mode recompute."
        )
    return [[s.rollout_log_probs.clone()] for s in samples_list for _ in range(duplicate_factor)]


def nonfinite_rows(log_probs: torch.Tensor, action_mask: torch.Tensor, lag) -> torch.Tensor:
    """(B,) rows with a NaN/inf log-prob on a response token, not counting NaN on stale tokens (lag > 0) when
    ``lag`` is given (the exact modes mark a version with no weights that way)."""
    bad = ~torch.isfinite(log_probs) & action_mask.bool()
    if lag is not None:
        bad &= ~(torch.isnan(log_probs) & (lag > 0))
    return bad.any(-1)


def fill_prox_from_store(exp, store, consumed, version: int) -> None:
    """interrupt / dedicated modes: π_prox of stale tokens from the scores taken at their version's sync.

    Tokens of the current version keep the forward with the live weights (exact: the actor holds that
    version). A stale token with no stored score gets NaN, masked and counted by the caller. Every row's
    stream is recorded in ``consumed`` so the next sync does not score it again.
    """
    for row in range(exp.sequences.shape[0]):
        n = int(exp.attention_mask[row].sum())
        stream = exp.sequences[row, :n].tolist()
        consumed[tuple(stream)] += 1
        versions = exp.rollout_versions[row].tolist()
        for v in sorted(set(versions) - {NO_VERSION}):
            if v >= version:
                continue
            cols = torch.tensor([c for c, x in enumerate(versions) if x == v])
            scored = store.take(stream, versions, v)
            exp.action_log_probs[row, cols] = (
                float("nan") if scored is None else scored[cols].to(exp.action_log_probs.dtype)
            )


def write_audit_batch(folder: str, version: int, experiences) -> None:
    """--algo.prox_audit_dir: what the loss will see, per micro-batch, for offline recomputation."""
    os.makedirs(folder, exist_ok=True)
    fields = (
        "sequences",
        "attention_mask",
        "action_mask",
        "rollout_versions",
        "action_log_probs",
        "rollout_log_probs",
        "base_action_log_probs",
        "rollout_kept_counts",
    )
    batch = [{f: getattr(exp, f, None) for f in fields} for exp in experiences]
    torch.save({"weight_version": version, "micro_batches": batch}, os.path.join(folder, f"batch_v{version}.pt"))


def mask_stale_tokens(action_mask: torch.Tensor, versions: torch.Tensor, version: int, max_lag):
    """Version lag of each sampled token and the action mask without tokens older than ``max_lag``.

    Returns (action_mask, lag (B, A), sampled (B, A) bool: tagged tokens still in the mask, n_masked).
    Untagged tokens (NO_VERSION) are never masked by lag: there is nothing to measure.
    """
    sampled = action_mask.bool() & (versions != NO_VERSION)
    lag = torch.where(sampled, version - versions, torch.zeros_like(versions))
    if max_lag is None:
        return action_mask, lag, sampled, 0
    too_stale = sampled & (lag > max_lag)
    return action_mask & ~too_stale, lag, sampled & ~too_stale, int(too_stale.sum())


def rollout_metrics(
    lags: torch.Tensor, stale: torch.Tensor, prox: list, mu: list, masks: list, seq_weights: list = ()
) -> Dict[str, float]:
    """Batch-global metrics: version-lag histogram, stale-token count, train/rollout mismatch (k1, k3, χ², the largest
    |log ratio| over the flattened tokens of ``prox``, ``mu``, ``masks``), and ESS/B of the per-trajectory
    geometric-mean weights, from each micro-batch's ``corrections.sequence_log_weights`` (``seq_weights``)."""
    out: Dict[str, float] = {}
    n = max(lags.numel(), 1)
    if lags.numel():
        out["version_lag/mean"] = lags.float().mean().item()
        out["version_lag/max"] = lags.max().item()
    for bucket in LAG_BUCKETS:
        hit = lags >= bucket if bucket == LAG_BUCKETS[-1] else lags == bucket
        label = f"{bucket}+" if bucket == LAG_BUCKETS[-1] else str(bucket)
        out[f"version_lag/frac_{label}"] = hit.sum().item() / n
    out["version_lag/stale_masked_tokens"] = stale.item()
    if prox:
        mask = torch.cat(masks)
        stats = corrections.mismatch_stats(torch.cat(prox)[mask], torch.cat(mu)[mask])
        out.update({f"mismatch/{k}": v for k, v in zip(("k1", "k3", "chi2", "max_abs_log_ratio"), stats.tolist())})
    if seq_weights:
        # ESS/B of the seed's per-trajectory weights w_i = exp(mean_t log π_prox/μ), whatever corrects the loss: the
        # staleness monitor of every run (ESS-LR's rho_ess is the same number where it is on with its default form)
        log_w = torch.cat([w for w, _ in seq_weights])
        valid = torch.cat([v for _, v in seq_weights])
        out["mismatch/ess_frac"] = corrections.ess_ratio(log_w, valid).item()
    return out
