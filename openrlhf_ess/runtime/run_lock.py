"""One run per output folder: an exclusive lock in ``--ckpt.output_dir`` and ``--ckpt.path``.

Two runs writing one folder destroy each other's work: upstream's rotation of old checkpoints deletes the other
run's ``global_step*`` folders, ``latest`` ends up naming the other run's step, and a later ``--ckpt.load_enable``
resumes the wrong weights. The CLI takes the lock right after pre-flight, before Ray starts, and holds it until
the process exits.

Mechanism: ``flock(LOCK_EX | LOCK_NB)`` on ``<folder>/.openrlhf_ess.lock``, which also holds the holder's host,
PID, process start time (clock ticks since boot, from ``/proc/<pid>/stat``), boot id, start date and command as
JSON, to name it in a refusal.

- The kernel releases a flock when its process ends, however it ends (exit, exception, SIGINT, SIGTERM,
  SIGKILL, the OOM killer), so a dead run never blocks a new one. A clean exit also removes the file; after a
  kill the file stays, naming a process that is gone, and the next run takes it over with a notice.
- The file's content is checked too, for filesystems where flock does not exclude (NFS mounted with ``nolock``
  or ``local_lock=flock``: each host then only sees its own locks): a holder on this host is alive when its PID
  runs with the recorded start time (a reused PID has another), so a live holder is refused even if flock
  succeeded. A holder on another host cannot be checked from here: the run is refused, naming the file to
  delete if that run has ended.
- On NFSv4 (and v3 with lockd) Linux maps flock to POSIX byte-range locks that the server arbitrates across
  hosts; a crashed host's locks are released by the server after its lease (NFSv4: ~90 s).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from typing import Callable, List, Optional, Tuple

from openrlhf_ess.errors import ConfigError

LOCK_NAME = ".openrlhf_ess.lock"


# ---- the holder record (pure functions) --------------------------------------------------------------------------


def process_start_ticks(pid: int) -> Optional[int]:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: the fields after its ')' are fixed.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19])  # field 22 of the whole line


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def this_process(argv: Optional[List[str]] = None) -> dict:
    """The record this run writes into its lock files."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "start_ticks": process_start_ticks(pid),
        "boot_id": boot_id(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([sys.executable] + list(sys.argv if argv is None else argv)),
    }


def parse_holder(text: str) -> Optional[dict]:
    """The holder record of a lock file's text; None for an empty or unreadable one (no holder)."""
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def holder_alive(holder: dict, host: Optional[str] = None, boot: Optional[str] = None) -> Optional[bool]:
    """Whether the process a lock file names still runs: True, False, or None when it cannot be told (another
    host). A PID that runs with another start time was reused by a new process: the holder is gone."""
    if holder.get("host") != (host if host is not None else socket.gethostname()):
        return None
    if holder.get("boot_id") and holder.get("boot_id") != (boot if boot is not None else boot_id()):
        return False  # the machine rebooted since
    ticks = process_start_ticks(holder["pid"])
    return ticks is not None and ticks == holder.get("start_ticks")


def describe(holder: Optional[dict]) -> str:
    if not holder:
        return "a run whose details are not written yet (it is starting)"
    command = holder.get("command", "?")
    if len(command) > 300:
        command = command[:300] + " ..."
    where = f"PID {holder['pid']} on host {holder.get('host', '?')}"
    return f"{where}, started {holder.get('started', '?')}, command: {command}"


def lock_dirs(args, saves_best: bool = False) -> List[Tuple[str, str]]:
    """(flag, folder) for each folder a run owns: the final model's, and the checkpoints' when it writes or resumes
    from them (resuming moves broken checkpoints aside; ``saves_best``: a best checkpoint at an eval, as the caller
    decides from the flags). The same folder twice is locked once."""
    dirs = [("--ckpt.output_dir", args.ckpt.output_dir)]
    saving = args.ckpt.save_steps > 0 or saves_best
    if saving or (args.ckpt.load_enable and os.path.isdir(args.ckpt.path)):
        dirs.append(("--ckpt.path", args.ckpt.path))
    out, seen = [], set()
    for flag, folder in dirs:
        real = os.path.realpath(folder)
        if real not in seen:
            seen.add(real)
            out.append((flag, folder))
    return out


