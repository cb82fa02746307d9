"""The ranks of checks 1, 5 and 6: ``launch_ranks`` starts ``world`` processes of
this module (``python -m tests.gpu.ranks TASK ...``) as a launcher starts a job's ranks, RANK, WORLD_SIZE and
MASTER_ADDR/PORT set, one result file each."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from typing import List

from tests.gpu.harness import REPO, CollectiveLog, hide_modules, missing_reason
from tests.helpers.ports import free_port

RANK_GRACE_S = 20  # after one rank fails, how long the others get to finish (or fail) before they are killed
NO_COLOCATE = types.SimpleNamespace(
    train=types.SimpleNamespace(colocate_all=False, colocate_actor_ref=False, colocate_critic_reward=False)
)


def world_for(args) -> int:
    """Ranks for checks 5 and 6: --ranks, else one per GPU (at most 8) on CUDA, 2 on the CPU."""
    if args.ranks:
        return args.ranks
    if args.device == "cpu":
        return 2
    import torch

    return min(torch.cuda.device_count(), 8)


def launch_ranks(args, task: str, world: int, options: dict, timeout: float) -> List[dict]:
    """``world`` processes of this script (``--rank-task task``), as a launcher starts a job's ranks: RANK,
    WORLD_SIZE, MASTER_ADDR/PORT set, one result file each. A rank that fails gives the others RANK_GRACE_S, then
    they are killed (a rank waiting in a collective for a dead peer would hang). Their output goes to the test's
    (the log). Returns one ``{rank, rc, timed_out, result}`` per rank (``result``: its file, or None)."""
    port, procs, t0 = free_port(), [], time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["WORLD_SIZE"] = str(world)
    for rank in range(world):
        result = tempfile.NamedTemporaryFile(prefix=f"gpu_check_{task}_{rank}_", suffix=".json", delete=False).name
        cmd = [sys.executable, "-m", "tests.gpu.ranks", "--rank-task", task, "--rank", str(rank), "--result", result]
        cmd += ["--device", args.device, "--rank-options", json.dumps(options)]
        cmd += ["--without", ",".join(args.without)] if args.without else []
        out = tempfile.TemporaryFile("w+")
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        proc = subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=subprocess.STDOUT)
        procs.append((rank, proc, out, result))
    failed_at, timed_out = None, False
    while any(p.poll() is None for _, p, _, _ in procs):
        now = time.time()
        if failed_at is None and any(p.poll() not in (None, 0) for _, p, _, _ in procs):
            failed_at = now
        if now - t0 > timeout or (failed_at is not None and now - failed_at > RANK_GRACE_S):
            timed_out = now - t0 > timeout
            for _, p, _, _ in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    runs = []
    for rank, p, out, result in procs:
        rc = p.wait()
        out.seek(0)
        text = out.read()
        out.close()
        print(f"---- {task} rank {rank}/{world} (rc {rc}) ----\n{text}", flush=True)
        got = None
        with contextlib.suppress(OSError, ValueError):
            with open(result) as f:
                got = json.load(f)
        with contextlib.suppress(OSError):
            os.unlink(result)
        lines = [line for line in text.splitlines() if line.strip()]
        runs.append(dict(rank=rank, rc=rc, timed_out=timed_out, result=got, last_line=lines[-1] if lines else ""))
    return runs


def ranks_ok(runs: List[dict], what: str) -> List[dict]:
    """The ranks' results, or an error naming the ranks that failed (the check's FAIL)."""
    bad = [r for r in runs if r["rc"] != 0 or r["result"] is None]
    if bad:
        why = "; ".join(
            f"rank {r['rank']}: " + ("timed out" if r["timed_out"] else f"exit code {r['rc']}") + f": {r['last_line']}"
            for r in bad
        )
        raise RuntimeError(f"{what}: {len(bad)} of {len(runs)} ranks failed ({why}); their output is in the log")
    return [r["result"] for r in runs]


def _rank_init(args, options: dict):
    """In a rank: its device set as a correctly placed run sets it (rank r on GPU r; ``options["gpu"] == "zero"``:
    GPU 0, the defect), and the process group if ``options["backend"]``. Returns (rank, world, torch.device)."""
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", 0 if options.get("gpu") == "zero" else rank)
        torch.cuda.set_device(device)
    backend = options.get("backend")
    if backend:
        import datetime

        import torch.distributed as dist

        kwargs = {"device_id": device} if backend == "nccl" else {}  # NCCL: the communicator bound to this GPU
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120), **kwargs
        )
    return rank, world, device


def _rank_done(options: dict) -> None:
    if options.get("backend"):
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def rank_placement(args, options: dict) -> dict:
    """A rank's placement report, as ``selfcheck.placement_report`` builds it inside a Ray actor, without Ray:
    node = the host name, device = the physical GPU's UUID (CPU: a per-rank fake id, "rank 0's" for the control),
    pid, current_device. With a process group, the reports are also all-gathered over it."""
    import socket

    import torch

    rank, world, device = _rank_init(args, options)
    report = {
        "node": socket.gethostname(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if args.device == "cuda":
        index = torch.cuda.current_device()
        report["current_device"] = f"cuda:{index}"
        report["device"] = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    else:
        report["current_device"] = "cpu"
        report["device"] = f"CPU-FAKE-{0 if options.get('gpu') == 'zero' else rank}"
    out = {"report": report, "gathered": None, "backend": options.get("backend")}
    if options.get("backend"):
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, report)
        out["gathered"] = gathered
    _rank_done(options)
    return out


def rank_collectives(args, options: dict) -> dict:
    """``selfcheck.collective_probe()`` on this rank of the real process group, its collectives recorded; the
    probes all-gathered over the same group (the driver's ray.get in the real check)."""
    import torch.distributed as dist

    from openrlhf_ess import distributed
    from openrlhf_ess.checks import selfcheck

    rank, world, device = _rank_init(args, options)
    forced = world == 1
    if forced:  # one GPU: a world of one, as check 1 runs it
        distributed.is_multi_rank = lambda: True
    with CollectiveLog() as log:
        probe = selfcheck.collective_probe()
        calls = log.take()
    gathered = [None] * world
    dist.all_gather_object(gathered, probe)
    _rank_done(options)
    return {
        "probe": probe,
        "calls": calls,
        "gathered": gathered,
        "forced_multi_rank": forced,
        "backend": options["backend"],
        "rank_device": str(device),
        "collective_device": str(distributed.device()),
    }


# ---- check 1: our collectives, each rank with inputs of its own (tests/gpu/test_1_collectives.py states the
# expected results as functions of the world size)


def check1_values(rank: int, world: int) -> list:
    """all_reduce_max's input on ``rank``: the elementwise max over the ranks is not any one rank's."""
    return [1.5 + rank, -2.0 - rank, 3.25 * (world - rank), 7.0]


def check1_rows(rank: int):
    import torch

    return torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank


def check1_needs(rank: int) -> list:
    """The stale versions ``rank`` needs (``ProxSources.agree``: every rank must get the union)."""
    return [3, 5] if rank == 0 else [4]


def check1_streams(rank: int) -> list:
    """``score_streams``' streams: 20 on rank 0 (ceil(20 / 16) = 2 forwards), none on the others (which must run
    the same 2 forwards)."""
    return [[1, 2, 3, 4]] * (20 if rank == 0 else 0)


def _check1_ops(device, rank: int, world: int, log) -> dict:
    """Each of our collectives once, the collectives each issued (``calls``) kept with its result."""
    from openrlhf_ess import distributed
    from tests.helpers.device_discipline_ranks import TinyLM, prox_sources

    ops = {}
    log.take()
    out = distributed.all_reduce_max(check1_values(rank, world))
    ops["all_reduce_max"] = {"result": out, "types": [type(v).__name__ for v in out], "calls": log.take()}
    local = check1_rows(rank)
    host, dev = distributed.all_gather_rows(local), distributed.all_gather_rows(local.to(device))
    ops["all_gather_rows"] = {
        "result": [host.tolist(), dev.tolist()],
        "devices": [str(host.device), str(dev.device)],
        "calls": log.take(),
    }
    model = TinyLM().to(device)
    sources = prox_sources(model)
    agreed = sources.agree(check1_needs(rank), [3, 4, 5, 6])
    ops["agree"] = {"result": agreed, "calls": log.take()}
    from openrlhf_ess.trainer import prox

    streams = check1_streams(rank)
    model.calls = 0
    scored = sources.score_streams(0, streams)
    forwards, calls = model.calls, log.take()
    direct = prox.stream_log_probs(model, streams) if streams else []  # version 0 = the live weights: the same
    diff = max([(a - b).abs().max().item() for a, b in zip(scored, direct)] or [0.0])
    ops["score_streams"] = {
        "result": {"forwards": forwards, "scored": len(scored), "max_abs_diff": diff},
        "model_device": str(next(model.parameters()).device),
        "calls": calls,
    }
    try:
        from openrlhf_ess.trainer import ess_lr
        from tests.gpu.harness import _hand_items

        items = _hand_items(device)
    except ImportError as err:  # the same on every rank, before any collective
        ops["global_lr_scale"] = {"missing": missing_reason(err), "calls": log.take()}
        return ops
    mine = items[rank::world]  # world 2: rank 0 the weights 1, rank 1 the weights 5 (each rank's own rho is 1)
    scale, metrics = ess_lr.global_lr_scale(mine, "geo_mean", "sqrt", 0.1)
    calls = log.take()
    real = distributed.is_multi_rank
    distributed.is_multi_rank = lambda: False
    try:
        own, own_metrics = ess_lr.global_lr_scale(mine, "geo_mean", "sqrt", 0.1)  # this rank's items alone
    finally:
        distributed.is_multi_rank = real
    ops["global_lr_scale"] = {
        "result": {"lr_scale": scale, "rho_ess": metrics.get("rho_ess"), "items": len(mine)},
        "own": {"lr_scale": own, "rho_ess": own_metrics.get("rho_ess")},
        "calls": calls + log.take(),
    }
    return ops


def rank_check1(args, options: dict) -> dict:
    """Check 1 on this rank of the real process group: our collectives, each with this rank's inputs."""
    from openrlhf_ess import distributed

    rank, world, device = _rank_init(args, options)
    forced = world == 1
    if forced:  # one GPU: a world of one (NCCL refuses two ranks on one GPU)
        distributed.is_multi_rank = lambda: True
    with CollectiveLog() as log:
        ops = _check1_ops(device, rank, world, log)
    _rank_done(options)
    return {
        "rank": rank,
        "world": world,
        "ops": ops,
        "forced_multi_rank": forced,
        "backend": options["backend"],
        "rank_device": str(device),
        "collective_device": str(distributed.device()),
    }


RANK_TASKS = {"placement": rank_placement, "collectives": rank_collectives, "check1": rank_check1}


def run_rank(args) -> int:
    hide_modules(args.without)
    result = RANK_TASKS[args.rank_task](args, json.loads(args.rank_options or "{}"))
    with open(args.result, "w") as f:
        json.dump(result, f, default=str)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank-task", required=True, choices=sorted(RANK_TASKS))
    p.add_argument("--result", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], required=True)
    p.add_argument("--rank-options", default="{}")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--without", default="")
    args = p.parse_args(argv)
    args.without = [m.strip() for m in args.without.split(",") if m.strip()]
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
