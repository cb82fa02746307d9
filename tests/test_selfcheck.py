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
