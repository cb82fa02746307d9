"""The weight-sync check with vLLM sleep mode (``--train.colocate_all --vllm.enable_sleep``), on a stand-in engine.

Why a stand-in: vLLM's CPU backend has no sleep mode (``CPUWorker.sleep`` / ``wake_up`` only log "sleep mode is
not supported on CPU", and the CLI refuses ``--vllm.enable_sleep`` on CPU), and what sleep does to an engine is
GPU memory management (``CuMemAllocator`` unmaps the weights' and KV cache's device memory). So
:class:`StandInEngine` keeps vLLM's *state* (vLLM 0.31.0) and turns what the GPU would do into errors:

- ``sleep()`` (upstream ``RolloutRayActor.sleep``, level 1 -> ``EngineCore.sleep`` -> ``Executor.sleep``): the
  scheduler is paused, then ``sleeping_tags = {"weights", "kv_cache"}``: weights copied to the host and their
  device memory unmapped (here: overwritten with NaN, and any access raises), KV cache discarded.
- ``wake_up(tags)`` (upstream ``RolloutRayActor.wake_up``: ``None`` -> ``["weights", "kv_cache"]``, one vLLM call per
  tag): ``Executor.wake_up`` removes a tag that is asleep, and only logs a warning for one that is not (or when
  nothing is asleep); ``EngineCore.wake_up`` resumes the scheduler only once nothing is asleep.
- reading or writing weights while ``"weights"`` is asleep: on a GPU, a kernel over unmapped memory (CUDA illegal
  memory access); here :class:`EngineAsleep`.
- a generate request (the canary, a rollout) while the scheduler is paused: vLLM queues it and never schedules
  it, so the caller waits forever; here :class:`EngineAsleep`.

``test_stand_in_engine_follows_vllm_sleep_state`` drives vLLM's own ``EngineCore`` / ``Executor`` sleep and wake
code (and upstream's ``RolloutRayActor.sleep`` / ``wake_up``) next to the stand-in and compares their states, so
the stand-in cannot drift from what it stands for.

The trainer is our ``ActorPPOTrainer`` (its real ``ppo_train`` and ``broadcast_to_vllm``, and a real
``WeightSync``) around a tiny torch model, with upstream's training and per-tensor broadcast replaced by a small
update and a copy into the engines. :class:`Controller` makes the calls upstream's controller makes in one
colocated step (openrlhf 0.11.2): ``SamplesGenerator.generate_samples`` (``wake_up()`` -> generate ->
``sleep()``), ``PPOTrainer.ppo_train`` (actor ``fit`` -> our ``ppo_train``), ``PPOTrainer.broadcast_to_vllm``
(``wake_up(tags=["weights"])`` -> actor ``broadcast_to_vllm``). ``torch.distributed`` is a single-process gloo
group on 127.0.0.1.
"""

import asyncio
import copy
from types import SimpleNamespace

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf.trainer.ray import ppo_actor as upstream_actor  # noqa: E402
from safetensors.torch import load as load_safetensors  # noqa: E402

from openrlhf_ess.trainer import sync_check, weight_sync  # noqa: E402
from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer  # noqa: E402
from tests.helpers.one_rank import DeepSpeedLike, RemoteHandle, TinyLM, gloo_single_process  # noqa: E402

BOTH = frozenset({"weights", "kv_cache"})


_gloo_single_process = pytest.fixture(scope="module", autouse=True)(gloo_single_process)


class EngineAsleep(Exception):
    """What the GPU (or vLLM's paused scheduler) would do. Not a RuntimeError: it cannot pass for the check's."""


class Timeline:
    """The controller's phase, and every engine call the sync check made, with the engine's state at the time."""

    def __init__(self):
        self.phase = "init"
        self.calls = []

    def checks(self, method=None):
        return [c for c in self.calls if method is None or c["method"] == method]


