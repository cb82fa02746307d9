"""Check 1: our collectives (``openrlhf_ess.distributed`` and its callers) on a real process group of two ranks,
each rank with inputs of its own, so that a collective that returned a rank's own values, or another rank's, fails
(tests/gpu/ranks.py, task ``check1``). The ranks: two gloo processes on the CPU; on CUDA one NCCL rank per GPU, two
at most. NCCL refuses two ranks on one GPU, so on a machine with one GPU the world is one rank with the multi-rank
path forced (``FORCED_MULTI_RANK``): there the collectives run on the GPU and their placement is checked, but that
each rank gets the others' values is checked by the CPU variant (gloo, two ranks) and, on the GPUs of a real run, by
the start-up self-check (``selfcheck.collective_probe`` / ``check_collectives``, check 6 on two or more GPUs).

The negative control runs in this process on a group of one: a host tensor in a NCCL collective must raise. On the
CPU the group is gloo, which accepts host tensors: the real control is a SKIP there, and the adapted control (the
virtual NCCL of tests/helpers/strict_device.py) runs instead."""

import math
import types

import pytest
import torch
import torch.distributed as dist

from tests.gpu.conftest import INFO, expect
from tests.gpu.harness import FORCED_MULTI_RANK, _hand_items, _on_device, missing_reason, single_rank_env
from tests.gpu.ranks import check1_needs, check1_rows, check1_streams, check1_values, launch_ranks, ranks_ok

ONE_GPU = (
    "one GPU: a world of ONE rank (NCCL refuses two ranks on one GPU), openrlhf_ess.distributed.is_multi_rank forced "
    "to True; the collectives run on the GPU and their placement is checked here, but that each rank gets the "
    "others' values is not: the CPU variant checks it on two gloo ranks, and the start-up self-check "
    "(selfcheck.collective_probe / check_collectives) on the run's own NCCL ranks"
)


def _gpu_info() -> None:
    props = torch.cuda.get_device_properties(0)
    INFO.update(
        gpu=props.name,
        capability=f"{props.major}.{props.minor}",
        gpu_memory_gib=round(props.total_memory / 2**30, 1),
        gpu_count=torch.cuda.device_count(),
        nccl=".".join(map(str, torch.cuda.nccl.version())),
    )


@pytest.fixture(scope="module")
def ranks(args):
    """The ranks' results (one ``rank_check1`` dict each, in rank order): two gloo ranks on the CPU; on CUDA one
    NCCL rank per GPU, two at most (one GPU: a world of one, the multi-rank path forced)."""
    cuda = args.device == "cuda"
    if cuda:
        _gpu_info()
    world = min(torch.cuda.device_count(), 2) if cuda else 2
    backend = "nccl" if cuda else "gloo"
    runs = ranks_ok(launch_ranks(args, "check1", world, {"backend": backend}, 180), "check 1 ranks")
    common = [f"process group: {backend}, {world} rank(s), each with inputs of its own"]
    common += [ONE_GPU, FORCED_MULTI_RANK] if world == 1 else []
    return types.SimpleNamespace(runs=runs, world=world, backend=backend, cuda=cuda, common=common)


def start(r, entry, op: str) -> list:
    """Every rank's result of ``op``; the common expectations: backend, world, each rank's collectives issued on
    its own device (``distributed.device()`` = the rank's device)."""
    entry["notes"].extend(r.common)
    entry["numbers"].update(backend=r.backend, world=r.world)
    expect(entry, len(r.runs) == r.world, f"{len(r.runs)} ranks reported, expected {r.world}")
    for run in r.runs:
        expect(entry, run["backend"] == r.backend, f"rank {run['rank']}: backend {run['backend']}, not {r.backend}")
        expect(entry, run["world"] == r.world, f"rank {run['rank']}: world size {run['world']}, not {r.world}")
        expect(
            entry,
            run["collective_device"] == run["rank_device"],
            f"rank {run['rank']}: distributed.device() is {run['collective_device']}, not {run['rank_device']}",
        )
    return [run["ops"][op] for run in r.runs]


def placed(r, entry, results, ops):
    entry["numbers"]["collectives"] = {run["rank"]: got["calls"] for run, got in zip(r.runs, results)}
    for run, got in zip(r.runs, results):
        names = [c["op"] for c in got["calls"]]
        expect(entry, names == ops, f"rank {run['rank']} issued {names}, expected {ops}")
        expect(
            entry,
            _on_device(got["calls"], run["rank_device"]),
            f"rank {run['rank']}: collective tensors not all on {run['rank_device']}: {got['calls']}",
        )


