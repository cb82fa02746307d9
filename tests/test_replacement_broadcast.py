"""Engine replacement with upstream's NCCL/gloo weight sync (``--vllm.max_restarts``, ``--vllm.sync_backend nccl``):
the weights kept for a restarted engine, the group formed again after a restart, a death during a broadcast, and
the start-up probe of a re-formed group.

Why stand-ins: upstream's broadcast needs vLLM's ``PyNcclCommunicator`` on both sides, and vLLM's CPU build has none
(the CLI resolves ``nccl`` to ``reload`` on CPU and refuses ``gloo``); its per-tensor ``load_weights`` is refused by
vLLM's CPU linears too. So the trainer here is our ``ActorPPOTrainer`` (its real ``broadcast_to_vllm`` and a real
``WeightSync`` with its ``ReplacementSync``, ``trainer/replacement_sync.py``) around a tiny torch model, with
upstream's broadcast replaced by :func:`_broadcast`, which sends every parameter through the trainer's current
:class:`StandInGroup` to the engines in it, as upstream's per-tensor loop does; the keeper is the real
``EngineKeeperImpl`` behind a handle that calls it at once. What only a GPU can tell (a second rendezvous, the bytes
through NCCL) the start-up probe does on the user's cluster (``ReplacementSync.startup_regroup_probe``), whose logic
is tested here; the abort of a communicator with a dead peer neither shows.
"""

import threading
import types
from types import SimpleNamespace

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf.trainer.ray import ppo_actor as upstream_actor  # noqa: E402
from safetensors.torch import load as load_safetensors  # noqa: E402

from openrlhf_ess.trainer import replacement_sync, weight_sync  # noqa: E402
from openrlhf_ess.trainer.ray import engine_keeper  # noqa: E402
from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer  # noqa: E402
from tests.helpers.one_rank import DeepSpeedLike, RemoteHandle, TinyLM, gloo_single_process  # noqa: E402

_gloo_single_process = pytest.fixture(scope="module", autouse=True)(gloo_single_process)


class FakeRay:
    """``ray.put`` an identity; ``ray.get`` resolves a deferred answer (an engine's call that returns only once the
    broadcast it waits for has happened) and returns anything else as it is."""

    put = staticmethod(lambda value: value)

    @staticmethod
    def get(refs, **kwargs):
        if isinstance(refs, list):
            return [r() if callable(r) else r for r in refs]
        return refs


class StandInGroup:
    """One formed weight sync group: who is in it, whether it was aborted, and what went through it."""

    def __init__(self, members):
        self.members, self.destroyed, self.sent = list(members), False, []

    def destroy(self):
        self.destroyed = True

    def broadcast(self, tensor, src, stream=None):
        assert not self.destroyed, "a broadcast through an aborted group"
        self.sent.append(tensor.detach().clone())
        for member in self.members:
            member.received.append(tensor.detach().clone())


class StandInEngine:
    """An engine as the group and the sync see it: the group its workers are in, the weights it holds."""

    def __init__(self, index, trainer=None):
        self.index, self.group, self.received, self.weights, self.dead = index, None, [], {}, False
        self.flip_probe_bit, self.asked_ready, self.trainer = False, 0, trainer
        self.serving, self.paused = False, False  # requests in flight; paused for a sync (pause_if_serving)
        self.restart_when_asked = None  # a dead engine that Ray restarts as pid N when a call reaches it
        self.asked_pause = 0

    def held_weight_version(self):
        """Rank 0 asks every engine before it decides. A call that meets a dead engine is sent again by Ray to its
        successor, which answers once its __init__ (the hello to the keeper, the kept weights) is done."""
        self.asked_ready += 1
        if self.dead and self.restart_when_asked is not None:
            keeper = self.trainer.keeper_impl
            keeper.hello(self.index, self.restart_when_asked, reconstructed=True)
            keeper.rejoined(self.index, self.restart_when_asked, version=keeper.version, seconds=1.0)
            self.dead, self.restart_when_asked = False, None
            self.serving, self.paused = True, False  # the calls Ray sent again run on the new, unpaused instance
        return 0

    def pause_if_serving(self):
        self.asked_pause += 1
        if self.serving and not self.paused:
            self.paused = True
            self.trainer.order.append(("paused", self.index))
        return self.paused

    def probe_sync_group(self, numel):
        """The engine actor's answer, one digest per worker (one worker here), once the probe has arrived: the
        worker waits in the broadcast that rank 0 starts after this call."""
        from openrlhf_ess.trainer.sync_check import bytes_digest

        def answer():
            got = self.received[-1].clone()
            assert got.numel() == numel
            if self.flip_probe_bit:
                got.view(torch.int32)[7] ^= 1
            return [bytes_digest(got)]

        return answer


