"""What the run asks Ray for, per role, checked against the cluster before upstream's ``train()`` places anything.

Upstream's ``train()`` (openrlhf/cli/train_ppo_ray.py, 0.11.2) reserves devices role by role and waits for each
reservation with ``ray.get(pg.ready())``. A request the cluster can never satisfy (e.g. the reference model left
at upstream's default of 8 GPUs per node) therefore waits forever with nothing on the console. This module
mirrors upstream's placement, role by role (:func:`requests`), so the CLI can compare it with the cluster's
totals (:func:`check`) and fail at once with the numbers and the flags to change; :class:`PlacementWatchdog`
says what a placement still waits for after :data:`PLACEMENT_WAIT_WARN_S` seconds (resources held by other jobs).

Upstream's rules, mirrored here:

- a model group of N = nodes x GPUs-per-node ranks takes N GPU slots and N CPU slots: a placement group of N
  bundles ``{"GPU": 1, "CPU": 1}`` (``RayActorGroup`` when GPUs per node > 1), or N actors with ``num_gpus=1,
  num_cpus=1`` (one GPU per node);
- the vLLM engines: one placement group of engines x tensor-parallel bundles;
- ``--train.colocate_actor_ref`` / ``--train.colocate_all``: the reference model (and with ``colocate_all`` the
  engines when training is synchronous, the critic and the reward model) live in the policy's placement group;
  ``--train.colocate_critic_reward``: the reward model lives in the critic's;
- the controllers (``PPOTrainer``, and in async mode its generator and trainer actors) hold nothing but need one
  free CPU slot to start (Ray's default actor); the dedicated pi_prox model (``--algo.prox_mode dedicated``)
  holds ``--algo.prox_dedicated_num_gpus`` GPUs and one CPU, created after the controllers.

Placement groups use Ray's PACK strategy, which spreads bundles over nodes when one node is too small, so the
totals decide; only a single actor asking for more than one GPU (the dedicated model) needs one node that big.
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from openrlhf_ess import config

# Seconds a placement group may stay pending before the watchdog says what it waits for (the run goes on).
PLACEMENT_WAIT_WARN_S = 60.0
# How often the watchdog reads Ray's placement group table.
PLACEMENT_POLL_S = 5.0
# Upstream's default GPUs per node for every model group (an 8-GPU node).
UPSTREAM_GPUS_PER_NODE = 8
# CPU slots the controllers need free to start (Ray's default actor: 0 held, 1 to be placed).
CONTROLLER_CPU = 1


class ResourceError(config.ConfigError):
    """The run asks for more than the Ray cluster has: its placement could never happen."""


@dataclass
class Request:
    """One role's reservation: the GPU and CPU slots it holds for the whole run."""

    role: str
    gpus: float
    cpus: float
    flags: str  # the flags that set it, with their values
    change: str  # the flags to change to ask for less
    bundles: int = 0  # size of the placement group it creates (0: plain actors, or shares another's)
    shared_with: Optional[str] = None  # the role whose placement group it lives in (takes nothing itself)
    single_actor_gpus: float = 0.0  # GPUs one actor of it needs on one node (only without a placement group)
    at_upstream_default: bool = False  # its GPUs per node were left at upstream's default


def _num(value: float) -> str:
    return f"{value:g}"


def _group(role: str, prefix: str, nodes: int, per_node: int, change: str) -> Request:
    n = nodes * per_node
    default = per_node == UPSTREAM_GPUS_PER_NODE
    flags = f"--{prefix}.num_nodes {nodes} x --{prefix}.num_gpus_per_node {per_node}"
    if default:
        flags += " (upstream's default, for an 8-GPU node)"
    return Request(
        role,
        gpus=n,
        cpus=n,
        flags=flags,
        change=change,
        bundles=n if per_node > 1 else 0,
        at_upstream_default=default,
    )


def _shared(role: str, prefix: str, nodes: int, per_node: int, host: str, flag: str) -> Request:
    return Request(
        role,
        gpus=0,
        cpus=0,
        flags=f"--{prefix}.num_nodes {nodes} x --{prefix}.num_gpus_per_node {per_node}, in the {host}'s "
        f"placement group ({flag})",
        change="",
        shared_with=host,
    )


