"""Check 1: our collectives (``openrlhf_ess.distributed`` and its callers) on a real NCCL group of one rank, with
the multi-rank path forced; a host tensor in a NCCL collective must raise (the control that the check can fail).
On the CPU the group is gloo, which accepts host tensors: the real control is a SKIP there, and the adapted control
(the virtual NCCL of tests/helpers/strict_device.py) runs instead."""

import math
import types

import pytest
import torch
import torch.distributed as dist

from tests.gpu.conftest import INFO, expect
from tests.gpu.harness import (
    FORCED_MULTI_RANK,
    CollectiveLog,
    _hand_items,
    _on_device,
    missing_reason,
    single_rank_env,
)


@pytest.fixture(scope="module")
def group(device):
    """A process group of one rank (NCCL on cuda:0, gloo on the CPU), ``distributed.is_multi_rank`` forced."""
    from openrlhf_ess import distributed

    cuda = device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
        props = torch.cuda.get_device_properties(0)
        INFO.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    single_rank_env()
    dist.init_process_group(backend, rank=0, world_size=1)
    want = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    real_is_multi_rank = distributed.is_multi_rank
    distributed.is_multi_rank = lambda: True
    common = [FORCED_MULTI_RANK, f"process group: {dist.get_backend()}, world size {dist.get_world_size()}"]
    try:
        yield types.SimpleNamespace(
            cuda=cuda, backend=backend, want=want, common=common, real_is_multi_rank=real_is_multi_rank
        )
    finally:
        distributed.is_multi_rank = real_is_multi_rank
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture
def log(group):
    with CollectiveLog() as log:
        yield log


@pytest.fixture(scope="module")
def tiny_model(group):
    from tests.helpers.device_discipline_ranks import TinyLM, prox_sources

    model = TinyLM().to(group.want)
    return model, prox_sources(model)


def start(g, entry, log):
    from openrlhf_ess import distributed

    entry["notes"].extend(g.common)
    entry["numbers"]["backend"] = dist.get_backend()
    expect(entry, dist.get_backend() == g.backend, f"backend {dist.get_backend()}, expected {g.backend}")
    expect(entry, distributed.device() == g.want, f"distributed.device() is {distributed.device()}, not {g.want}")
    log.take()


def placed(g, entry, calls, ops):
    entry["numbers"]["collectives"] = calls
    expect(entry, [c["op"] for c in calls] == ops, f"collectives issued {[c['op'] for c in calls]}, expected {ops}")
    expect(entry, _on_device(calls, g.want), f"collective tensors not all on {g.want}: {calls}")


def test_all_reduce_max(check, group, log):
    from openrlhf_ess import distributed

    backend, want = group.backend, group.want
    with check("1.all_reduce_max", "distributed.all_reduce_max on the real backend") as e:
        start(group, e, log)
        values = [1.5, -2.0, 3.25, 7.0]
        out = distributed.all_reduce_max(values)
        placed(group, e, log.take(), ["all_reduce"])
        expect(e, out == values and all(type(v) is float for v in out), f"result {out}, expected {values}")
        e["summary"] = f"{backend}: 1 all_reduce on {want} (float64), host floats back"


def test_all_gather_rows(check, group, log):
    from openrlhf_ess import distributed

    backend, want = group.backend, group.want
    with check("1.all_gather_rows", "distributed.all_gather_rows on the real backend") as e:
        start(group, e, log)
        local = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        out_host = distributed.all_gather_rows(local)
        out_dev = distributed.all_gather_rows(local.to(want))
        placed(group, e, log.take(), ["all_gather", "all_gather"])
        for out in (out_host, out_dev):
            expect(e, out.shape == (1, 2, 3) and out.device.type == "cpu", f"got {out.shape} on {out.device}")
            expect(e, torch.equal(out[0], local), "gathered rows differ from the input")
        e["summary"] = f"{backend}: host and device inputs gathered on {want}, (1, 2, 3) back on the host"


def test_agree(check, group, log, tiny_model):
    backend, want = group.backend, group.want
    model, sources = tiny_model
    with check("1.agree", "ProxSources.agree (ZeRO-3 path: which stale versions any rank needs)") as e:
        start(group, e, log)
        agreed = sources.agree([3, 5], [3, 4, 5, 6])
        placed(group, e, log.take(), ["all_reduce"])
        expect(e, agreed == [3, 5], f"agree gave {agreed}, expected [3, 5]")
        e["summary"] = f"{backend}: [3, 5] of [3, 4, 5, 6] via 1 all_reduce on {want}"


def test_score_streams(check, group, log, tiny_model):
    backend, want = group.backend, group.want
    model, sources = tiny_model
    with check("1.score_streams", "ProxSources.score_streams (interrupt mode) with the model on the device") as e:
        start(group, e, log)
        from openrlhf_ess.trainer import prox

        streams = [[1, 2, 3, 4]] * 20
        model.calls = 0
        scored = sources.score_streams(0, streams)
        forwards = model.calls
        placed(group, e, log.take(), ["all_reduce"])
        direct = prox.stream_log_probs(model, streams)  # version 0 = the live weights: the same numbers
        diff = max((a - b).abs().max().item() for a, b in zip(scored, direct))
        e["numbers"].update(forwards=forwards, streams=len(scored), max_abs_diff=diff)
        expect(e, len(scored) == 20, f"{len(scored)} streams scored, expected 20")
        expect(e, e["numbers"]["forwards"] == 2, f"{e['numbers']['forwards']} forwards, expected ceil(20/16) = 2")
        expect(e, diff <= 1e-6, f"swapped-weights log-probs differ from the live model's by {diff}")
        expect(e, next(model.parameters()).device == want, "the weight swap moved the model off the device")
        e["summary"] = f"{backend}: 20 streams, 2 forwards on {want}, |diff| vs live model {diff:.1e}"


def test_global_lr_scale(check, group, log):
    from openrlhf_ess import distributed

    backend, want = group.backend, group.want
    with check("1.global_lr_scale", "ess_lr.global_lr_scale (moments all-gather) on hand-valued items") as e:
        start(group, e, log)
        try:
            from openrlhf_ess.trainer import ess_lr

            items = _hand_items(want)
        except ImportError as err:
            pytest.skip(f"openrlhf does not import ({missing_reason(err)}): ess_lr needs its experience module")
        scale, metrics = ess_lr.global_lr_scale(items, "geo_mean", "sqrt", 0.1)
        placed(group, e, log.take(), ["all_gather"])
        distributed.is_multi_rank = group.real_is_multi_rank
        try:
            single, _ = ess_lr.global_lr_scale(items, "geo_mean", "sqrt", 0.1)  # the single-process path
        finally:
            distributed.is_multi_rank = lambda: True
        e["numbers"].update(
            lr_scale=scale, rho_ess=metrics.get("rho_ess"), hand_lr_scale=math.sqrt(9 / 13), hand_rho=9 / 13
        )
        expect(e, abs(metrics.get("rho_ess", -1) - 9 / 13) <= 1e-6, f"rho {metrics.get('rho_ess')} != 9/13")
        expect(e, abs(scale - math.sqrt(9 / 13)) <= 1e-6, f"scale {scale} != sqrt(9/13)")
        expect(e, scale == single, f"forced multi-rank scale {scale} != single-process {single}")
        e["summary"] = f"{backend}: 1 all_gather on {want}; rho {metrics.get('rho_ess'):.6f} (9/13), scale {scale:.6f}"


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