class StandInEngine:
    """Our RolloutRayActor over a vLLM engine with sleep mode, as far as the sync check sees it (module docstring)."""

    def __init__(self, model, timeline, tensor_parallel=False):
        self.model = copy.deepcopy(model)  # the weights this engine generates with
        self.timeline = timeline
        self.tensor_parallel = tensor_parallel  # weight_checksums() answers one dict per worker, as with TP 2
        self.sleeping_tags = set()  # vLLM's Executor.sleeping_tags
        self.paused = False  # vLLM's scheduler pause state (EngineCore.is_scheduler_paused)
        self.corrupt_syncs = False  # every sync leaves one tensor wrong on this engine
        self.renamed = {}  # tensors reported under another name: a layout the check's name map does not know
        self.warnings = []
        self._host_copy = None

    # ---- sleep mode (upstream RolloutRayActor -> vLLM AsyncLLM -> EngineCore -> Executor) ----

    def sleep(self, level=1):
        assert level == 1  # upstream always sleeps at level 1 (weights offloaded to host, KV cache discarded)
        self.paused = True  # EngineCore.sleep pauses the scheduler (mode "abort") before the executor sleeps
        if "weights" in self.sleeping_tags:
            self.warnings.append("Executor is already sleeping.")
            return
        self._host_copy = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))  # device memory unmapped: nothing valid there
        self.sleeping_tags |= BOTH

    def wake_up(self, tags=None):
        for tag in tags or ["weights", "kv_cache"]:  # upstream: one vLLM wake_up per tag
            self._vllm_wake_up([tag])

    def _vllm_wake_up(self, tags):
        if not self.sleeping_tags:  # Executor.wake_up
            self.warnings.append("Executor is not sleeping.")
        elif any(t not in self.sleeping_tags for t in tags):
            self.warnings.append(f"Tag {tags} is not in sleeping tags {sorted(self.sleeping_tags)}")
        else:
            if "weights" in tags:
                with torch.no_grad():
                    for n, p in self.model.named_parameters():
                        p.copy_(self._host_copy[n])
                self._host_copy = None
            self.sleeping_tags -= set(tags)
        if not self.sleeping_tags:  # EngineCore.wake_up: the scheduler resumes once fully awake
            self.paused = False

    # ---- what needs which part awake ----

    def _log(self, method):
        self.timeline.calls.append(
            {
                "method": method,
                "engine": self,
                "phase": self.timeline.phase,
                "asleep": frozenset(self.sleeping_tags),
                "paused": self.paused,
            }
        )

    def _weights_resident(self, what):
        if "weights" in self.sleeping_tags:
            raise EngineAsleep(f"{what}: the weights are asleep (device memory unmapped: CUDA illegal memory access)")

    def _scheduler_running(self, what):
        if self.paused:
            raise EngineAsleep(
                f"{what}: request queued on a paused scheduler (asleep: {sorted(self.sleeping_tags)}); vLLM never "
                "schedules it, the caller would wait forever"
            )

    def update_weights(self, state):
        """The receiving side of a sync (upstream update_weight / update_weight_cuda_ipc, our reload)."""
        self._weights_resident("weight update")
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(state[n])
            if self.corrupt_syncs:
                self.model.head.weight.mul_(3.0)  # e.g. a wrong scale, or a stale tensor
        return len(state)

    def load_weights_from_safetensors(self, blob, with_checksums=False):
        count = self.update_weights(load_safetensors(blob))
        checksums = self.weight_checksums() if with_checksums else None
        return {"counts": [count], "checksums": checksums, "checksum_seconds": 0.0}

    def weight_checksums(self):
        self._log("weight_checksums")
        self._weights_resident("weight_checksums")
        params = list(self.model.named_parameters())
        if self.tensor_parallel:  # two workers, as vLLM's TP 2 lays weights out: row shards, or whole replicas
            workers = [{}, {}]
            for n, p in params:
                shards = p.chunk(2, 0)
                for w, shard in zip(workers, shards if len(shards) == 2 else (p, p)):
                    w[n] = sync_check.checksum(shard)
            return str(params[0][1].dtype), workers
        return str(params[0][1].dtype), {self.renamed.get(n, n): sync_check.checksum(p) for n, p in params}

    def prompt_log_probs(self, token_ids):
        self._log("prompt_log_probs")
        self._scheduler_running("prompt_log_probs")
        self._weights_resident("prompt_log_probs")
        ids = torch.tensor([token_ids])
        with torch.no_grad():
            logp = self.model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        return logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()

    def generate(self):
        """A rollout: needs everything awake."""
        self._scheduler_running("generate")
        self._weights_resident("generate")


class FakeRay:
    @staticmethod
    def get(refs):
        return refs