def requests(args: types.SimpleNamespace) -> List[Request]:
    """Every role's reservation, in the order upstream's ``train()`` makes them (see the module docstring)."""
    train = args.train
    out: List[Request] = []
    policy = "policy (actor) model"
    colocate_policy = train.colocate_actor_ref or train.colocate_all
    engines = args.vllm.num_engines or 0
    if engines > 0:
        n = engines * args.vllm.tensor_parallel_size
        flags = f"--vllm.num_engines {engines} x --vllm.tensor_parallel_size {args.vllm.tensor_parallel_size}"
        if train.colocate_all and not train.async_enable:
            out.append(
                Request(
                    "vLLM engines",
                    0,
                    0,
                    flags + f", in the {policy}'s placement group (--train.colocate_all)",
                    "",
                    shared_with=policy,
                )
            )
        else:
            out.append(
                Request(
                    "vLLM engines",
                    gpus=n,
                    cpus=n,
                    flags=flags,
                    change="--vllm.num_engines / --vllm.tensor_parallel_size, or --train.colocate_all (synchronous "
                    "training) to share the policy's GPUs",
                    bundles=n,
                )
            )
    actor = _group(
        policy,
        "actor",
        args.actor.num_nodes,
        args.actor.num_gpus_per_node,
        "--actor.num_nodes / --actor.num_gpus_per_node",
    )
    if colocate_policy:
        actor.bundles = actor.gpus  # the shared placement group is created even for one GPU per node
    out.insert(0, actor)  # upstream creates the colocated group first; the totals do not depend on order
    if args.algo.kl.init_coef > 0:
        if colocate_policy:
            flag = "--train.colocate_all" if train.colocate_all else "--train.colocate_actor_ref"
            out.append(_shared("reference model", "ref", args.ref.num_nodes, args.ref.num_gpus_per_node, policy, flag))
        else:
            out.append(
                _group(
                    "reference model",
                    "ref",
                    args.ref.num_nodes,
                    args.ref.num_gpus_per_node,
                    "--ref.num_gpus_per_node (and --ref.num_nodes), or --train.colocate_actor_ref to share the "
                    "policy's GPUs, or --algo.kl.init_coef 0 (no reference model)",
                )
            )
    critic_host = None  # the placement group the critic and reward model go to
    if train.colocate_all:
        critic_host = (policy, "--train.colocate_all")
    if args.critic.model_name_or_path:
        if train.colocate_critic_reward:
            critic_host = None  # upstream creates a new group for the critic, which the reward model then shares
        if critic_host:
            out.append(_shared("critic", "critic", args.critic.num_nodes, args.critic.num_gpus_per_node, *critic_host))
        else:
            critic = _group(
                "critic",
                "critic",
                args.critic.num_nodes,
                args.critic.num_gpus_per_node,
                "--critic.num_gpus_per_node (and --critic.num_nodes), or --train.colocate_critic_reward to share "
                "the reward model's GPUs, or an estimator without a critic (--algo.advantage.estimator reinforce, "
                "reinforce_baseline, group_norm, ...)",
            )
            if train.colocate_critic_reward:
                critic.bundles = critic.gpus
                critic_host = ("critic", "--train.colocate_critic_reward")
            out.append(critic)
    if not args.reward.remote_url:
        if critic_host:
            out.append(
                _shared("reward model", "reward", args.reward.num_nodes, args.reward.num_gpus_per_node, *critic_host)
            )
        else:
            out.append(
                _group(
                    "reward model",
                    "reward",
                    args.reward.num_nodes,
                    args.reward.num_gpus_per_node,
                    "--reward.num_gpus_per_node (and --reward.num_nodes), or a rule-based reward "
                    "(--reward.remote_url)",
                )
            )
    dedicated = config.dedicated_gpus(args)
    if dedicated:
        gpus = args.algo.prox_dedicated_num_gpus
        out.append(
            Request(
                "dedicated pi_prox model",
                gpus=gpus,
                cpus=1,
                flags=f"--algo.prox_mode dedicated, --algo.prox_dedicated_num_gpus {_num(gpus)}",
                change="--algo.prox_dedicated_num_gpus, or --algo.prox_mode interrupt (no extra model)",
                single_actor_gpus=gpus,
            )
        )
    return out


