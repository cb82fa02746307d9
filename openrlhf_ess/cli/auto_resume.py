"""``--train.auto_resume N``: the CLI supervises its own run and restarts it from the newest complete checkpoint
after a death during training, up to N times.

With N > 0, ``main()`` validates the flags (bad input still exits 2 at once) and then, instead of training, runs the
same command without ``--train.auto_resume`` as a child process in a process group of its own (:func:`supervise`).
The child is the ordinary CLI: it takes the run lock of its output folders (``runtime/run_lock.py``; this process
takes none, so nothing blocks the child and a second run is still refused by the child's lock) and reports how it
ended in a small status file whose path it finds in :data:`STATUS_ENV`: that training began (written when upstream's
``train()`` calls the controller's ``fit()``, the same moment that divides start-up failures from deaths during the
run in ``cli/triage.py``), and the failure's class and message. When it fails during training, the supervisor
starts the command again with ``--ckpt.load_enable`` (added once), which resumes from the newest complete
checkpoint under ``--ckpt.path`` (``trainer/resume.py``).

Never restarted (:func:`decide`): a finished run (exit 0); bad input (exit 2); a start-up failure (it would fail the
same way); a stop by a signal (the child's exit 128 + signal or its death by a signal, or the supervisor's own
SIGTERM / SIGHUP / SIGINT, which it forwards to the child's process group, SIGKILL after :data:`CHILD_GRACE_S`); a
failed write of an output or a failing reward function (the same again: the message names the fix); no complete
checkpoint to resume from. What a restart loses: the steps since the last checkpoint and the start-up time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, NamedTuple, Optional, Sequence

FLAG = "--train.auto_resume"
LOAD_FLAG = "--ckpt.load_enable"
STATUS_ENV = "OPENRLHF_ESS_AUTO_RESUME_STATUS"  # the child's status file (set by the supervisor for each attempt)
CLI_MODULE = "openrlhf_ess.cli.train_ppo_ray"

# How long the child gets, after the forwarded signal, to end its run (its own processes get STOP_GRACE_S = 3 s in
# cli/train_ppo_ray.py, then it removes the run's /dev/shm files, the lock and Ray's folder: 3-5 s measured) before
# its process group is SIGKILLed. Below docker stop's 10 s, so the clean-up is done when the scheduler's SIGKILL comes.
CHILD_GRACE_S = 8.0

# Failures during training that a restart would meet again: the message already names the fix.
NOT_RESTARTED = {
    "StartupFailed": "a start-up failure: a restart would fail the same way",
    "OutputFailed": "an output could not be written: a restart would fail the same way",
    "RewardFailed": "the reward function failed (--reward.failure_policy): a restart would fail the same way",
}


# ---- the child's side: its status file ----------------------------------------------------------------------------


def _update_status(**fields) -> None:
    """Merge ``fields`` into the status file :data:`STATUS_ENV` names (temp file, then rename); unset: nothing."""
    path = os.environ.get(STATUS_ENV)
    if not path:
        return
    status = {**read_status(path), **fields}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)
    except OSError as e:  # the supervisor's folder is gone: it then sees no status, and does not restart
        print(f"[openrlhf-ess] auto-resume: could not write the status file {path}: {e}", file=sys.stderr)


def mark_training_began() -> None:
    """Called when upstream's train() calls the controller's ``fit()``: a failure from now on is during training."""
    _update_status(training_began=True)


def record_failure(kind: str, message: str) -> None:
    """The failure the CLI ends with: its class (``ActorDied``, ``StartupFailed``, ...) and message."""
    _update_status(failure=kind, message=" ".join(str(message).split()))


def read_status(path: str) -> dict:
    try:
        with open(path) as f:
            status = json.load(f)
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


# ---- the decision (pure) ------------------------------------------------------------------------------------------


class Decision(NamedTuple):
    restart: bool
    exit_code: int  # the supervisor's, when it does not restart
    why: str  # what ended the attempt and, when not restarting, why not


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def failure_text(status: dict, limit: int = 240) -> str:
    """``Kind: message`` of the child's recorded failure, cut to ``limit`` characters."""
    kind = status.get("failure") or "an unclassified error"
    message = status.get("message") or "(no message; the traceback is above)"
    text = f"{kind}: {message}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decide(
    rc: int,
    status: dict,
    newest_step: Optional[int],
    restarts_done: int,
    max_restarts: int,
    signalled: Optional[int] = None,
    ckpt_path: str = "--ckpt.path",
) -> Decision:
    """Whether to start the run again after an attempt ended with exit code ``rc`` (``Popen.returncode``: negative
    when a signal killed it), the child's ``status`` (:func:`read_status`), ``newest_step`` (the newest complete
    checkpoint under ``ckpt_path``, None: none) and the restarts already made. ``signalled``: the signal the
    supervisor itself received (it then stops, whatever the child's code)."""
    if signalled is not None:
        return Decision(False, 128 + signalled, f"{_signal_name(signalled)} received: stopped, not restarted")
    if rc == 0:
        return Decision(False, 0, "the run finished")
    if rc < 0:
        name = _signal_name(-rc)
        return Decision(
            False,
            128 - rc,
            f"the run's process was killed by {name} (a stop request, or the kernel's OOM killer on the driver): "
            "not restarted",
        )
    if rc >= 128:
        return Decision(False, rc, f"the run was stopped by {_signal_name(rc - 128)} (exit {rc}): not restarted")
    if rc == 2:
        return Decision(False, 2, "bad input (exit 2, the error above): a restart would fail the same way")
    if rc != 1:
        return Decision(False, rc, f"the run exited with code {rc}, not a failure the CLI classifies: not restarted")
    kind = status.get("failure")
    if kind in NOT_RESTARTED:
        return Decision(False, 1, f"{failure_text(status)} -- {NOT_RESTARTED[kind]}")
    if not status.get("training_began"):
        return Decision(
            False,
            1,
            f"{failure_text(status)} -- before training began (a start-up failure): a restart would fail the same way",
        )
    if newest_step is None:
        return Decision(
            False,
            1,
            f"{failure_text(status)} -- during training, but there is no complete checkpoint under {ckpt_path} "
            "to resume from: nothing to resume from (a run writes one every --ckpt.save_steps steps; a smaller "
            "value loses fewer steps)",
        )
    if restarts_done >= max_restarts:
        return Decision(False, 1, f"{failure_text(status)} -- all {max_restarts} restart(s) used")
    return Decision(True, 1, failure_text(status))


