"""Start-up self-checks: the GPU-path contracts, proved on the user's own cluster before the first rollout.

Our CI has no GPU with vLLM, Ray and DeepSpeed on it. So every contract the product relies on that only real
hardware can break is checked where the user runs, in seconds, after the models are placed and loaded and
before the controller's ``fit()`` (the seam is on the driver: ``cli/train_ppo_ray.py::_FitCall``). A violation
stops the run with a message naming the contract, the observed values and the fix (``--selfcheck off`` skips
the checks; their time is logged). docs/gpu_path.md#start-up-self-checks lists them and what each catches.

- **Placement**: every rank of every trainer role (actor, reference, critic, reward model) reports its node, its
  device (the physical GPU's UUID on CUDA; Ray's logical GPU id on CPU) and ``torch.cuda.current_device()``.
  Two ranks of one role on one device, or two roles on one device that no ``--train.colocate_*`` flag put
  together, stop the run with the table. Catches every actor of a node landing on GPU 0.
- **Collectives**: every actor rank runs one all-reduce and one all-gather through ``openrlhf_ess/distributed.py``
  on the real process group and checks the values and that the tensors were on the collective device.
- **Engine canary**: before any sync (both hold the loaded model), within ``--vllm.sync_check_tol``: the engines'
  log-probs of a fixed 32-token canary against the trainer's own forward, and μ of 32 tokens that engine 0
  samples with the run's temperature / top-p / top-k against the trainer's log-probs of them (over the kept
  support with the sampling mask) (``weight_sync.py::startup_canary``).
- **Memory**: each actor rank's free device memory (``torch.cuda.mem_get_info`` plus what PyTorch's allocator
  holds unused), less a floor of the training step's activations at its longest micro-batch, against the extra
  peak the run's features state (docs/gpu_path.md's table, :func:`memory_needs`); a shortfall names the flag.
- **Engine contract** (with ``--algo.sampling_mask keep``): in each engine at its start
  (``trainer/engine_contract.py::check_kept_count_contract``).

The functions ``*_report`` / ``*_probe`` run inside the Ray actors (through Ray's ``__ray_call__``, which works
on upstream's actor classes untouched); everything else is pure and runs on the driver.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional, Sequence

ROLES = ("actor", "reference", "critic", "reward")  # upstream's RayActorGroup roles, as passed to the controller
MiB = 1 << 20


class SelfCheckError(RuntimeError):
    """A start-up self-check failed: the message names the contract, what was observed and the fix."""


# ---------------------------------------------------------------------------------------------- placement


def placement_report(_actor=None) -> dict:
    """In a trainer rank: where it runs. ``device`` identifies the physical device (GPU UUID on CUDA)."""
    import os
    import socket

    import ray
    import torch

    ctx = ray.get_runtime_context()
    ids = [str(i) for i in ctx.get_accelerator_ids().get("GPU", [])]
    report = {
        "node": ctx.get_node_id()[:8],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ray_gpu_ids": ids,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        report["current_device"] = f"cuda:{index}"
        report["device"] = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    else:  # CPU runs: Ray's logical GPU is the unit of placement
        report["current_device"] = "cpu"
        report["device"] = f"logical GPU {','.join(ids)}" if ids else None
    return report


def colocated_roles(args) -> List[frozenset]:
    """The sets of roles that the run's ``--train.colocate_*`` flags put on the same GPUs."""
    train = args.train
    if getattr(train, "colocate_all", False):
        return [frozenset(ROLES)]
    groups = []
    if getattr(train, "colocate_actor_ref", False):
        groups.append(frozenset({"actor", "reference"}))
    if getattr(train, "colocate_critic_reward", False):
        groups.append(frozenset({"critic", "reward"}))
    return groups


def shared_devices(reports: Dict[str, Sequence[dict]], colocated: Iterable[frozenset] = ()) -> List[str]:
    """The placement violations in ``reports`` (role -> one report per rank): one line per shared device."""
    colocated = list(colocated)
    by_device: Dict[tuple, List[tuple]] = {}
    for role, ranks in reports.items():
        for rank, report in enumerate(ranks):
            if report.get("device") is None:  # holds no GPU (e.g. a CPU-only helper): nothing to share
                continue
            by_device.setdefault((report["node"], report["device"]), []).append((role, rank, report))
    problems = []
    for (node, device), holders in sorted(by_device.items()):
        roles = [role for role, _, _ in holders]
        same_role = sorted({r for r in roles if roles.count(r) > 1})
        distinct = frozenset(roles)
        allowed = len(distinct) == 1 or any(distinct <= group for group in colocated)
        if same_role or not allowed:
            who = ", ".join(
                f"{role} rank {rank} (pid {rep['pid']}, {rep['current_device']}, "
                f"CUDA_VISIBLE_DEVICES={rep['cuda_visible_devices']!r})"
                for role, rank, rep in holders
            )
            why = (
                f"{len(holders)} ranks of {'/'.join(same_role)}"
                if same_role
                else f"roles {'/'.join(sorted(distinct))} without a --train.colocate_* flag for them"
            )
            problems.append(f"node {node}, {device}: {why}: {who}")
    return problems


