"""Check 7: the memory self-check (``memory_needs`` / ``check_memory``) on a stated 7B case against the arithmetic;
and, on CUDA, ``memory_probe`` with this GPU's ``torch.cuda.mem_get_info`` while the caching allocator holds a freed
block: the cached memory must count as free."""

import types

import pytest

from openrlhf_ess.checks import selfcheck
from tests.gpu.conftest import expect
from tests.gpu.harness import available

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


BLOCK = 256 << 20  # the block 7.memory_measured allocates and frees: the caching allocator keeps it reserved
# the measured case's args: only the snapshot's partition is needed (no sync check), so the need is model_bytes / world
CACHED_ARGS = types.SimpleNamespace(
    algo=types.SimpleNamespace(prox_mode="snapshot", prox_score_memory_mb=0),
    vllm=types.SimpleNamespace(sync_check_tol=0.0),
    ds=types.SimpleNamespace(zero_stage=3),
)


def _cache_a_block(nbytes: int) -> None:
    """Allocate ``nbytes`` on the current CUDA device and free them: PyTorch's caching allocator keeps the block
    reserved (``memory_reserved`` - ``memory_allocated`` grows by it), free to this process though mem_get_info
    counts it as taken."""
    import torch

    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    del block


def test_memory_measured(check, args, monkeypatch):
    with check("7.memory_measured", "selfcheck.memory_probe counts the allocator's cached memory as free") as e:
        e["notes"].append(
            "the product's rule (selfcheck.memory_probe): free = torch.cuda.mem_get_info()'s free + "
            "(memory_reserved - memory_allocated); here a 256 MiB block is allocated and freed first, so the "
            "allocator holds at least 256 MiB cached"
        )
        if args.device != "cuda":
            pytest.skip(
                "CPU: no caching allocator to hold freed memory (memory_probe measures nothing without CUDA; "
                "7.memory_decision checks the arithmetic)"
            )
        import torch

        torch.cuda.set_device(0)
        module = torch.nn.Linear(1024, 1000, dtype=torch.bfloat16, device="cuda")  # 1024 x 1000 + 1000 bf16
        _cache_a_block(BLOCK)
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        cached = reserved - allocated
        seen = []  # what mem_get_info gave the probe
        real_mem_get_info = torch.cuda.mem_get_info

        def recorded(*a, **k):
            seen.append(real_mem_get_info(*a, **k))
            return seen[-1]

        monkeypatch.setattr(torch.cuda, "mem_get_info", recorded)
        probe = selfcheck.memory_probe(types.SimpleNamespace(actor=module))  # upstream's actor.actor: the module
        monkeypatch.setattr(torch.cuda, "mem_get_info", real_mem_get_info)
        e["numbers"].update(
            probe=probe, mem_get_info=seen, reserved=reserved, allocated=allocated, cached=cached, block=BLOCK
        )
        want = (1024 * 1000 + 1000) * 2
        expect(e, probe["model_bytes"] == want, f"memory_probe counted {probe['model_bytes']} bytes, expected {want}")
        expect(e, probe["largest_param_bytes"] == 1024 * 1000 * 2, f"largest {probe['largest_param_bytes']}")
        expect(e, cached >= BLOCK, f"the allocator holds {cached} bytes cached after a {BLOCK}-byte block was freed")
        expect(e, len(seen) == 1, f"memory_probe called mem_get_info {len(seen)} times, expected once")
        if len(seen) != 1 or probe["free"] is None:
            return
        raw_free, total = seen[0]
        free = probe["free"]
        expect(e, total == probe["total"], f"total {probe['total']} != mem_get_info's {total}")
        expect(
            e,
            free == raw_free + cached,
            f"memory_probe's free {free} != mem_get_info's {raw_free} + cached {cached}: the cached memory is not "
            "counted as free",
        )
        # the verdict: a need above mem_get_info's free but within free + cached must be accepted
        need_bytes = raw_free + cached // 2
        report = {"model_bytes": need_bytes, "largest_param_bytes": 0, "world": 1, "free": free, "total": total}
        needs = selfcheck.memory_needs(CACHED_ARGS, need_bytes, 0, 1)
        expect(e, sum(needs.values()) == need_bytes, f"memory_needs gave {needs}, expected {need_bytes} in all")
        try:
            verdict, error = selfcheck.check_memory([report], CACHED_ARGS), None
        except selfcheck.SelfCheckError as err:
            verdict, error = None, str(err)
        try:
            selfcheck.check_memory([{**report, "free": raw_free}], CACHED_ARGS)
            control = None
        except selfcheck.SelfCheckError as err:
            control = str(err)
        e["numbers"].update(need=need_bytes, verdict=verdict, error=error, control_error=control)
        counted = raw_free + cached
        expect(e, error is None, f"need {need_bytes} <= mem_get_info's free + cached {counted} refused: {error}")
        expect(e, control is not None, f"need {need_bytes} > mem_get_info's free {raw_free} accepted without cache")
        e["summary"] = (
            f"{cached / MiB:,.0f} MiB cached counted as free ({free / MiB:,.0f} = {raw_free / MiB:,.0f} + "
            f"{cached / MiB:,.0f} MiB); a need between the two accepted, refused without the cache"
        )


def test_step_floor(check, args, deepspeed_stack):
    """The memory check's floors of a training micro-batch and a no-grad forward (``selfcheck.step_floor`` /
    ``logits_floor``) against what upstream's ``Actor`` (OpenRLHF) holds on this device: CUDA, a random 2-layer
    Qwen2 of hidden 2,048, V = 151,936, bf16, one row of 4,096 tokens, the peak growth of ``max_memory_allocated``
    over the resident model (with the device's attention and cross-entropy kernels, flash-attn's where installed);
    CPU, 2 layers of hidden 128, V = 8,192, 2 rows of 256, torch.profiler's memory events. The floor must not exceed
    the measurement: a floor above it would refuse runs that fit."""
    with check("7.step_floor", "the step's and a forward's activation floors under upstream's Actor") as e:
        e["notes"].extend(deepspeed_stack)  # openrlhf.models imports flash_attn: the shim where it is missing
        if not (available("openrlhf") and available("deepspeed")):  # the wheel folder brings both to the image
            pytest.skip(
                "OpenRLHF is not installed: the floors are of upstream's Actor, whose package imports DeepSpeed "
                "(the wheel folder brings both)"
            )
        import torch

        from benchmarks.opob_norm_memory import build
        from tests.helpers.actor_memory import measured_and_floors

        cuda = args.device == "cuda"
        hidden, head_dim, vocab, rows, length = (2048, 128, 151_936, 1, 4096) if cuda else (128, 32, 8192, 2, 256)
        sdpa = {"attn_implementation": "sdpa"}
        model = build(2, hidden, vocab, head_dim, max_len=length, device=args.device, dtype=torch.bfloat16, **sdpa)
        measured, floors, shape = measured_and_floors(model, rows, length, args.device)
        e["numbers"].update(measured=measured, floors=floors, shape=shape, tokens=rows * length)
        for name in ("step", "forward"):
            expect(
                e,
                floors[name] <= measured[name],
                f"{name}: the floor {floors[name] / MiB:,.0f} MiB exceeds the measured "
                f"{measured[name] / MiB:,.0f} MiB",
            )
        e["summary"] = ", ".join(
            f"{k}: floor {floors[k] / MiB:,.0f} MiB of measured {measured[k] / MiB:,.0f} MiB "
            f"({floors[k] / max(measured[k], 1):.2f})"
            for k in ("step", "forward")
        )