def _init_vllm_sync_group(trainer, backend):
    """Upstream's group set-up, as far as the test sees it: a new group of rank 0 and every living engine."""
    trainer.groups_formed += 1
    trainer._model_update_group = StandInGroup([e for e in trainer.engines if not e.dead])
    for engine in trainer.engines:
        engine.group = trainer._model_update_group


def _broadcast(trainer):
    """Upstream's broadcast_to_vllm: every parameter through the current group, into every engine in it; a member
    that is dead makes it fail as upstream's ``ray.get`` of the engines' ``update_weight`` would."""
    group = trainer._model_update_group
    trainer.order.append("broadcast")
    for name, param in trainer.actor.model.module.named_parameters():
        if trainer.die_during_broadcast is not None:
            trainer.engines[trainer.die_during_broadcast].dead = True
            trainer.keeper_impl.hello(trainer.die_during_broadcast, 999, reconstructed=True)
            trainer.die_during_broadcast = None
        if any(m.dead for m in group.members):
            raise RuntimeError("update_weight: the actor died (Ray's error)")
        assert not any(m.serving and not m.paused for m in group.members), "a weight rewritten while it serves"
        group.broadcast(param.data, src=0)
        for member in group.members:
            member.weights[name] = member.received[-1]


def make_trainer(monkeypatch, *, max_restarts=2, cuda_ipc=False, watchdog_s=0.0):
    vllm = SimpleNamespace(
        sync_backend="nccl",
        sync_check_tol=0.05,
        sync_check_rel_tol=0.1,
        sync_with_ray=False,
        enable_sleep=False,
        max_restarts=max_restarts,
        watchdog_s=watchdog_s,
    )
    algo = SimpleNamespace(prox_audit_dir=None, prox_mode="recompute")
    args = SimpleNamespace(vllm=vllm, ds=SimpleNamespace(zero_stage=0), algo=algo)
    torch.manual_seed(0)
    trainer = object.__new__(ActorPPOTrainer)  # our methods, without upstream's init (DeepSpeed, replay buffer)
    trainer.args = args
    trainer.strategy = SimpleNamespace(args=args)
    trainer.actor = SimpleNamespace(model=DeepSpeedLike(TinyLM()))
    trainer.weight_version = 0
    trainer.prox = SimpleNamespace(after_sync=lambda version: None)
    trainer.use_cuda_ipc = cuda_ipc
    trainer.engines = [StandInEngine(i, trainer) for i in range(2)]
    trainer.vllm_engines = [RemoteHandle(e) for e in trainer.engines]
    trainer.groups_formed, trainer.order, trainer.die_during_broadcast = 0, [], None
    keeper = engine_keeper.EngineKeeperImpl(max_restarts)
    for e in trainer.engines:
        keeper.hello(e.index, 100 + e.index, reconstructed=False)
    trainer.keeper_impl = keeper
    put = keeper.put_weights

    def put_weights(version, refs, canary=None):
        trainer.order.append(("kept", version))
        put(version, refs, canary)

    keeper.put_weights = put_weights
    monkeypatch.setattr(engine_keeper, "find", lambda: RemoteHandle(keeper))
    monkeypatch.setattr(weight_sync, "ray", FakeRay)
    monkeypatch.setattr(replacement_sync, "ray", FakeRay)
    monkeypatch.setattr(replacement_sync, "RESTART_POLL_S", 0.01)
    monkeypatch.setattr(upstream_actor.ActorPPOTrainer, "_init_vllm_sync_group", _init_vllm_sync_group)
    monkeypatch.setattr(upstream_actor.ActorPPOTrainer, "broadcast_to_vllm", _broadcast)
    monkeypatch.setattr(
        ActorPPOTrainer, "advance_version", lambda self: setattr(self, "weight_version", self.weight_version + 1)
    )
    trainer.weight_sync = weight_sync.WeightSync(trainer)
    trainer._init_vllm_sync_group("nccl")  # upstream's __init__ forms the first group
    return trainer