def totals(reqs: List[Request]) -> Dict[str, float]:
    """GPU and CPU slots the run needs at its peak: what the roles hold, plus one free CPU for each controller
    to start (controllers start after the model groups; the dedicated model's CPU comes after them)."""
    gpus = sum(r.gpus for r in reqs)
    models_cpu = sum(r.cpus for r in reqs if r.role != "dedicated pi_prox model")
    dedicated_cpu = sum(r.cpus for r in reqs if r.role == "dedicated pi_prox model")
    return {"GPU": gpus, "CPU": models_cpu + max(CONTROLLER_CPU, dedicated_cpu)}


def _role_line(r: Request) -> str:
    if r.shared_with:
        return f"{r.role}: none of its own ({r.flags})"
    return f"{r.role}: {_num(r.gpus)} GPU + {_num(r.cpus)} CPU ({r.flags})"


def check(
    args: types.SimpleNamespace,
    cluster: Dict[str, float],
    nodes: Optional[List[Dict[str, float]]] = None,
    where: str = "",
) -> None:
    """Raise :class:`ResourceError` if the run's reservations can never be placed on ``cluster``.

    ``cluster``: the cluster's total resources (``ray.cluster_resources()``); ``nodes``: each alive node's
    resources (for a single actor that needs several GPUs on one node); ``where``: a sentence on where the
    cluster's numbers come from (e.g. what the CLI declared on a machine without CUDA).
    """
    reqs = requests(args)
    need = totals(reqs)
    have = {"GPU": float(cluster.get("GPU", 0)), "CPU": float(cluster.get("CPU", 0))}
    short = [k for k in ("GPU", "CPU") if need[k] > have[k] + 1e-9]
    big = [r for r in reqs if r.single_actor_gpus > 1]
    too_big = []
    if nodes is not None:
        largest = max((float(n.get("GPU", 0)) for n in nodes), default=0.0)
        too_big = [r for r in big if r.single_actor_gpus > largest + 1e-9]
    if not short and not too_big:
        return
    lines = "; ".join(_role_line(r) for r in reqs)
    held_cpu = need["CPU"] - max(CONTROLLER_CPU, sum(r.cpus for r in reqs if r.role == "dedicated pi_prox model"))
    parts = []
    if short:
        parts.append(
            f"the run needs {_num(need['GPU'])} GPU and {_num(need['CPU'])} CPU slots ({_num(held_cpu)} CPU held "
            f"by the model groups, 1 GPU + 1 CPU per rank, plus {CONTROLLER_CPU} free to start the controllers), "
            f"the Ray cluster has {_num(have['GPU'])} GPU and {_num(have['CPU'])} CPU in total"
        )
    for r in too_big:
        parts.append(
            f"the {r.role} needs {_num(r.single_actor_gpus)} GPUs on one node, the largest node has {_num(largest)}"
        )
    defaults = [r for r in reqs if r.at_upstream_default and not r.shared_with]
    suspects = (
        defaults
        or sorted((r for r in reqs if r.change), key=lambda r: r.gpus if "GPU" in short else r.cpus, reverse=True)[:2]
    )
    suspects = suspects + [r for r in too_big if r not in suspects]
    fix = "; ".join(f"for the {r.role}, {r.change}" for r in suspects)
    hint = ""
    if defaults:
        names = ", ".join(f"the {r.role}" for r in defaults)
        hint = f" Upstream's default of {UPSTREAM_GPUS_PER_NODE} GPUs per node is still set for {names}."
    raise ResourceError(
        f"the requested devices can never be placed, so the run would wait forever: {'; '.join(parts)}. "
        f"Per role: {lines}.{hint} Change: {fix}; or give Ray more.{(' ' + where) if where else ''}"
    )


# ---------------------------------------------------------------------------------------- host memory

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def model_bytes(path: str) -> int:
    """Bytes of the weight files in a local model folder (0 for a hub id or a folder without weights)."""
    import os

    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(WEIGHT_FILES))