def _fake_fit(self, kl_ctl):
    """Upstream's ppo_train: the weights move."""
    g = torch.Generator().manual_seed(self.weight_version)
    with torch.no_grad():
        for p in self.actor.model.module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {"policy_loss": 0.0}


def _fake_broadcast(self):
    """Upstream's broadcast_to_vllm (nccl / gloo / CUDA IPC): every parameter into every engine."""
    state = {n: p.detach().clone() for n, p in self.actor.model.module.named_parameters()}
    for engine in self.vllm_engines:
        engine.update_weights.remote(state)


def make_trainer(monkeypatch, *, sleep, backend="nccl", canary_every=1, tensor_parallel=False, n_engines=2):
    vllm = SimpleNamespace(
        sync_backend=backend,
        sync_check_tol=0.05,
        sync_check_rel_tol=0.1,
        sync_check_canary_every=canary_every,
        sync_check_min_coverage=0.95,
        enable_sleep=sleep,
        sync_with_ray=False,
        max_restarts=0,
    )
    algo = SimpleNamespace(
        prox_audit_dir=None,
        prox_mode="recompute",
        ess_lr_enable=False,
        advantage=SimpleNamespace(is_correction_level="off", baseline="estimator"),
        tis_cap=None,
        kl=SimpleNamespace(off_policy_k2_enable=False),
        max_version_lag=None,
    )
    train = SimpleNamespace(colocate_all=sleep, async_enable=False)
    args = SimpleNamespace(vllm=vllm, ds=SimpleNamespace(zero_stage=0, enable_sleep=sleep), algo=algo, train=train)
    torch.manual_seed(0)
    module = TinyLM()
    trainer = object.__new__(ActorPPOTrainer)  # our methods, without upstream's init (DeepSpeed, replay buffer)
    trainer.args = args
    trainer.strategy = SimpleNamespace(args=args)
    trainer.actor = SimpleNamespace(model=DeepSpeedLike(module))
    trainer.weight_version = 0
    trainer.prox = SimpleNamespace(active=False, after_sync=lambda version: None)
    trainer.lr_scale_hook = None
    timeline = Timeline()
    engines = [StandInEngine(module, timeline, tensor_parallel) for _ in range(n_engines)]
    trainer.vllm_engines = [RemoteHandle(e) for e in engines]
    trainer.weight_sync = weight_sync.WeightSync(trainer)
    monkeypatch.setattr(weight_sync, "ray", FakeRay)
    monkeypatch.setattr(upstream_actor.ActorPPOTrainer, "ppo_train", _fake_fit)
    monkeypatch.setattr(upstream_actor.ActorPPOTrainer, "broadcast_to_vllm", _fake_broadcast)
    return Controller(trainer, engines, timeline, sleep)


class Controller:
    """Upstream's controller calls, in the order of one colocated training step (openrlhf 0.11.2)."""

    def __init__(self, trainer, engines, timeline, sleep):
        self.trainer, self.engines, self.timeline, self.sleep = trainer, engines, timeline, sleep
        if sleep:  # create_vllm_engines(vllm_enable_sleep=True) ends with batch_vllm_engine_call(engines, "sleep")
            for e in engines:
                e.sleep()

    def generate(self):  # SamplesGenerator.generate_samples
        self.timeline.phase = "generate"
        if self.sleep:
            for e in self.engines:
                e.wake_up()
        for e in self.engines:
            e.generate()
        if self.sleep:
            for e in self.engines:
                e.sleep()

    def ppo_train(self):  # PPOTrainer.ppo_train: (ds.enable_sleep: reload_states ->) actor fit (-> offload_states)
        self.timeline.phase = "ppo_train"
        return self.trainer.ppo_train(0.0)

    def broadcast(self):  # PPOTrainer.broadcast_to_vllm
        self.timeline.phase = "broadcast"
        if self.sleep:
            for e in self.engines:
                e.wake_up(tags=["weights"])
        self.trainer.broadcast_to_vllm()

    def step(self):
        self.generate()
        status = self.ppo_train()
        self.broadcast()
        return status


def _trainer_params(controller):
    return dict(controller.trainer.actor.model.module.named_parameters())