# ---- taking and releasing ------------------------------------------------------------------------------------------


class RunLock:
    """An exclusive lock on one folder, held by an open file descriptor (its flock) until :meth:`release`."""

    def __init__(self, flag: str, folder: str, fd: int, log: Callable[[str], None] = print):
        self.flag, self.folder, self.fd, self.log = flag, folder, fd, log
        self.path = os.path.join(folder, LOCK_NAME)
        self.owner = os.getpid()

    def release(self) -> None:
        """Remove the file and drop the flock. Idempotent; a forked child (which shares the flock) does nothing.
        A file that cannot be removed (the folder became unwritable) is emptied, which the next run takes over
        without a word, and the user is told which file it is."""
        if self.fd < 0 or os.getpid() != self.owner:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError as e:
            try:
                os.ftruncate(self.fd, 0)
                kept = "emptied; the next run with this folder takes it over"
            except OSError:
                kept = "left as it is; the next run sees that this process has ended and takes it over"
            self.log(
                f"[openrlhf-ess] run lock: could not remove {self.path} ({e.strerror}: {self.flag} {self.folder} is "
                f"no longer writable); the file was {kept}. Delete it once the folder is writable again if you like."
            )
        finally:
            os.close(self.fd)
            self.fd = -1


def _refuse(flag: str, folder: str, holder: Optional[dict]) -> ConfigError:
    path = os.path.join(folder, LOCK_NAME)
    return ConfigError(
        f"{flag} {folder}: in use by another run ({describe(holder)}; lock file {path}). Two runs writing one "
        "folder delete each other's checkpoints and a later --ckpt.load_enable resumes the wrong weights. Wait "
        f"for that run to end, or choose another {flag}."
    )


def acquire(flag: str, folder: str, log: Callable[[str], None] = print, argv: Optional[List[str]] = None) -> RunLock:
    """Take the lock of ``folder`` (created if missing) or raise :class:`ConfigError` naming the holder."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_NAME)
    for _ in range(5):  # the holder may remove the file between our open and our flock: then open it again
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read(fd)
                os.close(fd)
                raise _refuse(flag, folder, holder) from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            log(
                f"[openrlhf-ess] run lock: {path}: this filesystem does not support flock ({e.strerror}); only the "
                "holder recorded in the file is checked"
            )
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        holder = _read(fd)
        if holder is not None:
            alive = holder_alive(holder)
            if alive is None:
                os.close(fd)
                raise ConfigError(
                    f"{flag} {folder}: the lock file {path} names a run on another host ({describe(holder)}), whose "
                    "liveness cannot be checked from here (a flock would have excluded it on a filesystem that "
                    f"shares locks; this one may not). If that run has ended, delete {path} and start again; if it "
                    f"is running, choose another {flag}."
                )
            if alive:
                os.close(fd)
                raise _refuse(flag, folder, holder)
            log(
                f"[openrlhf-ess] run lock: took over {path} from {describe(holder)}: that process is no longer "
                "running (it was killed before it could remove the file)"
            )
        _write(fd, this_process(argv))
        return RunLock(flag, folder, fd, log)
    raise ConfigError(f"{flag} {folder}: could not take the lock {path} (it kept being replaced). Try again.")


def acquire_all(
    args, log: Callable[[str], None] = print, argv: Optional[List[str]] = None, saves_best: bool = False
) -> List[RunLock]:
    """Lock every folder of :func:`lock_dirs`; on a refusal, release those already taken and raise."""
    locks: List[RunLock] = []
    try:
        for flag, folder in lock_dirs(args, saves_best):
            locks.append(acquire(flag, folder, log, argv))
    except BaseException:
        release_all(locks)
        raise
    return locks


def release_all(locks: List[RunLock]) -> None:
    for lock in locks:
        lock.release()


def _read(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return parse_holder(b"".join(chunks).decode("utf-8", "replace"))


def _write(fd: int, holder: dict) -> None:
    data = (json.dumps(holder, indent=1) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
