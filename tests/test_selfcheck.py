"""Start-up self-checks: each fires on the fault it exists for, with the contract and the fix named.

The faults are built the way the GPU cluster would show them: reports of two ranks on one physical device (what
a worker hook that initialised CUDA produced), a collective that came back wrong, a rank with too little free
memory. The passing side runs in every e2e run (``tests/test_e2e_cli.py::_check_run`` asserts the log line) and
the collective probe on two ranks under the virtual NCCL (``tests/test_device_discipline.py``).
"""

import types

import pytest

from openrlhf_ess.checks import selfcheck
from openrlhf_ess.checks.selfcheck import SelfCheckError


def _rank(device, pid, node="aaaa0001"):
    return {"node": node, "device": device, "pid": pid, "current_device": "cuda:0", "cuda_visible_devices": "0,1"}


def _args(colocate_all=False, colocate_actor_ref=False, colocate_critic_reward=False):
    train = types.SimpleNamespace(
        colocate_all=colocate_all, colocate_actor_ref=colocate_actor_ref, colocate_critic_reward=colocate_critic_reward
    )
    return types.SimpleNamespace(train=train)


def test_two_ranks_of_one_role_on_one_gpu_stop_the_run_with_the_table():
    # every actor on GPU 0, as a cluster shows it: both actor ranks report physical GPU 0 (same UUID)
    reports = {"actor": [_rank("GPU-0000", 11), _rank("GPU-0000", 12)], "reference": [_rank("GPU-1111", 13)]}
    with pytest.raises(SelfCheckError, match=r"(?s)placement.*GPU-0000: 2 ranks of actor: actor rank 0 \(pid 11"):
        selfcheck.check_placement(reports, _args(colocate_all=True))  # even colocate_all never shares one role


def test_two_roles_on_one_gpu_need_a_colocate_flag():
    reports = {"actor": [_rank("GPU-0000", 11)], "reference": [_rank("GPU-0000", 12)]}
    with pytest.raises(SelfCheckError, match=r"roles actor/reference without a --train.colocate_\* flag"):
        selfcheck.check_placement(reports, _args())
    assert "2 trainer ranks on 1 devices" in selfcheck.check_placement(reports, _args(colocate_actor_ref=True))
    with pytest.raises(SelfCheckError):  # the critic/reward flag does not cover actor/reference
        selfcheck.check_placement(reports, _args(colocate_critic_reward=True))


def test_distinct_devices_and_nodes_pass():
    reports = {
        "actor": [_rank("GPU-0000", 11), _rank("GPU-1111", 12), _rank("GPU-0000", 13, node="bbbb0002")],
        "reference": [_rank("GPU-2222", 14), {"node": "aaaa0001", "device": None, "pid": 15}],
    }
    assert "5 trainer ranks on 4 devices" in selfcheck.check_placement(reports, _args())


def _probe(rank, world=2, maximum=None, gathered=None, device="cuda:0", cuda=True):
    return {
        "rank": rank,
        "world": world,
        "device": device,
        "cuda": cuda,
        "max": maximum if maximum is not None else [float(world - 1), 0.0],
        "gathered": gathered if gathered is not None else list(range(world)),
    }


def test_collectives_that_came_back_wrong_or_on_the_host_are_named():
    assert "2 actor rank(s)" in selfcheck.check_collectives([_probe(0), _probe(1)])
    with pytest.raises(SelfCheckError, match=r"rank 1: all-gather gave \[0, 0\], expected \[0, 1\]"):
        selfcheck.check_collectives([_probe(0), _probe(1, gathered=[0, 0])])
    with pytest.raises(SelfCheckError, match=r"rank 0: collectives on cpu although CUDA is available"):
        selfcheck.check_collectives([_probe(0, device="cpu"), _probe(1)])


def _memory_args(prox_mode="snapshot", zero_stage=3, tol=1e-3):
    return types.SimpleNamespace(
        algo=types.SimpleNamespace(prox_mode=prox_mode, prox_score_memory_mb=2048),
        vllm=types.SimpleNamespace(sync_check_tol=tol),
        ds=types.SimpleNamespace(zero_stage=zero_stage),
    )


def test_memory_needs_follow_the_documented_table():
    gib = 1 << 30
    # 70B in bf16 = 140 GB over 16 ZeRO-3 ranks; largest parameter: the 8192 x 152k embedding, 2.5 GB
    model, largest = 140 * gib, 8192 * 151936 * 2
    needs = selfcheck.memory_needs(_memory_args("snapshot"), model, largest, 16)
    assert needs == {
        "--vllm.sync_check_tol (0 disables the sync check)": largest + 128 * 2**20,
        "--algo.prox_mode snapshot": model // 16,
    }
    assert selfcheck.memory_needs(_memory_args("ewma", zero_stage=2, tol=0), model, largest, 16) == {
        # ZeRO 0-2: the whole model swapped in (16-bit) + the largest parameter in fp32 while it is cast there
        "--algo.prox_mode ewma": model + 2 * largest
    }
    assert selfcheck.memory_needs(_memory_args("interrupt"), model, largest, 16)["--algo.prox_score_memory_mb"] == (
        2048 * 2**20
    )


