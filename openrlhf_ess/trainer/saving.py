"""The trained model survives an unwritable or full output folder; a save that cannot write says why (docs/faults.md,
sections 8 and 13).

Upstream's ``train()`` saves the final model once, after ``fit()``, with ``PolicyModelActor.save_model`` ->
``DeepspeedStrategy.save_model(model, tokenizer, --ckpt.output_dir)``: every rank gathers the weights (a collective
under ZeRO-3), rank 0 writes them with ``save_pretrained`` straight into the folder, then every rank meets at a
barrier. A folder that became unwritable (permissions, a read-only remount, a full disk) lost every trained step
with a bare ``PermissionError``. :func:`save_final_model` keeps upstream's save and changes where it writes:

1. into a fresh temporary folder inside the target (``<--ckpt.output_dir>/.openrlhf_ess_saving``), then each
   file is renamed into the target (a rename within one folder tree: atomic per file, never a half-written file
   under its final name; weight files of an earlier save that the new one does not have are removed, as
   ``save_pretrained`` does);
2. if that folder cannot be written, into a fresh fallback folder, ``<system temp dir>/openrlhf_ess_model_<name>_
   <date>-<pid>`` (then one in the home folder), on rank 0's machine;
3. the run then ends with :class:`OutputWriteError` naming the target, the cause and where the model is.

The ranks agree after each attempt (an all-reduce of "it failed anywhere"), so a failure on rank 0 never leaves the
other ranks waiting in a collective: rank 0 catches its own write error and joins the barrier upstream's save
would have reached. Checkpoints (``--ckpt.save_steps``) are not redirected (a checkpoint elsewhere could not be
resumed from): a write failure there names its real cause (:func:`checkpoint_write_error`) and stops the run.

What a write failure is, and its cause (:func:`write_failure`), in this order: an ``OSError`` anywhere in the
exception's chain (``__cause__`` / ``__context__``) gives its errno; an errno the wrapper's text carries
(safetensors: "os error 28", torch: "strerror: Permission denied"); for torch's own writer, whose
``[enforce fail at inline_container.cc] unexpected pos N vs M`` carries none (a full disk, behind
``basic_ios::clear: iostream error``), the target folder's filesystem at the time of the error: read-only, full
(``os.statvfs``) or refusing a probe write; the wording of other write errors only as a last resort.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from typing import Callable, List, Optional, Tuple

STAGING = ".openrlhf_ess_saving"  # inside --ckpt.output_dir; renamed into it file by file
# Files of a model save that a new save replaces: the weights (single or sharded) and their index.
_WEIGHTS = re.compile(
    r"^(?:model|pytorch_model|adapter_model)(?:-\d+-of-\d+)?\.(?:safetensors|bin)(?:\.index\.json)?$"
)
# The writers that wrap an OS write error without its errno: torch's zip writer (inline_container.cc, its
# PytorchStreamWriter, the C++ stream behind it) and safetensors (SafetensorError "Error while serializing").
_WRAPPED_WRITE = re.compile(
    r"inline_container\.cc|PytorchStreamWriter|iostream error|Error while serializing|"
    r"Parent directory .* does not exist|open file failed|file write failed",
    re.I,
)
# An errno in a wrapper's text: safetensors' "(os error 28)" / "code: 28", torch's "errno 13", Python's "[Errno 28]".
_ERRNO_IN_TEXT = re.compile(r"os error (\d+)|code: (\d+)|errno:? ?(\d+)|\[Errno (\d+)\]", re.I)
# The strerror texts of the write errors, as torch words them ("... failed with strerror: Permission denied").
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.EFBIG)
# Last resort: how other writers and the OS word a file that cannot be written.
_WRITE_ERROR = re.compile(
    r"write failed|No space left|Permission denied|Read-only file system|Disk quota exceeded|"
    r"Operation not permitted|Input/output error",
    re.I,
)
# Below this much free space (or no free inode) the filesystem is full for a save that failed without an errno.
FULL_BELOW_BYTES = 16 * 2**20
# What the user can do, by cause.
FIXES = {
    errno.ENOSPC: "Free space on that filesystem (or move --ckpt.path, with its checkpoints, to a larger one)",
    errno.EDQUOT: "Free space within your disk quota there, or have it raised",
    errno.EROFS: "The filesystem is mounted read-only: remount it read-write (or move --ckpt.path, with its "
    "checkpoints, to a writable one)",
    errno.EIO: "The storage reported an I/O error: check it (dmesg, the device's or the network filesystem's "
    "health) before writing to it again",
    errno.EACCES: "Make the folder writable by the user the run is started as",
    errno.EPERM: "Make the folder writable by the user the run is started as",
}


class OutputWriteError(RuntimeError):
    """The run could not write an output (the final model, a checkpoint); the message names the folder, the cause
    and where the work is. The CLI prints it as its last line (exit 1)."""


# ---- small pure helpers ------------------------------------------------------------------------------------------


def describe_os_error(e: BaseException) -> str:
    """``strerror: filename`` of an OSError, else ``Type: first line``."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{': ' + str(e.filename) if e.filename else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def free_space(folder: str) -> str:
    """'N MB free' on the filesystem of ``folder`` (its nearest existing ancestor), or '' if unknown."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        stat = os.statvfs(folder or ".")
    except OSError:
        return ""
    return f"{stat.f_bavail * stat.f_frsize / 2**20:.0f} MB free there"


def _probe(folder: str, create: bool = True) -> Optional[OSError]:
    """The OSError that writing (and removing) one file in ``folder`` raises, or None. ``create``: make the folder
    first; else probe its nearest existing ancestor (changing nothing)."""
    while not create and folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        os.makedirs(folder or ".", exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".openrlhf_ess_probe_", dir=folder or ".")
        try:
            os.write(fd, b"openrlhf-ess write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        return e
    return None


def write_problem(folder: str, create: bool = True) -> Optional[str]:
    """Why a file cannot be written in ``folder``, found by writing and removing one; None if it can. ``create``:
    make the folder first; else probe its nearest existing ancestor (changing nothing). As root, permission bits
    never refuse a write: the probe is the only reliable test."""
    error = _probe(folder, create)
    return describe_os_error(error) if error is not None else None


def _chain(e: BaseException):
    """``e`` and the exceptions it was raised from or during (``__cause__``, ``__context__``), each once."""
    seen, todo = set(), [e]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        todo += [exc.__cause__, exc.__context__]


def filesystem_problem(folder: str) -> Optional[Tuple[int, str]]:
    """(errno, what) when the filesystem of ``folder`` (its nearest existing ancestor) cannot take a file now:
    mounted read-only, or full (less than :data:`FULL_BELOW_BYTES` free for this user, or no free inode), read with
    ``os.statvfs``; None when it looks writable or cannot be read."""
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        stat = os.statvfs(folder or ".")
    except OSError:
        return None
    if stat.f_flag & os.ST_RDONLY:
        return errno.EROFS, f"{os.strerror(errno.EROFS)} (the filesystem of {folder} is mounted read-only)"
    free = stat.f_bavail * stat.f_frsize
    if free < FULL_BELOW_BYTES or (stat.f_files and stat.f_favail == 0):
        what = f"{free / 2**20:.1f} MB free" if free < FULL_BELOW_BYTES else "no free inode"
        return errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (the filesystem of {folder} is full: {what})"
    return None


def _errno_in_text(text: str) -> Optional[int]:
    """The errno a wrapper's message carries, as a number or as its strerror text, or None."""
    match = _ERRNO_IN_TEXT.search(text)
    if match:
        code = int(next(g for g in match.groups() if g))
        if code in errno.errorcode:
            return code
    for code in _WRITE_ERRNOS:
        if os.strerror(code).lower() in text.lower():
            return code
    return None


