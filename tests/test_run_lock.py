"""One run per output folder (openrlhf_ess/runtime/run_lock.py; docs/faults.md §8).

The holder is a real second process (a bare Python holding the lock, or the CLI with upstream's train() replaced by
a sleep, so no Ray starts); every process a test starts is ended by its PID on every exit.
"""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from openrlhf_ess.config import ConfigError
from openrlhf_ess.runtime import run_lock
from tests.helpers.e2e import REPO, tiny_args

HOLD = (
    "import sys, time\nfrom openrlhf_ess.runtime import run_lock\n"
    "run_lock.acquire('--ckpt.output_dir', sys.argv[1], argv=['holder-command', '--x'])\n"
    "print('locked', flush=True)\ntime.sleep(600)\n"
)


class _Started:
    """A child process, ended by its PID when the test ends (however it ends)."""

    def __init__(self, argv, **kwargs):
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)

    def wait_for(self, marker: str, timeout: float = 120) -> str:
        seen, deadline = [], time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline().decode()
            seen.append(line)
            if marker in line:
                return "".join(seen)
            if not line and self.proc.poll() is not None:
                break
        raise AssertionError(f"no {marker!r} from the child: {''.join(seen)[-3000:]}")

    def exited(self, timeout: float) -> None:
        """Wait for the child to exit; if it does not, fail with every thread's stack (the child registers
        faulthandler on SIGUSR1) and its output since the last read."""
        try:
            self.proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(2)
            self.proc.kill()
            self.proc.wait(30)
            tail = self.proc.stdout.read().decode(errors="replace")[-6000:]
            raise AssertionError(f"the child did not exit within {timeout:.0f} s; its threads and output:\n{tail}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.proc.stdout.close()


@pytest.fixture
def started():
    children = []

    def start(argv, **kwargs):
        children.append(_Started(argv, **kwargs))
        return children[-1]

    yield start
    for child in children:
        child.stop()


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken_over(tmp_path, started):
    holder = started([sys.executable, "-c", HOLD, str(tmp_path)])
    holder.wait_for("locked")
    path = os.path.join(tmp_path, run_lock.LOCK_NAME)
    with pytest.raises(ConfigError) as info:
        run_lock.acquire("--ckpt.output_dir", str(tmp_path))
    message = str(info.value)
    assert f"--ckpt.output_dir {tmp_path}: in use by another run (PID {holder.proc.pid} on host" in message
    assert "holder-command --x" in message and f"lock file {path}" in message
    assert "choose another --ckpt.output_dir" in message
    os.kill(holder.proc.pid, signal.SIGKILL)  # no clean-up: the file stays, naming a dead process
    holder.proc.wait(30)
    assert json.load(open(path))["pid"] == holder.proc.pid
    lines = []
    lock = run_lock.acquire("--ckpt.output_dir", str(tmp_path), log=lines.append)
    assert len(lines) == 1 and f"took over {path} from PID {holder.proc.pid}" in lines[0], lines
    assert "no longer running" in lines[0]
    assert json.load(open(path))["pid"] == os.getpid()
    lock.release()
    assert not os.path.exists(path)


def _write_holder(folder, **fields):
    holder = {**run_lock.this_process(["someone"]), **fields}
    with open(os.path.join(folder, run_lock.LOCK_NAME), "w") as f:
        json.dump(holder, f)
    return holder


def test_a_live_holder_without_flock_is_refused_and_a_reused_pid_is_not(tmp_path):
    """The file's content is checked too (filesystems where flock does not exclude): our own PID with our start
    time is a live holder; the same PID with another start time is a new process that reused it."""
    _write_holder(tmp_path)  # this very process, alive, not holding the flock
    with pytest.raises(ConfigError, match=f"in use by another run \\(PID {os.getpid()} on host"):
        run_lock.acquire("--ckpt.path", str(tmp_path))
    _write_holder(tmp_path, start_ticks=run_lock.process_start_ticks(os.getpid()) - 1)
    lines = []
    run_lock.acquire("--ckpt.path", str(tmp_path), log=lines.append).release()
    assert "took over" in lines[0] and "no longer running" in lines[0]


def test_a_holder_on_another_host_is_refused_naming_the_file_to_delete(tmp_path):
    _write_holder(tmp_path, host="other-node-7")
    path = os.path.join(tmp_path, run_lock.LOCK_NAME)
    with pytest.raises(ConfigError) as info:
        run_lock.acquire("--ckpt.path", str(tmp_path))
    assert "names a run on another host (PID" in str(info.value) and "on host other-node-7" in str(info.value)
    assert f"If that run has ended, delete {path} and start again" in str(info.value)


def test_holder_records():
    me = run_lock.this_process(["-m", "x"])
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname() and me["command"].endswith(" -m x")
    assert run_lock.holder_alive(me) is True
    assert run_lock.holder_alive({**me, "boot_id": "another-boot"}) is False
    assert run_lock.holder_alive({**me, "pid": 2**22 + 12345}) is False  # above pid_max: no such process
    assert run_lock.holder_alive({**me, "host": "elsewhere"}) is None
    assert run_lock.parse_holder("") is None and run_lock.parse_holder("garbage{") is None
    assert run_lock.parse_holder(json.dumps(me)) == me


def test_release_is_idempotent_and_not_done_by_a_forked_child(tmp_path):
    lock = run_lock.acquire("--ckpt.output_dir", str(tmp_path))
    pid = os.fork()
    if pid == 0:  # a child forked while the lock is held (multiprocessing fork) must not remove it
        lock.release()
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists(lock.path)
    lock.release()
    lock.release()
    assert not os.path.exists(lock.path)


def test_a_lock_in_a_folder_that_became_unwritable_is_emptied_and_named(tmp_path, monkeypatch):
    """The folder turned read-only during the run: the file cannot be removed, so it is emptied (no holder for the
    next run to refuse) and the user is told which file it is. Root ignores a folder's write bit, so as root the
    refusal is injected at ``os.unlink`` with the error a read-only folder gives."""
    folder = tmp_path / "ckpts"
    lines = []
    lock = run_lock.acquire("--ckpt.path", str(folder), log=lines.append)
    if os.geteuid() == 0:

        def unlink(path, *a, **k):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

        monkeypatch.setattr(run_lock.os, "unlink", unlink)
    else:
        folder.chmod(0o555)
    try:
        lock.release()
    finally:
        folder.chmod(0o755)
        monkeypatch.undo()
    assert os.path.getsize(lock.path) == 0
    assert len(lines) == 1, lines
    assert lock.path in lines[0] and "--ckpt.path" in lines[0] and "no longer writable" in lines[0], lines[0]
    assert "emptied" in lines[0] and "Permission denied" in lines[0], lines[0]
    taken = []
    run_lock.acquire("--ckpt.path", str(folder), log=taken.append).release()
    assert taken == [] and not os.path.exists(lock.path)  # the next run takes the empty file over without a word


def _args(tmp_path, save_steps=-1, load=False, ckpt_path=None):
    return types.SimpleNamespace(
        ckpt=types.SimpleNamespace(
            output_dir=str(tmp_path / "out"),
            path=ckpt_path or str(tmp_path / "ckpts"),
            save_steps=save_steps,
            load_enable=load,
            best_metric_key="none",
        ),
        eval=types.SimpleNamespace(dataset=None),
    )


def test_lock_dirs(tmp_path):
    out = ("--ckpt.output_dir", str(tmp_path / "out"))
    assert run_lock.lock_dirs(_args(tmp_path)) == [out]
    assert run_lock.lock_dirs(_args(tmp_path, save_steps=5)) == [out, ("--ckpt.path", str(tmp_path / "ckpts"))]
    assert run_lock.lock_dirs(_args(tmp_path, load=True)) == [out]  # nothing there to resume from or protect
    os.makedirs(tmp_path / "ckpts")
    assert run_lock.lock_dirs(_args(tmp_path, load=True)) == [out, ("--ckpt.path", str(tmp_path / "ckpts"))]
    assert run_lock.lock_dirs(_args(tmp_path, save_steps=5, ckpt_path=str(tmp_path / "out" / "."))) == [out]


def test_lock_dirs_takes_the_best_checkpoint_decision_from_its_caller(tmp_path):
    """A run that saves only a best checkpoint at its evals owns --ckpt.path too; the lock is told so (it reads no
    flag predicate of its own: runtime/ imports nothing from config/)."""
    import ast
    import inspect

    out = ("--ckpt.output_dir", str(tmp_path / "out"))
    ckpts = ("--ckpt.path", str(tmp_path / "ckpts"))
    assert run_lock.lock_dirs(_args(tmp_path), saves_best=True) == [out, ckpts]
    assert run_lock.lock_dirs(_args(tmp_path), saves_best=False) == [out]
    imported = [
        node.module or ""
        for node in ast.walk(ast.parse(inspect.getsource(run_lock)))
        if isinstance(node, ast.ImportFrom)
    ] + [
        alias.name
        for node in ast.walk(ast.parse(inspect.getsource(run_lock)))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    assert "config" not in imported and not any(m.startswith("openrlhf_ess.config") for m in imported)


def _cli_script(argv):
    """The real CLI (parse, pre-flight, lock) with upstream's train() replaced by a wait: no Ray starts."""
    return (
        "import faulthandler, signal, sys, time\nfrom openrlhf_ess.cli import train_ppo_ray as cli\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)  # _Started.exited: where a stuck exit waits\n"
        # Ctrl-C as under a terminal: a background job of a non-interactive shell (`pytest ... &`) starts with
        # SIGINT ignored, which its children inherit, and Python then installs no KeyboardInterrupt handler
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "def train(args):\n    print('training', flush=True)\n    time.sleep(600)\n"
        f"cli.train = train\ncli.main({argv!r})\n"
    )


@pytest.mark.engine
def test_cli_refuses_a_second_run_at_once_and_before_ray(tiny_world, tmp_path, started, capsys):
    import ray

    argv = tiny_args(tiny_world, str(tmp_path)) + ["--ckpt.save_steps", "1"]
    first = started([sys.executable, "-c", _cli_script(argv)])
    first.wait_for("training", timeout=300)
    from openrlhf_ess.cli import train_ppo_ray as cli

    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    folder = argv[argv.index("--ckpt.output_dir") + 1]
    assert f"openrlhf-ess: error: --ckpt.output_dir {folder}: in use by another run (PID {first.proc.pid}" in err
    assert "openrlhf_ess.cli.train_ppo_ray --actor.model_name_or_path" in err  # the holder's command
    assert not ray.is_initialized()
    with capsys.disabled():
        print(f"\nsecond run refused after {seconds:.1f} s (pre-flight included)")


@pytest.mark.engine
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_the_lock_is_released_when_the_run_is_interrupted(tiny_world, tmp_path, started, sig):
    """SIGINT, SIGTERM, SIGHUP before Ray started: the CLI removes its lock files on the way out (our
    SIGTERM/SIGHUP handler is in force from main()'s first line; before, SIGTERM here killed the process with no
    clean-up and left the files for the next run to take over), and exits with 128 + the signal's number."""
    argv = tiny_args(tiny_world, str(tmp_path)) + ["--ckpt.save_steps", "1"]
    run = started([sys.executable, "-c", _cli_script(argv)])
    run.wait_for("training", timeout=300)
    folders = [argv[argv.index(flag) + 1] for flag in ("--ckpt.output_dir", "--ckpt.path")]
    paths = [os.path.join(folder, run_lock.LOCK_NAME) for folder in folders]
    assert all(json.load(open(p))["pid"] == run.proc.pid for p in paths)
    os.kill(run.proc.pid, sig)
    run.exited(120)
    assert not any(os.path.exists(p) for p in paths)
    lines = []
    for flag, folder in zip(("--ckpt.output_dir", "--ckpt.path"), folders):
        run_lock.acquire(flag, folder, log=lines.append).release()
    assert lines == []
    if sig != signal.SIGINT:
        assert run.proc.returncode == 128 + sig
