"""The actor's π_prox sources (``--algo.prox_mode snapshot | interrupt | ewma``, docs/prox_modes.md).

One object per actor rank, called by ``ActorPPOTrainer`` at four points: after each optimizer step
(:meth:`ProxSources.after_optimizer_step`, EWMA), after each weight sync (:meth:`ProxSources.after_sync`,
snapshots), when the experience maker asks for π_prox (:meth:`ProxSources.log_probs`) and, in interrupt mode,
at each sync (:meth:`ProxSources.score_streams`). The stores and the weight swap are in ``prox.py``.

Under ZeRO-3 every swapped forward gathers on every rank, so the ranks agree on which forwards to run
(one small all-reduce through ``openrlhf_ess.distributed``, on the collective device).

A make-experience asks for π_prox once per micro-batch. The actor runs its micro-batches inside
:meth:`ProxSources.grouped_forwards`: each asks as usual, gets the live forward back with the π_prox columns to be
filled, and the swapped forwards run after the loop, grouped by version: each stored version is swapped in once for
every micro-batch that needs it. Host -> device bytes per make-experience: (distinct stale versions) × this rank's
stored bytes (snapshot), or 1 × (ewma, batch style), instead of that times the micro-batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from openrlhf_ess import distributed
from openrlhf_ess.models import corrections
from openrlhf_ess.trainer import prox


class ProxSources:
    def __init__(self, args, engine, weight_version: int = 0, partitioned: Optional[bool] = None):
        """``engine``: the actor's DeepSpeed engine (``actor.model``); ``partitioned``: ZeRO-3 (default: detected)."""
        self.args, self.engine = args, engine
        algo = args.algo
        self.snapshots = self.ewma = None
        self._seconds, self._forwards, self._missing = 0.0, 0, 0
        self._swap = prox.SwapStats()  # prox/swap_bytes, prox/swap_seconds since the last metrics()
        self._deferred: Optional[List[Optional[_Deferred]]] = None  # inside grouped_forwards: the calls' π_prox
        self._optimizer_steps_seen = 0
        # ZeRO-3: snapshots and EWMA weights are this rank's partitions, swapped in on every rank at once
        self.partitioned = prox.is_partitioned(self.module) if partitioned is None else partitioned
        if algo.prox_mode in ("snapshot", "interrupt"):
            # interrupt scores at each sync, so only the version the engines hold must be kept
            self.snapshots = prox.WeightSnapshots(algo.prox_snapshots if algo.prox_mode == "snapshot" else 1)
            self.snapshots.put(weight_version, self.module)
        elif algo.prox_mode == "ewma":
            decay = algo.prox_ewma_decay
            if algo.prox_ewma_ref_batch is not None:  # Hilton's rule: β_ref^(B / B_ref)
                decay = corrections.ewma_decay_for_batch(decay, args.train.batch_size, algo.prox_ewma_ref_batch)
            self.ewma = prox.EwmaWeights(decay, algo.prox_ewma_style)
            if self.ewma.style == "hilton":  # θ̄_0 = θ₀ with weight 1 (a resume replaces it with the saved average)
                self.ewma.start(self.module)
        # --algo.prox_ewma_decay auto: the version lag of the tokens scored since the last optimizer step
        # (sum, count), the optimizer steps per version (counted between syncs) and the β last used
        self._lag_sum, self._lag_count, self._lag = 0.0, 0, 0.0
        self._steps_at_sync, self._steps_per_version = 0, 1.0
        self.ewma_decay_used: Optional[float] = None

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def active(self) -> bool:
        return self.snapshots is not None or self.ewma is not None

    # ---- hooks the trainer calls ---------------------------------------------------------------------

    def after_optimizer_step(self) -> None:
        """PPO-EWMA averages the weights after every optimizer step (accumulation boundaries only)."""
        if self.ewma is not None and self.engine.global_steps > self._optimizer_steps_seen:
            self._optimizer_steps_seen = self.engine.global_steps
            self.ewma.update(self.module, self._auto_decay() if self.ewma.decay == "auto" else None)

    def _auto_decay(self) -> float:
        """β for this step under ``--algo.prox_ewma_decay auto``: the EWMA's mean age β/(1−β) equals the mean
        version lag of the tokens scored since the last step, in optimizer steps (lag × steps per version).
        No token scored since: the previous lag. Every rank takes the largest rank's lag, so the ranks (and
        ZeRO-3's partitions) average with one β; called on every rank at the same optimizer step."""
        if self._lag_count:
            self._lag = self._lag_sum / self._lag_count
            self._lag_sum, self._lag_count = 0.0, 0
        lag = self._lag
        if distributed.is_multi_rank():
            lag = distributed.all_reduce_max([lag])[0]
        self.ewma_decay_used = corrections.ewma_decay_for_age(lag * self._steps_per_version)
        return self.ewma_decay_used

    def after_sync(self, version: int) -> None:
        if self.snapshots is not None:
            self.snapshots.put(version, self.module)
        steps = self._optimizer_steps_seen - self._steps_at_sync
        if steps > 0:
            self._steps_per_version, self._steps_at_sync = float(steps), self._optimizer_steps_seen

    @property
    def per_minibatch(self) -> bool:
        """--algo.prox_ewma_style hilton: π_prox is recomputed from the average for every minibatch."""
        return self.ewma is not None and self.ewma.style == "hilton"

    def minibatch_log_probs(self, forward) -> torch.Tensor:
        """hilton: ``forward()`` (the actor's no-grad log-probs of this minibatch's actions) with the EWMA weights
        θ̄ as they are now, between two optimizer steps (Hilton et al.'s π_prox; every rank at once under ZeRO-3)."""
        t0 = time.time()
        with self._swapped(self.ewma.state()):
            out = forward()
        self._forwards += 1
        self._seconds += time.time() - t0
        return out

    def _swapped(self, state):
        """The module with ``state``'s weights for one block (all ranks together under ZeRO-3)."""
        release = self.engine.optimizer.empty_partition_cache if self.partitioned else None
        return prox.swapped_weights(self.module, state, release, self._swap)

    def agree(self, local: list, candidates: list) -> list:
        """ZeRO-3: the candidates that any rank needs (each swapped forward gathers on every rank)."""
        if not self.partitioned or not candidates:
            return [c for c in candidates if c in local]
        flags = distributed.all_reduce_max([float(c in local) for c in candidates])
        return [c for c, f in zip(candidates, flags) if f > 0]

    def log_probs(self, current: torch.Tensor, versions: torch.Tensor, forward, weight_version: int) -> torch.Tensor:
        """π_prox per token for snapshot/ewma modes; ``current`` is the forward with the live weights.

        snapshot: tokens of version v get the forward with v's weights (live weights for the current
        version); a version no longer kept gives NaN, which the controller masks and counts (or stops
        on, per --algo.prox_missing). ewma: one forward with the bias-corrected EWMA weights.
        Inside :meth:`grouped_forwards` the swapped forwards are deferred: the live forward (with NaN on versions no
        longer kept) is returned and its stale columns filled after the loop.
        """
        t0 = time.time()
        if self.ewma is not None:
            if self.ewma.decay == "auto":
                tagged = versions >= 0  # prompt/padding columns carry a negative version (NO_VERSION)
                self._lag_sum += float((weight_version - versions[tagged]).clamp(min=0).sum())
                self._lag_count += int(tagged.sum())
            state = self.ewma.state()
            if state is None:  # no optimizer step yet: the EWMA equals the initial weights
                if self._deferred is not None:
                    self._deferred.append(None)
                return current
            if self._deferred is not None:
                self._deferred.append(_Deferred(forward, None, set()))
                return current.clone()
            with self._swapped(state):
                out = forward()
            self._forwards += 1
        else:
            out = current.clone()
            stale = sorted(set(versions[versions >= 0].unique().tolist()) - {weight_version})
            kept = self.snapshots.versions()  # the same on every rank
            for version in stale:
                if version not in kept:
                    selected = versions == version
                    out[selected] = float("nan")
                    self._missing += int(selected.sum())
            if self._deferred is not None:
                self._deferred.append(_Deferred(forward, versions, set(stale) & set(kept)))
                return out
            # under ZeRO-3 a rank without tokens of a version still joins that version's forward
            for version in self.agree(stale, [v for v in kept if v != weight_version]):
                with self._swapped(self.snapshots.get(version)):
                    scored = forward()
                selected = versions == version
                out[selected] = scored[selected]
                self._forwards += 1
        self._seconds += time.time() - t0
        return out

    def grouped_forwards(self, run: Callable[[], list], weight_version: int) -> list:
        """``run()``: this rank's old-log-prob forwards, one per micro-batch, each asking :meth:`log_probs` for its
        π_prox (upstream's ``execute_batch`` loop over the actor's ``forward``); returns their results, the
        (B, A) π_prox in each result's first A columns (a result may carry more columns after them).

        The swapped forwards run after ``run()``, each stored weight set swapped in once for all the micro-batches
        that need it, so a version's bytes move host -> device once per call instead of once per micro-batch. Each
        deferred ``forward`` must be self-contained (it runs after its micro-batch's own forward returned). Under
        ZeRO-3 every rank runs, per version, as many swapped forwards as the busiest rank (repeating one of its
        micro-batches, result dropped): the forwards gather collectively.
        """
        if self._deferred is not None:
            raise RuntimeError("ProxSources.grouped_forwards does not nest; this is a bug")
        self._deferred = []
        try:
            results = run()
            calls = self._deferred
        finally:
            self._deferred = None
        if len(calls) != len(results):
            raise RuntimeError(
                f"{len(results)} old-log-prob forwards asked for pi_prox {len(calls)} times (one each expected): "
                "a forward that skipped or repeated it would get another micro-batch's values; this is a bug"
            )
        t0 = time.time()
        jobs = [(i, c) for i, c in enumerate(calls) if c is not None]
        if self.ewma is not None:
            state = self.ewma.state()  # None (no optimizer step yet) on every rank alike: nothing was deferred
            self._score_groups(results, [] if state is None else [(state, jobs, None)], jobs)
        else:
            stale = sorted(set().union(*(c.stale for _, c in jobs)))
            kept = self.snapshots.versions()  # the same on every rank
            agreed = self.agree(stale, [v for v in kept if v != weight_version])
            groups = [(self.snapshots.get(v), [(i, c) for i, c in jobs if v in c.stale], v) for v in agreed]
            self._score_groups(results, groups, jobs)
        self._seconds += time.time() - t0
        return results

    def _score_groups(self, results: list, groups: list, jobs: list) -> None:
        """Per group (state, [(result index, call)], version; None: every column): one swap, then its calls'
        forwards; under ZeRO-3 padded with forwards of this rank's first call up to the busiest rank's count."""
        counts = [len(calls) for _, calls, _ in groups]
        if self.partitioned and counts:
            counts = [int(n) for n in distributed.all_reduce_max([float(n) for n in counts])]
        for (state, calls, version), count in zip(groups, counts):
            if count > len(calls) and not jobs:
                raise RuntimeError(
                    f"ZeRO-3: another actor rank needs pi_prox forwards with weight version {version}, and this rank "
                    "has no micro-batch to join them with (the batch has fewer micro-batches than actor ranks): "
                    "make --rollout.batch_size x --rollout.n_samples_per_prompt / --rollout.micro_batch_size a "
                    "multiple of the actor ranks."
                )
            with self._swapped(state):
                for i, call in calls:
                    scored = call.forward()
                    head = results[i][..., : scored.shape[-1]]  # the π_prox columns (OPOB appends one after)
                    if version is None:
                        head.copy_(scored)
                    else:
                        selected = call.versions == version
                        head[selected] = scored[selected].to(head.dtype)
                for _ in range(count - len(calls)):  # ZeRO-3: join the other ranks' gathers, result dropped
                    jobs[0][1].forward()
            self._forwards += count

    def score_streams(self, version: int, streams, kept=None, stop_ids=(), routes=None) -> list:
        """interrupt mode, at the sync version -> version + 1: π_version of each token stream, scored with the
        kept copy of ``version``'s weights (the live weights are already the next version's). Every actor rank
        is called, some with no streams; under ZeRO-3 all of them run the same number of forwards."""
        state = self.snapshots.get(version)
        if state is None:
            raise RuntimeError(f"interrupt mode: no copy of version {version} (kept: {self.snapshots.versions()})")
        # --algo.prox_score_memory_mb (partial args namespaces in tests lack it: the flag's default)
        memory_mb = getattr(self.args.algo, "prox_score_memory_mb", prox.SCORE_MEMORY_MB)
        # this rank's forwards (a function of its stream lengths, the model and the budget); the max over ranks
        forwards = prox.forwards_needed(streams, model=self.module, memory_mb=memory_mb)
        if self.partitioned:
            forwards = int(distributed.all_reduce_max([forwards])[0])
        if forwards == 0:
            return []
        t0 = time.time()
        model = self.module
        was_training = model.training
        model.eval()
        try:
            with self._swapped(state):
                out = prox.stream_log_probs(
                    model,
                    streams,
                    self.args.rollout.temperature,
                    forwards=forwards,
                    kept=kept,
                    stop_ids=stop_ids,
                    memory_mb=memory_mb,
                    routes=routes,
                )
        finally:
            model.train(was_training)
        self._seconds += time.time() - t0
        self._forwards += 1
        return out

    def metrics(self) -> dict:
        """Cost of the π_prox mode since the last call: extra forward time and count, host memory."""
        stored = self.snapshots.nbytes() if self.snapshots is not None else self.ewma.nbytes()  # this rank's
        out = {
            "prox/extra_forward_seconds": self._seconds,
            "prox/extra_forwards": float(self._forwards),
            "prox/missing_version_tokens": float(self._missing),
            "prox/host_memory_mb": stored / 2**20,
            # stored weights swapped into the actor (host -> device on a GPU) and the seconds those copies took
            "prox/swap_bytes": float(self._swap.bytes),
            "prox/swap_seconds": self._swap.seconds,
        }
        if self.ewma is not None:
            out["prox/ewma_updates"] = float(self.ewma.n)
            if self.ewma_decay_used is not None:
                out["prox/ewma_decay"] = self.ewma_decay_used
        self._seconds, self._forwards, self._missing = 0.0, 0, 0
        self._swap = prox.SwapStats()
        return out

    # ---- checkpoint ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a restart needs to continue exactly: the PPO-EWMA average (snapshots need nothing: the
        rollouts in flight at a checkpoint do not survive a restart, and versions restart consistently at 0).
        Under ZeRO-3 the average is this rank's partition; DeepSpeed writes one client state per rank."""
        if self.ewma is None:
            return {}
        return {"ewma": self.ewma.state_dict(), "partition_of": self.partition_owner()}

    def load_state_dict(self, state: dict) -> None:
        if self.ewma is None or "ewma" not in state:
            return
        saved_owner = state.get("partition_of")
        if saved_owner != self.partition_owner():
            raise RuntimeError(
                f"--algo.prox_mode ewma: this rank ({self.partition_owner()}) was given the EWMA weights saved "
                f"by {saved_owner} (rank, ranks; None = unpartitioned). Resume with the same --ds.zero_stage and "
                "number of actor ranks (--actor.num_nodes x --actor.num_gpus_per_node)."
            )
        check_partition_layout(self.module, state["ewma"]["avg"])
        self.ewma.load_state_dict(state["ewma"])
        self._optimizer_steps_seen = self.engine.global_steps

    def partition_owner(self):
        """(rank, ranks) whose partition this rank's stored weights are under ZeRO-3; None otherwise."""
        if not self.partitioned:
            return None
        return (torch.distributed.get_rank(), torch.distributed.get_world_size())


def check_partition_layout(module: torch.nn.Module, saved) -> None:
    """EWMA weights saved under ZeRO-3 are this rank's partitions: they only fit the same layout."""
    if not saved:
        return
    for name, p in module.named_parameters():
        if name not in saved or saved[name].shape != prox.storage(p).shape:
            raise RuntimeError(
                f"--algo.prox_mode ewma: the checkpoint's EWMA weights do not fit this run's parameters "
                f"({name}: saved {tuple(saved[name].shape) if name in saved else 'nothing'}, here "
                f"{tuple(prox.storage(p).shape)}). Under ZeRO-3 they are per-rank partitions: resume with the "
                "same --ds.zero_stage and number of actor ranks (--actor.num_nodes x --actor.num_gpus_per_node)."
            )


@dataclass
class _Deferred:
    """One micro-batch's π_prox forward left for :meth:`ProxSources.grouped_forwards`: ``forward()`` scores it with
    whatever weights are swapped in; ``versions`` (B, A) its token versions (None: every column, EWMA); ``stale``
    the kept versions it needs."""

    forward: Callable[[], torch.Tensor]
    versions: Optional[torch.Tensor]
    stale: set