def write_failure(e: BaseException, folder: str) -> Optional[Tuple[Optional[int], str]]:
    """(errno or None, the cause in words) when ``e`` is a failure to write a file into ``folder``; None for any
    other error.

    In this order: an OSError in the exception's chain (its errno and strerror); an errno in a wrapper's text
    (safetensors, torch); for a wrapper without one (torch's ``inline_container.cc`` "unexpected pos" on a full
    disk), the filesystem of ``folder`` now (read-only or full by ``os.statvfs``, then a probe write); the wording
    of the error only as a last resort. A failure named by its errno is still probed, so a reason torch's words
    hide (a folder it cannot see into reported as "Parent directory ... does not exist") is named."""
    chain = list(_chain(e))
    for exc in chain:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno, describe_os_error(exc)
    text = " ".join(str(exc) for exc in chain)
    if _WRAPPED_WRITE.search(text) or type(e).__name__ == "SafetensorError":
        code = _errno_in_text(text)
        if code is not None:
            return code, os.strerror(code)
        found = filesystem_problem(folder)
        if found is not None:
            return found
        probed = _probe(folder, create=False)
        if probed is not None:
            return probed.errno, describe_os_error(probed)
        return None, describe_os_error(e)
    if isinstance(e, OSError) or _WRITE_ERROR.search(text):
        probed = _probe(folder, create=False)
        if probed is not None:
            return probed.errno, describe_os_error(probed)
        return _errno_in_text(text), describe_os_error(e)
    return None