def test_all_reduce_max(check, ranks):
    world = ranks.world
    with check("1.all_reduce_max", "distributed.all_reduce_max on the real backend") as e:
        results = start(ranks, e, "all_reduce_max")
        placed(ranks, e, results, ["all_reduce"])
        inputs = [check1_values(rank, world) for rank in range(world)]
        want = [max(column) for column in zip(*inputs)]
        e["numbers"].update(inputs=inputs, expected=want, results=[got["result"] for got in results])
        for rank, got in enumerate(results):
            expect(e, got["result"] == want, f"rank {rank}: max {got['result']}, expected {want} (inputs {inputs})")
            expect(e, set(got["types"]) == {"float"}, f"rank {rank}: {got['types']}, expected host floats")
        e["summary"] = f"{ranks.backend}, {world} ranks: elementwise max {want} on every rank, host floats back"


def test_all_gather_rows(check, ranks):
    world = ranks.world
    with check("1.all_gather_rows", "distributed.all_gather_rows on the real backend") as e:
        results = start(ranks, e, "all_gather_rows")
        placed(ranks, e, results, ["all_gather", "all_gather"])
        want = torch.stack([check1_rows(rank) for rank in range(world)]).tolist()
        for rank, got in enumerate(results):
            for what, out, device in zip(("host", "device"), got["result"], got["devices"]):
                expect(e, out == want, f"rank {rank}, {what} input: gathered {out}, expected every rank's {want}")
                expect(e, device == "cpu", f"rank {rank}, {what} input: gathered rows on {device}, not the host")
        e["summary"] = (
            f"{ranks.backend}, {world} ranks: host and device inputs gathered, ({world}, 2, 3) in rank order back on "
            "the host"
        )


def test_agree(check, ranks):
    world = ranks.world
    with check("1.agree", "ProxSources.agree (ZeRO-3 path: which stale versions any rank needs)") as e:
        results = start(ranks, e, "agree")
        placed(ranks, e, results, ["all_reduce"])
        needs = [check1_needs(rank) for rank in range(world)]
        want = sorted({v for need in needs for v in need})
        for rank, got in enumerate(results):
            expect(e, got["result"] == want, f"rank {rank}: agree gave {got['result']}, expected {want} ({needs})")
        e["numbers"].update(needs=needs, agreed=[got["result"] for got in results])
        e["summary"] = f"{ranks.backend}, {world} ranks needing {needs}: {want} on every rank via 1 all_reduce"


def test_score_streams(check, ranks):
    world = ranks.world
    with check("1.score_streams", "ProxSources.score_streams (interrupt mode) with the model on the device") as e:
        results = start(ranks, e, "score_streams")
        placed(ranks, e, results, ["all_reduce"])
        e["numbers"]["ranks"] = [got["result"] for got in results]
        for (rank, got), run in zip(enumerate(results), ranks.runs):
            n = len(check1_streams(rank))
            res = got["result"]
            expect(e, res["scored"] == n, f"rank {rank}: {res['scored']} streams scored, expected {n}")
            expect(e, res["forwards"] == 2, f"rank {rank}: {res['forwards']} forwards, expected ceil(20/16) = 2")
            diff = res["max_abs_diff"]
            expect(e, diff <= 1e-6, f"rank {rank}: log-probs off the live model's by {diff}")
            expect(e, got["model_device"] == run["rank_device"], f"rank {rank}: the weight swap moved the model off")
        e["summary"] = (
            f"{ranks.backend}, {world} ranks: 20 streams on rank 0"
            + (", none on rank 1" if world > 1 else "")
            + ": 2 forwards on every rank, log-probs = the live model's"
        )


def test_global_lr_scale(check, ranks):
    world = ranks.world
    with check("1.global_lr_scale", "ess_lr.global_lr_scale (moments all-gather) on hand-valued items") as e:
        results = start(ranks, e, "global_lr_scale")
        missing = [got["missing"] for got in results if "missing" in got]
        if missing:
            pytest.skip(f"openrlhf does not import ({missing[0]}): ess_lr needs its experience module")
        placed(ranks, e, results, ["all_gather"])
        e["numbers"].update(
            ranks=[got["result"] for got in results],
            own=[got["own"] for got in results],
            hand_lr_scale=math.sqrt(9 / 13),
            hand_rho=9 / 13,
        )
        for rank, got in enumerate(results):
            res = got["result"]
            expect(e, abs((res["rho_ess"] or -1) - 9 / 13) <= 1e-6, f"rank {rank}: rho {res['rho_ess']} != 9/13")
            expect(e, abs(res["lr_scale"] - math.sqrt(9 / 13)) <= 1e-6, f"rank {rank}: scale {res['lr_scale']}")
            if world > 1:  # each rank's items alone have equal weights: rho 1; 9/13 only from every rank's moments
                expect(e, abs(got["own"]["rho_ess"] - 1) <= 1e-6, f"rank {rank}: own items' rho {got['own']}")
        e["summary"] = (
            f"{ranks.backend}, {world} ranks ({results[0]['result']['items']} items each): 1 all_gather; rho "
            f"{results[0]['result']['rho_ess']:.6f} (9/13) on every rank"
            + (", where each rank's own items give 1" if world > 1 else "")
        )