def check_placement(reports: Dict[str, Sequence[dict]], args) -> str:
    problems = shared_devices(reports, colocated_roles(args))
    if problems:
        raise SelfCheckError(
            "start-up self-check failed (placement): ranks share a device that should be theirs alone:\n  "
            + "\n  ".join(problems)
            + "\nEvery rank of a node on one GPU means CUDA was initialised before Ray set CUDA_VISIBLE_DEVICES "
            "(a worker set-up hook or sitecustomize calling torch.cuda, or "
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES set). Fix that, or pass the --train.colocate_* flag that "
            "asks for sharing; --selfcheck off skips this."
        )
    ranks = sum(len(r) for r in reports.values())
    devices = len({(r["node"], r["device"]) for rs in reports.values() for r in rs if r.get("device")})
    return f"placement: {ranks} trainer ranks on {devices} devices"


# -------------------------------------------------------------------------------------------- collectives


def collective_probe(_actor=None) -> dict:
    """In every actor rank at once: one all-reduce and one all-gather through ``distributed.py``."""
    import torch
    import torch.distributed as dist

    from openrlhf_ess import distributed

    multi = distributed.is_multi_rank()  # one rank: the same calls, which then return the local values
    rank, world = (dist.get_rank(), dist.get_world_size()) if multi else (0, 1)
    maximum = distributed.all_reduce_max([float(rank), -float(rank)])
    gathered = distributed.all_gather_rows(torch.tensor([rank], dtype=torch.int64))
    return {
        "rank": rank,
        "world": world,
        "device": str(distributed.device()),
        "cuda": torch.cuda.is_available(),
        "max": maximum,
        "gathered": gathered.reshape(-1).tolist(),
    }


def check_collectives(results: Sequence[dict]) -> str:
    world = results[0]["world"] if results else 0
    problems = []
    for r in results:
        if r["world"] != world:
            problems.append(f"rank {r['rank']} sees world size {r['world']}, rank 0 sees {world}")
        if r["max"] != [float(world - 1), 0.0]:
            problems.append(f"rank {r['rank']}: all-reduce(max) gave {r['max']}, expected {[float(world - 1), 0.0]}")
        if r["gathered"] != list(range(world)):
            problems.append(f"rank {r['rank']}: all-gather gave {r['gathered']}, expected {list(range(world))}")
        if r.get("cuda") and not r["device"].startswith("cuda"):
            problems.append(f"rank {r['rank']}: collectives on {r['device']} although CUDA is available (NCCL)")
    if sorted(r["rank"] for r in results) != list(range(world)):
        problems.append(f"ranks answering {sorted(r['rank'] for r in results)}, expected 0..{world - 1}")
    if problems:
        raise SelfCheckError(
            "start-up self-check failed (collectives on the actor's process group):\n  "
            + "\n  ".join(problems)
            + "\nCheck the network between the nodes (NCCL_DEBUG=INFO shows NCCL's choice) and that every rank "
            "runs the same build; --selfcheck off skips this."
        )
    return f"collectives: all-reduce + all-gather on {world} actor rank(s), device {results[0]['device']}"


# ------------------------------------------------------------------------------------------------- memory