def fallback_dirs(target: str, stamp: Optional[str] = None) -> List[str]:
    """Fresh folders for the model when ``target`` cannot take it, named after the target and the run."""
    stamp = stamp or f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    name = f"openrlhf_ess_model_{os.path.basename(os.path.normpath(target)) or 'output'}_{stamp}"
    return [os.path.join(tempfile.gettempdir(), name), os.path.join(os.path.expanduser("~"), name)]


def publish(staging: str, target: str) -> List[str]:
    """Rename every file of ``staging`` into ``target`` (replacing same-named ones), remove weight files of an earlier
    save that the new one lacks, and remove ``staging``. Returns the names moved."""
    names = sorted(os.listdir(staging))
    for name in names:
        dest = os.path.join(target, name)
        if os.path.isdir(dest) and not os.path.islink(dest):
            shutil.rmtree(dest)  # a folder the model save writes (e.g. a processor's); replaced whole
        os.replace(os.path.join(staging, name), dest)
    new = set(names)
    for name in os.listdir(target):
        if _WEIGHTS.match(name) and name not in new:
            os.remove(os.path.join(target, name))  # as save_pretrained's clean-up of a previous save
    os.rmdir(staging)
    return names


def _prepare(folder: str) -> Optional[str]:
    """An empty, writable ``folder`` (a leftover of a killed save is removed: it is ours); why not, or None."""
    try:
        if os.path.lexists(folder):
            shutil.rmtree(folder)
    except OSError as e:
        return describe_os_error(e)
    return write_problem(folder)


# ---- the final save ------------------------------------------------------------------------------------------------


