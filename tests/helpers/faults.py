"""Fault injection for tests/test_faults.py: run the real CLI and track, then clean up, every process it starts.

``run_cli_tracked`` is ``tests.helpers.e2e.run_cli`` plus process bookkeeping: while the CLI runs, the
process tree under it (the driver, its private Ray instance, Ray's workers, vLLM's engine processes) is
sampled every 0.2 s and remembered by (pid, start time). When the CLI has exited, or its time is up, any
of those processes still alive is reported and then ended: SIGTERM, and SIGKILL after a grace period,
by PID and only if the PID still belongs to the process recorded (same start time). Nothing is ever
matched by name. The run's --ray.temp_dir folder is removed afterwards.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

from benchmarks.common import REPO, _Tree, end_processes  # noqa: F401  (the process tracking: benchmarks/common.py)
from openrlhf_ess.runtime.shm_cleanup import SHM_DIR


class TrackedRun:
    """Result of :func:`run_cli_tracked`."""

    def __init__(self, rc, log, seconds, ended_at, timed_out, leftovers, n_processes, shm_left=(), shm_counts=None):
        self.rc, self.log, self.seconds, self.timed_out = rc, log, seconds, timed_out
        self.ended_at = ended_at  # time.time() when the CLI process had exited
        self.leftovers = leftovers  # processes of this run still alive after it ended (then ended by us)
        self.n_processes = n_processes
        self.shm_left = list(shm_left)  # /dev/shm files the run's processes used that are still there
        self.shm_counts = shm_counts  # (entries in /dev/shm before the run, after it): other runs change it too


def run_cli_tracked(
    args: list,
    run_dir: str,
    timeout: int = 600,
    env=None,
    settle: float = 20.0,
    during=None,
    new_session=False,
    launcher=None,
) -> TrackedRun:
    """Run ``python -m openrlhf_ess.cli.train_ppo_ray ARGS`` with a time limit and leave no process behind.

    ``settle``: seconds the run's processes get to exit by themselves after the CLI exits (Ray's
    shutdown signals them asynchronously); whatever is still there after that is a leftover.
    ``during(proc, tree)``: called once the run has started, while it is tracked (e.g. to signal it at a point of
    its progress); the run's end is awaited after it returns. An exception inside it ends the whole run.
    ``new_session``: the CLI leads a process group of its own, as a batch scheduler's job step does, so that
    ``during`` can signal the whole group (``os.killpg(proc.pid, sig)``: Slurm's scancel, Kubernetes).
    ``launcher``: what runs the CLI module instead of ``python -m`` (a test launcher such as
    ``tests.helpers.fault_injection.LAUNCHER``).
    """
    cmd = (launcher or [sys.executable, "-m"]) + ["openrlhf_ess.cli.train_ppo_ray"] + args
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": run_dir, **(env or {})}
    log_path = os.path.join(run_dir, "log.txt")
    t0 = time.time()
    timed_out = False
    shm_before = len(os.listdir(SHM_DIR))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=new_session
        )
        with _Tree(proc.pid) as tree:
            if during is not None:
                during(proc, tree)
            try:
                rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                timed_out = True
                tree.sample()
                end_processes([p for p in tree.alive()], grace=5)
                rc = proc.wait()
    ended_at = time.time()
    seconds = ended_at - t0
    deadline = time.time() + settle
    while tree.alive() and time.time() < deadline:
        time.sleep(0.5)
    left = tree.alive()
    leftovers = [f"{p.pid} {tree.seen[p.pid][1]}" for p in left]
    end_processes(left)
    if "--ray.temp_dir" in args:  # the private Ray instance's folder (sockets, logs) goes too
        shutil.rmtree(args[args.index("--ray.temp_dir") + 1], ignore_errors=True)
    with open(log_path) as f:
        text = f.read()
    shm_counts = (shm_before, len(os.listdir(SHM_DIR)))
    return TrackedRun(rc, text, seconds, ended_at, timed_out, leftovers, len(tree.seen), tree.shm_left(), shm_counts)


def signal_at(reached, sig: signal.Signals, group: bool, what: str, run_dir: str, limit_s: float, before=None):
    """A ``during`` for :func:`run_cli_tracked`: wait until ``reached(tree)`` returns a point of the run's own progress
    (looked at every 10 ms; the run must not end first, nor take more than ``limit_s``), append it to the returned
    function's ``points``, call ``before()`` if given, and send ``sig`` to the CLI, or to its whole process group
    when ``group`` (then start the run with ``new_session=True``: Slurm's scancel, Kubernetes)."""

    def during(proc, tree):
        deadline = time.time() + limit_s
        while not (point := reached(tree)):
            log = os.path.join(run_dir, "log.txt")
            assert proc.poll() is None, f"the run ended before {what}: " + open(log).read()[-4000:]
            assert time.time() < deadline, f"{what}: not reached within {limit_s:.0f} s"
            time.sleep(0.01)
        during.points.append(point)
        if before is not None:
            before()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    during.points = []
    return during


def assert_stopped_by_signal(run: TrackedRun, sig: signal.Signals, group: bool) -> None:
    """A run signalled with ``sig`` (to its whole process group when ``group``, else to the CLI alone) said it was
    stopping, exited with 128 + the signal's number (SIGINT: KeyboardInterrupt), accounted for and removed the
    /dev/shm files its processes used and left no process (docs/faults.md §9 and §11)."""
    assert not run.timed_out, run.log[-4000:]
    assert "*** SIGTERM received" not in run.log or group, run.log[-4000:]  # Abseil's handler: not in the driver
    if sig == signal.SIGINT:
        assert run.rc != 0 and "KeyboardInterrupt" in run.log, run.log[-4000:]
    else:
        assert run.rc == 128 + sig, (run.rc, run.log[-4000:])
        assert f"[openrlhf-ess] {sig.name} received: stopping the run." in run.log, run.log[-4000:]
    if sig != signal.SIGHUP:  # vLLM was up and the CLI had seen its files: it accounts for them, removed or gone
        # (a group SIGTERM also reaches vLLM's processes, which may unlink their queues before they die; seen in CI)
        account = r"shared-memory file\(s\) this run's processes (left in|used is left in) /dev/shm"
        assert re.search(account, run.log), run.log[-4000:]
    assert not run.shm_left, f"/dev/shm files of the run left behind: {run.shm_left}"
    assert not run.leftovers, run.leftovers


# A reward file for --reward.remote_url that kills the vLLM engine it runs in (upstream calls the reward
# function inside the engine actor) on its N-th call, while other requests of the rollout are in flight:
# SIGKILL of its own process, as the kernel's OOM killer or a crash in a native kernel would. Before dying
# it writes the engine's PID to a file, so the test can check the run reported that process.
KILL_ENGINE_REWARD = """
import os
import shutil
import signal

import torch

_calls = 0


def reward_func(queries, prompts, labels):
    global _calls
    _calls += 1
    if _calls == {kill_at}:
        with open({marker!r}, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    rewards = torch.tensor([0.5] * len(queries))
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{}}}}
"""


def write_kill_engine_reward(path: str, marker: str, kill_at: int = 3) -> str:
    with open(path, "w") as f:
        f.write(KILL_ENGINE_REWARD.format(kill_at=kill_at, marker=marker))
    return path
