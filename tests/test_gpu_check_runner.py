"""scripts/gpu_check.sh and its runner (tests/gpu/runner.py): the report's structure (JSON, JUnit XML,
the short report), the exit code, the missing-packages case, no CUDA device, the wheel folder. The checks themselves
are the tests of tests/gpu/ (their CPU variants run in the default suite); here the runner runs cheap ones in its
CPU variant (--device cpu: pytest -m "not gpu", one pytest process per unit)."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_KEYS = {"id", "name", "status", "reason", "summary", "numbers", "notes", "seconds"}
CHECK_1 = ["1.all_reduce_max", "1.all_gather_rows", "1.agree", "1.score_streams", "1.virtual_nccl"]


def _run(tmp_path, *args, timeout=600, **env_vars):
    """The shell entry point, the report under $OUT; a --device cpu run installs no wheels (GPU_WHEELS unset)."""
    temp = tmp_path / "temp"  # the runner's own temporary files go here, and none may be left
    temp.mkdir(exist_ok=True)
    env = dict(os.environ, OUT=str(tmp_path), TMPDIR=str(temp))
    env.pop("GPU_WHEELS", None)
    env.update(env_vars)
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    left = [name for name in os.listdir(temp) if name.startswith("gpu_check")]  # the pip log, the units' parts
    assert not left, left
    path = tmp_path / "gpu_check.json"
    assert path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(path.read_text())
    _check_structure(report, run, tmp_path)
    return run, report, {e["id"]: e for e in report["checks"]}


def _check_structure(report, run, tmp_path):
    assert report["schema"] == 1 and report["device"] in ("cpu", "cuda")
    assert {"versions", "argv"} <= set(report["environment"])
    for entry in report["checks"]:
        assert ENTRY_KEYS <= set(entry) <= ENTRY_KEYS | {"test"}, entry  # "test": the pytest node id
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
    # the JUnit XML: every test of the units, and the runner's own entries
    junit = ET.parse(tmp_path / "gpu_check.xml").getroot()
    names = {case.get("name") for case in junit.iter("testcase")}
    assert {e["test"].split("::")[-1] for e in report["checks"] if "test" in e} | {"0.wheels"} <= names


def test_cpu_run_report_and_exit_code(tmp_path):
    """Check 7 through the runner (the cheapest unit; the checks themselves run in tests/gpu/): entries from the
    tests' JSON part, numbers included."""
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "7")
    assert run.returncode == 0, run.stdout[-4000:]
    assert by_id["0.wheels"]["status"] == "SKIP" and "--device cpu" in by_id["0.wheels"]["reason"]
    ids = ["0.wheels", "7.memory_decision", "7.memory_measured", "7.step_floor"]
    assert [e["id"] for e in report["checks"]] == ids
    assert by_id["7.memory_measured"]["status"] == "SKIP" and "CPU" in by_id["7.memory_measured"]["reason"]
    assert by_id["7.memory_decision"]["test"] == "tests/gpu/test_7_memory.py::test_memory_decision[cpu]"
    memory = by_id["7.memory_decision"]
    assert memory["status"] == "PASS", memory  # the stated 7B case's need, by hand: embedding + 2^24 x 8 + model / 8
    assert memory["numbers"]["need_bytes"] == 152_064 * 3_584 * 2 + 2**27 + 14 * 10**9 // 8
    assert memory["numbers"]["cases"]["below"]["error"] and not memory["numbers"]["cases"]["above"]["error"]
    floor = by_id["7.step_floor"]  # the floors under upstream's Actor, 2 rows of 256 tokens at V 8,192, bf16
    assert floor["status"] == "PASS", floor
    assert floor["numbers"]["floors"]["forward"] == 512 * 8192 * 6
    assert all(floor["numbers"]["floors"][k] <= floor["numbers"]["measured"][k] for k in ("step", "forward"))


def test_missing_packages_skip_with_the_reason_and_stubs_are_reported(tmp_path):
    """As on the GPU image without the wheel folder: no OpenRLHF and no Ray (stubbed, said so)."""
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "1", "--without", "openrlhf,ray")
    assert run.returncode == 0, run.stdout[-4000:]
    skipped = by_id["1.global_lr_scale"]
    assert skipped["status"] == "SKIP" and "openrlhf" in skipped["reason"], skipped
    assert all(by_id[c]["status"] == "PASS" for c in CHECK_1)
    assert all(by_id[c]["numbers"]["backend"] == "gloo" for c in CHECK_1 if c != "1.virtual_nccl")
    assert report["environment"]["stubbed"] == ["ray"]
    # the real negative control needs NCCL: honestly SKIPped, with what gloo did; the adapted control passes
    control = by_id["1.host_tensor_refused"]
    assert control["status"] == "SKIP" and "gloo accepts host tensors" in control["reason"], control
    virtual = by_id["1.virtual_nccl"]
    assert virtual["status"] == "PASS", virtual
    assert "No backend type associated with device type cpu" in virtual["numbers"]["host_tensor_error"]
    assert any("is_multi_rank forced to True" in n for n in report["notes"])  # the forced path is stated


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would really run")
def test_no_cuda_device_is_a_failure(tmp_path):
    # --device cuda is the default; an empty wheel folder, as on a GPU machine without one
    run, report, by_id = _run(tmp_path, "--checks", "1", GPU_WHEELS=str(tmp_path / "no_wheels"))
    assert run.returncode == 1 and by_id["0.device"]["status"] == "FAIL", run.stdout[-3000:]
    assert "--device cpu" in by_id["0.device"]["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the test would really run")
def test_cuda_variant_without_cuda_fails_in_pytest(tmp_path):
    """pytest -m gpu run directly, without the runner: the cuda variant FAILs (never a fallback to the CPU)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu/test_7_memory.py", "-m", "gpu", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1 and "no CUDA device" in run.stdout, run.stdout[-3000:]


@pytest.mark.slow
def test_cpu_checks_3_and_4(tmp_path):
    """Checks 3 and 4 on CPU with cpu_compat, as the tests run DeepSpeed and OpenRLHF: each unit a process of its own
    (in a plain pytest session they SKIP, tests/gpu/conftest.py::own_process)."""
    run, report, by_id = _run(tmp_path, "--device", "cpu", "--checks", "3,4")
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


@pytest.mark.engine
def test_wheel_folder_is_installed_offline_and_a_broken_one_fails(tmp_path):
    folder, site = tmp_path / "wheels", tmp_path / "site"
    _wheel(str(folder))
    fast = ["--device", "cpu", "--checks", "7"]
    run, report, by_id = _run(tmp_path, *fast, GPU_WHEELS=str(folder), GPU_CHECK_SITE=str(site))
    assert by_id["0.wheels"]["status"] == "PASS" and run.returncode == 0, run.stdout[-3000:]
    assert (site / "gpu_check_probe" / "__init__.py").exists()
    (folder / "broken-0.1-py3-none-any.whl").write_bytes(b"not a zip")
    run, report, by_id = _run(tmp_path, *fast, GPU_WHEELS=str(folder), GPU_CHECK_SITE=str(site))
    assert by_id["0.wheels"]["status"] == "FAIL" and run.returncode == 1, run.stdout[-3000:]
