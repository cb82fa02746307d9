"""The trained model survives an unwritable or full output folder (issue 21, item 3; docs/faults.md §6).

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
resumed from): a write failure there names its real cause (:func:`checkpoint_write_error`; torch reports a file it
cannot open as "Parent directory ... does not exist" or "open file failed") and stops the run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from typing import Callable, ContextManager, List, Optional, Tuple

STAGING = ".openrlhf_ess_saving"  # inside --ckpt.output_dir; renamed into it file by file
# Tests only: a write failure injected into rank 0's save_pretrained of the final model (errno name, e.g. EACCES).
FAULT_ENV = "OPENRLHF_ESS_FAULT_FINAL_SAVE"
# Files of a model save that a new save replaces: the weights (single or sharded) and their index.
_WEIGHTS = re.compile(
    r"^(?:model|pytorch_model|adapter_model)(?:-\d+-of-\d+)?\.(?:safetensors|bin)(?:\.index\.json)?$"
)
# How torch, DeepSpeed and the OS word a file that cannot be written.
_WRITE_ERROR = re.compile(
    r"Parent directory .* does not exist|open file failed|file write failed|write failed|No space left|"
    r"Permission denied|Read-only file system|Disk quota exceeded|Operation not permitted",
    re.I,
)


class OutputWriteError(RuntimeError):
    """The run could not write an output (the final model, a checkpoint); the message names the folder, the cause
    and where the work is. The CLI prints it as its last line (exit 1)."""


# ---- small pure helpers ------------------------------------------------------------------------------------------


def describe_os_error(e: BaseException) -> str:
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


def write_problem(folder: str, create: bool = True) -> Optional[str]:
    """Why a file cannot be written in ``folder``, found by writing and removing one; None if it can. ``create``:
    make the folder first; else probe its nearest existing ancestor (changing nothing). As root, permission bits
    never refuse a write: the probe is the only reliable test."""
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
        return describe_os_error(e)
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
    fault: Callable[[], ContextManager] = contextlib.nullcontext,
    fallbacks: Optional[List[str]] = None,
) -> str:
    """Upstream's final save (``save(folder)``: collective, rank 0 writes), into ``target`` or a fallback.

    ``agree(ok)``: True when ``ok`` on every rank (an all-reduce); ``barrier()``: the one upstream's save ends with,
    which rank 0 joins itself when its write raised; ``fault``: a context around rank 0's first write (tests).
    Returns ``target``; raises :class:`OutputWriteError` on rank 0 when the model went elsewhere or nowhere (the
    other ranks return the folder it went to)."""
    staging = os.path.join(target, STAGING)
    tried: List[Tuple[str, str]] = []  # (folder, why it failed)
    for place in [staging] + (fallbacks if fallbacks is not None else fallback_dirs(target)):
        problem = _prepare(place) if rank0 else None
        if not agree(problem is None):
            tried.append((place, problem or "failed on rank 0"))
            continue
        try:
            with fault() if place == staging and rank0 else contextlib.nullcontext():
                save(place)
        except (OSError, RuntimeError) as e:
            if not rank0 or (not isinstance(e, OSError) and not _WRITE_ERROR.search(str(e))):
                raise
            problem = describe_os_error(e)
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
                f"{'; ' + free_space(target) if 'space' in first.lower() else ''}); it was written to {place} "
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


@contextlib.contextmanager
def injected_fault(model):
    """Tests only (``OPENRLHF_ESS_FAULT_FINAL_SAVE=EACCES``, ``ENOSPC``, ...): ``model.save_pretrained`` raises that
    error, as a folder that became unwritable makes it raise inside rank 0's write (after the ZeRO-3 gather)."""
    name = os.environ.get(FAULT_ENV)
    if not name:
        yield
        return
    code = getattr(errno, name)

    def failing(folder, *args, **kwargs):
        raise OSError(code, f"{os.strerror(code)} (injected by {FAULT_ENV})", os.path.join(folder, "config.json"))

    model.save_pretrained = failing  # this instance only, for this one call
    try:
        yield
    finally:
        del model.save_pretrained


# ---- checkpoints ---------------------------------------------------------------------------------------------------


def checkpoint_write_error(e: BaseException, ckpt_path: str, tag: str) -> Optional[OutputWriteError]:
    """Our error for a checkpoint save that failed to write, naming the real cause; None for another failure.

    torch words a file it cannot open as "Parent directory <d> does not exist" (when it cannot see into the
    folder) or "open file failed" (when it cannot create the file), whatever the reason; the folder is probed to
    say which (permission, read-only, full)."""
    if not isinstance(e, OSError) and not _WRITE_ERROR.search(str(e)):
        return None
    folder = os.path.join(ckpt_path, "_actor", tag)
    if isinstance(e, OSError) and e.filename:
        folder = os.path.dirname(str(e.filename)) if not os.path.isdir(str(e.filename)) else str(e.filename)
    cause = write_problem(folder, create=False) or describe_os_error(e)
    space = free_space(folder)
    reported = describe_os_error(e)
    return OutputWriteError(
        f"the checkpoint {tag} could not be written to {folder} (--ckpt.path {ckpt_path}): {cause}"
        f"{'; ' + space if space else ''}"
        f"{' (the save reported: ' + reported + ')' if reported != cause else ''}. The run stops here; the "
        f"checkpoints written before are kept under {os.path.join(ckpt_path, '_actor')}. Make the folder writable "
        "(or free space), then run the same command with --ckpt.load_enable to continue from the last one."
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