def _train(trainer, step):
    with torch.no_grad():
        for p in trainer.actor.model.module.parameters():
            p.add_(0.1 * (step + 1))


def _kept_state(keeper):
    """The weights the keeper holds, decoded from its safetensors messages (safetensors' own reader)."""
    state = {}
    for blob in keeper.refs:
        state.update(load_safetensors(blob))
    return state


def _trainer_state(trainer):
    return {n: p.detach().clone() for n, p in trainer.actor.model.module.named_parameters()}


def test_each_sync_keeps_the_weights_it_sends_before_any_engine_takes_them(monkeypatch):
    """The keeper holds the very tensors the broadcast is about to send, with the version they become, before the
    broadcast starts (an engine restarted during the sync loads that set)."""
    trainer = make_trainer(monkeypatch)
    for step in range(2):
        _train(trainer, step)
        trainer.broadcast_to_vllm()
        assert trainer.order[-2:] == [("kept", step + 1), "broadcast"], trainer.order
        kept, ours = _kept_state(trainer.keeper_impl), _trainer_state(trainer)
        assert kept.keys() == ours.keys() and all(torch.equal(kept[n], ours[n]) for n in ours)
        assert trainer.keeper_impl.version == trainer.weight_version == step + 1
        # the canary a restarted engine checks itself against: the synced weights' log-probs of its tokens, here
        # from the kept tensors by hand (embedding, tanh, head, log-softmax in float64)
        reference = trainer.keeper_impl.canary
        ids = torch.tensor(reference["ids"])
        logits = torch.tanh(kept["embed.weight"].double()[ids]) @ kept["head.weight"].double().T
        expected = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
        assert len(ids) == weight_sync.SYNC_CANARY_TOKENS and (reference["tol"], reference["rel_tol"]) == (0.05, 0.1)
        assert torch.allclose(torch.tensor(reference["log_probs"], dtype=torch.float64), expected, atol=1e-5)
    assert trainer.groups_formed == 1  # no restart: upstream's one group throughout


def test_a_restart_between_syncs_forms_the_group_again_with_every_engine_before_the_broadcast(monkeypatch):
    """Engine 1 dies between syncs and Ray restarts it (it said hello to the keeper): the next sync aborts rank 0's
    group, forms a new one with both engines, and broadcasts through it; the restarted engine ends with the trainer's
    weights. The sync after forms nothing more."""
    trainer = make_trainer(monkeypatch)
    _train(trainer, 0)
    trainer.broadcast_to_vllm()
    first = trainer._model_update_group
    trainer.engines[1].dead = True  # its old group holds a dead member: a broadcast through it would hang
    trainer.keeper_impl.hello(1, 201, reconstructed=True)
    trainer.keeper_impl.rejoined(1, 201, version=1, seconds=1.0)
    trainer.engines[1].dead = False  # the new engine actor, in the same handle
    _train(trainer, 1)
    trainer.broadcast_to_vllm()
    second = trainer._model_update_group
    assert first.destroyed and not second.destroyed and trainer.groups_formed == 2
    assert [e.asked_ready for e in trainer.engines] == [2, 2]  # every engine answered before each sync decided
    assert second.members == trainer.engines and len(first.sent) == len(second.sent) == 2
    ours = _trainer_state(trainer)
    for engine in trainer.engines:
        assert all(torch.equal(engine.weights[n], ours[n]) for n in ours)
    trainer.broadcast_to_vllm()
    assert trainer.groups_formed == 2


