"""Stale build locks of torch C++ extensions (DeepSpeed's JIT ops), found and cleared before a run starts.

On first use DeepSpeed builds its CPU shared-memory comm op (``deepspeed_shm_comm``, ``ShareMemCommBuilder``,
34-60 s on 2 cores) with torch's ``cpp_extension.load``, under a ``lock`` file in the build folder
(``$TORCH_EXTENSIONS_DIR/<op>/lock``, default ``~/.cache/torch_extensions/py<ver>_<cpu|cuXY>/<op>/lock``). torch's
``FileBaton`` creates it with ``O_CREAT | O_EXCL``, keeps it open while building, and deletes it at the end. A run
killed during the build (Ctrl-C, a timeout, a preempted job) leaves the file, and every later run waits in
``FileBaton.wait`` forever with nothing printed.

A lock is stale when no build holds it. The builder keeps the file open for the whole build, so on one machine
"no process has it open" (every ``/proc/<pid>/fd``) means no build is running. A build on another machine that
shares the folder (NFS home) is invisible here, and so are processes we may not inspect (another user's): then
only a lock older than :data:`STALE_AGE_S` (a build takes about a minute) is taken as stale. A stale lock is
removed with a notice; a lock that may be live is named, with the command that removes it.
"""

from __future__ import annotations

import glob
import os
import time
from typing import List, Optional, Tuple

STALE_AGE_S = 600.0
RECHECK_S = 1.0  # a lock found unheld is looked at again after this, before it is removed
# Filesystem types that other machines may share (/proc/mounts); a build there is invisible to /proc.
_SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs", "9p", "fuse")


def extensions_root() -> str:
    """The root torch builds extensions under: $TORCH_EXTENSIONS_DIR, else torch's default (without importing
    torch: ``~/.cache/torch_extensions``, honouring XDG_CACHE_HOME as ``get_default_build_root`` does)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions")


def lock_files(root: Optional[str] = None) -> List[str]:
    """Every build lock under the root: ``<root>/<op>/lock`` ($TORCH_EXTENSIONS_DIR) and
    ``<root>/<py..._cpu>/<op>/lock`` (torch's default root)."""
    root = root or extensions_root()
    return sorted(set(glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))))


def holders(path: str) -> Tuple[List[int], bool]:
    """(pids of this machine's processes that have ``path`` open, whether every process could be inspected)."""
    target = os.path.realpath(path)
    pids, complete = [], True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue  # exited meanwhile
        except PermissionError:
            complete = False
            continue
        for fd in fds:
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if link == target or link == target + " (deleted)":
                pids.append(int(entry))
                break
    return pids, complete


def fs_type(path: str) -> str:
    """The filesystem type of the mount that holds ``path`` (/proc/mounts, longest mount point), or ''."""
    best, kind = "", ""
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mount = parts[1].replace("\\040", " ")
                    inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                    if inside and len(mount) > len(best):
                        best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def clear_stale(notices: List[str], root: Optional[str] = None, now: Optional[float] = None) -> List[str]:
    """Remove the build locks no build holds (module docstring), adding a notice for each lock found; returns the
    locks removed."""
    removed = []
    now = time.time() if now is None else now
    for lock in lock_files(root):
        try:
            age = now - os.stat(lock).st_mtime
        except FileNotFoundError:
            continue  # the build finished meanwhile
        op = os.path.basename(os.path.dirname(lock))
        pids, complete = holders(lock)
        if pids:
            held_by = ", ".join(f"pid {p} ({_cmdline(p)})" for p in pids[:3])
            notices.append(
                f"torch extension build lock {lock}: a build of {op} is running ({held_by} holds it); the run's "
                "processes that need the op wait for it."
            )
            continue
        kind = fs_type(lock)
        shared = kind.split(".")[0] in _SHARED_FS
        if complete and not shared:
            why = "no process of this machine holds it"
        elif age > STALE_AGE_S:
            why = f"it is {age / 60:.0f} min old (a build takes about a minute) and no process here holds it"
        else:
            unseen = f"a build on another machine sharing this {kind} folder" if shared else "another user's build"
            notices.append(
                f"torch extension build lock {lock}: {age:.0f} s old and no process here holds it, but "
                f"{unseen} cannot be seen from here. If no build of {op} is running, delete it (rm {lock}); "
                "otherwise the run's processes that need the op wait on it (torch's FileBaton.wait) with nothing "
                "printed."
            )
            continue
        # torch's FileBaton.release closes the file, then deletes it: a lock seen unheld in between is about to go.
        # Looked at again a moment later, a stale lock is still there and still unheld.
        time.sleep(RECHECK_S)
        if not os.path.exists(lock) or holders(lock)[0]:
            continue
        try:
            os.remove(lock)
        except FileNotFoundError:
            continue
        removed.append(lock)
        notices.append(
            f"removed a stale torch extension build lock {lock} ({why}): a run killed while building {op} left "
            "it, and every process that needs the op would have waited on it forever (torch's FileBaton.wait). "
            f"The op is built again on first use (or now: python -m openrlhf_ess.tools.build_ops)."
        )
    return removed