def test_a_rank_without_room_for_the_features_is_refused_naming_the_flag():
    gib = 1 << 30
    report = {"model_bytes": 140 * gib, "largest_param_bytes": gib, "world": 16, "free": 4 * gib, "total": 80 * gib}
    with pytest.raises(SelfCheckError, match=r"memory.*4,096 MiB free.*The largest is --algo.prox_mode snapshot"):
        selfcheck.check_memory([report, {**report, "free": 60 * gib}], _memory_args("snapshot"))
    assert "<= 61,440 MiB free" in selfcheck.check_memory([{**report, "free": 60 * gib}], _memory_args("snapshot"))
    assert "not measured" in selfcheck.check_memory([{**report, "free": None}], _memory_args())


def test_free_memory_counts_what_the_allocator_holds_unused(monkeypatch):
    """mem_get_info() counts PyTorch's cached-but-unused blocks as taken; upstream's fit() empties
    the cache anyway, so they are free to the run. The GPU branch is driven with recorders of torch.cuda's answers:
    4 GiB free by the driver, 10 GiB reserved by the allocator of which 2 GiB allocated -> 12 GiB usable."""
    import torch

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (4 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 * gib)
    report = selfcheck.memory_probe(object())
    assert report["free"] == 12 * gib and report["cached"] == 8 * gib and report["total"] == 80 * gib
    # a 70B snapshot run over 16 ranks needs ~9.9 GiB more per rank: refused on the driver's 4 GiB, fits in 12
    report.update(model_bytes=140 * gib, largest_param_bytes=gib, world=16)
    assert "<= 12,288 MiB free" in selfcheck.check_memory([report], _memory_args("snapshot"))
    with pytest.raises(SelfCheckError, match="4,096 MiB free"):
        selfcheck.check_memory([{**report, "free": 4 * gib}], _memory_args("snapshot"))


# The training step's activations (the floors of selfcheck.step_floor / logits_floor) at real sizes and on a real
# upstream Actor.

QWEN7B = {"vocab": 151936, "layers": 28, "hidden_size": 3584, "dtype_bytes": 2}
LLAMA70B = {"vocab": 151936, "layers": 80, "hidden_size": 8192, "dtype_bytes": 2}


def test_the_activation_floors_at_real_sizes():
    """By hand: bf16 logits and their fp32 copy, 2 + 4 bytes a vocabulary entry; an fp32 model's cast copies
    nothing; each layer's input, H · 2 bytes a token."""
    mib = 1 << 20
    assert selfcheck.logits_floor(4096, 151936, 2) == 4096 * 151936 * 6  # 3,561 MiB
    assert selfcheck.logits_floor(4096, 151936, 4) == 4096 * 151936 * 4
    assert selfcheck.step_floor(4096, **QWEN7B) == 4096 * 151936 * 6 + 28 * 4096 * 3584 * 2
    assert round(selfcheck.step_floor(4096, **QWEN7B) / mib) == 3561 + 784


def _step_args(train_micro=1, rollout_micro=4, max_len=4096, prox_mode="snapshot", zero_stage=3, dynamic=False):
    return types.SimpleNamespace(
        algo=types.SimpleNamespace(prox_mode=prox_mode, prox_score_memory_mb=2048),
        vllm=types.SimpleNamespace(sync_check_tol=1e-3),
        ds=types.SimpleNamespace(zero_stage=zero_stage, ring_attn_size=1),
        data=types.SimpleNamespace(max_len=max_len),
        train=types.SimpleNamespace(
            micro_batch_size=train_micro, dynamic_batch_enable=dynamic, max_tokens_per_gpu=16192
        ),
        rollout=types.SimpleNamespace(micro_batch_size=rollout_micro, max_tokens_per_gpu=None),
    )