def test_a_death_just_before_the_sync_is_found_by_asking_every_engine(monkeypatch):
    """Engine 1 dies a moment before the sync, before Ray restarted it (the keeper has heard nothing): rank 0's
    question reaches its successor, whose start is a restart the keeper counts, so the group is formed again and the
    broadcast reaches both engines. The successor serves the calls Ray sent again, unpaused: it is paused before the
    broadcast rewrites its weights, and the idle engine is left as it is. Counting the restarts before asking (the
    earlier order) broadcast into the dead member's group: Ray's error stopped the run."""
    trainer = make_trainer(monkeypatch)
    _train(trainer, 0)
    trainer.broadcast_to_vllm()
    trainer.engines[1].dead, trainer.engines[1].restart_when_asked = True, 301
    assert trainer.keeper_impl.used() == 0
    _train(trainer, 1)
    trainer.broadcast_to_vllm()
    assert trainer.keeper_impl.used() == 1 and trainer.groups_formed == 2
    assert trainer._model_update_group.members == trainer.engines
    assert trainer.order[-3:] == [("kept", 2), ("paused", 1), "broadcast"]
    assert [e.asked_pause for e in trainer.engines] == [2, 2]  # every engine asked at every sync
    ours = _trainer_state(trainer)
    assert all(torch.equal(trainer.engines[1].weights[n], ours[n]) for n in ours)


def test_no_group_is_formed_again_with_cuda_ipc(monkeypatch):
    """CUDA IPC (colocated nccl, sync) has no group: after a restart the sync sends the handles as upstream does."""
    trainer = make_trainer(monkeypatch, cuda_ipc=True)
    trainer.keeper_impl.hello(0, 200, reconstructed=True)
    trainer.broadcast_to_vllm()
    assert trainer.groups_formed == 1 and trainer.order[-2:] == [("kept", 1), "broadcast"]


def test_a_death_during_the_broadcast_stops_the_run_naming_why(monkeypatch):
    """Engine 0 dies in the middle of the broadcast (Ray restarts it: the keeper hears its hello): the sync fails
    with our words, not only Ray's; a broadcast that fails with no restart keeps its own error."""
    trainer = make_trainer(monkeypatch)
    trainer.die_during_broadcast = 0
    with pytest.raises(RuntimeError, match="a vLLM engine died during the weight sync to version 1 over") as caught:
        trainer.broadcast_to_vllm()
    assert "--train.auto_resume N" in str(caught.value) and "update_weight" in str(caught.value.__cause__)

    trainer = make_trainer(monkeypatch)
    trainer.engines[0].dead = True  # dead, and no restart began: not ours to name
    with pytest.raises(RuntimeError, match="^update_weight: the actor died"):
        trainer.broadcast_to_vllm()


@pytest.fixture
def ended_rank(monkeypatch):
    """os._exit of the watcher that ends rank 0, recorded instead: (the exit codes, an event set at the first)."""
    exits, released = [], threading.Event()

    def exit_(code):
        exits.append(code)
        released.set()

    monkeypatch.setattr(replacement_sync.os, "_exit", exit_)
    return exits, released


