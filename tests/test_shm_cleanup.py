"""/dev/shm files of a run, recorded while it runs and removed at its end (runtime/shm_cleanup.py). The
run is simulated by a child process that does what vLLM's processes do: a SharedMemory message queue
unregistered from the resource tracker (vLLM's ShmRingBuffer: psm_*) and a spawn-context lock (sem.mp-*); it is
killed with its process group, resource tracker included, as Ray ends an engine. Every child is ended by its PID
(process group) on any exit. The real stack: tests/test_faults.py::test_a_signalled_run_leaves_no_shared_memory and
tests/test_e2e_cli.py::_check_run."""

import os
import signal
import subprocess
import sys

import pytest

from openrlhf_ess.runtime import shm_cleanup

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
    names = []
    try:
        psm, sem = child.stdout.readline().split()
        names += [psm, "sem." + sem.lstrip("/")]
        yield child, psm, names[1]
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
        for name in names:  # what a test left of the child's files (it was killed: nothing else removes them)
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


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


# ---- what SIGKILL leaves, swept by the next run ------------------------------------------------------------------


def _dead_pid():
    """A PID whose process has exited (and been reaped): a run's CLI killed with SIGKILL."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    return gone.pid


def test_a_sigkilled_run_s_files_are_swept_by_the_next_run(engine, tmp_path, monkeypatch):
    monkeypatch.setenv(shm_cleanup.STATE_ENV, str(tmp_path))
    child, psm, sem = engine
    watch = shm_cleanup.ShmWatch(root=child.pid)  # the ledger's creator: the child, killed below
    watch.sample()
    ledgers = list(tmp_path.glob("run-*.json"))
    assert len(ledgers) == 1  # written as soon as the watch saw a file
    os.killpg(child.pid, signal.SIGKILL)  # no clean-up of any kind runs
    child.wait(30)
    assert os.path.exists(f"/dev/shm/{psm}") and os.path.exists(f"/dev/shm/{sem}")
    held = sum(os.stat(f"/dev/shm/{n}").st_blocks * 512 for n in (psm, sem))  # RAM they hold (touched pages)
    swept = shm_cleanup.sweep_dead_runs()
    assert sorted(swept.files) == sorted([psm, sem]) and swept.runs == [child.pid]
    assert not os.path.exists(f"/dev/shm/{psm}") and not os.path.exists(f"/dev/shm/{sem}")
    assert swept.bytes == held > 0
    assert "freed 2 shared-memory file(s)" in swept.message() and psm in swept.message()
    assert not list(tmp_path.glob("run-*.json"))  # nothing left to sweep: the ledger goes too
    assert shm_cleanup.sweep_dead_runs().message() == ""


def test_the_sweep_never_touches_a_live_run_a_held_file_or_another_host(engine, tmp_path, monkeypatch):
    monkeypatch.setenv(shm_cleanup.STATE_ENV, str(tmp_path))
    child, psm, sem = engine  # alive: it maps both files
    held = shm_cleanup.mapped_shm(child.pid)
    files = {key: (1e12, name) for key, name in held.items()}
    live = shm_cleanup.Ledger("live-run", child.pid)  # its creator still runs
    live.write(files)
    dead = shm_cleanup.Ledger("dead-run", _dead_pid())  # creator gone, but its files are held by a live process
    dead.head["start"] = 1.0
    dead.write(files)
    other = shm_cleanup.Ledger("other-host", _dead_pid())
    other.head.update(start=1.0, host="another-node")
    other.write(files)
    swept = shm_cleanup.sweep_dead_runs()
    assert swept.files == [] and swept.message() == ""
    assert os.path.exists(f"/dev/shm/{psm}") and os.path.exists(f"/dev/shm/{sem}")
    # all three ledgers kept: the live run's, the one whose files are held (a later run retries), the other node's
    assert len(list(tmp_path.glob("run-*.json"))) == 3


def test_the_sweep_ends_the_dead_run_s_orphans_by_token(tmp_path, monkeypatch):
    """An engine process re-parented to init after its run's CLI was SIGKILLed carries the run's token: ended."""
    monkeypatch.setenv(shm_cleanup.STATE_ENV, str(tmp_path))
    env = dict(os.environ, **{shm_cleanup.RUN_ENV: "orphan-token"})
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env, start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        ledger = shm_cleanup.Ledger("orphan-token", _dead_pid())
        ledger.head["start"] = 1.0
        ledger.write({})
        swept = shm_cleanup.sweep_dead_runs(grace_s=5)
        assert swept.ended == [orphan.pid] and orphan.wait(10) is not None
        assert bystander.poll() is None  # no token: not ours
        assert "ended 1 of its process(es) still running" in swept.message()
    finally:
        for p in (orphan, bystander):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def test_the_state_folder_falls_back_when_home_is_read_only(tmp_path, monkeypatch):
    monkeypatch.delenv(shm_cleanup.STATE_ENV, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o500)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    try:
        folder = shm_cleanup.state_dir()
        if os.getuid() == 0:  # root writes anywhere: the HOME folder is used
            assert folder.startswith(str(home))
        else:
            assert folder.endswith(f"openrlhf-ess-{os.getuid()}/shm")
    finally:
        home.chmod(0o700)


def test_the_run_accounts_for_its_files_whether_it_removed_them_or_not():
    """Seen in CI: a group SIGTERM also reaches vLLM's processes, which sometimes unlink their queues before they
    die; the run then had nothing to remove and said nothing, so its clean-up could not be told from a missing one.
    The account is given once either way, and a later clean-up that does remove files still says so."""
    from openrlhf_ess.cli.train_ppo_ray import shm_account

    names = [f"psm_{i}" for i in range(8)]
    assert shm_account(names[:2], 2, False) == (
        "[openrlhf-ess] removed 2 shared-memory file(s) this run's processes left in /dev/shm: psm_0, psm_1"
    )
    assert shm_account(names, 9, False).endswith(": psm_0, psm_1, psm_2, psm_3, psm_4, psm_5 and 2 more")
    assert shm_account([], 3, False) == (
        "[openrlhf-ess] none of the 3 shared-memory file(s) this run's processes used is left in /dev/shm: their "
        "processes removed them"
    )
    assert shm_account([], 3, True) is None  # said once already
    assert shm_account([], 0, False) is None  # the watch saw nothing (a run stopped before vLLM started)
    assert shm_account(["sem.mp-x"], 3, True).startswith("[openrlhf-ess] removed 1 ")
