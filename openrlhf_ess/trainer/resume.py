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

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import zipfile
from typing import Callable, List, Optional

from openrlhf_ess.config.resolve import resume_applies

SIDECAR = "openrlhf_ess_resume.pkl"  # inside DeepSpeed's tag folder; written last, so it marks completion
IDENTITY = "openrlhf_ess_run.json"  # inside DeepSpeed's tag folder: which run wrote it (every run, sync or async)
_TAG = re.compile(r"^global_step(\d+)$")


# Whether an async run saves or loads checkpoints (our sidecar and resume checks); off: upstream's. A flag
# predicate, so it lives with the others (config/resolve.py); ``resume.applies`` is the name its callers use.
applies = resume_applies


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


# ---- which run wrote a checkpoint -----------------------------------------------------------------------------

# What must be the same for a resume to continue the run that wrote the checkpoint: the weights it trains (the
# model's config), the prompts the data loader's saved position indexes, and the sizes that position counts in.
IDENTITY_KEYS = (
    ("model_config", "--actor.model_name_or_path"),
    ("prompt_dataset", "--data.prompt_dataset"),
    ("rollout_batch_size", "--rollout.batch_size"),
    ("n_samples_per_prompt", "--rollout.n_samples_per_prompt"),
)


def _local(spec: str) -> str:
    return os.path.abspath(spec) if os.path.exists(spec) else spec