def test_a_broadcast_left_waiting_by_a_dead_member_ends_the_rank_after_the_grace(monkeypatch, capsys, ended_rank):
    """The broadcast never returns (NCCL reports no dead peer inside a node) and a restart began during it: rank 0
    ends its process its grace after it saw the restart (--vllm.watchdog_s here, shorter than its own), printing
    why; without a restart it waits."""
    exits, released = ended_rank
    trainer = make_trainer(monkeypatch, watchdog_s=0.2)

    def waits(self):
        self.keeper_impl.hello(1, 301, reconstructed=True)
        assert released.wait(timeout=30), "the rank was not ended"
        threading.Event().wait(10 * replacement_sync.RESTART_POLL_S)  # a watcher that went on would fire again here

    monkeypatch.setattr(upstream_actor.ActorPPOTrainer, "broadcast_to_vllm", waits)
    trainer.broadcast_to_vllm()
    assert exits == [1]
    assert "a vLLM engine died during the weight sync to version 1" in capsys.readouterr().err

    exits.clear()
    trainer = make_trainer(monkeypatch, watchdog_s=0.05)
    watched = []

    def slow(self):  # a long broadcast with every member alive: the watcher looks several times, ends nothing
        watched.append(True)
        threading.Event().wait(0.3)

    monkeypatch.setattr(upstream_actor.ActorPPOTrainer, "broadcast_to_vllm", slow)
    trainer.broadcast_to_vllm()
    assert watched and exits == []


def test_the_grace_after_a_death_in_the_broadcast_is_its_own_not_the_watchdogs(monkeypatch, capsys, ended_rank):
    """With --vllm.watchdog_s at its 600 s default, a broadcast left waiting by a dead member ends the rank after
    SYNC_DEATH_GRACE_S (made 0.2 s here), not after the watchdog's bound."""
    exits, released = ended_rank
    monkeypatch.setattr(replacement_sync, "SYNC_DEATH_GRACE_S", 0.2)
    trainer = make_trainer(monkeypatch, watchdog_s=600.0)

    def waits(self):
        self.keeper_impl.hello(1, 301, reconstructed=True)
        assert released.wait(timeout=30), "the rank was not ended within 30 s: the grace was the watchdog's 600 s"

    monkeypatch.setattr(upstream_actor.ActorPPOTrainer, "broadcast_to_vllm", waits)
    trainer.broadcast_to_vllm()
    assert exits == [1] and "died during the weight sync" in capsys.readouterr().err


def test_the_workers_leave_their_old_group_before_joining_the_new_one(monkeypatch):
    """Our worker extension aborts the group it is in before upstream's join (which overwrites it)."""
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap as Upstream

    from openrlhf_ess.trainer.ray.vllm_worker_wrap import WorkerWrap

    events = []
    monkeypatch.setattr(Upstream, "init_process_group", lambda self, *a, **k: events.append(("join", a)))
    worker = object.__new__(WorkerWrap)
    worker.init_process_group("127.0.0.1", 1234, 1, 3, "openrlhf")  # the first join: nothing to leave
    worker._model_update_group = SimpleNamespace(destroy=lambda: events.append("abort"))
    worker.init_process_group("127.0.0.1", 5678, 1, 3, "openrlhf")
    assert events == [
        ("join", ("127.0.0.1", 1234, 1, 3, "openrlhf")),
        "abort",
        ("join", ("127.0.0.1", 5678, 1, 3, "openrlhf")),
    ]


def test_the_worker_reports_the_bytes_it_received_through_the_group():
    """The probe's engine side: a float32 tensor received through the group (here the stand-in writes a known
    pattern into it), digested as sha256 of its bytes, computed here with hashlib over numpy's bytes."""
    import hashlib

    import numpy as np

    from openrlhf_ess.trainer.ray.vllm_worker_wrap import WorkerWrap

    sent = np.linspace(-1.0, 1.0, 64, dtype=np.float32)

    class Group:
        def broadcast(self, tensor, src, stream=None):
            tensor.copy_(torch.from_numpy(sent))

    worker = object.__new__(WorkerWrap)
    worker._model_update_group = Group()
    assert worker.probe_sync_group(64) == hashlib.sha256(sent.tobytes()).hexdigest()


