"""Engine replacement with the weight sync (``--vllm.max_restarts``; ``trainer/ray/engine_keeper.py``): the weights
kept for a restarted engine, and with upstream's NCCL/gloo broadcast the group formed again after a restart, the
watch on a death during a broadcast, the start-up probe of a re-formed group, and the check of a replaced engine.

One :class:`ReplacementSync` per actor rank, held by its :class:`~openrlhf_ess.trainer.weight_sync.WeightSync` (which
keeps its public methods and hands them here): it reads the weights through that sync (``gathered_on_rank0``, the
canary's reference) and runs its check (``_compare``).
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import ray
import torch

from openrlhf_ess import distributed
from openrlhf_ess.trainer import sync_check

REGROUP_PROBE_VALUES = 4096  # the start-up probe of a re-formed weight sync group (startup_regroup_probe)


class ReplacementSync:
    """The weight sync's part in engine replacement, on one actor rank (``sync``: its ``WeightSync``)."""

    def __init__(self, sync):
        self.sync = sync
        self.trainer, self.args = sync.trainer, sync.args
        self._group_restarts = 0  # NCCL/gloo with replacement: engine restarts when rank 0's group was formed

    def keep(self, named, reference: Optional[Dict[str, object]], dedicated: bool = False) -> Tuple[List[object], int]:
        """Rank 0, before a sync reaches any engine (replacement on): each safetensors message of the weights is put
        in Ray's object store once, and the keeper is given them with the version they become and the trainer's
        canary ``reference`` (``WeightSync.canary_reference``), so that an engine restarted from now on loads this set
        and checks itself before it serves. Returns the refs and that version. Cost: the model's bytes in the
        object store, kept until the next sync replaces them (a restart may need them until then)."""
        from openrlhf_ess.trainer.ray import engine_keeper
        from openrlhf_ess.trainer.ray.vllm_worker_wrap import weight_messages

        refs, kept = [], []
        for blob, _ in weight_messages(named):
            refs.append(ray.put(blob))
            if dedicated:
                kept.append(blob)
        version = self.trainer.weight_version + 1
        ray.get(engine_keeper.find().put_weights.remote(version, refs, reference))
        if dedicated:
            self.sync._blob_for_dedicated = (kept,)
        return refs, version

    def keep_for_restarts(self) -> None:
        """``--vllm.sync_backend nccl``/``gloo`` with replacement on (all ranks), before upstream's broadcast: the
        weights about to be sent, kept in Ray's object store for an engine restarted before the next sync
        (:meth:`keep`), which loads them in its ``__init__`` through vLLM's ``reload_weights`` as the reload backend
        does. The broadcast cannot serve it: a restarted engine has no place in the group until the next sync
        forms it again (:meth:`regroup_if_replaced`), and its calls sent again must be served before that.

        Cost per sync: one more pass over the weights, gathered one parameter at a time under ZeRO-3 (like the
        broadcast's), their copy to rank 0's host, and the model's bytes in its node's object store (M + 3·m, as
        pre-flight counts)."""
        reference = self.sync.canary_reference()
        named = self.sync.gathered_on_rank0()
        if named is not None:
            self.keep(named, reference)

    def broadcast_replaceable(self, broadcast) -> None:
        """Upstream's NCCL/gloo (or CUDA IPC) sync ``broadcast`` with replacement on (all ranks): the weights kept
        for a restarted engine first, rank 0's group formed again if an engine was restarted since (not with CUDA
        IPC, which has none), then the broadcast.

        An engine that dies *during* it cannot be replaced within it: its peers wait in the collective for data it
        never takes (NCCL reports no dead peer inside a node), and the caller's ``ray.get`` may never return. So
        rank 0 watches the keeper meanwhile (:class:`_RestartDuringSync`): the broadcast failing after a restart
        began raises the named error; still running :data:`SYNC_DEATH_GRACE_S` after it (or ``--vllm.watchdog_s``,
        if shorter), the rank ends its process with the same words, so the run stops instead of hanging with idle
        GPUs."""
        self.keep_for_restarts()
        if torch.distributed.get_rank() != 0:
            broadcast()
            return
        watchdog_s = float(getattr(self.args.vllm, "watchdog_s", 0) or 0)
        with _RestartDuringSync(self, min(watchdog_s, SYNC_DEATH_GRACE_S)) as watch:
            if not getattr(self.trainer, "use_cuda_ipc", False):
                self.regroup_if_replaced()
                watch.since(self._group_restarts)  # a restart the new group already holds is no death in it
            # A restarted engine came back unpaused and may serve calls Ray sent again: paused like the others
            # before the broadcast rewrites its layers one by one (RolloutRayActorImpl.pause_if_serving).
            ray.get([engine.pause_if_serving.remote() for engine in self.trainer.vllm_engines])
            try:
                broadcast()
            except Exception as error:
                if not watch.restarted():
                    raise
                raise RuntimeError(watch.message()) from error

    def regroup_if_replaced(self) -> bool:
        """Rank 0, before each NCCL/gloo broadcast with replacement on: if an engine was restarted since the group
        was formed, form it again with every engine (:meth:`regroup`). A restarted engine joins no group by itself,
        and a group with a dead member would wait forever in the broadcast. Returns whether it did.

        Every engine answers first, and only then are the restarts counted. Ray holds a call to a restarting actor
        until its ``__init__`` is done (where the new instance says hello to the keeper) and sends a call that met a
        dead one again to its successor (``max_task_retries=-1``), so an engine that died a moment before the sync,
        not yet restarting, is counted too; a restart that fails raises here, which stops the run with the keeper's
        list of failures, and one that never ends is the watchdog's (``--vllm.restart_timeout_s``). The group's
        rendezvous also needs every member started: it waits at most 300 s."""
        from openrlhf_ess.trainer.ray import engine_keeper

        ray.get([engine.held_weight_version.remote() for engine in self.trainer.vllm_engines])
        restarts = ray.get(engine_keeper.find().used.remote())
        if restarts <= self._group_restarts:
            return False
        self.regroup()
        self._group_restarts = restarts
        print(
            f"[openrlhf-ess] weight sync group formed again with every vLLM engine after {restarts} engine "
            f"restart(s) (--vllm.sync_backend {self.args.vllm.sync_backend})",
            flush=True,
        )
        return True

    def regroup(self) -> None:
        """Rank 0: leave the weight sync group and form a new one with every engine: the old communicator aborted
        (vLLM's ``PyNcclCommunicator.destroy``: ``ncclCommAbort``, bounded at 5 s, safe with a dead peer; the
        engines' workers abort theirs as they join the new one, ``vllm_worker_wrap.WorkerWrap.init_process_group``),
        then upstream's ``_init_vllm_sync_group``: a new port, rank 0 and every engine worker. Upstream overwrites a
        group without tearing it down, and a new communicator beside a stale one with a dead peer has failed to
        start on GPUs (vLLM's own report)."""
        old = getattr(self.trainer, "_model_update_group", None)
        destroy = getattr(old, "destroy", None)
        if callable(destroy):
            destroy()
        self.trainer._init_vllm_sync_group(self.args.vllm.sync_backend)

    def startup_regroup_probe(self) -> str:
        """Start-up self-check (rank 0; NCCL/gloo with replacement on, GPUs): what a replacement will do, done once
        before the first rollout: the group formed a second time (:meth:`regroup`) and a probe of
        :data:`REGROUP_PROBE_VALUES` float32 values broadcast through it, received by every engine worker as a
        weight is (``probe_sync_group``, never loaded); each worker's digest of the bytes it received must equal
        rank 0's of the bytes it sent (a broadcast copies bits). Shows on the user's cluster what no CPU run can,
        with every member alive: a healthy communicator aborted, a new rendezvous, a second communicator, the data
        path. It kills no one, so the abort of a communicator whose peer died is not shown. Returns its summary
        line."""
        t0 = time.time()
        self.regroup()
        probe = torch.linspace(-1.0, 1.0, REGROUP_PROBE_VALUES, dtype=torch.float32)
        ours = sync_check.bytes_digest(probe)
        engines = self.trainer.vllm_engines
        refs = [engine.probe_sync_group.remote(REGROUP_PROBE_VALUES) for engine in engines]
        group = self.trainer._model_update_group
        group.broadcast(probe.to(distributed.device()), src=0, stream=distributed.stream())
        got = ray.get(refs)
        bad = [(i, w, digest) for i, workers in enumerate(got) for w, digest in enumerate(workers) if digest != ours]
        if bad:
            raise RuntimeError(
                "start-up self-check failed (engine replacement): the weight sync group formed a second time, as "
                "after an engine restart, delivered other bytes than rank 0 sent to engine worker(s) "
                f"{[(i, w) for i, w, _ in bad]} (sha256 received {bad[0][2][:16]}..., sent {ours[:16]}...): a "
                "restarted engine would not take part in later syncs correctly. Use --vllm.sync_backend reload with "
                "--vllm.max_restarts, or --vllm.max_restarts 0."
            )
        return (
            f"replacement: the weight sync group formed a second time with {len(engines)} engine(s) and a probe "
            f"broadcast through it arrived intact in every worker ({time.time() - t0:.1f} s)"
        )

    def check_replaced(self) -> Dict[str, float]:
        """After an engine was replaced (all ranks, at the start of a training step, when the trainer holds the
        weights of the last sync, sync and async alike): the sync check on every engine now, with checksums taken
        now (a replaced engine's load-time ones died with it) and the canary, before the batch it helped generate is
        trained. Stands for the check of the last sync, which the next step would otherwise run. Returns its
        metrics."""
        sync = self.sync
        sync._loaded_engine_checksums, sync._to_check = None, False
        sync.metrics = {}
        sync._compare(canary=True)
        return dict(sync.metrics)


