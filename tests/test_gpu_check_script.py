"""scripts/gpu_check.sh (issue 12) in its CPU variant: the report's structure, the exit code, checks 1, 2 and 5-9.

On CPU the process group is gloo, which accepts host tensors: the real negative control (a host tensor in a NCCL
collective raises) can only run on a GPU, so here it must be reported SKIP with that reason, and the adapted
control (the virtual NCCL of tests/helpers/strict_device.py) must pass. Checks 3 and 4 (DeepSpeed, OpenRLHF) run
on CPU in the slow test."""

import json
import os
import subprocess

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_1 = ["1.all_reduce_max", "1.all_gather_rows", "1.agree", "1.score_streams", "1.global_lr_scale"]
ENTRY_KEYS = {"id", "name", "status", "reason", "summary", "numbers", "notes", "seconds"}


def _run(tmp_path, *args, timeout=600, **env_vars):
    """The shell entry point, the report under $OUT; a --device cpu run installs no wheels (GPU_WHEELS unset)."""
    env = dict(os.environ, OUT=str(tmp_path))
    env.pop("GPU_WHEELS", None)
    env.update(env_vars)
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    path = tmp_path / "gpu_check.json"
    assert path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(path.read_text())
    _check_structure(report, run, tmp_path)
    return run, report, {e["id"]: e for e in report["checks"]}


def _check_structure(report, run, tmp_path):
    assert report["schema"] == 1 and report["device"] in ("cpu", "cuda")
    assert {"versions", "argv"} <= set(report["environment"])
    for entry in report["checks"]:
        assert set(entry) == ENTRY_KEYS, entry
        assert entry["status"] in ("PASS", "FAIL", "SKIP"), entry
        assert isinstance(entry["numbers"], dict) and isinstance(entry["notes"], list)
        if entry["status"] != "PASS":
            assert entry["reason"], entry  # every SKIP and FAIL says why
    counts = report["counts"]
    assert counts == {s: sum(e["status"] == s for e in report["checks"]) for s in ("PASS", "FAIL", "SKIP")}
    # exit code non-zero iff a check FAILed, and the same in the report
    assert (run.returncode != 0) == (counts["FAIL"] > 0) and report["exit_code"] == run.returncode, run.stdout[-3000:]
    # the short report at the end: one line per entry, then the counts
    tail = run.stdout[run.stdout.rindex("gpu_check: device") :]
    assert all(f"{e['status']:4}  {e['id']}" in tail for e in report["checks"]), tail
    assert f"PASS {counts['PASS']}  FAIL {counts['FAIL']}  SKIP {counts['SKIP']}" in tail
    assert (tmp_path / "gpu_check.log").exists()
    assert report["checks"][0]["id"] == "0.wheels"  # what the wheel folder gave (SKIP: none, or a CPU run)


def test_cpu_checks_1_and_2(tmp_path):
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "1,2")
    assert run.returncode == 0, run.stdout[-4000:]
    assert any("is_multi_rank forced to True" in n for n in report["notes"])  # the forced path is stated
    assert by_id["0.wheels"]["status"] == "SKIP" and "--device cpu" in by_id["0.wheels"]["reason"]
    for cid in CHECK_1:
        entry = by_id[cid]
        assert entry["status"] == "PASS", entry
        assert entry["numbers"]["backend"] == "gloo"
        # each of ours really issued its collective, with its tensors on distributed.device() (the CPU here)
        assert entry["numbers"]["collectives"] and all(
            t.startswith("cpu/") for c in entry["numbers"]["collectives"] for t in c["tensors"]
        ), entry
    assert by_id["1.score_streams"]["numbers"]["forwards"] == 2
    assert by_id["1.global_lr_scale"]["numbers"]["lr_scale"] == pytest.approx((9 / 13) ** 0.5, abs=1e-6)
    # the real negative control needs NCCL: honestly SKIPped, with what gloo did
    control = by_id["1.host_tensor_refused"]
    assert control["status"] == "SKIP" and "gloo accepts host tensors" in control["reason"], control
    # the adapted control: the virtual NCCL refuses the host tensor with NCCL's message, accepts ours
    virtual = by_id["1.virtual_nccl"]
    assert virtual["status"] == "PASS", virtual
    assert "No backend type associated with device type cpu" in virtual["numbers"]["host_tensor_error"]
    assert virtual["numbers"]["collectives"] == ["all_reduce", "all_reduce", "all_gather", "all_reduce"] + [
        "all_reduce",
        "all_gather",
    ]
    # check 2: no host allocator counter, so the memory check is a SKIP; the sums are checked
    assert by_id["2.checksum_memory"]["status"] == "SKIP"
    sums = by_id["2.checksum_correctness"]
    assert sums["status"] == "PASS" and sums["numbers"]["chunks"] == 3, sums
    assert sums["numbers"]["rel_err_sum"] <= 1e-12 and sums["numbers"]["throughput_gb_s"] > 0