def test_the_start_up_probe_forms_the_group_again_and_names_a_worker_that_got_other_bytes(monkeypatch):
    trainer = make_trainer(monkeypatch)
    first = trainer._model_update_group
    line = trainer.weight_sync.startup_regroup_probe()
    assert first.destroyed and trainer.groups_formed == 2
    assert line.startswith("replacement: the weight sync group formed a second time with 2 engine(s)"), line
    sent = trainer._model_update_group.sent[-1]
    assert sent.dtype == torch.float32 and sent.numel() == replacement_sync.REGROUP_PROBE_VALUES

    trainer.engines[1].flip_probe_bit = True
    with pytest.raises(
        RuntimeError, match=r"delivered other bytes than rank 0 sent to engine worker\(s\) \[\(1, 0\)\]"
    ):
        trainer.weight_sync.startup_regroup_probe()


@pytest.mark.parametrize(
    "vllm, train, cuda, due",
    [
        ({}, {}, True, True),
        ({"sync_backend": "gloo"}, {}, True, True),
        ({"max_restarts": 0}, {}, True, False),
        ({"sync_backend": "reload"}, {}, True, False),  # no group to form
        ({}, {"colocate_all": True}, True, False),  # CUDA IPC: no group
        ({}, {"colocate_all": True, "async_enable": True}, True, True),  # async colocated: upstream's group
        ({}, {}, False, False),  # no GPU: no NCCL
    ],
)
def test_the_start_up_probe_runs_where_a_replacement_would_form_a_group(monkeypatch, vllm, train, cuda, due):
    from openrlhf_ess import config
    from openrlhf_ess.checks.selfcheck import regroup_probe_due

    monkeypatch.setattr(config, "on_cuda", lambda args: cuda)
    args = types.SimpleNamespace(
        vllm=types.SimpleNamespace(**{"max_restarts": 1, "num_engines": 2, "sync_backend": "nccl", **vllm}),
        train=types.SimpleNamespace(**{"colocate_all": False, "async_enable": False, **train}),
    )
    assert regroup_probe_due(args) is due


def test_pre_flight_takes_nccl_and_refuses_a_ray_collective_group():
    from openrlhf_ess.config.validation import _validate_replacement
    from openrlhf_ess.errors import ConfigError

    def args(**vllm):
        base = dict(max_restarts=1, num_engines=1, sync_backend="nccl", sync_check_tol=0.05, enable_sleep=False)
        return types.SimpleNamespace(
            vllm=types.SimpleNamespace(**{**base, **vllm}), algo=types.SimpleNamespace(prox_mode="recompute")
        )

    _validate_replacement(args())
    _validate_replacement(args(sync_backend="gloo"))
    with pytest.raises(ConfigError, match=r"Drop --vllm.sync_with_ray .*, or --vllm.max_restarts 0"):
        _validate_replacement(args(sync_with_ray=True))


def test_rank_0s_host_holds_the_kept_set_beside_the_broadcast():
    """Pre-flight's host-memory needs with NCCL and replacement: 2 M + 3 messages on rank 0 (the set kept, and the
    next sync's set put before the keeper lets it go), and a restarted engine's workers staging it as a reload does:
    TP·(M + 2m) + 2m; none of it without replacement."""
    from openrlhf_ess.checks.resources import host_memory_needs
    from openrlhf_ess.trainer.ray.vllm_worker_wrap import RELOAD_MESSAGE_BYTES

    model = 10 << 30
    m = RELOAD_MESSAGE_BYTES

    def needs(n):
        args = types.SimpleNamespace(
            vllm=types.SimpleNamespace(sync_backend="nccl", num_engines=2, tensor_parallel_size=2, max_restarts=n),
            algo=types.SimpleNamespace(prox_mode="recompute"),
        )
        return host_memory_needs(args, model)

    assert needs(0) == {}
    assert needs(1) == {
        "actor rank 0 (--vllm.max_restarts: the weights kept for a restarted engine)": 2 * model + 3 * m,
        "a restarted vLLM engine with its 2 worker(s) (--vllm.max_restarts)": 2 * (model + 2 * m) + 2 * m,
    }