@pytest.mark.parametrize("backend", ["nccl", "reload"])
def test_sleep_mode_checks_each_sync_while_its_weights_are_awake(monkeypatch, backend):
    """Each sync is checked inside broadcast_to_vllm, while the controller holds the engines' weights awake; the
    canary wakes the KV cache and puts the engines back to sleep; generation still finds what it expects.

    Before the fix the check ran at the start of the next ppo_train, on sleeping engines: weight_checksums on
    unmapped weights (nccl), or a canary queued forever on a paused scheduler (reload)."""
    ctl = make_trainer(monkeypatch, sleep=True, backend=backend, canary_every=2)
    statuses, after_sync = [], []
    for _ in range(3):
        statuses.append(ctl.step())
        after_sync.append([(frozenset(e.sleeping_tags), e.paused) for e in ctl.engines])

    # syncs 1 and 3 ran the canary (the first, then every 2): the engines were put back to sleep after it, as
    # after a generation; after sync 2 their weights stay awake, as upstream leaves them
    n = len(ctl.engines)
    assert after_sync == [[(BOTH, True)] * n, [({"kv_cache"}, True)] * n, [(BOTH, True)] * n]
    checks = ctl.timeline.checks()
    assert checks and all(c["phase"] == "broadcast" and "weights" not in c["asleep"] for c in checks)
    canaries = ctl.timeline.checks("prompt_log_probs")
    assert len(canaries) == 2 * len(ctl.engines) and all(c["asleep"] == frozenset() for c in canaries)
    assert len(ctl.timeline.checks("weight_checksums")) == 3 * len(ctl.engines)

    # each check's metrics come with the next step's status, as without sleep mode
    assert "sync/checksum_tensors_compared" not in statuses[0]
    assert statuses[1]["sync/checksum_tensors_compared"] == 2.0 * len(ctl.engines)
    assert statuses[1]["sync/canary_mean_abs_diff"] == 0.0
    assert statuses[2]["sync/checksum_tensors_compared"] == 2.0 * len(ctl.engines)
    assert "sync/canary_mean_abs_diff" not in statuses[2]

    # the next generation wakes the engines, with the last sync's weights (also after the canary's re-sleep)
    ctl.generate()
    ctl.timeline.phase = "after"
    for e in ctl.engines:
        e.wake_up()
        for name, p in e.model.named_parameters():
            assert torch.equal(p, _trainer_params(ctl)[name])


@pytest.mark.parametrize("tensor_parallel", [False, True], ids=["checksums", "checksums-tp2"])
def test_sleep_mode_catches_a_wrong_engine_weight_at_the_sync(monkeypatch, tensor_parallel):
    """One engine ends the sync with one wrong weight: the check fails inside that broadcast_to_vllm. With tensor
    parallelism (each worker reports its shards; such engines once answered None and only the canary
    looked) the workers' sums are merged against the trainer's tensor sizes and the same tensor is named."""
    ctl = make_trainer(monkeypatch, sleep=True, tensor_parallel=tensor_parallel)
    ctl.engines[1].corrupt_syncs = True
    ctl.generate()
    ctl.ppo_train()
    match = r"engine 1: 1 of 2 tensors differ \(head.weight\)"
    with pytest.raises(RuntimeError, match=match):
        ctl.broadcast()
    assert all(c["phase"] == "broadcast" and "weights" not in c["asleep"] for c in ctl.timeline.checks())


def test_sleep_mode_check_error_names_the_version_of_the_sync(monkeypatch):
    ctl = make_trainer(monkeypatch, sleep=True)
    ctl.step()
    ctl.engines[0].corrupt_syncs = True
    ctl.generate()
    ctl.ppo_train()
    with pytest.raises(RuntimeError, match="weight sync check failed after version 2: .*engine 0"):
        ctl.broadcast()


def test_without_sleep_the_check_still_runs_at_the_start_of_the_next_step(monkeypatch):
    """The default path is unchanged: nothing is checked inside broadcast_to_vllm, the check of a sync runs at
    the start of the next ppo_train (before its training), and a wrong weight fails there."""
    ctl = make_trainer(monkeypatch, sleep=False)
    ctl.step()
    assert ctl.timeline.checks() == []  # the first sync: not checked yet
    status = ctl.step()
    checks = ctl.timeline.checks()
    assert checks and all(c["phase"] == "ppo_train" and not c["asleep"] and not c["paused"] for c in checks)
    assert status["sync/checksum_tensors_compared"] == 2.0 * len(ctl.engines)
    assert status["sync/canary_mean_abs_diff"] == 0.0
    for e in ctl.engines:
        assert not e.sleeping_tags and not e.paused and e.warnings == []

    ctl.engines[1].corrupt_syncs = True
    ctl.generate()
    ctl.ppo_train()
    ctl.broadcast()  # the wrong weight goes unnoticed here ...
    ctl.generate()
    with pytest.raises(RuntimeError, match=r"engine 1: 1 of 2 tensors differ \(head.weight\)"):
        ctl.ppo_train()  # ... and is caught at the start of the next step


