"""Shared-memory files a run leaves in /dev/shm, recorded while it runs and removed when it ends.

Who creates them. Every vLLM engine's processes (the engine actor, its EngineCore and worker processes):

- ``psm_<hex>``: Python's ``multiprocessing.shared_memory.SharedMemory`` (its default name prefix). vLLM's
  ``shm_broadcast.ShmRingBuffer`` (the message queues between the engine and its workers; 167 MB and 251 MB
  apparent size here) creates them, unregisters them from multiprocessing's resource tracker, and unlinks them
  only in ``__del__``;
- ``sem.mp-<random>``: named POSIX semaphores of ``multiprocessing`` locks under the spawn/forkserver start
  methods, unlinked by their finalizer or, if the process dies, by the resource tracker.

Ray ends an engine actor's processes with signals at shutdown (and the whole process group when one dies), so
neither ``__del__`` nor the resource tracker runs, and the files stay: 57 after ~30 runs.

What the CLI does (:class:`ShmWatch`): while the run lives, a thread looks every :data:`INTERVAL_S` seconds at the
/dev/shm files that the CLI's own process tree (the driver, its private Ray instance, Ray's workers, their vLLM
processes) has mapped or open (``/proc/<pid>/maps``, ``/proc/<pid>/fd``), and records them by inode. When the run ends
(exit 0, an error, SIGTERM/SIGHUP: ``signals.py``, SIGINT: ``KeyboardInterrupt``; one last :meth:`ShmWatch.sample` just
before Ray's shutdown, then an ``atexit`` hook, after it), it waits a few seconds for the tree to exit and removes the
recorded files that still exist (the same inode under the name seen, a semaphore under any ``sem.`` name) and that no
process outside the run maps or holds open (the run's processes carry :data:`RUN_ENV`, set before Ray starts, so one
the watch never sampled still counts as the run's). A file no process of this run was seen using is never touched, so
another run's files (or anything else in /dev/shm) are safe. Not covered: a file created and abandoned between two
looks, SIGKILL of the CLI itself, and the nodes of a cluster joined with --ray.address (their processes are not the
CLI's children).

What SIGKILL leaves. A run killed with SIGKILL (the OOM killer, preemption, Slurm after its
grace period) runs no clean-up. So the watch also writes what it records to a ledger in a per-user state folder
(:func:`state_dir`): the run's token, host, creator PID and start time, and each file's device, inode and name. A
run that ends cleans up and deletes its ledger. At start-up every run calls :func:`sweep_dead_runs`: for each
ledger of this host whose creator is gone, it ends the processes still carrying that run's token (orphans, by PID),
then removes the recorded files that still exist and that no live process maps or holds open, and prints one line
naming what was freed. A file it did not record, or one another process holds, is never touched. By hand, on a
node where no later run starts: ``python -m openrlhf_ess.runtime.shm_cleanup`` (the same sweep; docs/faults.md).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from typing import Dict, Iterable, List, Optional, Set, Tuple

SHM_DIR = "/dev/shm"
INTERVAL_S = 2.0
_PREFIX = SHM_DIR + "/"


def mapped_shm(pid: int) -> Dict[Tuple[int, int], str]:
    """{(device, inode): name} of the /dev/shm files process ``pid`` has mapped or open; empty if unreadable.

    By inode, not name: glibc's ``sem_open`` creates a named semaphore under a temporary name, maps it, links it to
    its final name (``sem.mp-...``) and deletes the temporary one, so the mapping shows ``/dev/shm/sem.XXXXXX
    (deleted)`` while the file left behind is the same inode under the final name."""
    found: Dict[Tuple[int, int], str] = {}
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = [line for line in f.read().decode(errors="replace").splitlines() if _PREFIX in line]
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith(_PREFIX):
            continue
        major, minor = parts[3].split(":")
        key = (os.makedev(int(major, 16), int(minor, 16)), int(parts[4]))
        found[key] = os.path.basename(parts[5].replace(" (deleted)", ""))
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(path).startswith(_PREFIX):
                continue
            st = os.stat(path)
        except OSError:
            continue
        found[(st.st_dev, st.st_ino)] = os.path.basename(os.readlink(path).replace(" (deleted)", ""))
    return found


def files_of(seen: Dict[Tuple[int, int], object]) -> List[str]:
    """Names of the /dev/shm entries that are files recorded in ``seen`` ({(device, inode): time last seen, or
    (time, name)}): the same inode under the name it was seen with (a semaphore: under any ``sem.`` name, as it is
    mapped under its temporary one), or, for a file seen under another name, one that already existed then (a
    newer file that got a freed inode number is someone else's). Not by change time alone: writes through a
    shared mapping update a ring buffer's ctime while it lives, so a queue last sampled seconds before its final
    writes would be skipped (a psm_* file left)."""
    out = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return out
    for name in names:
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        record = seen.get((st.st_dev, st.st_ino))
        if record is None:
            continue
        last, seen_as = record if isinstance(record, tuple) else (record, None)
        # a semaphore is mapped under its temporary name (sem.XXXXXX) and left under its final one (sem.mp-...)
        same = seen_as == name or (seen_as or "").startswith("sem.") and name.startswith("sem.")
        if same or st.st_ctime <= last + 1.0:
            out.append(name)
    return sorted(out)


RUN_ENV = "OPENRLHF_ESS_RUN"  # set by ShmWatch in the CLI's environment: every process of the run inherits it


def _of_run(pid: int, token: str) -> bool:
    """Whether process ``pid`` carries the run's token in its initial environment (re-parented ones included)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{RUN_ENV}={token}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def in_use_outside(tree_pids: Iterable[int], token: Optional[str] = None) -> Set[Tuple[int, int]]:
    """(device, inode) of the /dev/shm files that a live process outside the run has mapped or open: not one of
    ``tree_pids`` and not carrying the run's ``token`` (an engine process of the run that the watch never sampled,
    or that was re-parented while exiting, carries it)."""
    skip = set(tree_pids)
    used: Set[Tuple[int, int]] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in skip and not (token and _of_run(int(entry), token)):
            used.update(mapped_shm(int(entry)))
    return used


def _tree(root: int) -> List[Tuple[int, float]]:
    """(pid, start time) of ``root`` and its descendants."""
    import psutil

    try:
        proc = psutil.Process(root)
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in procs:
        try:
            out.append((p.pid, p.create_time()))
        except psutil.Error:
            pass
    return out


def end_processes(procs, grace_s: float = 10.0) -> None:
    """SIGTERM exactly these processes (psutil objects), then SIGKILL those still alive ``grace_s`` seconds later,
    as schedulers stop a job."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)


def alive_processes(seen: Iterable[Tuple[int, float]], exclude: Optional[int] = None) -> list:
    """The processes of ``seen`` ((pid, start time) pairs) that still exist and are not zombies, as psutil objects:
    a PID now held by another process (another start time) is not one of them. ``exclude``: a PID left out."""
    import psutil

    alive = []
    for pid, created in seen:
        if pid == exclude:
            continue
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def _alive(seen: Iterable[Tuple[int, float]], exclude: int) -> List[int]:
    return [p.pid for p in alive_processes(seen, exclude)]


def unlink_unheld(names: Iterable[str], held: Set[Tuple[int, int]]) -> Tuple[List[Tuple[str, int]], bool]:
    """Remove each /dev/shm file of ``names`` unless its (device, inode) is in ``held`` (another process maps or
    holds it: never ours to remove). Returns ((name, bytes of RAM it held), ...) of those removed, and whether any
    was kept because it was held. A file already gone is skipped: its owner removed it, as it should."""
    removed, kept = [], False
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in held:
                kept = True
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append((name, st.st_blocks * 512))  # touched pages: a queue's apparent size is more
    return removed, kept


class ShmWatch:
    """Records the /dev/shm files this process's tree uses; :meth:`cleanup` removes those left (module docstring)."""

    def __init__(self, root: Optional[int] = None, interval_s: float = INTERVAL_S, root_files: bool = True):
        self.root = os.getpid() if root is None else root
        self.root_files = root_files  # False: a file the root itself maps is never the run's (a test process)
        self.interval_s = interval_s
        self.files: Dict[Tuple[int, int], Tuple[float, str]] = {}  # (device, inode) -> (last seen in use, name)
        self.seen: Set[Tuple[int, float]] = set()  # (pid, start time) of the tree's processes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="openrlhf-ess-shm-watch", daemon=True)
        self._lock = threading.Lock()
        # Before Ray starts, so every process of the run inherits it; always a new one: a run started from another
        # process that carries a token (a test session, a run's own child) must not share that run's identity.
        self.token = os.environ[RUN_ENV] = f"{self.root}-{time.time():.6f}"
        self.ledger = Ledger(self.token, self.root)

    def start(self) -> "ShmWatch":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self, everywhere: bool = False) -> None:
        """Record the tree's processes and the /dev/shm files they map. ``everywhere``: also every process that
        carries the run's token (:data:`RUN_ENV`) wherever it is now: when a whole process group is signalled,
        Ray's raylet dies first and the engine actors and vLLM's processes are re-parented out of the tree, some
        before any periodic look saw them or their files."""
        tree = _tree(self.root)
        if everywhere:
            tree = sorted(set(tree) | set(self._carriers()))
        now = time.time()
        found = {key: (now, name) for pid, _ in tree for key, name in mapped_shm(pid).items()}
        if not self.root_files:  # a file the root maps itself (shared with a child or not) is not the run's
            for key in mapped_shm(self.root):
                found.pop(key, None)
        with self._lock:
            self.seen.update(tree)
            new = set(found) - set(self.files)
            self.files.update(found)
            if new:  # for the next run, should this one be killed with SIGKILL before its clean-up
                self.ledger.write(self.files)

    def _carriers(self) -> List[Tuple[int, float]]:
        """(pid, start time) of every live process but the watched root that carries the run's token."""
        found = [(pid, _start_time(pid)) for pid in _carrying(self.token, exclude=self.root)]
        return [(pid, start) for pid, start in found if start is not None]

    def end_processes(self, grace_s: float = 10.0) -> int:
        """End every process of the run still alive (recorded in the tree, or carrying the run's token: the same
        PID and start time; never the watching process itself): :func:`end_processes`. Returns how many there
        were. By PID and token, never by name: a re-parented vLLM EngineCore whose Ray actor died is still found,
        another run's process never is."""
        import psutil

        self.sample(everywhere=True)
        procs = []
        for pid in _alive(list(self.seen), self.root):
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        end_processes(procs, grace_s)
        return len(procs)

    def cleanup(self, wait_s: float = 10.0) -> List[str]:
        """Stop watching, give the run's other processes ``wait_s`` seconds to exit, then remove the recorded
        files that still exist; returns the names removed."""
        self._stop.set()
        self.sample()  # processes still there now, and what they map
        deadline = time.time() + wait_s
        while _alive(self.seen, self.root) and time.time() < deadline:
            time.sleep(0.2)
        with self._lock:
            left = files_of(self.files)
        others = in_use_outside((pid for pid, _ in self.seen), self.token) if left else set()
        removed, _ = unlink_unheld(left, others)
        self.ledger.remove()  # what is left is held by another process: never ours to remove
        return [name for name, _ in removed]


