"""Rank 0's rendezvous port is drawn outside the kernel's ephemeral range (trainer/ray/rendezvous.py).

A CI run once failed on EADDRINUSE: upstream's bind(("", 0)) port (44813, inside 32768-60999) was taken by another
socket before DeepSpeed's TCPStore bound it. Expected values here are written from the ranges by hand.
"""

from __future__ import annotations

import random
import socket
from types import SimpleNamespace

import pytest

from openrlhf_ess.trainer.ray import rendezvous


def test_candidate_ranges_cut_the_ephemeral_and_ray_worker_ranges():
    assert rendezvous.candidate_ranges((32768, 60999)) == [(20000, 32767), (61000, 65535)]
    assert rendezvous.candidate_ranges((1024, 65535)) == []
    assert rendezvous.candidate_ranges((15000, 25000), avoid=[(10002, 19999)]) == [(25001, 65535)]
    assert rendezvous.candidate_ranges((40000, 50000), avoid=[(30000, 35000)]) == [
        (20000, 29999),
        (35001, 39999),
        (50001, 65535),
    ]


def test_ephemeral_range_reads_the_kernel_file_or_falls_back(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t45000\n")
    assert rendezvous.ephemeral_range(str(f)) == (40000, 45000)
    assert rendezvous.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_ports_are_never_in_the_ephemeral_or_ray_worker_range():
    rng = random.Random(0)
    ports = {rendezvous.rendezvous_port(rng, ephemeral=(32768, 60999)) for _ in range(200)}
    assert len(ports) > 150  # drawn at random: two runs starting at once rarely collide
    for port in ports:
        assert 20000 <= port <= 32767 or 61000 <= port <= 65535, port


def test_a_taken_port_is_skipped():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]

        class FirstTaken(random.Random):
            calls = 0

            def randint(self, a, b):
                self.calls += 1
                return taken if self.calls == 1 else super().randint(a, b)

        rng = FirstTaken(1)
        port = rendezvous.rendezvous_port(rng, ephemeral=(1, 1))  # every port >= 20000 a candidate
        assert rng.calls >= 2 and port != taken


def test_no_candidate_falls_back_to_an_os_port():
    port = rendezvous.rendezvous_port(random.Random(0), ephemeral=(1024, 65535))
    assert 1024 <= port <= 65535


@pytest.mark.parametrize("key", ["ReferenceModelActor", "CriticModelActor", "RewardModelActor"])
def test_every_role_the_cli_places_draws_its_port_here(key, monkeypatch):
    from openrlhf_ess import upstream
    from openrlhf_ess.trainer.ray import ppo_actor, ref_actor

    monkeypatch.setattr(rendezvous, "ephemeral_range", lambda path=None: (20000, 60999))  # leaves 61000-65535
    cls = upstream.ray_actor_class(rendezvous.role_classes()[key])
    for plain in (cls, ppo_actor.PolicyModelActorImpl, ref_actor.ReferenceModelActorImpl):
        assert 61000 <= plain._get_free_port() <= 65535, plain
    base = {
        "ReferenceModelActor": upstream.reference_actor_class(),
        "CriticModelActor": upstream.critic_actor_class(),
        "RewardModelActor": upstream.reward_actor_class(),
    }[key]
    assert issubclass(cls, base) and key in cls.__name__  # the CLI's failure messages name roles by class name


def test_the_weight_sync_group_draws_its_port_here(monkeypatch):
    """Upstream's ``_init_vllm_sync_group`` runs as is (engines told their ranks, rank 0's group on the same port),
    with the port it used to take from ``bind(("", 0))`` drawn outside the ephemeral range."""
    import ray
    from openrlhf.trainer.ray import ppo_actor as upstream_actor

    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    monkeypatch.setattr(rendezvous, "ephemeral_range", lambda path=None: (20000, 60999))  # leaves 61000-65535
    joined, formed = [], []

    class Engine:
        def __init__(self):
            self.init_process_group = SimpleNamespace(remote=lambda *a, **k: joined.append((a, k)))

    monkeypatch.setattr(upstream_actor, "stateless_init_process_group", lambda *a: formed.append(a) or "group")
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    monkeypatch.setattr(ray._private.services, "get_node_ip_address", lambda: "10.0.0.1")
    monkeypatch.setattr(upstream_actor.torch.cuda, "current_device", lambda: 0)
    vllm = SimpleNamespace(num_engines=2, tensor_parallel_size=2, sync_with_ray=False)
    trainer = SimpleNamespace(strategy=SimpleNamespace(args=SimpleNamespace(vllm=vllm)), vllm_engines=[Engine()] * 2)
    ActorPPOTrainer._init_vllm_sync_group(trainer, "nccl")

    ((addr, port, rank, world, device),) = formed
    assert (addr, rank, world, device) == ("10.0.0.1", 0, 5, 0) and trainer._model_update_group == "group"
    assert 61000 <= port <= 65535, port  # upstream's own draw lands in 32768-60999 on this kernel's default range
    assert [a for a, _ in joined] == [("10.0.0.1", port, 1, 5, "openrlhf"), ("10.0.0.1", port, 3, 5, "openrlhf")]
    assert [k for _, k in joined] == [{"backend": "nccl", "use_ray": False}] * 2