def host_memory_needs(args: types.SimpleNamespace, model: int) -> Dict[str, int]:
    """Host bytes the weight transfer of ours needs at its peak, per process that holds it (docs/gpu_path.md), with
    m = min(M, the reload message bound, 1 GiB):

    - ``--vllm.sync_backend reload``: actor rank 0 builds one message at a time (its tensors, then its bytes:
      about 3·m) and Ray keeps a copy of it per engine until each has taken it (E·m); each engine's TP workers
      each stage the whole model as it arrives (M) plus a message and its parsed tensors (2·m), and the engine's
      front end holds the message in transit (2·m): TP·(M + 2·m) + 2·m on the engine's node;
    - ``--train.stale_k K``: the weights of versions v − K … v as host copies (K + 1)·M on rank 0, or under ZeRO-3 a
      partition per rank, (K + 1)·M·(ranks per node / ranks) per node (``trainer/stale_lag.py``);
    - ``--algo.prox_mode dedicated``: rank 0 keeps the sync's messages for the scorer (M; without ``reload``, its
      CPU copy and the messages: 2·M), and the scorer's received messages and parsed copy (2·M);
    - ``--vllm.max_restarts`` > 0 (engine replacement, ``trainer/ray/engine_keeper.py``): rank 0 puts each message
      in Ray's object store once, for every engine and a restarted one, and the set stays there until the next sync
      replaces it. The next sync puts its whole set before the keeper lets the last one go (a restart meanwhile
      still needs one), so both are there at its peak: 2·M + 3·m on rank 0's node instead of (3 + E)·m. With the
      NCCL/gloo broadcast the same sets are kept beside it (2·M + 3·m on rank 0's node), and a restarted engine
      loads one as a reload does (TP·(M + 2·m) + 2·m on its node).
    """
    from openrlhf_ess.trainer.ray.vllm_worker_wrap import RELOAD_MESSAGE_BYTES

    needs: Dict[str, int] = {}
    message = min(model, RELOAD_MESSAGE_BYTES)
    reload = args.vllm.sync_backend == config.RELOAD_BACKEND and args.vllm.num_engines
    kept = getattr(args.vllm, "max_restarts", 0) > 0 and args.vllm.num_engines  # the set kept for a restart
    tp = max(1, int(getattr(args.vllm, "tensor_parallel_size", 1) or 1))
    engine_load = tp * (model + 2 * message) + 2 * message  # an engine's workers staging a whole set
    if reload:
        engines = int(args.vllm.num_engines)
        needs["actor rank 0 (--vllm.sync_backend reload)"] = (
            2 * model + 3 * message if kept else (3 + engines) * message
        )
        needs[f"each vLLM engine with its {tp} worker(s) (--vllm.sync_backend reload)"] = engine_load
    elif kept:  # NCCL/gloo broadcast
        needs["actor rank 0 (--vllm.max_restarts: the weights kept for a restarted engine)"] = 2 * model + 3 * message
        needs[f"a restarted vLLM engine with its {tp} worker(s) (--vllm.max_restarts)"] = engine_load
    if args.algo.prox_mode == "dedicated":  # with reload, rank 0 keeps the very messages the engines loaded
        key = "actor rank 0 (--vllm.sync_backend reload)"
        if reload:
            needs[key] += model
        else:
            needs["actor rank 0 (the dedicated model's weights)"] = 2 * model
        needs["the dedicated pi_prox model (--algo.prox_mode dedicated)"] = 2 * model
    k = config.stale_k(args)
    if k > 0:  # trainer/stale_lag.py: versions v - K ... v, on rank 0 or (ZeRO-3) a partition on every rank
        copies = k + 1
        if args.ds.zero_stage == 3:
            ranks = max(1, int(args.actor.num_nodes) * int(args.actor.num_gpus_per_node))
            per_node = min(ranks, int(args.actor.num_gpus_per_node))
            needs[f"each actor node's {per_node} rank(s) (--train.stale_k {k}: {copies} copies, a partition each)"] = (
                copies * model * per_node // ranks
            )
        else:
            needs[f"actor rank 0 (--train.stale_k {k}: {copies} host copies of the weights)"] = copies * model
    return needs


def check_host_memory(args: types.SimpleNamespace, nodes: List[Dict[str, float]], model: int) -> None:
    """Raise :class:`ResourceError` when a process's stated host need exceeds the memory every node offers Ray
    (its ``memory`` resource): that process could never run there without the OS killing it mid-sync."""
    largest = max((float(n.get("memory", 0)) for n in nodes), default=0.0)
    if not model or largest <= 0:
        return
    over = {who: need for who, need in host_memory_needs(args, model).items() if need > largest}
    if not over:
        return
    gib = float(1 << 30)
    items = "; ".join(f"{who}: {need / gib:,.1f} GiB" for who, need in over.items())
    raise ResourceError(
        f"host memory: the model's weights are {model / gib:,.1f} GiB, and with these flags {items} at the peak of "
        f"a weight sync, more than the largest node offers Ray ({largest / gib:,.1f} GiB). Use --vllm.sync_backend "
        "nccl (GPU clusters: per-parameter broadcast, no host copy), a smaller --vllm.tensor_parallel_size, or "
        "--algo.prox_mode interrupt instead of dedicated."
    )


