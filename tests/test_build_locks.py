"""Stale torch extension build locks (runtime/build_locks.py): a run killed while DeepSpeed
JIT-builds its shm comm op leaves ``<op>/lock``, on which every later run waits forever (torch's FileBaton). The
builder is simulated by a child process that takes the lock with torch's own FileBaton, as cpp_extension.load
does, and is SIGKILLed (or kept alive) by this test; every child is ended by its PID."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.utils.file_baton import FileBaton

from openrlhf_ess.checks import preflight
from openrlhf_ess.runtime import build_locks
from tests.test_preflight import _args

HOLD = (
    "import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
    "assert FileBaton(sys.argv[1]).try_acquire()\nprint('held', flush=True)\ntime.sleep(600)\n"
)

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast


@pytest.fixture
def builder(tmp_path):
    """start(lock) -> a child process holding ``lock`` as torch's build does; ended by PID on any exit."""
    children = []

    def start(lock):
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        child = subprocess.Popen([sys.executable, "-c", HOLD, lock], stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout.readline().strip() == "held"
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)


def _killed_build(builder, lock):
    child = builder(lock)
    child.send_signal(signal.SIGKILL)  # Ctrl-C/timeout/preemption during the build
    child.wait(timeout=30)
    assert os.path.exists(lock)


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, builder):
    root = str(tmp_path / "ext")
    lock = os.path.join(root, "deepspeed_shm_comm", "lock")
    _killed_build(builder, lock)
    waiter = threading.Thread(target=FileBaton(lock).wait, daemon=True)  # what every later run does: forever
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()
    notices = []
    assert build_locks.clear_stale(notices, root) == [lock]
    assert not os.path.exists(lock) and len(notices) == 1
    assert notices[0].startswith(f"removed a stale torch extension build lock {lock} (no process of this machine")
    waiter.join(5.0)
    assert not waiter.is_alive()  # the waiting process goes on (and builds the op)
    baton = FileBaton(lock)
    assert baton.try_acquire()
    baton.release()


def test_a_lock_held_by_a_running_build_is_kept(tmp_path, builder):
    root = str(tmp_path / "ext")
    lock = os.path.join(root, "py311_cpu", "deepspeed_shm_comm", "lock")  # torch's default root layout
    child = builder(lock)
    notices = []
    assert build_locks.clear_stale(notices, root) == []
    assert os.path.exists(lock)
    assert f"a build of deepspeed_shm_comm is running (pid {child.pid}" in notices[0]


def test_when_a_holder_cannot_be_seen_only_an_old_lock_is_removed(tmp_path, builder, monkeypatch):
    """Processes we may not inspect, or a folder shared with other machines: a young lock is named (with the
    command that removes it), one older than STALE_AGE_S is removed."""
    root = str(tmp_path / "ext")
    lock = os.path.join(root, "deepspeed_shm_comm", "lock")
    _killed_build(builder, lock)
    monkeypatch.setattr(build_locks, "holders", lambda path: ([], False))
    notices = []
    assert build_locks.clear_stale(notices, root) == [] and os.path.exists(lock)
    assert "cannot be seen from here" in notices[0] and f"rm {lock}" in notices[0]
    old = time.time() - build_locks.STALE_AGE_S - 60
    os.utime(lock, (old, old))
    notices = []
    assert build_locks.clear_stale(notices, root) == [lock]
    assert "min old (a build takes about a minute)" in notices[0]


def test_preflight_removes_a_stale_lock_before_ray_starts(tiny_world, tmp_path, builder, monkeypatch):
    root = str(tmp_path / "ext")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", root)  # as scripts/env_cpu.sh sets it; forwarded to Ray workers
    lock = os.path.join(root, "deepspeed_shm_comm", "lock")
    _killed_build(builder, lock)
    notices = preflight.check(_args(tiny_world, tmp_path))
    assert not os.path.exists(lock)
    assert any(n.startswith(f"removed a stale torch extension build lock {lock}") for n in notices), notices


def test_the_shm_op_is_built_at_install():
    """scripts/bootstrap_cpu.sh builds the op (python -m openrlhf_ess.tools.build_ops) into the folder
    scripts/env_cpu.sh gives every run, so no run compiles it (or leaves its lock)."""
    script = open(os.path.join(os.path.dirname(__file__), "..", "scripts", "bootstrap_cpu.sh")).read()
    assert "openrlhf_ess.tools.build_ops" in script
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        pytest.skip("TORCH_EXTENSIONS_DIR is not set: run through scripts/test.sh (scripts/env_cpu.sh)")
    assert os.path.isfile(os.path.join(root, "deepspeed_shm_comm", "deepspeed_shm_comm.so"))


def test_the_venv_is_byte_compiled_at_install():
    """scripts/bootstrap_cpu.sh byte-compiles the installed packages itself (pip runs with --no-compile, then
    compileall on every core): where PYTHONDONTWRITEBYTECODE=1 is set Python never writes a .pyc at import, so
    without them every process of every run would compile the stack's sources again (docs/install.md)."""
    import importlib.util

    script = open(os.path.join(os.path.dirname(__file__), "..", "scripts", "bootstrap_cpu.sh")).read()
    assert "--no-compile" in script and "-m compileall" in script
    # the packages' sources, found without importing them; one module deep in torch too
    sources = [importlib.util.find_spec(name).origin for name in ("torch", "vllm", "deepspeed", "transformers", "ray")]
    sources.append(os.path.join(os.path.dirname(sources[0]), "nn", "functional.py"))
    for source in sources:
        cached = importlib.util.cache_from_source(source)
        assert os.path.isfile(cached), f"no {cached}: {source} was not byte-compiled"