def test_a_layout_the_check_cannot_name_fails_unless_the_flag_accepts_it(monkeypatch):
    """An engine whose largest tensor comes under a name the check does not know: the check can compare only the
    rest, so it fails, naming the tensor left out, the coverage and the flag; --vllm.sync_check_min_coverage below
    that coverage accepts it."""
    ctl = make_trainer(monkeypatch, sleep=False)
    sizes = {n: p.numel() for n, p in _trainer_params(ctl).items()}
    largest = max(sizes, key=sizes.get)
    covered = 1 - sizes[largest] / sum(sizes.values())  # the elements the engine still reports by our names
    assert covered < 0.95
    for e in ctl.engines:
        e.renamed = {largest: largest + ".packed"}
    ctl.step()
    ctl.generate()
    with pytest.raises(RuntimeError) as err:
        ctl.ppo_train()
    message = str(err.value)
    assert f"only {100 * covered:.1f}% of the trainer's weight elements" in message
    assert "--vllm.sync_check_min_coverage 0.95" in message and f": {largest} (1 tensors left out)" in message

    ctl = make_trainer(monkeypatch, sleep=False)
    ctl.trainer.args.vllm.sync_check_min_coverage = covered - 0.01
    for e in ctl.engines:
        e.renamed = {largest: largest + ".packed"}
    ctl.step()
    status = ctl.step()
    assert status["sync/checksum_coverage"] == pytest.approx(covered)


def test_stand_in_engine_follows_vllm_sleep_state():
    """The stand-in's state (sleeping tags, scheduler paused) matches vLLM's own sleep/wake code, driven through
    upstream's RolloutRayActor.sleep / wake_up, for the calls of a colocated sleep run with the fix: including
    wake_up(tags=["kv_cache"]) for the canary, and a later wake_up() that finds a tag (or nothing) asleep: vLLM
    only logs a warning, and resumes the scheduler once nothing is asleep."""
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from openrlhf_ess import upstream

    executor = object.__new__(UniProcExecutor)  # vLLM's Executor state machine; the workers' rpc does nothing
    executor.sleeping_tags = set()
    executor.collective_rpc = lambda *args, **kwargs: None
    core = SimpleNamespace(model_executor=executor, paused=False)
    core.pause_scheduler = lambda mode="abort", clear_cache=True: setattr(core, "paused", True)
    core.resume_scheduler = lambda: setattr(core, "paused", False)

    class AsyncLLMLike:  # AsyncLLM.sleep / wake_up -> EngineCore.sleep / wake_up
        async def sleep(self, level=1, mode="abort"):
            EngineCore.sleep(core, level, mode)

        async def wake_up(self, tags=None):
            EngineCore.wake_up(core, tags)

    actor_cls = upstream.ray_actor_class(RolloutRayActor)
    actor = SimpleNamespace(llm=AsyncLLMLike())
    stand_in = StandInEngine(TinyLM(), Timeline())
    calls = [
        ("sleep", None),  # engines created
        ("wake_up", None),  # generation
        ("sleep", None),
        ("wake_up", ["weights"]),  # the sync
        ("wake_up", ["kv_cache"]),  # the canary
        ("sleep", None),  # after the canary
        ("wake_up", None),  # generation
        ("sleep", None),
        ("wake_up", ["weights"]),  # a sync without canary
        ("wake_up", None),  # generation: "weights" is awake already
        ("wake_up", None),  # nothing asleep
        ("sleep", None),
        ("sleep", None),  # already asleep
    ]
    for method, tags in calls:
        if method == "sleep":
            asyncio.run(actor_cls.sleep(actor))
            stand_in.sleep()
        else:
            asyncio.run(actor_cls.wake_up(actor, tags=tags))
            stand_in.wake_up(tags)
        assert (executor.sleeping_tags, core.paused) == (stand_in.sleeping_tags, stand_in.paused), (method, tags)
