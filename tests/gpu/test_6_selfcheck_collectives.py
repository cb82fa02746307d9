"""Check 6: ``selfcheck.collective_probe`` on every rank of a real process group (tests/gpu/ranks.py),
``check_collectives`` on the results: two gloo ranks on the CPU, one NCCL rank per GPU on CUDA (on one GPU a world of
one with the multi-rank path forced: NCCL refuses two ranks on one GPU)."""

import copy

import pytest

from openrlhf_ess.checks import selfcheck
from tests.gpu.conftest import expect
from tests.gpu.harness import FORCED_MULTI_RANK, _on_device
from tests.gpu.ranks import launch_ranks, ranks_ok, world_for


def test_collectives(check, args):
    cuda = args.device == "cuda"
    world = world_for(args)
    backend = "nccl" if cuda else "gloo"
    with check("6.collectives", "selfcheck.collective_probe on every rank of the real group, check_collectives") as e:
        if world < 1:
            pytest.skip("no CUDA device")
        if world == 1:
            e["notes"] += [
                FORCED_MULTI_RANK,
                "one GPU: the probe's collectives run on the GPU and the verdict is read, but a gather across ranks "
                "is not: the CPU variant gathers over two gloo ranks, and the start-up self-check of a real run over "
                "its own NCCL ranks",
            ]
        runs = ranks_ok(launch_ranks(args, "collectives", world, {"backend": backend}, 150), "collective ranks")
        probes = runs[0]["gathered"]
        e["numbers"].update(
            world=world,
            backend=backend,
            probes=probes,
            collectives={r["probe"]["rank"]: r["calls"] for r in runs},
        )
        expect(e, all(r["gathered"] == probes for r in runs), "the ranks gathered different probes")
        expect(e, [r["probe"] for r in runs] == probes, "the gathered probes differ from the ranks' own")
        for r in runs:
            rank, device = r["probe"]["rank"], r["rank_device"]
            ops = [c["op"] for c in r["calls"]]
            expect(
                e, ops == ["all_reduce", "all_gather"], f"rank {rank} issued {ops}, expected all_reduce, all_gather"
            )
            expect(e, _on_device(r["calls"], device), f"rank {rank}: collective tensors not on {device}: {r['calls']}")
            if cuda:
                expect(e, r["probe"]["device"].startswith("cuda"), f"rank {rank}: probe device {r['probe']['device']}")
                expect(
                    e,
                    r["probe"]["device"] == device,
                    f"rank {rank}: collectives on {r['probe']['device']}, its device is {device}",
                )
        verdict = selfcheck.check_collectives(probes)  # SelfCheckError: the FAIL
        # the verdict can fail: a rank whose all-gather came back wrong is refused
        wrong = copy.deepcopy(probes)
        wrong[-1]["gathered"] = [0] * world if world > 1 else [1]
        try:
            selfcheck.check_collectives(wrong)
            refused = None
        except selfcheck.SelfCheckError as err:
            refused = str(err).splitlines()[1].strip()
        e["numbers"].update(verdict=verdict, control_error=refused)
        expect(e, refused is not None, "check_collectives accepted a wrong all-gather")
        e["summary"] = f"{backend}: '{verdict}'; control (a wrong all-gather) refused"
    if not cuda:  # the CPU variant, by hand: two gloo ranks gathered [0, 1]; the control's all-gather of zeros named
        assert e["numbers"]["world"] == 2 and [p["gathered"] for p in e["numbers"]["probes"]] == [[0, 1], [0, 1]]
        assert "all-gather gave [0, 0]" in e["numbers"]["control_error"], e["numbers"]