# ---- what SIGKILL leaves: the ledger and the next run's sweep ---------------------------------------------------

STATE_ENV = "OPENRLHF_ESS_STATE_DIR"


def state_dir() -> str:
    """The per-user folder of the runs' ledgers: ``$OPENRLHF_ESS_STATE_DIR``, else ``$XDG_STATE_HOME/openrlhf-ess/shm``
    (``~/.local/state/openrlhf-ess/shm``); ``<tmp>/openrlhf-ess-<uid>/shm`` where that cannot be created (a read-only
    HOME). Per user, not per output folder: /dev/shm is per host, and the next run on the node may write elsewhere."""
    if os.environ.get(STATE_ENV):
        return os.environ[STATE_ENV]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    folder = os.path.join(base, "openrlhf-ess", "shm")
    try:
        os.makedirs(folder, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), f"openrlhf-ess-{os.getuid()}", "shm")


def _start_time(pid: int) -> Optional[float]:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class Ledger:
    """One run's record of its /dev/shm files, for a later run to sweep should this one be SIGKILLed."""

    def __init__(self, token: str, root: int, folder: Optional[str] = None):
        self.folder = folder or state_dir()
        self.path = os.path.join(self.folder, f"run-{token}.json")
        self.head = {"token": token, "host": socket.gethostname(), "pid": root, "start": _start_time(root)}
        self.failed = False

    def write(self, files: Dict[Tuple[int, int], Tuple[float, str]]) -> None:
        """Atomically replace the ledger with ``files`` ({(device, inode): (last seen, name)}). A folder that
        cannot be written costs only the SIGKILL sweep, never the run."""
        if self.failed:
            return
        record = dict(self.head, files=[[dev, ino, seen, name] for (dev, ino), (seen, name) in files.items()])
        try:
            os.makedirs(self.folder, exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.path)
        except OSError:
            self.failed = True

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _read_ledger(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            record = json.load(f)
        record["files"] = {(dev, ino): (seen, name) for dev, ino, seen, name in record["files"]}
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _carrying(token: str, exclude: Optional[int] = None) -> List[int]:
    """PIDs of the live processes that carry the run's token (:data:`RUN_ENV`), ``exclude`` (default: this one)
    excepted."""
    skip = os.getpid() if exclude is None else exclude
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != skip and _of_run(int(e), token)]


