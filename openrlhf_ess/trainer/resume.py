"""Resuming async runs without losing prompts, from complete checkpoints only (--train.async_enable).

Upstream's checkpoint (DeepSpeed's, ``<ckpt.path>/_actor/global_step<N>/`` and the ``latest`` file naming
the tag) already holds the data loader position of the batch the trainer consumed at step N: the generator
captures it when it queues that batch, so rollouts queued or in flight at the checkpoint come after it and
are generated again on resume. Two things are ours, in a sidecar file written next to DeepSpeed's files:

- the prompts the generator had dispatched but the trainer had not consumed at step N although the data
  loader is past them: those left over in upstream's sample buffer when one vLLM call draws more prompts
  than a step trains (``--rollout.vllm_generate_batch_size`` > ``--rollout.batch_size``). They are
  replayed first on resume, then the data loader continues from its saved position;
- completion: the sidecar is written (temp file, then rename) after every rank's DeepSpeed save returned,
  so a checkpoint without it was cut short by a kill. Before the actors load, :func:`prepare` points
  ``latest`` at the newest complete checkpoint and moves the incomplete ones aside, with a printed line.

Why regenerate rather than restore finished rollouts: a restored rollout would be trained by weights that
are not the ones it was sampled against in the resumed run's version numbering (versions restart at 0 on
the trainer and the engines), and the exact π_prox modes would need the old versions' weights or scores as
well; regenerating costs one batch of generation and keeps every mode exact with no extra state.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time
from typing import Callable, List, Optional

SIDECAR = "openrlhf_ess_resume.pkl"  # inside DeepSpeed's tag folder; written last, so it marks completion
_TAG = re.compile(r"^global_step(\d+)$")


def applies(args) -> bool:
    """Whether an async run saves or loads checkpoints (our sidecar and resume checks); off: upstream's."""
    ckpt = args.ckpt  # save_steps: -1 on the driver, inf in the actors (upstream's controller sets it) = never
    return bool(args.train.async_enable) and (bool(ckpt.load_enable) or 0 < ckpt.save_steps < float("inf"))


def actor_dir(ckpt_path: str) -> str:
    return os.path.join(ckpt_path, "_actor")  # upstream's PolicyModelActor.save_checkpoint


def tag_of(global_step: int) -> str:
    return f"global_step{global_step}"  # upstream's BasePPOTrainer.save_logs_and_checkpoints


def write_sidecar(ckpt_path: str, global_step: int, state: dict) -> Optional[str]:
    """Write ``state`` next to DeepSpeed's files of step ``global_step`` (temp file, fsync, rename).

    Call only after every rank's save returned: the file's presence says the checkpoint is complete.
    Nothing is written where DeepSpeed wrote no step folder (e.g. upstream's --ckpt.disable_ds)."""
    folder = os.path.join(actor_dir(ckpt_path), tag_of(global_step))
    if not os.path.isdir(folder):
        return None
    path = os.path.join(folder, SIDECAR)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        pickle.dump({**state, "global_step": global_step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_sidecar(folder: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, SIDECAR), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _read_latest(folder: str) -> Optional[str]:
    try:
        with open(os.path.join(folder, "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _write_latest(folder: str, tag: str) -> None:
    tmp = os.path.join(folder, f"latest.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, "latest"))


def step_tags(folder: str) -> List[int]:
    """The steps of the ``global_step<N>`` folders under ``folder``, ascending (complete or not)."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for d in os.listdir(folder) if (m := _TAG.match(d)))


def prepare(ckpt_path: str, log: Callable[[str], None] = print) -> Optional[dict]:
    """Before the actors load (--ckpt.load_enable): make ``latest`` name the newest complete checkpoint.

    Incomplete step folders (no sidecar: a kill during the save) are moved to ``_actor.incomplete/`` (and
    the critic's folders of the same tags likewise), so neither DeepSpeed's load nor upstream's rotation of
    old checkpoints sees them. With no complete checkpoint, ``_actor`` is moved aside whole and the run
    starts fresh. Returns the loaded checkpoint's sidecar (None: fresh start). A ``latest`` naming a
    ``best*`` tag (upstream's best-metric checkpoints) is left alone."""
    folder = actor_dir(ckpt_path)
    if not os.path.isdir(folder):
        return None
    latest = _read_latest(folder)
    if latest is not None and not _TAG.match(latest) and os.path.isdir(os.path.join(folder, latest)):
        log(f"[openrlhf-ess] resume: {folder}/latest names {latest!r}, not a step checkpoint; loaded as upstream does")
        return None
    complete = [s for s in step_tags(folder) if read_sidecar(os.path.join(folder, tag_of(s))) is not None]
    newest = complete[-1] if complete else None
    aside = os.path.join(ckpt_path, "_actor.incomplete")
    for step in step_tags(folder):
        if step in complete:
            continue
        log(
            f"[openrlhf-ess] resume: checkpoint {tag_of(step)} is incomplete (no {SIDECAR}: the job was killed "
            f"while saving it); not loaded, moved to {aside}/"
            + (f"; loading {tag_of(newest)}, the newest complete one" if newest is not None else "")
        )
        _move_aside(ckpt_path, tag_of(step))
    if newest is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in ("_actor", "_critic"):
            if os.path.isdir(os.path.join(ckpt_path, name)):
                os.replace(os.path.join(ckpt_path, name), os.path.join(ckpt_path, f"{name}.unloadable-{stamp}"))
        log(
            f"[openrlhf-ess] resume: no complete checkpoint under {folder}; starting fresh (folder moved aside to "
            f"_actor.unloadable-{stamp}). Async checkpoints written before openrlhf-ess wrote {SIDECAR} lack it "
            "too; such a run can be continued without --train.async_enable (upstream's loader reads it)."
        )
        return None
    if latest != tag_of(newest):
        _write_latest(folder, tag_of(newest))
        critic = os.path.join(ckpt_path, "_critic")
        if os.path.isdir(os.path.join(critic, tag_of(newest))):
            _write_latest(critic, tag_of(newest))
    return read_sidecar(os.path.join(folder, tag_of(newest)))


def _move_aside(ckpt_path: str, tag: str) -> None:
    for name in ("_actor", "_critic"):
        src = os.path.join(ckpt_path, name, tag)
        if os.path.isdir(src):
            dst = os.path.join(ckpt_path, f"{name}.incomplete", f"{tag}-{time.strftime('%Y%m%d-%H%M%S')}")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.move(src, dst)


def loaded_sidecar(ckpt_path: str) -> Optional[dict]:
    """The sidecar of the checkpoint ``latest`` names (the one the actors loaded, after :func:`prepare`)."""
    folder = actor_dir(ckpt_path)
    latest = _read_latest(folder)
    return read_sidecar(os.path.join(folder, latest)) if latest else None


def restored_message(sidecar: dict) -> str:
    """What a resume restored, for the driver's log."""
    replay = len(sidecar.get("replay", []))
    return (
        f"[openrlhf-ess] resume: restored {tag_of(sidecar['global_step'])} (step {sidecar['global_step']}, "
        f"episode {sidecar.get('episode', 0) + 1}): the policy trained by then (it had made "
        f"{sidecar.get('weight_version', '?')} weight syncs; versions restart at 0 on the trainer and the "
        f"engines); {sidecar.get('prompts_trained', '?')} prompts of the run trained; {replay} prompts "
        "dispatched but not trained at the checkpoint are replayed first, and the rollouts queued or in flight "
        "then are regenerated from the data loader's saved position"
    )