def test_cpu_checks_5_to_8(tmp_path):
    """The start-up self-checks and the mask / scoring maths (issue 20) in their CPU variant: two gloo ranks with
    per-rank fake device ids, the arithmetic of the memory check, float64 references at V = 151,936; the peaks and
    mem_get_info need CUDA: SKIP with the reason."""
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "5,6,7,8")
    assert run.returncode == 0, run.stdout[-4000:]
    placement = by_id["5.placement"]
    assert placement["status"] == "PASS" and placement["numbers"]["backend"] == "gloo", placement
    assert [r["device"] for r in placement["numbers"]["reports"]] == ["CPU-FAKE-0", "CPU-FAKE-1"]
    assert placement["numbers"]["verdict"] == "placement: 2 trainer ranks on 2 devices"
    control = by_id["5.placement_control"]  # every rank on device 0: refused, the device and the ranks named
    assert control["status"] == "PASS" and "CPU-FAKE-0: 2 ranks of actor" in control["numbers"]["error"], control
    collectives = by_id["6.collectives"]
    assert collectives["status"] == "PASS" and collectives["numbers"]["world"] == 2, collectives
    assert [p["gathered"] for p in collectives["numbers"]["probes"]] == [[0, 1], [0, 1]]
    assert "all-gather gave [0, 0]" in collectives["numbers"]["control_error"]
    memory = by_id["7.memory_decision"]
    assert memory["status"] == "PASS", memory  # the stated 7B case's need, by hand: embedding + 2^24 x 8 + model / 8
    assert memory["numbers"]["need_bytes"] == 152_064 * 3_584 * 2 + 2**27 + 14 * 10**9 // 8
    assert memory["numbers"]["cases"]["below"]["error"] and not memory["numbers"]["cases"]["above"]["error"]
    for cid in ("7.memory_measured", "8.mask_backward_memory", "8.prox_scoring_memory"):
        assert by_id[cid]["status"] == "SKIP" and "CPU" in by_id[cid]["reason"], by_id[cid]
    mask = by_id["8.mask_log_probs"]
    assert mask["status"] == "PASS" and mask["numbers"]["vocab"] == 151_936, mask
    assert mask["numbers"]["apply_grad_max_abs_diff"] <= 1e-5 and mask["numbers"]["truncation_effect_max"] > 1e-2
    scoring = by_id["8.prox_scoring"]
    assert scoring["status"] == "PASS" and max(scoring["numbers"]["max_abs_diff"].values()) <= 1e-4, scoring
    assert scoring["numbers"]["kept_effect_max"] > 1e-2


def test_cpu_check_9_routing_replay(tmp_path):
    """MoE routing replay's seam in the CPU variant (fp32): own routes bit-identical for both tiny families, shifted
    routes change the logits; the hook's cost on a reduced layer is reported as numbers (on CUDA: Qwen3-30B-A3B's)."""
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "9")
    assert run.returncode == 0, run.stdout[-4000:]
    exact = by_id["9.replay_bitexact"]
    assert exact["status"] == "PASS", exact
    for family in ("qwen2_moe", "qwen3_moe"):
        assert exact["numbers"][f"{family}_own_max_diff"] == 0.0 and exact["numbers"][f"{family}_shifted_max_diff"] > 0
    cost = by_id["9.replay_cost"]
    assert cost["status"] == "PASS" and cost["numbers"]["tokens"] == 32 and cost["numbers"]["ratio"] > 0, cost