class Swept:
    """What :func:`sweep_dead_runs` freed: ``files`` (names), ``bytes`` (RAM they held), ``ended`` (PIDs of
    orphans), ``runs`` (the dead runs' ``pid`` values); :meth:`message` is the one line the CLI prints (empty if
    nothing was freed)."""

    def __init__(self):
        self.files: List[str] = []
        self.bytes = 0
        self.ended: List[int] = []
        self.runs: List[int] = []

    def message(self) -> str:
        if not (self.files or self.ended):
            return ""
        shown = ", ".join(self.files[:6]) + (f" and {len(self.files) - 6} more" if len(self.files) > 6 else "")
        text = (
            f"freed {len(self.files)} shared-memory file(s) ({self.bytes / 2**20:.0f} MiB) in {SHM_DIR} that an "
            f"earlier run (pid {', '.join(map(str, self.runs))}, gone without its clean-up: SIGKILL?) left"
        )
        text += f": {shown}" if self.files else ""
        if self.ended:
            text += (
                f"; ended {len(self.ended)} of its process(es) still running (pid {', '.join(map(str, self.ended))})"
            )
        return text


def sweep_dead_runs(folder: Optional[str] = None, own_token: Optional[str] = None, grace_s: float = 10.0) -> Swept:
    """Remove what runs of this user on this host left in /dev/shm when they died without clean-up (module
    docstring). A ledger whose creator (PID and start time) still lives is a running run's: skipped. Safe to call
    from any number of runs at once: every removal re-checks that no live process maps or holds the file."""
    import psutil

    swept = Swept()
    folder = folder or state_dir()
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("run-") and n.endswith(".json"))
    except OSError:
        return swept
    host = socket.gethostname()
    for name in names:
        path = os.path.join(folder, name)
        record = _read_ledger(path)
        if record is None or record.get("host") != host or record.get("token") == own_token:
            continue
        if record.get("start") is not None and _start_time(record["pid"]) == record["start"]:
            continue  # its creator runs: a live run's ledger
        orphans = []
        for pid in _carrying(record["token"]):
            try:
                orphans.append(psutil.Process(pid))
            except psutil.Error:
                pass
        if orphans:
            end_processes(orphans, grace_s)
            swept.ended += [p.pid for p in orphans]
        left = files_of(record["files"])
        removed, kept = unlink_unheld(left, in_use_outside(()) if left else set())
        swept.files += [name for name, _ in removed]
        swept.bytes += sum(size for _, size in removed)
        if removed or orphans:
            swept.runs.append(record["pid"])
        if not kept:
            try:
                os.unlink(path)
            except OSError:
                pass
    return swept


if __name__ == "__main__":  # by hand, on a node where no later run will start: the same sweep as a run's start-up
    result = sweep_dead_runs()
    print(result.message() or f"nothing to free: no run of this user left files in {SHM_DIR} ({state_dir()})")