class _RestartDuringSync:
    """Rank 0, around an NCCL/gloo broadcast with replacement on (:meth:`ReplacementSync.broadcast_replaceable`): a
    thread that asks the keeper every :data:`RESTART_POLL_S` seconds whether an engine restart began since the sync
    started. If one did and the sync is still running ``grace_s`` later, the broadcast is waiting for a member that
    is gone: the thread prints :meth:`message` and ends this process (Ray then stops the run, naming this rank's
    death), since the main thread may wait in the collective for ever. ``grace_s`` 0 (``--vllm.watchdog_s 0``):
    no thread, a hang is waited for, as that flag says."""

    def __init__(self, sync: "ReplacementSync", grace_s: float):
        self.sync, self.grace_s = sync, grace_s
        self._start = self._restarts()
        self._done = False
        self._thread = None

    @staticmethod
    def _restarts() -> int:
        from openrlhf_ess.trainer.ray import engine_keeper

        return ray.get(engine_keeper.find().used.remote())

    def restarted(self) -> bool:
        return self._restarts() > self._start

    def since(self, restarts: int) -> None:
        """Count only the restarts after ``restarts`` (those the group was formed again for are in it)."""
        self._start = max(self._start, restarts)

    def message(self) -> str:
        args = self.sync.args
        return (
            f"a vLLM engine died during the weight sync to version {self.sync.trainer.weight_version + 1} over "
            f"--vllm.sync_backend {args.vllm.sync_backend}: a broadcast cannot go on without one of its members, so "
            "the run stops here (an engine that dies between syncs is replaced, and the next sync forms the group "
            "again). The checkpoints written so far are kept: --train.auto_resume N restarts the run from the "
            "newest; --vllm.sync_backend reload replaces an engine at any point, syncs included."
        )

    def _watch(self) -> None:
        import sys

        seen = None
        while not self._done:
            time.sleep(RESTART_POLL_S)
            if self._done:
                return
            try:
                if seen is None and self.restarted():
                    seen = time.monotonic()
            except Exception:  # the keeper gone: the run is ending anyway
                return
            if seen is not None and time.monotonic() - seen >= self.grace_s and not self._done:
                print(f"[openrlhf-ess] {self.message()}", file=sys.stderr, flush=True)
                os._exit(1)
                return  # os._exit does not return; a stand-in for it (tests) must not see a second call

    def __enter__(self) -> "_RestartDuringSync":
        import threading

        if self.grace_s > 0:
            self._thread = threading.Thread(target=self._watch, name="restart-during-sync", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done = True


RESTART_POLL_S = 2.0  # how often rank 0 asks the keeper during an NCCL/gloo sync with replacement on
# How long a broadcast may go on after one of its engines began a restart before rank 0 ends the run: no broadcast
# completes without a member that died in it, so this only lets one that was already ending end (a 70B model's
# broadcast over NVLink takes seconds), and keeps the GPUs from idling --vllm.watchdog_s (600 s by default) for it.
SYNC_DEATH_GRACE_S = 60.0