def memory_probe(actor) -> dict:
    """In an actor rank: the policy's full parameter bytes, its largest parameter, the world size, free memory."""
    import torch
    import torch.distributed as dist

    model = getattr(actor, "actor", None)  # upstream's PolicyModelActor: the Actor module around the DS engine
    total = largest = 0
    if model is not None:
        for p in model.parameters():
            n = getattr(p, "ds_numel", p.numel()) * p.element_size()  # ZeRO-3: the full size, not the partition
            total, largest = total + n, max(largest, n)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    report = {"model_bytes": total, "largest_param_bytes": largest, "world": world, "free": None, "total": None}
    config = getattr(getattr(getattr(model, "model", None), "module", getattr(model, "model", None)), "config", None)
    from openrlhf_ess.trainer.opob import norm_width

    report["hidden"] = norm_width(config) if config is not None else 0  # the norm pass's per-row temporaries
    if config is not None and getattr(config, "vocab_size", 0):  # the activation floors' shape (model_shape)
        dtype_bytes = next((p.element_size() for p in model.parameters()), 2)
        report["shape"] = model_shape(config, dtype_bytes)
    if torch.cuda.is_available():
        free, device_total = torch.cuda.mem_get_info()
        # What PyTorch's caching allocator holds but does not use is free to this process (upstream's fit()
        # empties the cache anyway); mem_get_info alone counts it as taken and could refuse a run that fits.
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        report.update(free=free + max(cached, 0), total=device_total, cached=max(cached, 0))
    return report