def save_final_model(
    save: Callable[[str], None],
    target: str,
    rank0: bool,
    agree: Callable[[bool], bool],
    barrier: Callable[[], None],
    fallbacks: Optional[List[str]] = None,
) -> str:
    """Upstream's final save (``save(folder)``: collective, rank 0 writes), into ``target`` or a fallback.

    ``agree(ok)``: True when ``ok`` on every rank (an all-reduce); ``barrier()``: the one upstream's save ends with,
    which rank 0 joins itself when its write raised. Returns ``target``; raises :class:`OutputWriteError` on rank 0
    when the model went elsewhere or nowhere (the other ranks return the folder it went to)."""
    staging = os.path.join(target, STAGING)
    tried: List[Tuple[str, str]] = []  # (folder, why it failed)
    for place in [staging] + (fallbacks if fallbacks is not None else fallback_dirs(target)):
        problem = _prepare(place) if rank0 else None
        if not agree(problem is None):
            tried.append((place, problem or "failed on rank 0"))
            if rank0:
                shutil.rmtree(place, ignore_errors=True)  # made by the probe: ours, and empty
            continue
        try:
            save(place)
        except Exception as e:  # OSError, torch's RuntimeError, safetensors' SafetensorError
            found = write_failure(e, place) if rank0 else None
            if found is None:
                raise
            problem = found[1]
            barrier()  # the other ranks wait in the barrier that ends upstream's save_model
        if not agree(problem is None):
            tried.append((place, problem or "failed on rank 0"))
            if rank0:
                shutil.rmtree(place, ignore_errors=True)  # a partial model under a temporary name: no one's work
            continue
        if place == staging:
            if rank0:
                try:
                    publish(staging, target)
                except OSError as e:
                    raise OutputWriteError(
                        f"the trained model was written completely to {staging}, but could not be moved into "
                        f"--ckpt.output_dir {target} ({describe_os_error(e)}); it is all in {staging} (a Hugging "
                        "Face model folder: move its files into the target, or load it from there)."
                    ) from e
            return target
        if rank0:
            first = tried[0][1] if tried else "?"
            raise OutputWriteError(
                f"the trained model could not be written to --ckpt.output_dir {target} ({first}"
                f"{'; ' + free_space(target) if 'space' in first.lower() and 'free' not in first else ''}); it was "
                f"written to {place} "
                "instead (a Hugging Face model folder, on the machine of the policy's rank 0). Move it where it "
                "belongs, e.g. `mv "
                f"{place}/* {target}/` once that folder is writable. The checkpoints, if any, are under --ckpt.path."
            )
        return place
    raise OutputWriteError(
        "the trained model could not be written anywhere: "
        + "; ".join(f"{folder}: {why}" for folder, why in tried)
        + ". It is lost; the checkpoints, if any, are under --ckpt.path (resume with --ckpt.load_enable)."
    )


# ---- checkpoints ---------------------------------------------------------------------------------------------------


def checkpoint_write_error(e: BaseException, ckpt_path: str, tag: str) -> Optional[OutputWriteError]:
    """Our error for a checkpoint save that failed to write, naming the folder, the cause (:func:`write_failure`),
    what is kept and the fix for that cause; None for another failure."""
    folder = os.path.join(ckpt_path, "_actor", tag)
    for exc in _chain(e):
        name = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
        if name:
            folder = str(name) if os.path.isdir(str(name)) else os.path.dirname(str(name))
            break
    found = write_failure(e, folder)
    if found is None:
        return None
    code, cause = found
    space = free_space(folder) if "free" not in cause else ""
    reported = describe_os_error(e)
    fix = FIXES.get(code, "Make the folder writable (or free space)")
    return OutputWriteError(
        f"the checkpoint {tag} could not be written to {folder} (--ckpt.path {ckpt_path}): {cause}"
        f"{'; ' + space if space else ''}"
        f"{' (the save reported: ' + reported + ')' if reported != cause else ''}. The run stops here; the "
        f"checkpoints written before are kept under {os.path.join(ckpt_path, '_actor')} (a resume skips the "
        f"incomplete {tag}). {fix}, then run the same command with --ckpt.load_enable to continue from the last one."
    )


def prune_checkpoints(strategy, save_dir: str, max_num: int, keep: str) -> List[str]:
    """After the step checkpoint ``keep`` was written completely: delete the regular checkpoints beyond ``max_num``,
    in upstream's eviction order (``DeepspeedStrategy.save_ckpt``: no metric first, then the worst metric, then the
    oldest; ``best*`` ones never), never ``keep`` itself. Returns the folders deleted."""
    import shutil

    regular = [
        os.path.join(save_dir, d)
        for d in os.listdir(save_dir)
        if os.path.isdir(os.path.join(save_dir, d)) and not d.startswith("best") and d != keep
    ]
    over = len(regular) + 1 - max_num
    if over <= 0:
        return []
    metric = {path: strategy._read_ckpt_metric(path) for path in regular}
    order = sorted(
        regular,
        key=lambda p: (metric[p] is not None, metric[p] if metric[p] is not None else 0.0, os.path.getmtime(p)),
    )
    deleted = []
    for path in order[:over]:
        shutil.rmtree(path, ignore_errors=True)
        strategy.print(f"Deleted checkpoint {path} (--ckpt.max_num {max_num}; after {keep} was written)")
        deleted.append(path)
    return deleted
