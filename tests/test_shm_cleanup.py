"""/dev/shm files of a run, recorded while it runs and removed at its end (openrlhf_ess/shm_cleanup.py, issue 21
item 4). The run is simulated by a child process that does what vLLM's processes do: a SharedMemory message queue
unregistered from the resource tracker (vLLM's ShmRingBuffer: psm_*) and a spawn-context lock (sem.mp-*); it is
killed with its process group, resource tracker included, as Ray ends an engine. Every child is ended by its PID
(process group) on any exit. The real stack: tests/test_faults.py::test_a_signalled_run_leaves_no_shared_memory and
tests/test_e2e_cli.py::_check_run."""

import os
import signal
import subprocess
import sys

import pytest

from openrlhf_ess import shm_cleanup

ENGINE = """
import multiprocessing, sys, time
from multiprocessing import resource_tracker, shared_memory

queue = shared_memory.SharedMemory(create=True, size=1 << 16)
resource_tracker.unregister(queue._name, "shared_memory")  # as vLLM's ShmRingBuffer does
lock = multiprocessing.get_context("spawn").Lock()
print(queue.name, lock._semlock.name, flush=True)
time.sleep(600)
"""


@pytest.fixture
def engine():
    """A child doing what a vLLM engine process does to /dev/shm; (process, its psm_ name, its sem name)."""
    child = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        psm, sem = child.stdout.readline().split()
        yield child, psm, "sem." + sem.lstrip("/")
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)


def test_the_run_s_files_are_removed_and_no_other(engine, tmp_path):
    child, psm, sem = engine
    used = shm_cleanup.mapped_shm(child.pid)
    assert psm in used.values()  # the semaphore is mapped under glibc's temporary name: matched by inode
    assert os.stat(f"/dev/shm/{sem}").st_ino in {ino for _, ino in used}
    foreign = "psm_openrlhf_ess_test_" + str(os.getpid())  # another program's file: never touched
    open(os.path.join("/dev/shm", foreign), "w").close()
    try:
        watch = shm_cleanup.ShmWatch(root=child.pid, interval_s=0.1).start()
        watch.sample()
        os.killpg(child.pid, signal.SIGKILL)  # as Ray ends an engine: no __del__, no resource tracker
        child.wait(30)
        # what happened before the fix: the files stay
        assert os.path.exists(f"/dev/shm/{psm}") and os.path.exists(f"/dev/shm/{sem}")
        assert sorted(watch.cleanup(wait_s=5)) == sorted([psm, sem])
        assert not os.path.exists(f"/dev/shm/{psm}") and not os.path.exists(f"/dev/shm/{sem}")
        assert os.path.exists(os.path.join("/dev/shm", foreign))
    finally:
        os.remove(os.path.join("/dev/shm", foreign))


def test_files_their_owner_removed_are_not_reported(engine):
    child, psm, sem = engine
    watch = shm_cleanup.ShmWatch(root=child.pid)
    watch.sample()
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(30)
    for name in (psm, sem):
        os.unlink(f"/dev/shm/{name}")
    assert watch.cleanup(wait_s=1) == []