def swap_device_bytes(prox_mode: str, model_bytes: int, largest_param_bytes: int, shards: int) -> int:
    """Device bytes of a π_prox weight swap (``trainer/prox.py``): the stored weights of one version, this rank's
    1/``shards`` of them (ZeRO-3; 1 otherwise), held beside the live ones for all the micro-batches of that version
    (the versions take turns). EWMA (stored in fp32) copies each parameter in fp32 and casts it on the device: +
    the largest parameter's share in fp32 (twice its 16-bit bytes) meanwhile. 0 for modes that swap nothing."""
    if prox_mode not in ("snapshot", "interrupt", "ewma"):
        return 0
    shards = max(shards, 1)
    swapped = -(-model_bytes // shards)
    if prox_mode == "ewma":
        swapped += 2 * -(-largest_param_bytes // shards)
    return swapped


def model_shape(config, dtype_bytes: int) -> Dict[str, int]:
    """What the activation floors read of the policy: vocabulary V, layers L, hidden size H, parameter bytes b."""
    return {
        "vocab": int(getattr(config, "vocab_size", 0) or 0),
        "layers": int(getattr(config, "num_hidden_layers", 0) or 0),
        "hidden_size": int(getattr(config, "hidden_size", 0) or 0),
        "dtype_bytes": int(dtype_bytes),
    }


def logits_floor(tokens: int, vocab: int, dtype_bytes: int) -> int:
    """Bytes every forward of upstream's ``Actor`` holds at once over ``tokens`` tokens: the LM head's logits in the
    model's dtype and their fp32 copy, both live at ``output["logits"].to(torch.float32)`` (openrlhf/models/actor.py),
    tokens · V · (b + 4); for an fp32 model the cast copies nothing, tokens · V · 4. At V = 151,936 and 4,096 tokens
    of bf16: 3,561 MiB. A floor: the hidden states, the attention and the log-softmax come on top."""
    return tokens * vocab * (dtype_bytes + 4 if dtype_bytes < 4 else dtype_bytes)


def step_floor(tokens: int, vocab: int, layers: int, hidden_size: int, dtype_bytes: int) -> int:
    """A floor of a training micro-batch's activations over ``tokens`` tokens: :func:`logits_floor` plus
    L · tokens · H · b, each decoder layer's input saved for the backward (under gradient checkpointing all a layer
    keeps, without it a part of what it keeps), every one still live when the logits are cast at the forward's end.
    Qwen2.5-7B's shape (L 28, H 3,584, bf16) at 4,096 tokens and V = 151,936: 3,561 + 784 = 4,345 MiB."""
    return logits_floor(tokens, vocab, dtype_bytes) + layers * tokens * hidden_size * dtype_bytes


def _micro_tokens(args, phase: str) -> int:
    """The most tokens one micro-batch of ``phase`` ("train": the training step; "rollout": make-experience's
    forwards) holds on a rank: ``--{phase}.max_tokens_per_gpu`` under ``--train.dynamic_batch_enable``, else
    ``--{phase}.micro_batch_size`` rows × ``--data.max_len``; split over ``--ds.ring_attn_size`` ranks."""
    train, group = args.train, getattr(args, phase)
    if getattr(train, "dynamic_batch_enable", False):
        tokens = getattr(group, "max_tokens_per_gpu", None) or train.max_tokens_per_gpu
    else:
        tokens = group.micro_batch_size * args.data.max_len
    ring = max(int(getattr(getattr(args, "ds", None), "ring_attn_size", 1) or 1), 1)
    return -(-tokens // ring)


def memory_needs(
    args, model_bytes: int, largest_param_bytes: int, world: int, hidden: int = 0, shape: Optional[dict] = None
) -> Dict[str, int]:
    """Extra device bytes per actor rank that the run's features state (docs/gpu_path.md), keyed by the flag
    that brings (and reduces) each. Training's own memory is upstream's and DeepSpeed's, not counted here
    (:func:`check_memory` takes the step's activations off the free memory). ``hidden``: the widest normed
    activation (the whole-model norm pass's temporaries). ``shape`` (:func:`model_shape`; None: not known): adds the
    swapped forward's logits at make-experience's micro-batch, and what a norm pass longer than a training
    micro-batch activates beyond it."""
    algo, vllm = args.algo, args.vllm
    zero3 = args.ds.zero_stage == 3
    needs: Dict[str, int] = {}
    if vllm.sync_check_tol > 0:  # checksums: one gathered parameter + one float64 chunk of 2^24 elements
        needs["--vllm.sync_check_tol (0 disables the sync check)"] = largest_param_bytes + 128 * MiB
    swap = swap_device_bytes(algo.prox_mode, model_bytes, largest_param_bytes, world if zero3 else 1)
    if swap:
        needs[f"--algo.prox_mode {algo.prox_mode}"] = swap
        if shape:  # the swapped forward runs while the copy is held: its logits at make-experience's micro-batch
            forward = logits_floor(_micro_tokens(args, "rollout"), shape["vocab"], shape["dtype_bytes"])
            needs[f"--algo.prox_mode {algo.prox_mode}: its forward's logits (--rollout.micro_batch_size)"] = forward
    if algo.prox_mode == "interrupt":
        budget = getattr(algo, "prox_score_memory_mb", None)
        if budget:
            needs["--algo.prox_score_memory_mb"] = int(budget) * MiB
    advantage = getattr(algo, "advantage", None)  # (a namespace of the prox flags alone has none)
    if advantage is not None and advantage.baseline == "opob" and advantage.opob_norm == "full":
        from openrlhf_ess.trainer.opob import pass_extra_bytes, pass_tokens, rows_per_pass

        rows = rows_per_pass(args.data.max_len, 1 << 30, pass_tokens(args))  # rows of the longest length a pass takes
        extra = pass_extra_bytes(args.data.max_len, rows, hidden)
        if shape:  # a pass over more tokens than a training micro-batch activates more than the step does
            extra += max(0, step_floor(pass_tokens(args), **shape) - step_floor(_micro_tokens(args, "train"), **shape))
        needs["--algo.advantage.opob_norm full (head: no pass) / --algo.advantage.opob_pass_tokens"] = extra
    return needs


def check_memory(reports: Sequence[dict], args) -> str:
    """Refuse when a rank's free device memory, less the training step's activations, is below what the run's
    features state they add (:func:`memory_needs`). The step's activations are :func:`step_floor` at the longest
    micro-batch the flags allow (a floor, so the check never counts more than the step surely takes), kept off the
    free memory because the features' peaks come on top of what training holds (DeepSpeed's gradient buffers, the
    allocator's cache). Where the step alone exceeds the free memory the check warns and does not refuse: that is
    upstream's step, whether the run reaches its longest micro-batch or not."""
    measured = [r for r in reports if r.get("free") is not None]
    if not measured:
        return "memory: not measured (no CUDA device)"
    shape = measured[0].get("shape")
    step = step_floor(_micro_tokens(args, "train"), **shape) if shape else 0
    worst = min(measured, key=lambda r: r["free"])
    needs = memory_needs(
        args, worst["model_bytes"], worst["largest_param_bytes"], worst["world"], worst.get("hidden", 0), shape
    )
    need, room = sum(needs.values()), worst["free"] - step
    items = ", ".join(f"{k}: {v / MiB:,.0f} MiB" for k, v in sorted(needs.items(), key=lambda kv: -kv[1]))
    step_text = (
        f" less {step / MiB:,.0f} MiB for the training step's activations at its longest micro-batch (at least: "
        f"logits and each layer's input, --train.micro_batch_size × --data.max_len)"
        if step
        else ""
    )
    if room < 0:
        return (
            f"memory: WARNING: {worst['free'] / MiB:,.0f} MiB free, below the training step's own activations at "
            f"its longest micro-batch (at least {step / MiB:,.0f} MiB: its logits and each layer's input). Upstream's "
            "step may run out of memory on a micro-batch that long: lower --train.micro_batch_size or "
            f"--data.max_len, or add actor ranks (ZeRO-3). Our features state {need / MiB:,.0f} MiB more "
            f"({items or 'none'})."
        )
    if need > room:
        flag = max(needs, key=needs.get)
        raise SelfCheckError(
            f"start-up self-check failed (memory): an actor rank has {worst['free'] / MiB:,.0f} MiB free on its GPU "
            f"after loading{step_text}, {room / MiB:,.0f} MiB, and the run's features need {need / MiB:,.0f} MiB "
            f"more at their peak ({items}). The largest is {flag}: reduce it, add actor ranks (ZeRO-3 divides the "
            "model), or free memory (--actor.gradient_checkpointing_enable, a smaller --train.micro_batch_size); "
            "--selfcheck off skips this."
        )
    after_step = f" after the step's {step / MiB:,.0f} MiB" if step else ""
    return f"memory: {need / MiB:,.0f} MiB stated peak of our features <= {room / MiB:,.0f} MiB free{after_step}"


# ------------------------------------------------------------------------------------------- engine canary


def canary_skipped(args) -> Optional[str]:
    """Why the engines-vs-trainer canary cannot run at start-up (None: it runs; "" : nothing to compare)."""
    if not getattr(args.vllm, "num_engines", 0):
        return ""
    if args.vllm.sync_check_tol <= 0:
        return "--vllm.sync_check_tol 0"
    if getattr(args.vllm, "enable_sleep", False):
        return "--vllm.enable_sleep: the engines sleep until the first generation; the first sync runs it"
    if getattr(args.ckpt, "load_enable", False):
        return "--ckpt.load_enable: the engines hold the base model until the first sync, which runs it"
    return None


def regroup_probe_due(args) -> bool:
    """Whether the start-up self-check forms the weight sync group a second time and probes it, as an engine
    replacement will (``replacement_sync.py::ReplacementSync.startup_regroup_probe``): --vllm.max_restarts with
    upstream's NCCL/gloo group on GPUs (not with CUDA IPC, which has no group; the reload backend needs none)."""
    from openrlhf_ess import config

    vllm = args.vllm
    if not (getattr(vllm, "max_restarts", 0) > 0 and vllm.num_engines and vllm.sync_backend in ("nccl", "gloo")):
        return False
    cuda_ipc = vllm.sync_backend == "nccl" and args.train.colocate_all and not args.train.async_enable
    return not cuda_ipc and config.on_cuda(args)


# ------------------------------------------------------------------------------------------------ driver


def run(args, groups: Dict[str, Optional[list]], log=print) -> List[str]:
    """Run every trainer-side check on the actor handles ``groups`` (role -> handles in rank order, or None).

    Returns the summary lines (also logged); raises :class:`SelfCheckError` on a violation.
    """
    import ray

    start = time.monotonic()
    handles = {role: list(h) for role, h in groups.items() if h}
    placement = {role: ray.get([h.__ray_call__.remote(placement_report) for h in hs]) for role, hs in handles.items()}
    lines = [check_placement(placement, args)]
    actor = handles.get("actor", [])
    if actor:
        lines.append(check_collectives(ray.get([h.__ray_call__.remote(collective_probe) for h in actor])))
        lines.append(check_memory(ray.get([h.__ray_call__.remote(memory_probe) for h in actor]), args))
    trainer_side = time.monotonic() - start
    why_not = canary_skipped(args)
    if actor and why_not is None:
        rank0 = [r for r in ray.get([h.selfcheck_canary.remote() for h in actor]) if r is not None][0]
        sampled = rank0["sampled"]
        sampled = f"mean |Δ log p| {sampled:.2e}" if isinstance(sampled, float) else sampled
        lines.append(
            f"engine canary: mean |Δ log p| {rank0['canary']:.2e}, a sample with the run's settings: {sampled} "
            f"(--vllm.sync_check_tol {args.vllm.sync_check_tol})"
        )
    elif why_not:
        lines.append(f"engine canary: not run ({why_not})")
    if actor and regroup_probe_due(args):
        lines.append(ray.get(actor[0].selfcheck_regroup.remote()))
    canary = time.monotonic() - start - trainer_side
    lines.append(
        f"took {trainer_side:.1f} s + {canary:.1f} s for the canary, which first waits for the engines to finish "
        "starting (as the first rollout would) (--selfcheck off skips it)"
    )
    log("[openrlhf-ess] start-up self-check passed: " + "; ".join(lines), flush=True)
    return lines