def test_the_memory_check_takes_the_step_off_and_counts_the_swapped_forward():
    """70B over 16 ZeRO-3 ranks, snapshot, 4,096 tokens: the swapped forward's logits at the rollout micro-batch
    join the swap's copy, and the step's floor comes off the free memory. 20 GiB free passed before (the copy and
    the checksums, 11.2 GiB) and is refused now; the step alone above the free memory warns and does not refuse."""
    gib, mib = 1 << 30, 1 << 20
    largest = 8192 * 151936 * 2
    report = {"model_bytes": 140 * gib, "largest_param_bytes": largest, "world": 16, "shape": LLAMA70B}
    args = _step_args(rollout_micro=1)
    needs = selfcheck.memory_needs(args, 140 * gib, largest, 16, shape=LLAMA70B)
    forward = 4096 * 151936 * 6  # one row of the rollout micro-batch: bf16 logits + the fp32 copy
    assert needs == {
        "--vllm.sync_check_tol (0 disables the sync check)": largest + 128 * mib,
        "--algo.prox_mode snapshot": 140 * gib // 16,
        "--algo.prox_mode snapshot: its forward's logits (--rollout.micro_batch_size)": forward,
    }
    step = 4096 * 151936 * 6 + 80 * 4096 * 8192 * 2  # 8,681 MiB
    need = sum(needs.values())  # 14,906 MiB
    assert "<= 20,480 MiB free" in selfcheck.check_memory([{**report, "shape": None, "free": 20 * gib}], args)
    with pytest.raises(SelfCheckError, match=r"20,480 MiB free .* less 8,681 MiB for the training step.* 11,799 MiB"):
        selfcheck.check_memory([{**report, "free": 20 * gib}], args)
    free = step + need + mib
    line = selfcheck.check_memory([{**report, "free": free}], args)
    assert f"{need / mib:,.0f} MiB stated peak of our features <= {(free - step) / mib:,.0f} MiB free" in line
    assert "after the step's 8,681 MiB" in line
    warning = selfcheck.check_memory([{**report, "free": 8 * gib}], args)
    assert warning.startswith("memory: WARNING: 8,192 MiB free") and "at least 8,681 MiB" in warning
    # a rollout micro-batch of 16 rows: the swapped forward's logits alone are 55.6 GiB, named as the largest
    with pytest.raises(SelfCheckError, match=r"The largest is --algo.prox_mode snapshot: its forward's logits"):
        selfcheck.check_memory([{**report, "free": 60 * gib}], _step_args(rollout_micro=16))
    assert "<= " in selfcheck.check_memory([{**report, "free": 80 * gib}], _step_args(rollout_micro=16))


def test_the_step_floor_follows_dynamic_batches_and_ring_attention():
    args = _step_args(train_micro=2, dynamic=True)
    assert selfcheck._micro_tokens(args, "train") == 16192  # --train.max_tokens_per_gpu
    assert selfcheck._micro_tokens(args, "rollout") == 16192  # --rollout.max_tokens_per_gpu unset: train's
    args.rollout.max_tokens_per_gpu = 8000
    assert selfcheck._micro_tokens(args, "rollout") == 8000
    args.train.dynamic_batch_enable = False
    assert selfcheck._micro_tokens(args, "train") == 2 * 4096 and selfcheck._micro_tokens(args, "rollout") == 4 * 4096
    args.ds.ring_attn_size = 3  # the sequence split over the ring's ranks, rounded up
    assert selfcheck._micro_tokens(args, "train") == -(-2 * 4096 // 3)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_floors_hold_under_upstreams_actor(dtype):
    """Peak of live CPU allocations (torch.profiler's memory events) of upstream's real ``Actor`` around a random
    2-layer Qwen2 (H 128, V 8,192, gradient checkpointing, 2 rows of 256 tokens): a training forward and backward
    (each gradient dropped as it accumulates, ZeRO-3's footprint) is at least step_floor, a no-grad forward at
    least logits_floor. The floors count one moment, the forward's end, so they stay floors on the GPU path too
    (flash-attn's cross-entropy, not importable here, changes the backward, not that moment); measured here (MB,
    floor / measured): bf16 step 68.0 (0.37), forward 33.6 (0.75); fp32 step 68.6 (0.25), forward 33.6 (0.50):
    the backward's logits gradient and the fp32 path's log-sum-exp come on top. Each floor is asserted to be at
    least a fifth (step) and two fifths (forward) of its measurement, so a floor that lost its logits fails."""
    import torch

    from benchmarks.opob_norm_memory import build
    from tests.helpers.actor_memory import measured_and_floors

    dtype_ = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = build(2, hidden=128, vocab=8192, max_len=256, attn_implementation="sdpa", dtype=dtype_)
    measured, floors, shape = measured_and_floors(model, rows=2, length=256)
    assert shape == {"vocab": 8192, "layers": 2, "hidden_size": 128, "dtype_bytes": 2 if dtype == "bf16" else 4}
    assert floors == {  # by hand: 512 tokens
        "step": 512 * 8192 * (6 if dtype == "bf16" else 4) + 2 * 512 * 128 * (2 if dtype == "bf16" else 4),
        "forward": 512 * 8192 * (6 if dtype == "bf16" else 4),
    }
    (measured_step, measured_forward), (floor_step, floor_forward) = measured.values(), floors.values()
    print(dtype, {"step": (measured_step, floor_step), "forward": (measured_forward, floor_forward)})
    assert floor_step <= measured_step <= 5 * floor_step
    assert floor_forward <= measured_forward <= 2.5 * floor_forward
