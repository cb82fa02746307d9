"""SIGTERM/SIGHUP in the driver, against real Ray: our handler is in force from the first line of
main() to the last, whatever ray.init() installs, so the clean-up runs to its end however long it takes.

A child process starts a private Ray instance (127.0.0.1, its own temp dir) and is signalled at a point of its own
progress; its clean-up takes 4 s, longer than the 3 s that Abseil's failure-signal handler (installed by Ray's core
worker) allows before it aborts the process. The control case shows that abort with a bare ``ray.init``.
Every process of the child's tree is tracked by PID and start time and ended if it outlives the test
(tests/helpers/faults.py)."""

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.helpers.e2e import REPO
from tests.helpers.faults import _Tree, end_processes

CHILD = r"""
import os, signal, sys, time
import ray
from openrlhf_ess.runtime import signals

mode, temp_dir = sys.argv[1], sys.argv[2]
signals.install()
try:
    try:
        init = dict(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=temp_dir)
        if mode == "bare":  # the control: Ray's handlers as ray.init leaves them
            ray.init(**init)
            print("ray up", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        with signals.ray_init():
            ray.init(**init)
            if mode == "inside":  # Ray's core worker (Abseil's handler) is up, ours is not back yet
                print("ray up", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)
        print("ray up", flush=True)
        os.kill(os.getpid(), signal.SIGHUP if mode == "sighup" else signal.SIGTERM)
        time.sleep(60)
        print("not stopped", flush=True)
    finally:
        print("clean-up starts", flush=True)
        if mode == "sighup":  # a second signal (Slurm signals every process of the step) must not cut it short
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(4)
        ray.shutdown()
        print("clean-up done", flush=True)
finally:
    signals.finished()
"""


def _run(mode: str):
    temp_dir = tempfile.mkdtemp(prefix="ray_sig_", dir="/tmp")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, temp_dir],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    with _Tree(proc.pid) as tree:
        try:
            out, _ = proc.communicate(timeout=180)
        finally:
            tree.sample()
            end_processes([p for p in tree.alive() if p.pid != proc.pid], grace=5)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    import shutil

    shutil.rmtree(temp_dir, ignore_errors=True)
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.real_stack
def test_bare_ray_init_aborts_a_slow_clean_up_after_sigterm():
    """The control (a run without our handler): after a bare ray.init, SIGTERM reaches Abseil's handler, which arms a
    3 s alarm; the 4 s clean-up is cut and the process aborts. If Ray stops doing this, this test says so."""
    rc, out = _run("bare")
    assert "*** SIGTERM received" in out, out[-3000:]
    assert "clean-up starts" in out and "clean-up done" not in out, out[-3000:]
    assert rc in (-signal.SIGABRT, 128 + signal.SIGABRT), (rc, out[-3000:])


@pytest.mark.real_stack
@pytest.mark.parametrize("mode", ["after", "inside", "sighup"])
def test_our_handler_outlives_ray_init_and_the_clean_up_finishes(mode):
    """after: SIGTERM once ray.init has returned. inside: SIGTERM inside the ray_init() block, where Abseil's
    handler is the one installed (it prints, chains to Ray's sys.exit(15) and arms its alarm): the alarm is
    cancelled and the exit becomes ours. sighup: SIGHUP, then a SIGTERM during the clean-up, which goes on."""
    rc, out = _run(mode)
    sig = signal.SIGHUP if mode == "sighup" else signal.SIGTERM
    assert f"[openrlhf-ess] {sig.name} received: stopping the run." in out, out[-3000:]
    assert "clean-up done" in out and "not stopped" not in out, out[-3000:]
    assert rc == 128 + sig, (rc, out[-3000:])
    if mode == "after":
        assert "*** SIGTERM received" not in out, out[-3000:]  # Abseil's handler never saw it
    if mode == "inside":
        assert "*** SIGTERM received" in out, out[-3000:]  # it did, and still the clean-up finished
    if mode == "sighup":
        assert "SIGTERM received while stopping: the clean-up goes on" in out, out[-3000:]