# ---------------------------------------------------------------------------------- placement watchdog


def _bundle_text(bundle: Dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(bundle.items())) + "}"


def pending_message(
    pending: List[dict],
    waited_s: float,
    cluster: Dict[str, float],
    available: Dict[str, float],
    reqs: List[Request],
) -> str:
    """What the run waits for: the pending placement groups (entries of ``ray.util.placement_group_table()``),
    the role each one's size matches, and the cluster's total and free GPU/CPU slots."""
    groups = []
    for pg in pending:
        bundles = list(pg.get("bundles", {}).values())
        sums: Dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                sums[k] = sums.get(k, 0) + v
        kinds = sorted({_bundle_text(b) for b in bundles})
        roles = [r.role for r in reqs if r.bundles == len(bundles) and not r.shared_with]
        what = f"{len(bundles)} bundle{'s' if len(bundles) != 1 else ''} of {' / '.join(kinds) or '{}'}"
        what += " (" + ", ".join(f"{_num(sums[k])} {k}" for k in sorted(sums)) + " in all"
        if roles:
            what += "; the size of the " + " or the ".join(roles) + "'s request"
        groups.append(what + ")")

    def res(d: Dict[str, float]) -> str:
        return f"{_num(float(d.get('GPU', 0)))} GPU and {_num(float(d.get('CPU', 0)))} CPU"

    n = len(pending)
    return (
        f"still waiting after {waited_s:.0f} s for Ray to place {n} placement group{'s' if n != 1 else ''}: "
        f"{'; '.join(groups)}. The cluster has {res(cluster)} in total, {res(available)} free now. Placement "
        "waits until enough is free (other jobs on a shared cluster may hold it), and forever if that never "
        "happens: then stop the run (Ctrl-C) and lower the request (the --*.num_gpus_per_node, --vllm.num_engines "
        "flags), or add resources. The run goes on waiting."
    )


class PlacementWatchdog:
    """A daemon thread that prints, once per placement group, what the run has waited for longer than
    ``bound`` seconds. It never stops the run. The Ray calls are injectable for tests."""

    def __init__(
        self,
        reqs: List[Request],
        bound: float = PLACEMENT_WAIT_WARN_S,
        poll: float = PLACEMENT_POLL_S,
        out: Callable[[str], None] = lambda msg: print(f"[openrlhf-ess] {msg}", flush=True),
        table: Optional[Callable[[], dict]] = None,
        cluster: Optional[Callable[[], dict]] = None,
        available: Optional[Callable[[], dict]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        import ray

        self.reqs, self.bound, self.poll, self.out, self.clock = reqs, bound, poll, out, clock
        self.table = table or ray.util.placement_group_table
        self.cluster = cluster or ray.cluster_resources
        self.available = available or ray.available_resources
        self._first_seen: Dict[str, float] = {}
        self._reported: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="openrlhf-ess-placement-watchdog", daemon=True)

    def start(self) -> "PlacementWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.tick()
            except Exception:  # Ray shutting down, GCS unreachable: the watchdog only ever informs
                pass

    def tick(self) -> Optional[str]:
        """One look at Ray's placement groups; prints and returns the message if one is due."""
        now = self.clock()
        pending = {
            pg_id: info for pg_id, info in self.table().items() if info.get("state") in ("PENDING", "RESCHEDULING")
        }
        for pg_id in pending:
            self._first_seen.setdefault(pg_id, now)
        due = [
            pg_id for pg_id in pending if pg_id not in self._reported and now - self._first_seen[pg_id] >= self.bound
        ]
        if not due:
            return None
        self._reported.update(due)
        waited = max(now - self._first_seen[pg_id] for pg_id in due)
        msg = pending_message([pending[p] for p in due], waited, self.cluster(), self.available(), self.reqs)
        self.out(msg)
        return msg