def test_missing_packages_skip_with_the_reason_and_stubs_are_reported(tmp_path):
    """As on the GPU image without the wheel folder: no OpenRLHF and no Ray (stubbed, said so)."""
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "1", "--without", "openrlhf,ray")
    assert run.returncode == 0, run.stdout[-4000:]
    skipped = by_id["1.global_lr_scale"]
    assert skipped["status"] == "SKIP" and "openrlhf" in skipped["reason"], skipped
    assert all(by_id[c]["status"] == "PASS" for c in CHECK_1[:-1] + ["1.virtual_nccl"])
    assert report["environment"]["stubbed"] == ["ray"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would really run")
def test_no_cuda_device_is_a_failure(tmp_path):
    # --device cuda is the default; an empty wheel folder, as on a GPU machine without one
    run, report, by_id = _run(tmp_path, "--checks", "1", GPU_WHEELS=str(tmp_path / "no_wheels"))
    assert run.returncode == 1 and by_id["0.device"]["status"] == "FAIL", run.stdout[-3000:]
    assert "--device cpu" in by_id["0.device"]["reason"]


@pytest.mark.slow
def test_cpu_all_checks(tmp_path):
    """Checks 3 and 4 on CPU with cpu_compat, as the tests run DeepSpeed and OpenRLHF."""
    run, report, by_id = _run(tmp_path, "--device", "cpu")
    assert run.returncode == 0, run.stdout[-4000:]
    zero3 = by_id["3.zero3_gather_elements"]
    assert zero3["status"] == "PASS" and zero3["numbers"]["route"] == "trainer", zero3
    assert by_id["3.zero3_gather_memory"]["status"] == "SKIP"
    for cid in ("4.ess_lr_deepspeed", "4.ess_lr_k2_deepspeed"):
        assert by_id[cid]["status"] == "PASS", by_id[cid]
        assert by_id[cid]["numbers"]["lr_scale"] == pytest.approx([(9 / 13) ** 0.5] * 2, abs=1e-6)
    assert by_id["4.ess_lr_k2_deepspeed"]["numbers"]["k2_loss_calls"] > 0


@pytest.mark.slow
def test_cpu_zero3_zero_init_route(tmp_path):
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "3", "--zero3-route", "init")
    assert run.returncode == 0, run.stdout[-4000:]
    zero3 = by_id["3.zero3_gather_elements"]
    assert zero3["status"] == "PASS" and zero3["numbers"]["route"] == "init", zero3


def _wheel(folder, name="gpu_check_probe", version="0.0.1"):
    """A minimal pure-python wheel, as the wheel folder holds them."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as z:
        for name_in_zip, text in files.items():
            z.writestr(name_in_zip, text)
    return path


def test_wheel_folder_is_installed_offline_and_a_broken_one_fails(tmp_path):
    folder, site = tmp_path / "wheels", tmp_path / "site"
    _wheel(str(folder))
    fast = ["--device", "cpu", "--checks", "1", "--without", "openrlhf"]
    run, report, by_id = _run(tmp_path, *fast, GPU_WHEELS=str(folder), GPU_CHECK_SITE=str(site))
    assert by_id["0.wheels"]["status"] == "PASS" and run.returncode == 0, run.stdout[-3000:]
    assert (site / "gpu_check_probe" / "__init__.py").exists()
    (folder / "broken-0.1-py3-none-any.whl").write_bytes(b"not a zip")
    run, report, by_id = _run(tmp_path, *fast, GPU_WHEELS=str(folder), GPU_CHECK_SITE=str(site))
    assert by_id["0.wheels"]["status"] == "FAIL" and run.returncode == 1, run.stdout[-3000:]
