"""Check 7: the memory self-check (``memory_needs`` / ``check_memory``) on a stated 7B case against the arithmetic,
with this GPU's ``torch.cuda.mem_get_info``."""

import types

import pytest

from openrlhf_ess.checks import selfcheck
from tests.gpu.conftest import expect

# the stated case: a 7B model in bf16 (7.0e9 parameters), its largest parameter a 152,064 x 3,584 bf16 embedding
# (Qwen2.5-7B's), 8 actor ranks under ZeRO-3, --algo.prox_mode snapshot, the sync check on (its default 0.5)
MEMORY_CASE = dict(params=7_000_000_000, bytes_per_param=2, largest=152_064 * 3_584 * 2, world=8)
MEMORY_ARGS = types.SimpleNamespace(
    algo=types.SimpleNamespace(prox_mode="snapshot", prox_score_memory_mb=2048),
    vllm=types.SimpleNamespace(sync_check_tol=0.5),
    ds=types.SimpleNamespace(zero_stage=3),
)
MEMORY_CASE_TEXT = (
    "stated case: 7B parameters in bf16 (14.0e9 bytes), largest parameter 152,064 x 3,584 bf16 (1.09e9 bytes), "
    "8 ranks, ZeRO-3, --algo.prox_mode snapshot, --vllm.sync_check_tol 0.5"
)


def _memory_expected() -> dict:
    """The stated case's needs by hand (docs/gpu_path.md's table): the sync check holds one gathered parameter + one
    float64 chunk of 2^24 elements; snapshot moves the rank's stored partition (model / world) to the device."""
    c = MEMORY_CASE
    return {"sync_check": c["largest"] + (1 << 24) * 8, "snapshot": c["params"] * c["bytes_per_param"] // c["world"]}


def _memory_verdict(report: dict):
    from openrlhf_ess.checks import selfcheck

    try:
        return selfcheck.check_memory([report], MEMORY_ARGS), None
    except selfcheck.SelfCheckError as err:
        return None, str(err)


c, MiB = MEMORY_CASE, 1 << 20
model_bytes = c["params"] * c["bytes_per_param"]
hand = _memory_expected()
need = sum(hand.values())
case = {"model_bytes": model_bytes, "largest_param_bytes": c["largest"], "world": c["world"]}


def test_memory_decision(check, args):
    with check("7.memory_decision", "selfcheck.memory_needs / check_memory against the arithmetic") as e:
        e["notes"].append(MEMORY_CASE_TEXT)
        needs = selfcheck.memory_needs(MEMORY_ARGS, model_bytes, c["largest"], c["world"])
        e["numbers"].update(needs=needs, need_by_hand=hand, need_bytes=need, need_mib=round(need / MiB, 1))
        expect(e, sorted(needs.values()) == sorted(hand.values()), f"memory_needs gave {needs}, by hand {hand}")
        cases = {}
        for name, free in (("below", need - MiB), ("equal", need), ("above", need + MiB), ("unmeasured", None)):
            verdict, error = _memory_verdict({**case, "free": free, "total": None if free is None else 2 * need})
            cases[name] = {"free": free, "verdict": verdict, "error": error}
        e["numbers"]["cases"] = cases
        expect(e, cases["below"]["error"] is not None, f"free = need - 1 MiB accepted: {cases['below']['verdict']}")
        expect(
            e,
            "The largest is --algo.prox_mode snapshot" in (cases["below"]["error"] or ""),
            "the refusal does not name --algo.prox_mode snapshot (the larger need)",
        )
        for name in ("equal", "above"):
            expect(e, cases[name]["error"] is None, f"free {name} the need refused: {cases[name]['error']}")
        expect(e, "not measured" in (cases["unmeasured"]["verdict"] or ""), "free = None not reported unmeasured")
        e["summary"] = (
            f"need {need / MiB:,.0f} MiB (sync check {hand['sync_check'] / MiB:,.0f} + snapshot "
            f"{hand['snapshot'] / MiB:,.0f}); free = need - 1 MiB refused, = need and + 1 MiB accepted"
        )


def test_memory_measured(check, args):
    with check("7.memory_measured", "selfcheck.memory_probe + check_memory with torch.cuda.mem_get_info") as e:
        e["notes"].append(MEMORY_CASE_TEXT + "; free and total: this GPU's, measured by memory_probe")
        if args.device != "cuda":
            pytest.skip("CPU: torch.cuda.mem_get_info needs a CUDA device (7.memory_decision checks the arithmetic)")
        import torch

        torch.cuda.set_device(0)
        module = torch.nn.Linear(1024, 1000, dtype=torch.bfloat16, device="cuda")  # 1024 x 1000 + 1000 bf16
        probe = selfcheck.memory_probe(types.SimpleNamespace(actor=module))  # upstream's actor.actor: the module
        own_free, own_total = torch.cuda.mem_get_info()
        e["numbers"].update(probe=probe, mem_get_info=[own_free, own_total])
        want = (1024 * 1000 + 1000) * 2
        expect(e, probe["model_bytes"] == want, f"memory_probe counted {probe['model_bytes']} bytes, expected {want}")
        expect(e, probe["largest_param_bytes"] == 1024 * 1000 * 2, f"largest {probe['largest_param_bytes']}")
        free, total = probe["free"], probe["total"]
        expect(e, free is not None and 0 < free <= total, f"mem_get_info gave free {free}, total {total}")
        expect(e, total == own_total, f"total {total} != torch.cuda.mem_get_info's {own_total}")
        if free is None:
            return
        verdict, error = _memory_verdict({**case, "free": free, "total": total})
        refused_by_hand = need > free
        e["numbers"].update(
            free_mib=round(free / MiB, 1),
            total_mib=round(total / MiB, 1),
            need_mib=round(need / MiB, 1),
            refused=error is not None,
            refused_by_hand=refused_by_hand,
            verdict=verdict,
            error=error,
        )
        expect(
            e,
            (error is not None) == refused_by_hand,
            f"check_memory {'refused' if error else 'accepted'} "
            f"need {need} with free {free}: the arithmetic says {'refuse' if refused_by_hand else 'accept'}",
        )
        e["summary"] = f"free {free / MiB:,.0f} of {total / MiB:,.0f} MiB, need {need / MiB:,.0f} MiB: " + (
            "refused, as the arithmetic says" if error else "accepted, as the arithmetic says"
        )
