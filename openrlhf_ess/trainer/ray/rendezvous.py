"""The port of torch.distributed's rendezvous, for every trainer role (policy, reference, critic, reward).

Upstream's ``BaseDistributedActor`` (``openrlhf/trainer/ray/launcher.py``) gives rank 0 its ``MASTER_PORT`` with
``bind(("", 0))``: a port from the kernel's *ephemeral* range, released at once and bound again by DeepSpeed's
``TCPStore`` only when the model loads, seconds later. In between, the kernel may hand that same port to any
outgoing TCP connection on the node as its local port (Ray's gRPC clients, a download, another job), and the
rendezvous fails with ``EADDRINUSE``. Measured: one CLI run in the ~60 of the test suite (the policy rank,
port 44813; ``ip_local_port_range`` 32768-60999). A port outside the ephemeral range is never handed out
implicitly; only an explicit ``bind`` can take it. So the roles draw rank 0's port at random from outside both
that range and Ray's worker-port range, and check it is free, as upstream does.

Every role's class is a thin subclass with :class:`RendezvousPort` first in its bases; the CLI substitutes them for
upstream's (``cli/train_ppo_ray.py::train``, ``upstream.run_train``). The weight-sync group of rank 0 and the
engines (upstream's ``_init_vllm_sync_group``) had the same ``bind(("", 0))`` and the same window, with the engines'
remote calls going out inside it, and is formed again at every engine replacement: it draws here too
(``ActorPPOTrainer._init_vllm_sync_group``, through ``upstream.vllm_sync_group_init_drawing``). Nothing else of
upstream's changes.
"""

from __future__ import annotations

import random
import socket
from typing import Iterable, List, Optional, Tuple

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
# Ray's default --min-worker-port / --max-worker-port: ports Ray's workers bind explicitly.
RAY_WORKER_PORTS = (10002, 19999)
LOWEST = 20000  # below: Ray's worker ports and the well-known services (GCS 6379, client server 10001, ...)
TRIES = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> Tuple[int, int]:
    """The kernel's ephemeral port range (``ip_local_port_range``); Linux's default where it cannot be read."""
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL


def candidate_ranges(ephemeral: Tuple[int, int], avoid: Iterable[Tuple[int, int]] = (RAY_WORKER_PORTS,)) -> List:
    """The inclusive port ranges in [``LOWEST``, 65535] outside ``ephemeral`` and every range in ``avoid``."""
    ranges = [(LOWEST, 65535)]
    for lo, hi in (ephemeral, *avoid):
        cut = []
        for a, b in ranges:
            if hi < a or lo > b:
                cut.append((a, b))
                continue
            if a < lo:
                cut.append((a, lo - 1))
            if b > hi:
                cut.append((hi + 1, b))
        ranges = cut
    return ranges


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def rendezvous_port(
    rng: Optional[random.Random] = None, ephemeral: Optional[Tuple[int, int]] = None, tries: int = TRIES
) -> int:
    """A free TCP port outside the ephemeral range and Ray's worker ports, drawn at random (two runs starting on one
    node at once rarely draw the same); upstream's ``bind(("", 0))`` where the node has no such port free (an
    ``ip_local_port_range`` that spans everything)."""
    rng = rng or random.SystemRandom()
    ranges = candidate_ranges(ephemeral or ephemeral_range())
    sizes = [b - a + 1 for a, b in ranges]
    for _ in range(tries if ranges else 0):
        a, b = rng.choices(ranges, weights=sizes)[0]
        port = rng.randint(a, b)
        if _free(port):
            return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class RendezvousPort:
    """Put first in a trainer role's bases: its rank 0 draws ``MASTER_PORT`` with :func:`rendezvous_port`."""

    @staticmethod
    def _get_free_port() -> int:
        return rendezvous_port()


def role_classes() -> dict:
    """Upstream's reference, critic and reward actors with :class:`RendezvousPort`, keyed as ``upstream.run_train``
    takes them (the policy's and the masked reference's own classes have it in their bases)."""
    import ray

    from openrlhf_ess import upstream

    bases = {
        "ReferenceModelActor": upstream.reference_actor_class(),
        "CriticModelActor": upstream.critic_actor_class(),
        "RewardModelActor": upstream.reward_actor_class(),
    }
    # Built here, not at import: this module is imported by every role before cpu_compat's patches matter, and
    # a class made at call time is pickled by value (its bases by reference), so Ray's workers need nothing more.
    return {
        key: ray.remote(num_gpus=1)(type(f"{key}Impl", (RendezvousPort, base), {"__module__": __name__}))
        for key, base in bases.items()
    }
