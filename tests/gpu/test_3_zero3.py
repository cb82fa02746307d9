"""Check 3: ZeRO-3 (world size 1): ``WeightSync.trainer_checksums`` / ``synced_state`` gather one parameter at a
time, as ZeRO-3's parameter status and as device memory, against a whole-model gather (the control). The route:
the real trainer (needs OpenRLHF), else a deepspeed.zero.Init model (``GPU_CHECK_ZERO3_ROUTE``: auto, trainer,
init). Slow on the CPU."""

import tempfile
import time
import types
from typing import List

import pytest

from openrlhf_ess.trainer import sync_check
from tests.gpu.conftest import expect, own_process
from tests.gpu.harness import SLACK_BYTES, _build_model_dir, missing_reason, single_rank_env, torch_adam_on_cuda

pytestmark = pytest.mark.slow

# wider and deeper than the tiny world: a gathered parameter (one MLP matrix, 2**19 elements) is about 1/40 of
# the model, so a whole-model gather stands out above "the largest parameter + one float64 copy of it"
ZERO3_SPEC = dict(
    hidden_size=512, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=8, intermediate_size=1024
)


def _zero3_trainer(world: dict):
    """The real actor (upstream's strategy and Actor, our ActorPPOTrainer) as tests/helpers/zero3_memory.py builds
    it, but bf16; returns (module, engine, WeightSync)."""
    from tests.helpers.ds_actor import build_actor
    from tests.helpers.ess_ds import MICRO

    strategy, model, optim, scheduler = build_actor(
        world["model"],
        world["prompts"],
        3,
        "bf16",
        MICRO,
        MICRO,
        extra=["--vllm.num_engines", "1", "--algo.kl.init_coef", "0"],
        zero_overrides={"stage3_param_persistence_threshold": 100},
    )
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    trainer = ActorPPOTrainer(
        strategy, model, None, optim, scheduler, micro_train_batch_size=MICRO, dataloader_pin_memory=False
    )
    return model.model.module, model.model, trainer.weight_sync


def _zero3_init_model(world: dict, backend: str):
    """No OpenRLHF: transformers loads the model under deepspeed.zero.Init (HfDeepSpeedConfig, ZeRO-3), and
    WeightSync runs on a stand-in trainer."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from openrlhf_ess.trainer.weight_sync import WeightSync

    deepspeed.init_distributed(dist_backend=backend)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
        "bf16": {"enabled": True},
    }
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - while it lives, from_pretrained builds under zero.Init
    module = AutoModelForCausalLM.from_pretrained(world["model"], dtype=torch.bfloat16)
    ns = types.SimpleNamespace
    trainer = ns(args=ns(ds=ns(zero_stage=3)), actor=ns(model=ns(module=module)))
    return module, None, WeightSync(trainer)


def _zero3_route(args, notes: List[str]):
    """("trainer" | "init", None), or (None, why the check is skipped)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        return None, f"DeepSpeed does not import ({missing_reason(err)})"
    if args.zero3_route != "init":
        try:
            import openrlhf_ess.trainer.ray.ppo_actor  # noqa: F401
            import tests.helpers.ds_actor  # noqa: F401

            return "trainer", None
        except ImportError as err:
            if args.zero3_route == "trainer":
                return None, f"--zero3-route trainer, but {missing_reason(err)}"
            notes.append(f"real trainer not built ({missing_reason(err)}): the deepspeed.zero.Init route instead")
    try:
        import openrlhf_ess.trainer.weight_sync  # noqa: F401
    except ImportError as err:
        return None, f"openrlhf_ess.trainer.weight_sync does not import ({missing_reason(err)})"
    return "init", None