@pytest.fixture(scope="module")
def group(device):
    """The negative controls' process group, in this process: one rank (NCCL on cuda:0, gloo on the CPU),
    ``distributed.is_multi_rank`` forced (a host tensor's refusal is a property of the backend, not of the world)."""
    from openrlhf_ess import distributed

    cuda = device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
    single_rank_env()
    dist.init_process_group(backend, rank=0, world_size=1)
    want = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    real_is_multi_rank = distributed.is_multi_rank
    distributed.is_multi_rank = lambda: True
    try:
        yield types.SimpleNamespace(cuda=cuda, backend=backend, want=want)
    finally:
        distributed.is_multi_rank = real_is_multi_rank
        dist.barrier()
        dist.destroy_process_group()


def test_host_tensor_refused(check, group):
    from openrlhf_ess import distributed

    want = group.want
    with check("1.host_tensor_refused", "negative control: a host tensor in a collective of the group") as e:
        e["notes"].append(f"process group: {dist.get_backend()}")
        refused = None
        try:
            dist.all_reduce(torch.ones(2))
        except RuntimeError as err:
            refused = str(err)
        e["numbers"]["host_tensor_error"] = refused
        moved = torch.ones(2).to(distributed.device())
        dist.all_reduce(moved)  # the same tensor on distributed.device() is accepted
        e["numbers"]["device_tensor_result"] = moved.cpu().tolist()
        if not group.cuda:
            measured = f"raised: {refused}" if refused else "returned without error"
            pytest.skip(
                f"gloo accepts host tensors (measured here: dist.all_reduce(torch.ones(2)) {measured}), so a real "
                "refusal needs NCCL; the adapted control is 1.virtual_nccl"
            )
        expect(e, refused is not None, "NCCL accepted a host tensor: the discipline checks above could not fail")
        first_line = (refused or "(nothing)").strip().splitlines()[0][:160]
        e["summary"] = f"NCCL refused the host tensor: {first_line!r}; the same tensor on {want} accepted"


def test_virtual_nccl(check, group):
    from openrlhf_ess import distributed

    with check("1.virtual_nccl", "CPU adaptation: the same collectives under tests/helpers/strict_device.py") as e:
        if group.cuda:
            pytest.skip("on CUDA the real NCCL group is the check (1.host_tensor_refused and the entries above)")
        from tests.helpers.device_discipline_ranks import TinyLM, prox_sources
        from tests.helpers.strict_device import NCCL_ERROR, strict_collectives

        e["notes"].append(
            "the virtual accelerator of tests/helpers/strict_device.py: collectives called from openrlhf_ess or this "
            "module refuse tensors not moved to distributed.device(), with NCCL's message"
        )
        with strict_collectives(("openrlhf_ess", __name__)) as calls:
            try:
                dist.all_reduce(torch.ones(2))
                refused = None
            except RuntimeError as err:
                refused = str(err)
            dist.all_reduce(torch.ones(2).to(distributed.device()))
            distributed.all_reduce_max([1.0, 2.0])
            distributed.all_gather_rows(torch.ones(3))
            model = TinyLM()
            sources = prox_sources(model)
            agreed = sources.agree([3, 5], [3, 4, 5, 6])
            scored = sources.score_streams(0, [[1, 2, 3, 4]] * 20)
            try:
                from openrlhf_ess.trainer import ess_lr

                scale, _ = ess_lr.global_lr_scale(_hand_items("cpu"), "geo_mean", "sqrt", 0.1)
            except ImportError as err:
                scale = None
                e["notes"].append(f"global_lr_scale not run: {missing_reason(err)}")
        names = [name for name, _ in calls]
        e["numbers"].update(host_tensor_error=refused, collectives=names)
        expect(
            e, refused is not None and NCCL_ERROR in refused, f"virtual NCCL did not refuse a host tensor: {refused}"
        )
        expected = ["all_reduce", "all_reduce", "all_gather", "all_reduce", "all_reduce"] + (
            ["all_gather"] * bool(scale)
        )
        expect(e, names == expected, f"checked collectives {names}, expected {expected}")
        expect(e, agreed == [3, 5] and len(scored) == 20, f"agree {agreed}, {len(scored)} streams")
        if scale is not None:
            expect(e, abs(scale - math.sqrt(9 / 13)) <= 1e-6, f"scale {scale} != sqrt(9/13)")
        e["summary"] = f"host tensor refused ({NCCL_ERROR!r}); {len(names)} collectives on the device accepted"
