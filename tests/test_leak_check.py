"""The session-wide leak check (tests/helpers/leak_check.py) fails a session whose test left a
process running, names it and the test, and ends it; a session whose tests end what they start passes. Each case is
an inner pytest session in a subprocess; the leaked process writes its PID to a file, and this test ends it by that
PID if it is still there (it never is when the check works)."""

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.helpers.e2e import REPO

pytestmark = pytest.mark.engine  # inner pytest sessions in child processes: not in --fast

# A process that daemonizes as a Ray daemon does: the child it forks is re-parented to init (not a child of pytest)
# and writes its PID to argv[1] before the parent exits.
DAEMON = """
import os, sys, time
if os.fork() == 0:
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    sys.exit(0)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
"""

INNER = """
import subprocess, sys


def test_starts_a_run_and_forgets_it():
    subprocess.run([sys.executable, {daemon!r}, {pid_file!r}], check=True)


def test_ends_what_it_starts():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    child.kill()
    child.wait()
"""


def _inner(tmp_path, leak: bool, workers: int = 0):
    """An inner pytest session (the leak check as a plugin) over INNER, on ``workers`` pytest-xdist workers if any;
    (its result, the leaked PID file)."""
    daemon, pid_file = tmp_path / "daemon.py", tmp_path / "leaked.pid"
    daemon.write_text(DAEMON)
    body = INNER.format(daemon=str(daemon), pid_file=str(pid_file))
    if not leak:
        body = body.replace("def test_starts_a_run_and_forgets_it", "def _not_a_test")
    (tmp_path / "test_inner.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": REPO, "OPENRLHF_ESS_LEAK_GRACE_S": "3"}
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.helpers.leak_check", "-p", "no:cacheprovider", "-q"]
    cmd += ["-n", str(workers)] if workers else []
    run = subprocess.run(cmd + ["test_inner.py"], cwd=str(tmp_path), env=env, capture_output=True, text=True)
    return run, pid_file


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist-2"])
def test_a_leaked_process_fails_the_session_and_is_ended(tmp_path, workers):
    """Under pytest-xdist too (scripts/test.sh): the worker's report reaches the controller, which fails the run."""
    run, pid_file = _inner(tmp_path, leak=True, workers=workers)
    pid = int(pid_file.read_text())
    try:
        out = run.stdout + run.stderr
        assert run.returncode != 0, out  # both tests passed: the leak alone fails the session
        assert "2 passed" in out and "1 process(es) started by the tests outlived them (now ended by PID):" in out
        assert f"pid {pid} (" in out and "started during test_inner.py::test_starts_a_run_and_forgets_it" in out
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(pid) and str(tmp_path) in " ".join(psutil.Process(pid).cmdline()):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist-2"])
def test_a_session_that_ends_what_it_starts_passes(tmp_path, workers):
    run, _ = _inner(tmp_path, leak=False, workers=workers)
    assert run.returncode == 0 and "1 passed" in run.stdout and "outlived" not in run.stdout, run.stdout + run.stderr