def _zero3_measure(args, route: str, notes: List[str]) -> dict:
    """Build the ZeRO-3 model, then run trainer_checksums, synced_state and the whole-model control, each from an
    empty partition cache, sampling ZeRO-3's gathered elements and (CUDA) the allocator's peak."""
    import deepspeed
    import torch

    from openrlhf_ess.trainer import sync_check
    from tests.helpers.zero3_memory import Peak, gathered_elements

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    single_rank_env()
    adam = torch_adam_on_cuda(args) if route == "trainer" else None
    notes += [adam] if adam else []
    world = _build_model_dir(tempfile.mkdtemp(prefix="gpu_check_zero3_"), ZERO3_SPEC)
    if route == "trainer":
        module, engine, ws = _zero3_trainer(world)
        notes.append(
            "route: the real actor (upstream's DeepspeedStrategy + Actor, our ActorPPOTrainer, as "
            "tests/helpers/zero3_memory.py builds it), bf16, ZeRO-3, stage3_param_persistence_threshold 100"
        )
    else:
        module, engine, ws = _zero3_init_model(world, "nccl" if cuda else "gloo")
        notes.append(
            "route: no OpenRLHF strategy or engine: transformers loads the model under deepspeed.zero.Init "
            "(HfDeepSpeedConfig, ZeRO-3, bf16, stage3_param_persistence_threshold 100); WeightSync's own methods "
            "on a stand-in trainer"
        )
    params = list(module.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_tensor") and not p.ds_persist]
    largest = max(partitioned, key=lambda p: p.ds_numel)
    m = dict(
        route=route,
        parameters=len(params),
        partitioned=len(partitioned),
        persistent=len(params) - len(partitioned),
        largest_numel=largest.ds_numel,
        whole_partitioned_numel=sum(p.ds_numel for p in partitioned),
        model_numel=sum(p.ds_numel for p in params),
        param_bytes_per_element=largest.ds_tensor.element_size(),
    )
    peak = Peak(module)

    def whole_model_control():
        """The pre-fix pattern: every parameter gathered at once, then summed."""
        with deepspeed.zero.GatheredParameters(params):
            return {n: sync_check.checksum(p.data) for n, p in module.named_parameters()}

    results, memory, left, seconds = {}, {}, {}, {}

    def phase(name, fn):
        if engine is not None:
            engine.empty_partition_cache()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        peak.phase = name
        results[name] = fn()
        peak.phase = None
        if cuda:
            torch.cuda.synchronize()
            memory[name] = torch.cuda.max_memory_allocated() - base
        seconds[name] = round(time.perf_counter() - t0, 4)
        left[name] = gathered_elements(module)

    if cuda:
        # The first float64 torch.dot of a process makes cuBLAS's workspace (32 MiB on an H200, through the caching
        # allocator): a one-time, constant cost that a real run has paid in its first training step, before any
        # sync. Measured on an H200, without this the checksums phase grew by exactly 32 MiB + its chunk + 1 MiB.
        before = torch.cuda.memory_allocated()
        sync_check.checksum(torch.ones(8, dtype=torch.bfloat16, device="cuda"))
        torch.cuda.synchronize()
        m["warmup_bytes_kept"] = torch.cuda.memory_allocated() - before
    with peak.sampling(forwards=False):
        phase("checksums", ws.trainer_checksums)
        phase("synced_state", ws.synced_state)
        phase("whole_model_control", whole_model_control)
    # the one-at-a-time gathers read the full values: the checksums agree with the copied weights
    from_state = sync_check.combine_checksums((n, sync_check.checksum(t)) for n, t in results["synced_state"].items())
    bad, compared = sync_check.mismatched(results["checksums"], from_state, sync_check.SAME_DTYPE_TOL)
    m.update(
        peaks=peak.peaks,
        left=left,
        memory=memory,
        phase_seconds=seconds,
        mismatched=bad,
        compared=compared,
        checksum_elements=sum(v[2] for v in results["checksums"].values()),
    )
    m["world_size"] = torch.distributed.get_world_size()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return m


IDS = ("3.zero3_gather_elements", "3.zero3_gather_memory")
NAMES = (
    "WeightSync.trainer_checksums / synced_state gather one parameter at a time (ZeRO-3 parameter status)",
    "... and their peak device memory growth (torch.cuda.max_memory_allocated)",
)


def test_zero3_gather_elements(check, args, deepspeed_stack, shared):
    notes = list(deepspeed_stack)
    route, reason = _zero3_route(args, notes)
    shared.update(notes=notes, reason=reason)
    with check(IDS[0], NAMES[0]) as e:
        e["notes"] = notes  # the same list: the route's notes land here too
        if reason:
            pytest.skip(reason)
        own_process("check 3")
        m = shared["m"] = _zero3_measure(args, route, notes)
        largest, whole, peaks, left = m["largest_numel"], m["whole_partitioned_numel"], m["peaks"], m["left"]
        e["numbers"].update({k: v for k, v in m.items() if k not in ("memory", "peaks", "left")})
        e["numbers"].update(peak_gathered_elements=peaks, left_gathered=left)
        for name in ("checksums", "synced_state"):
            got = peaks.get(name, 0)
            expect(e, 0 < got <= largest, f"{name} held {got} elements gathered at once, more than {largest}")
            expect(e, left[name] == 0, f"{name} left {left[name]} elements gathered")
        control = peaks.get("whole_model_control", 0)
        expect(e, control == whole > 3 * largest, f"control gathered {control}, expected the whole {whole}")
        expect(e, not m["mismatched"] and m["compared"] > 0, f"trainer_checksums != synced_state on {m['mismatched']}")
        expect(e, m["checksum_elements"] == m["model_numel"], f"checksums cover {m['checksum_elements']} elements")
        e["summary"] = (
            f"route {route}: peak gathered {peaks.get('checksums')} / {peaks.get('synced_state')} elements "
            f"(largest parameter {largest}); whole-model control {control} of {whole}"
        )


def test_zero3_gather_memory(check, args, shared):
    notes, m = shared.get("notes", []), shared.get("m")
    reason = shared.get("reason")
    with check(IDS[1], NAMES[1]) as e:
        e["notes"] = list(notes)
        if reason:
            pytest.skip(reason)
        if m is None:
            pytest.skip(f"no measurement: the model was not built or measured ({IDS[0]} says why)")
        if args.device != "cuda":
            pytest.skip("CPU: torch has no peak-allocation counter for host memory (torch.cuda.max_memory_allocated)")
        largest, elem, memory = m["largest_numel"], m["param_bytes_per_element"], m["memory"]
        copy_bytes = min(largest, sync_check.CHUNK_ELEMENTS) * 8
        bound = largest * elem + copy_bytes + SLACK_BYTES
        e["notes"].append(
            "bound: the largest parameter's bytes + one float64 copy of its (first) checksum chunk "
            f"(min(numel, CHUNK_ELEMENTS) x 8) + {SLACK_BYTES} bytes slack"
        )
        # checksums' growth beyond the gathered parameter, in float64 copies of it (the bound allows 1)
        copies = round((memory["checksums"] - largest * elem) / copy_bytes, 3)
        e["numbers"].update(
            route=m["route"],
            peak_growth_bytes=memory,
            bound_bytes=bound,
            largest_param_bytes=largest * elem,
            whole_partitioned_bytes=m["whole_partitioned_numel"] * elem,
            checksums_float64_copies=copies,
            cublas_warmup_bytes_kept=m.get("warmup_bytes_kept"),
            world_size=m["world_size"],
        )
        for name in ("checksums", "synced_state"):
            why = ""
            if name == "checksums":
                why = f" (= largest parameter + {copies} float64 copies of it: see 2.checksum_memory)"
            expect(e, memory[name] <= bound, f"{name} grew the peak by {memory[name]} bytes, above {bound}" + why)
        world = m["world_size"]
        control_sees = memory["whole_model_control"] > bound
        if world > 1:
            expect(
                e,
                control_sees,
                f"the whole-model control grew the peak by {memory['whole_model_control']} bytes only, not above "
                f"the bound {bound}: this model cannot tell one parameter from the whole",
            )
        elif not control_sees:
            # Measured on an H200 (world of one): gathering all 21M parameters grew the peak by the float64 chunk
            # alone. The partition is the whole parameter, so a gather allocates nothing: memory cannot tell one
            # parameter from the whole here, and 3.zero3_gather_elements (ZeRO-3's parameter status) is the
            # check of the gathers. This entry still bounds what the checksums and the copies allocate.
            e["notes"].append(
                f"world of one: the whole-model control grew the peak by {memory['whole_model_control']} bytes "
                "(a gather allocates nothing when the partition is the whole parameter), so this entry bounds "
                "what the checksums and copies allocate, not the gathers; 3.zero3_gather_elements checks those"
            )
        e["summary"] = (
            f"route {m['route']}: peak +{memory['checksums'] / 2**20:.2f} / +{memory['synced_state'] / 2**20:.2f} MiB "
            f"(bound {bound / 2**20:.2f} MiB); whole-model control +{memory['whole_model_control'] / 2**20:.2f} MiB"
        )