# ---- the command of each attempt (pure) ---------------------------------------------------------------------------


def child_argv(argv: Sequence[str], resume: bool) -> List[str]:
    """``argv`` without ``--train.auto_resume N`` (``--train.auto_resume=N`` too); with ``resume``, also
    ``--ckpt.load_enable`` at the end unless it is there already."""
    out: List[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == FLAG:
            skip = True  # its value follows
            continue
        if token.startswith(FLAG + "="):
            continue
        out.append(token)
    if resume and LOAD_FLAG not in out:
        out.append(LOAD_FLAG)
    return out


def launch_command(argv: Sequence[str], orig_argv: Optional[Sequence[str]] = None) -> List[str]:
    """What started this process, up to the CLI's flags ``argv``: the interpreter's options and ``-m <module>`` as
    typed (``sys.orig_argv``), so every attempt runs the same command (a launcher module in front of the CLI
    included); ``python -m`` the CLI when ``argv`` is not the command line's tail (``main(argv)`` called directly)."""
    orig = list(sys.orig_argv if orig_argv is None else orig_argv)
    n = len(argv)
    if n and len(orig) > n and orig[-n:] == list(argv):
        return [sys.executable] + orig[1:-n]
    return [sys.executable, "-m", CLI_MODULE]


def newest_complete(ckpt_path: str, need_sidecar: bool) -> Optional[int]:
    """The step of the checkpoint a ``--ckpt.load_enable`` run would load (read only), or None."""
    from openrlhf_ess.trainer import resume

    found = resume.plan(ckpt_path, need_sidecar)
    return None if found is None else found.newest


# ---- the supervisor -----------------------------------------------------------------------------------------------


def _end_with_the_supervisor() -> None:
    """In the child, before it runs the CLI: SIGTERM when the supervisor dies (Linux's ``PR_SET_PDEATHSIG``). The
    child leads a process group of its own, so a supervisor killed by SIGKILL (which it cannot forward) would
    otherwise leave the run training on, unsupervised; with it the run stops as after any SIGTERM (its clean-up)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child outlives a SIGKILLed supervisor
        return
    if os.getppid() == 1:  # the supervisor died before the call
        os.kill(os.getpid(), signal.SIGTERM)


class _Child:
    """The running attempt and the supervisor's stop signals: the first is forwarded to the child's process group,
    and SIGKILL follows after ``grace_s`` (or at a second signal)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

    def __init__(self, grace_s: float, log):
        self.grace_s, self.log = grace_s, log
        self.proc: Optional[subprocess.Popen] = None
        self.signum: Optional[int] = None
        self.signalled_at = 0.0
        self.forwarded = self.killed = False
        self._previous = {}

    def install(self) -> None:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.signalled_at = signum, time.monotonic()
            self.log(
                f"[openrlhf-ess] auto-resume: {_signal_name(signum)} received: stopping the run (forwarded to its "
                f"process group; SIGKILL after {self.grace_s:g} s); not restarted"
            )
            self._forward()
        else:
            self._kill()

    def _signal_group(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _forward(self) -> None:
        if self.proc is not None and not self.forwarded:
            self.forwarded = True
            self._signal_group(self.signum)

    def _kill(self) -> None:
        if self.proc is not None and not self.killed:
            self.killed = True
            self._signal_group(signal.SIGKILL)

    def run(self, cmd: List[str], env: dict) -> int:
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_end_with_the_supervisor)
        self.forwarded = self.killed = False
        try:
            while True:
                if self.signum is not None:
                    self._forward()  # a signal that came before the child existed
                    if time.monotonic() - self.signalled_at > self.grace_s:
                        self._kill()
                try:
                    return self.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if self.signum is not None:
                self._kill()  # what the child left in its group (its Ray workers), after its own clean-up
            self.proc = None


def supervise(
    argv: Sequence[str],
    max_restarts: int,
    ckpt_path: str,
    need_sidecar: bool,
    command: Optional[List[str]] = None,
    log=None,
    grace_s: float = CHILD_GRACE_S,
) -> int:
    """Run ``command + argv`` (without ``--train.auto_resume``) until it finishes or :func:`decide` says stop;
    returns the exit code for the supervisor. ``command``: what runs the CLI (default: :func:`launch_command`);
    ``need_sidecar``: an async run (``resume.applies``), whose checkpoints are complete with their sidecar."""
    log = log or (lambda line: print(line, flush=True))
    command = list(command or launch_command(argv))
    child = _Child(grace_s, log)
    folder = tempfile.mkdtemp(prefix="openrlhf-ess-auto-resume-")
    failures: List[str] = []
    log(
        f"[openrlhf-ess] auto-resume: on ({FLAG} {max_restarts}): this process (pid {os.getpid()}) runs the job in a "
        "child process and restarts it from the newest complete checkpoint if it dies during training"
    )
    child.install()
    try:
        restarts, resumed_from = 0, None
        while True:
            status_path = os.path.join(folder, f"attempt{restarts}.json")
            env = {**os.environ, STATUS_ENV: status_path}
            if child.signum is not None:
                return 128 + child.signum
            t0 = time.monotonic()
            rc = child.run(command + child_argv(argv, resume=restarts > 0), env)
            status = read_status(status_path)
            newest = newest_complete(ckpt_path, need_sidecar) if rc == 1 and child.signum is None else None
            decision = decide(rc, status, newest, restarts, max_restarts, child.signum, ckpt_path)
            if rc != 0 and child.signum is None:
                since = "from the start" if resumed_from is None else f"resumed from step {resumed_from}"
                failures.append(f"{len(failures) + 1}) {since}, after {time.monotonic() - t0:.0f} s: {decision.why}")
            if not decision.restart:
                if rc != 0 and child.signum is None:
                    log(f"[openrlhf-ess] auto-resume: not restarted: {decision.why}")
                if restarts:
                    ended = "the run finished" if rc == 0 else f"exit {decision.exit_code}"
                    log(
                        f"[openrlhf-ess] auto-resume: {ended} after {restarts} restart(s); failures in order: "
                        + " | ".join(failures)
                    )
                return decision.exit_code
            restarts, resumed_from = restarts + 1, newest
            log(
                f"[openrlhf-ess] auto-resume: attempt {restarts}/{max_restarts}: the run failed during training "
                f"({decision.why}); restarting from global_step{newest} (step {newest}, the newest complete "
                f"checkpoint under {ckpt_path}) with {LOAD_FLAG}"
            )
    finally:
        child.restore()
        shutil.rmtree(folder, ignore_errors=True)
