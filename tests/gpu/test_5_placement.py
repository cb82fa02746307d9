"""Check 5: the start-up self-check's placement (``selfcheck.check_placement``) on the reports of ranks started
here (tests/gpu/ranks.py), rank r on GPU r (passes; on one GPU: one rank), every rank on GPU 0, the defect the check
exists for (must be refused), and several ranks on distinct devices (needs two GPUs on CUDA: a SKIP on one GPU, that
only). On the CPU: two gloo ranks with per-rank fake device ids."""

import pytest

from openrlhf_ess.checks import selfcheck
from tests.gpu.conftest import expect
from tests.gpu.ranks import NO_COLOCATE, launch_ranks, ranks_ok, world_for

FAKE = (
    "CPU: the device ids are per-rank fakes (CPU-FAKE-r); what runs for real is the launch, the gather and "
    "check_placement's verdict"
)


def table(reports):
    return [{k: r.get(k) for k in ("rank", "node", "pid", "device", "current_device")} for r in reports]


def test_placement(check, args, shared):
    cuda = args.device == "cuda"
    world = world_for(args)
    backend = "nccl" if cuda else "gloo"
    with check("5.placement", "selfcheck.check_placement on the reports of N ranks, rank r on GPU r") as e:
        e["notes"].append(
            "the check's own report (tests/gpu/ranks.py; selfcheck.placement_report needs Ray's runtime context): "
            "node = host name, device = GPU UUID (torch.cuda.get_device_properties(i).uuid), pid, current_device"
        )
        e["notes"] += [] if cuda else [FAKE]
        if world == 1:
            e["notes"].append(
                "one GPU: one rank (a NCCL group of one); several ranks on distinct GPUs is 5.placement_distinct, "
                "which needs two GPUs"
            )
        runs = ranks_ok(launch_ranks(args, "placement", world, {"backend": backend}, 150), "placement ranks")
        reports = [r["report"] for r in runs]
        gathered = runs[0]["gathered"]
        e["numbers"].update(world=world, backend=backend, reports=table(reports))
        expect(
            e,
            all(r["gathered"] == reports for r in runs),
            "the reports all-gathered over the group differ from the ranks' own",
        )
        want = [f"cuda:{r}" if cuda else "cpu" for r in range(world)]
        got = [r["current_device"] for r in reports]
        expect(e, got == want, f"current devices {got}, expected {want}")
        expect(e, len({r["pid"] for r in reports}) == world, "ranks share a pid")
        expect(e, len({r["device"] for r in reports}) == world, f"devices not distinct: {table(reports)}")
        if cuda:
            expect(e, all(r["device"].startswith("GPU-") for r in reports), f"not GPU UUIDs: {table(reports)}")
        verdict = selfcheck.check_placement({"actor": gathered}, NO_COLOCATE)  # SelfCheckError: the FAIL
        e["numbers"]["verdict"] = verdict
        want_verdict = f"placement: {world} trainer ranks on {world} devices"
        expect(e, verdict == want_verdict, f"verdict {verdict!r}, expected {want_verdict!r}")
        shared["placement"] = {"world": world, "reports": reports, "verdict": verdict}
        e["summary"] = f"{backend}, {world} rank(s): '{verdict}' (rank r on {'cuda:r' if cuda else 'fake id r'})"
    if not cuda:  # the CPU variant, by hand: gloo ranks with their fake ids (two unless --ranks), the verdict's words
        assert [r["device"] for r in e["numbers"]["reports"]] == [f"CPU-FAKE-{r}" for r in range(world)], e["numbers"]
        assert e["numbers"]["verdict"] == f"placement: {world} trainer ranks on {world} devices"


def test_placement_distinct(check, args, shared):
    cuda = args.device == "cuda"
    with check("5.placement_distinct", "several ranks, each on its own device, accepted as distinct") as e:
        if cuda and world_for(args) < 2:
            import torch

            pytest.skip(
                f"needs 2 GPUs: several NCCL ranks each on a GPU of its own (distinct UUIDs); this machine has "
                f"{torch.cuda.device_count()} (5.placement ran one rank on it, 5.placement_control the GPU-0 defect)"
            )
        got = shared.get("placement")
        if got is None:
            pytest.fail("5.placement did not run its ranks (it says why)", pytrace=False)
        devices = [r["device"] for r in got["reports"]]
        e["numbers"].update(world=got["world"], devices=devices, verdict=got["verdict"])
        expect(e, got["world"] >= 2, f"{got['world']} rank(s): not several")
        expect(e, len(set(devices)) == len(devices) == got["world"], f"devices not distinct: {devices}")
        expect(
            e,
            got["verdict"] == f"placement: {got['world']} trainer ranks on {got['world']} devices",
            f"the verdict does not count {got['world']} devices: {got['verdict']!r}",
        )
        e["summary"] = f"{got['world']} ranks on {len(set(devices))} distinct devices: '{got['verdict']}'"


def test_placement_control(check, args):
    cuda = args.device == "cuda"
    world = world_for(args)
    with check("5.placement_control", "negative control: every rank on device 0 (the GPU-0 defect) is refused") as e:
        n = max(world, 2)
        e["notes"].append(
            f"{n} processes, each on device 0 (torch.cuda.set_device(0)), as every rank of a node was after CUDA was "
            "initialised before Ray set CUDA_VISIBLE_DEVICES; their reports come back through files, as the real "
            "check's come back through Ray (NCCL refuses two ranks on one GPU, so no process group)"
        )
        e["notes"] += [] if cuda else [FAKE]
        runs = ranks_ok(launch_ranks(args, "placement", n, {"gpu": "zero"}, 120), "control ranks")
        reports = [r["report"] for r in runs]
        e["numbers"].update(world=n, reports=table(reports))
        devices = {r["device"] for r in reports}
        expect(e, len(devices) == 1, f"the ranks report {len(devices)} devices, expected one")
        try:
            verdict, raised = selfcheck.check_placement({"actor": reports}, NO_COLOCATE), None
        except selfcheck.SelfCheckError as err:
            verdict, raised = None, str(err)
        e["numbers"].update(error=raised, verdict=verdict)
        expect(e, raised is not None, f"check_placement accepted {n} ranks on one device: {verdict}")
        if raised:
            device = reports[0]["device"]
            expect(e, f"{device}: {n} ranks of actor" in raised, f"the error does not name {device} and {n} ranks")
            e["summary"] = f"SelfCheckError: {raised.splitlines()[1].strip()[:200]}"
    if not cuda:
        assert "CPU-FAKE-0: 2 ranks of actor" in (e["numbers"]["error"] or ""), e["numbers"]