def run_identity(args) -> dict:
    """What identifies the run for its checkpoints (:data:`IDENTITY_KEYS`), plus the model's path for messages. The
    model by the hash of its ``config.json`` (architecture, depth, sizes; the path may move between jobs), a hub id
    by its name; the prompt datasets by absolute path."""
    model = args.actor.model_name_or_path
    digest = model
    config = os.path.join(model, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            digest = "sha256:" + hashlib.sha256(f.read()).hexdigest()[:16]
    return {
        "model": _local(model),
        "model_config": digest,
        "prompt_dataset": ",".join(_local(p.split("@")[0].strip()) for p in str(args.data.prompt_dataset).split(",")),
        "rollout_batch_size": args.rollout.batch_size,
        "n_samples_per_prompt": args.rollout.n_samples_per_prompt,
    }


def write_identity(ckpt_path: str, tag: str, identity: dict) -> None:
    """Next to DeepSpeed's files of ``tag`` (rank 0, after its save returned); a folder DeepSpeed did not write
    (--ckpt.disable_ds) gets nothing."""
    folder = os.path.join(actor_dir(ckpt_path), tag)
    if os.path.isdir(folder):
        tmp = os.path.join(folder, f"{IDENTITY}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(identity, f, indent=1)
        os.replace(tmp, os.path.join(folder, IDENTITY))


def read_identity(folder: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, IDENTITY)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # written before openrlhf-ess recorded it: not checked


def identity_mismatch(saved: dict, now: dict) -> List[tuple]:
    """(flag, the checkpoint's value, this run's) for each :data:`IDENTITY_KEYS` entry that differs."""
    out = []
    for key, flag in IDENTITY_KEYS:
        if key in saved and saved[key] != now.get(key):
            shown = (saved.get("model"), now.get("model")) if key == "model_config" else (saved[key], now.get(key))
            out.append((flag, *shown))
    return out


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


_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_STATES = re.compile(
    r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$"
)  # and DeepSpeed's old name


def checkpoint_layout(folder: str) -> Optional[dict]:
    """``{"zero_stage", "dp", "mp", "bf16"}`` of a DeepSpeed step folder, from its rank-0 model states file
    (unpickled with its tensors memory-mapped, not read); None if it cannot be inspected here (no such file, or a
    class this process cannot import: then DeepSpeed decides). Raises ``ValueError`` for a file that does not
    unpickle."""
    names = sorted(n for n in os.listdir(folder) if _MODEL_STATES.match(n))
    if not names:
        return None
    import torch

    try:
        state = torch.load(os.path.join(folder, names[0]), map_location="cpu", mmap=True, weights_only=False)
    except (ImportError, AttributeError):
        return None
    except Exception as e:  # a torch zip whose pickle or records are damaged
        raise ValueError(f"{names[0]} does not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    if not isinstance(state, dict) or "dp_world_size" not in state:
        return None
    zero = (state.get("ds_config") or {}).get("zero_optimization") or {}
    return {
        "zero_stage": int(zero.get("stage", 0)),
        "dp": int(state["dp_world_size"]),
        "mp": int(state.get("mp_world_size", 1)),
        "bf16": bool(((state.get("ds_config") or {}).get("bf16") or {}).get("enabled")),
    }


def checkpoint_problem(folder: str) -> Optional[str]:
    """Why DeepSpeed could not load step folder ``folder``, or None when it looks whole: a model states file, every
    ``*.pt`` a complete torch zip (a file cut short has no zip directory at its end), and one model states file per
    rank (ZeRO-3) and one optimizer states file per data-parallel rank, as many as the model states file says wrote
    it (DeepSpeed's loader expects exactly those names)."""
    names = set(os.listdir(folder))
    if not any(_MODEL_STATES.match(n) for n in names):
        return "no *_model_states.pt file"
    for name in sorted(names):
        if name.endswith(".pt") and not zipfile.is_zipfile(os.path.join(folder, name)):
            return f"{name} is truncated or not a torch checkpoint file"
    try:
        layout = checkpoint_layout(folder)
    except ValueError as e:
        return str(e)
    if layout is None:
        return None
    dp, mp = layout["dp"], layout["mp"]
    if layout["zero_stage"] == 3:
        models = [f"zero_pp_rank_{r}_mp_rank_{m:02d}_model_states.pt" for r in range(dp) for m in range(mp)]
    else:
        models = [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    missing = [n for n in models if n not in names]
    if missing:
        return f"{missing[0]} is missing ({len(missing)} of the {len(models)} model states files)"
    optim = {(int(m.group(1)), int(m.group(2))) for n in names if (m := _OPTIM_STATES.match(n))}
    if layout["zero_stage"] >= 1 or optim:
        lost = [(r, m) for r in range(dp) for m in range(mp) if (r, m) not in optim]
        if lost:
            # the name DeepSpeed gives it (_get_rank_zero_ckpt_name): "bf16_" first when the engine ran in bf16
            prefix = "bf16_" if layout["bf16"] else ""
            return (
                f"the optimizer states of rank {lost[0][0]} are missing ({prefix}zero_pp_rank_{lost[0][0]}_mp_rank_"
                f"{lost[0][1]:02d}_optim_states.pt; {len(lost)} of the {dp * mp} ranks that wrote it)"
            )
    return None


class Plan:
    """What a resume from ``<ckpt_path>/_actor`` would do, found without changing anything (:func:`plan`)."""

    def __init__(self, folder: str, latest: Optional[str], steps: List[int]):
        self.folder, self.latest, self.steps = folder, latest, steps
        self.newest: Optional[int] = None  # the step that is loaded (None: none is complete)
        self.skipped: List[tuple] = []  # (step, why) of newer steps that are not loaded: moved aside
        self.upstream_tag = False  # `latest` names a best* checkpoint: loaded as upstream does

    @property
    def latest_is_stale(self) -> bool:
        """`latest` names no checkpoint folder (garbage, or a step that is gone)."""
        return self.latest is not None and not os.path.isdir(os.path.join(self.folder, self.latest))


def plan(ckpt_path: str, need_sidecar: bool) -> Optional[Plan]:
    """The checkpoint ``latest`` names under ``<ckpt_path>/_actor`` (upstream's choice), or, if that one is not
    complete, the newest complete one before it; and the ones not loaded: newer than ``latest``, or incomplete
    (read only). Without a usable ``latest``, the newest complete one.

    Complete: :func:`checkpoint_problem` finds nothing (and the critic's folder of that step, if the run has one,
    too); in async runs (``need_sidecar``) also our sidecar, written after every rank's save returned. None when
    there is no ``_actor`` folder."""
    folder = actor_dir(ckpt_path)
    if not os.path.isdir(folder):
        return None
    latest = _read_latest(folder)
    result = Plan(folder, latest, step_tags(folder))
    if latest is not None and not _TAG.match(latest) and os.path.isdir(os.path.join(folder, latest)):
        result.upstream_tag = True
        return result
    critic = os.path.join(ckpt_path, "_critic")
    followed = _TAG.match(latest) if latest is not None and os.path.isdir(os.path.join(folder, latest)) else None
    for step in reversed(result.steps):
        why = None
        if followed is not None and step > int(followed.group(1)):
            # upstream loads the tag `latest` names; a newer folder is not this run's last completed save
            result.skipped.append(
                (
                    step,
                    f"is newer than {latest}, the checkpoint `latest` names (DeepSpeed writes `latest` when a save "
                    "completes): another run's save in this --ckpt.path, or one cut short",
                )
            )
            continue
        if need_sidecar and read_sidecar(os.path.join(folder, tag_of(step))) is None:
            why = f"is incomplete (no {SIDECAR}: the job was killed while saving it)"
        else:
            problem = checkpoint_problem(os.path.join(folder, tag_of(step)))
            if problem is None and os.path.isdir(critic):
                critic_step = os.path.join(critic, tag_of(step))
                problem = checkpoint_problem(critic_step) if os.path.isdir(critic_step) else "no critic checkpoint"
                problem = problem and f"the critic's: {problem}"
            why = problem and f"is broken ({problem})"
        if why is None:
            result.newest = step
            break
        result.skipped.append((step, why))
    return result


def prepare(ckpt_path: str, log: Callable[[str], None] = print, need_sidecar: bool = True) -> Optional[dict]:
    """Before the actors load (--ckpt.load_enable): make ``latest`` name the newest complete checkpoint.

    Newer step folders that are not complete (async: no sidecar, a kill during the save; any run: a file cut short,
    a missing shard) are moved to ``_actor.incomplete/`` (and the critic's folders of the same tags likewise), so
    neither DeepSpeed's load nor upstream's rotation of old checkpoints sees them; nothing is deleted. With no
    complete checkpoint, ``_actor`` is moved aside whole and the run starts fresh; with no checkpoint at all, one
    line says where it looked. Returns the loaded checkpoint's sidecar (sync runs: ``{"global_step": N}`` when it
    has none; None: fresh start). A ``latest`` naming a ``best*`` tag (upstream's best-metric checkpoints) is left
    alone. ``need_sidecar``: an async run (our sidecar marks completion)."""
    found = plan(ckpt_path, need_sidecar)
    folder = actor_dir(ckpt_path)
    if found is None or (not found.steps and found.latest is None):
        why = "does not exist" if found is None else "holds no global_step* checkpoint and no latest file"
        log(
            "[openrlhf-ess] resume: --ckpt.load_enable, but there is no checkpoint to load: "
            f"{os.path.abspath(folder)} {why} (a run with --ckpt.save_steps writes its checkpoints to "
            "<--ckpt.path>/_actor/); training starts from step 0. To resume a run, pass the --ckpt.path it saved to."
        )
        return None
    if found.upstream_tag:
        log(
            f"[openrlhf-ess] resume: {folder}/latest names {found.latest!r}, not a step checkpoint; loaded as "
            "upstream does"
        )
        return None
    newest = found.newest
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if found.latest_is_stale:
        kept = os.path.join(folder, f"latest.ignored-{stamp}")
        os.replace(os.path.join(folder, "latest"), kept)
        log(
            f"[openrlhf-ess] resume: {folder}/latest names {found.latest[:80]!r}, which is no checkpoint there; "
            f"ignored (kept as {os.path.basename(kept)})"
            + (f"; loading {tag_of(newest)}, the newest complete one" if newest is not None else "")
        )
    aside = os.path.join(ckpt_path, "_actor.incomplete")
    for step, why in found.skipped:
        log(
            f"[openrlhf-ess] resume: checkpoint {tag_of(step)} {why}; not loaded, moved to {aside}/"
            + (f"; loading {tag_of(newest)}, the newest complete one" if newest is not None else "")
        )
        _move_aside(ckpt_path, tag_of(step))
    if newest is None:
        for name in ("_actor", "_critic"):
            if os.path.isdir(os.path.join(ckpt_path, name)):
                os.replace(os.path.join(ckpt_path, name), os.path.join(ckpt_path, f"{name}.unloadable-{stamp}"))
        log(
            f"[openrlhf-ess] resume: no complete checkpoint under {folder}; starting fresh (folder moved aside to "
            f"_actor.unloadable-{stamp})."
            + (
                f" Async checkpoints written before openrlhf-ess wrote {SIDECAR} lack it too; such a run can be "
                "continued without --train.async_enable (upstream's loader reads it)."
                if need_sidecar
                else ""
            )
        )
        return None
    if _read_latest(folder) != tag_of(newest):
        _write_latest(folder, tag_of(newest))
        critic = os.path.join(ckpt_path, "_critic")
        if os.path.isdir(os.path.join(critic, tag_of(newest))):
            _write_latest(critic, tag_of(newest))
    sidecar = read_sidecar(os.path.join(folder, tag_of(newest)))
    if need_sidecar:
        return sidecar
    log(f"[openrlhf-ess] resume: loading {tag_of(newest)} from {folder} (the newest complete checkpoint)")
    return sidecar or {"global_step": newest}


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
