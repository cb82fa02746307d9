"""The GPU checks as pytest tests (docs/gpu_check.md): each test runs on ``device``, ``cpu`` (gloo; in the default
suite) or ``cuda`` (NCCL; ``-m gpu``, a failure where there is no CUDA device, never a fallback to the CPU).

What the device image lacks (vLLM, Ray, DeepSpeed, OpenRLHF) is handled here: the packages of ``GPU_CHECK_WITHOUT``
(comma-separated; the runner's ``--without``) are hidden for the whole process, ray and vllm are stubbed where
missing for the length of each module, and the modules that build the DeepSpeed actor ask for ``deepspeed_stack``.

A test's body is one check entry: ``with check(id, name) as e:`` collects ``expect(e, ok, message)`` failures and
fails the test once at its end with all of them; ``e["numbers"]``, ``e["summary"]`` and ``e["notes"]`` go to the
JUnit properties and, where ``GPU_CHECK_JSON`` names a file (tests/gpu/runner.py sets it), to a JSON part
``{"entries": [...], "info": {...}}`` rewritten after each test (a crash keeps what was done)."""

import contextlib
import json
import os
import time
import types

import pytest

from tests.gpu.harness import hide_modules, prepare_deepspeed_stack, stub_missing, uninstall_stubs

WITHOUT = [m.strip() for m in os.environ.get("GPU_CHECK_WITHOUT", "").split(",") if m.strip()]
hide_modules(WITHOUT)
INFO: dict = {}  # the environment the checks saw (the stubs, import notes, the GPU): the report's "environment"
ENTRIES: list = []


def expect(entry: dict, ok: bool, message: str) -> bool:
    """A soft assertion: the test goes on, and fails at the end of its ``check`` block with every message."""
    if not ok:
        entry["_failures"].append(message)
    return ok


def _options(device: str) -> types.SimpleNamespace:
    """The runner's options (environment variables), as the checks read them (``args``)."""
    env = os.environ.get
    return types.SimpleNamespace(
        device=device,
        checksum_gib=int(env("GPU_CHECK_CHECKSUM_GIB", "2")),
        zero3_route=env("GPU_CHECK_ZERO3_ROUTE", "auto"),
        fused_adam=env("GPU_CHECK_FUSED_ADAM", "") == "1",
        ranks=int(env("GPU_CHECK_RANKS", "0")),
        without=WITHOUT,
    )


def own_process(what: str) -> None:
    """DeepSpeed keeps its process groups for the life of a process (deepspeed.utils.groups, deepspeed.comm), and
    tests/helpers/ess_ds.py never destroys its own: a check that builds a DeepSpeed engine runs only in a process of
    its own, a unit of the runner (``GPU_CHECK_UNIT``), as scripts/gpu_check.sh runs it; elsewhere a SKIP."""
    if not os.environ.get("GPU_CHECK_UNIT"):
        pytest.skip(
            f"{what} builds a DeepSpeed engine: it runs in a process of its own, a unit of the runner (bash "
            "scripts/gpu_check.sh [--device cpu] --checks 3,4; in the slow suite "
            "tests/test_gpu_check_runner.py::test_cpu_checks_3_and_4; GPU_CHECK_UNIT=1 for a lone pytest process)"
        )


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.fail("torch.cuda.is_available() is False: no CUDA device (use --device cpu for the CPU run)")
    return request.param


@pytest.fixture(scope="module")
def args(device):
    return _options(device)


@pytest.fixture(scope="module", autouse=True)
def _imports_and_environment():
    """Each module: ray / vllm stubbed where missing (undone after it), os.environ restored after it (the checks
    set RANK, WORLD_SIZE, MASTER_ADDR/PORT as a one-rank launcher would), no process group left."""
    saved = dict(os.environ)
    stub_missing(INFO)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a check that failed half-way left its group
        dist.destroy_process_group()
    uninstall_stubs()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def deepspeed_stack(args):
    return prepare_deepspeed_stack(args, INFO)


@pytest.fixture(scope="module")
def shared(device):
    """What one entry of a module leaves to the next (a case, a model, a measurement), per device."""
    return {}


@pytest.fixture
def check(request):
    """``check(id, name)``: the block is the entry; soft failures fail the test once, at the block's end."""

    @contextlib.contextmanager
    def block(cid: str, name: str):
        entry = {"id": cid, "name": name, "summary": "", "numbers": {}, "notes": [], "_failures": []}
        request.node.gpu_entry = entry
        yield entry
        if entry["_failures"]:
            pytest.fail("; ".join(entry["_failures"]), pytrace=False)

    return block


def _entry_id(item) -> str:
    number = item.module.__name__.rsplit(".", 1)[-1].split("_")[1]
    return f"{number}.{item.originalname[len('test_') :]}"


def _reason(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, "Skipped: why")
        return report.longrepr[2].removeprefix("Skipped: ")
    return (crash.message if crash else str(report.longrepr)).removeprefix("Failed: ")[:2000]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    state = item.stash.setdefault(_STATE, {"status": "PASS", "reason": None, "seconds": 0.0, "trace": None})
    state["seconds"] += report.duration if report.when != "teardown" else 0.0  # the module's teardown: not the check
    if report.failed and state["status"] != "FAIL":
        state["status"], state["reason"] = "FAIL", _reason(report)
        if not isinstance(report.longrepr, str) and getattr(report.longrepr, "reprcrash", None):
            state["trace"] = "traceback: " + "".join(str(report.longrepr).splitlines(True)[-12:])
    elif report.skipped and state["status"] == "PASS":
        state["status"], state["reason"] = "SKIP", _reason(report)
    if report.when == "teardown":
        _record(item, state, report)
    return report


_STATE = pytest.StashKey[dict]()


def _record(item, state: dict, report) -> None:
    entry = dict(getattr(item, "gpu_entry", None) or {"id": _entry_id(item), "name": item.name})
    failures = entry.pop("_failures", [])
    entry = {
        "id": entry["id"],
        "name": entry["name"],
        "status": state["status"],
        "reason": state["reason"] if state["status"] != "PASS" else None,
        "summary": entry.get("summary", ""),
        "numbers": entry.get("numbers", {}),
        "notes": list(entry.get("notes", [])) + ([state["trace"]] if state["trace"] and not failures else []),
        "seconds": round(state["seconds"], 3),
        "test": item.nodeid,
    }
    for key in ("summary", "numbers"):
        report.user_properties.append((key, json.dumps(entry[key], default=str)))
    ENTRIES.append(entry)
    path = os.environ.get("GPU_CHECK_JSON")
    if path:
        print(f"\n[gpu_check] {entry['status']} {entry['id']}: {entry['reason'] or entry['summary']}", flush=True)
        with open(path, "w") as f:
            json.dump({"entries": ENTRIES, "info": INFO, "written": time.time()}, f, indent=1, default=str)
