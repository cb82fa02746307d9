"""Pre-flight, outputs and what guards them: output, checkpoint and log folders created, a probe file written and
removed (the final save must not be the first write to its folder: an unwritable one would lose the trained model);
none of them is, holds or lies inside a model, prompt, reward or agent path (:func:`_check_outputs_are_not_inputs`);
a checkpoint folder this run would save into holds no earlier run's checkpoints, which upstream's rotation deletes
(:func:`_check_checkpoints_of_another_run`); ``--ckpt.load_enable``: the checkpoint a resume would load was written
with the same ZeRO layout (:func:`_check_resume_checkpoint`; which one is loaded, and broken ones, are
``trainer/resume.py``'s). The start-up notice says where each output goes (:func:`outputs_notice`) and at which steps
the evals run (:func:`_check_eval_steps`). Stale build locks are ``runtime/build_locks.py``'s, called from
:func:`~openrlhf_ess.checks.preflight.check`."""

from __future__ import annotations

import glob
import os
import tempfile
import types
from typing import List, Tuple

from openrlhf_ess import config
from openrlhf_ess.config import ConfigError
from openrlhf_ess.runtime import run_lock
from openrlhf_ess.trainer import eval_clock

CHECKPOINT_ROLES = ("_actor", "_critic")  # the subfolders of --ckpt.path upstream's save_ckpt writes and rotates


def saves_best(args: types.SimpleNamespace) -> bool:
    """Whether the run saves a checkpoint at each eval that improves ``--ckpt.best_metric_key``."""
    return config.eval_on(args) and args.ckpt.best_metric_key != "none"


def saves_checkpoints(args: types.SimpleNamespace) -> bool:
    """Whether the run writes into ``--ckpt.path``: every ``--ckpt.save_steps``, or at a best eval."""
    return 0 < args.ckpt.save_steps < float("inf") or saves_best(args)


def output_dirs(args: types.SimpleNamespace) -> List[Tuple[str, str, str]]:
    """(flag, folder, what is written there and when) for every folder the run will write to."""
    dirs = [("--ckpt.output_dir", args.ckpt.output_dir, "the trained model, at the end of the run")]
    if args.critic.model_name_or_path and args.critic.save_value_network:
        dirs.append(("--ckpt.output_dir", args.ckpt.output_dir + "_critic", "the critic, at the end of the run"))
    if saves_checkpoints(args):
        when = [f"every {args.ckpt.save_steps} steps"] if 0 < args.ckpt.save_steps < float("inf") else []
        when += (
            ["at each eval that improves the best metric (the previous best is deleted)"] if saves_best(args) else []
        )
        dirs.append(("--ckpt.path", args.ckpt.path, f"checkpoints, {' and '.join(when)}"))
    if args.logger.tensorboard_dir:
        dirs.append(("--logger.tensorboard_dir", args.logger.tensorboard_dir, "TensorBoard events, from step 1"))
    if args.algo.prox_audit_dir:
        dirs.append(("--algo.prox_audit_dir", args.algo.prox_audit_dir, "the audit trail, from the first sync"))
    if args.logger.wandb.key and os.environ.get("WANDB_DIR"):
        dirs.append(("WANDB_DIR", os.environ["WANDB_DIR"], "wandb's run files, from the start"))
    if args.ray.temp_dir:
        dirs.append(("--ray.temp_dir", args.ray.temp_dir, "Ray's session files, at start-up"))
    return dirs


def outputs_notice(args: types.SimpleNamespace) -> str:
    """The start-up line that says where each output of the run goes, and which default moved."""
    parts = [f"{what} -> {folder} ({flag})" for flag, folder, what in output_dirs(args)]
    if args.logger.wandb.key and not os.environ.get("WANDB_DIR"):
        parts.append(f"wandb's run files -> {os.path.join(os.getcwd(), 'wandb')} (wandb's default; set WANDB_DIR)")
    line = "outputs: " + "; ".join(parts) + "."
    if saves_checkpoints(args) and getattr(args.ckpt, "path_defaulted", False):
        line += (
            f" --ckpt.path not passed: {args.ckpt.path}, under --ckpt.output_dir (upstream's default, "
            "./ckpt/checkpoints_ppo_ray, is relative to the working directory, where another run's checkpoints "
            "would be rotated away)."
        )
    return line


def _check_eval_steps(args: types.SimpleNamespace, n_prompts, notices: List[str]) -> None:
    """Say at which steps the evals run, where the run's step count is known (the prompts were counted, no dynamic
    filtering): every multiple of ``--eval.steps`` and the final step (``trainer/eval_schedule.py``); an
    ``--eval.steps`` beyond the run's steps is named with the numbers. ``--eval.dataset`` without ``--eval.steps``:
    no eval runs."""
    if not args.eval.dataset:
        return
    if not config.eval_on(args):
        notices.append(
            f"--eval.dataset {args.eval.dataset} with --eval.steps {args.eval.steps}: no eval runs (upstream's -1 "
            "means never). Pass --eval.steps N to evaluate every N steps and after the final step."
        )
        return
    if n_prompts is None or args.algo.dynamic_filtering_enable:
        return
    every, batch, episodes = args.eval.steps, args.rollout.batch_size, args.train.num_episodes
    total = eval_clock.run_steps(n_prompts, batch, episodes)
    planned = eval_clock.planned_evals(every, total)
    count = (
        f"{total} steps ({n_prompts} prompts / --rollout.batch_size {batch} = {total // episodes} per episode x "
        f"--train.num_episodes {episodes})"
    )
    shown = ", ".join(str(s) for s in planned) if len(planned) <= 8 else f"{planned[0]}, {planned[1]}, ..., {total}"
    lag = (
        f" Async: an eval due at a step runs on the weights the engines hold when it starts (up to "
        f"--train.async_queue_size {args.train.async_queue_size} step(s) later) and is logged at their step."
        if args.train.async_enable and every <= total
        else ""
    )
    if every > total:
        notices.append(
            f"--eval.steps {every} is more than the run's {count}: no multiple of it is reached; the one eval runs "
            f"after the final step {total}. For more evals, pass --eval.steps {max(1, total // 4)} or less."
        )
    else:
        notices.append(f"evals at steps {shown} of {count}: every --eval.steps {every} and after the final step.{lag}")


def _check_checkpoints_of_another_run(args: types.SimpleNamespace) -> None:
    """A ``--ckpt.path`` this run saves into, without ``--ckpt.load_enable``, holds no checkpoint of an earlier run.

    Upstream's save deletes them: a new best checkpoint removes every other ``best*`` folder, and a step checkpoint
    removes the oldest beyond ``--ckpt.max_num``; a later resume would also load whichever ``latest`` names. A
    folder a running run holds is left to the run lock, which names that run."""
    if args.ckpt.load_enable or not saves_checkpoints(args):
        return
    found = []
    for role in CHECKPOINT_ROLES:
        folder = os.path.join(args.ckpt.path, role)
        if os.path.isdir(folder):
            found += sorted(
                os.path.join(role, d) for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d))
            )
    if not found:
        return
    try:
        with open(os.path.join(args.ckpt.path, run_lock.LOCK_NAME)) as f:
            holder = run_lock.parse_holder(f.read())
    except OSError:
        holder = None
    if holder is not None and run_lock.holder_alive(holder) is not False:
        return  # in use: run_lock.acquire refuses it, naming the run
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    passed = "--ckpt.path" if not getattr(args.ckpt, "path_defaulted", False) else "--ckpt.path (by default)"
    raise ConfigError(
        f"{passed} {args.ckpt.path} holds the checkpoints of an earlier run ({shown}). This run saves checkpoints "
        "there, and upstream's rotation deletes the ones it finds (every other best checkpoint at a new best, the "
        "oldest beyond --ckpt.max_num). To continue that run pass --ckpt.load_enable; to start a new one, pass a "
        "new --ckpt.output_dir (or --ckpt.path), or move those checkpoints away first."
    )


def _check_ray_temp_dir(args: types.SimpleNamespace) -> None:
    """Ray's unix sockets live under <temp_dir>/session_<date>_<pid>/sockets/ and a socket path has at most 107
    bytes: a long --ray.temp_dir fails Ray's start-up with an OSError about AF_UNIX path length."""
    temp_dir = args.ray.temp_dir
    if not temp_dir or args.ray.address or os.environ.get("RAY_ADDRESS"):
        return  # a joined cluster has its own temp dir
    # "/session_2026-12-01_00-37-32_644000_<pid>" + "/sockets/plasma_store" (ray/_private/node.py)
    suffix = (
        len("/session_") + len("2026-12-01_00-37-32_644000_") + len(str(os.getpid())) + len("/sockets/plasma_store")
    )
    longest = 107 - suffix
    if len(os.path.abspath(temp_dir)) > longest:
        raise ConfigError(
            f"--ray.temp_dir {temp_dir}: {len(os.path.abspath(temp_dir))} characters, but Ray's unix sockets live "
            f"{suffix} characters deeper and a socket path has at most 107: use a folder of at most {longest} "
            "characters (e.g. /tmp/ray_run1), or drop the flag (a fresh short folder under /tmp)."
        )


def _check_writable_dirs(args: types.SimpleNamespace) -> List[str]:
    _check_ray_temp_dir(args)
    checked = []
    for flag, folder, what in output_dirs(args):
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ConfigError(f"{flag} {folder}: is a file, not a folder ({what} go(es) there). Choose a folder.")
        try:
            os.makedirs(folder, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".openrlhf_ess_preflight_", dir=folder)
            try:
                os.write(fd, b"openrlhf-ess pre-flight write probe\n")
            finally:
                os.close(fd)
                os.remove(probe)
        except OSError as e:
            raise ConfigError(
                f"{flag} {folder}: cannot write there ({e.strerror or e}"
                f"{': ' + str(e.filename) if e.filename and e.filename != folder else ''}). It receives {what}; "
                "found only then, the work before it would be lost. Choose a folder you can write to."
            ) from None
        checked.append(folder)
    return checked


def _local_prefix(spec: str) -> str:
    """The part of a path before its first glob character's folder (``data/*.jsonl`` -> ``data``)."""
    while spec and glob.has_magic(spec):
        spec = os.path.dirname(spec)
    return spec


def input_paths(args: types.SimpleNamespace) -> List[Tuple[str, str, str]]:
    """(flag, path, what it is) for every input of the run that is a path on this machine."""
    found = [("--actor.model_name_or_path", args.actor.model_name_or_path, "the policy and reference model")]
    if args.critic.model_name_or_path:
        found.append(("--critic.model_name_or_path", args.critic.model_name_or_path, "the critic model"))
    if args.reward.model_name_or_path and not args.reward.remote_url:
        found.append(("--reward.model_name_or_path", args.reward.model_name_or_path, "the reward model"))
    for flag, value in (("--data.prompt_dataset", args.data.prompt_dataset), ("--eval.dataset", args.eval.dataset)):
        for entry in (value or "").split(","):
            found.append((flag, _local_prefix(entry.split("@")[0].strip()), "prompts"))
    for url in args.reward.remote_url or []:
        found.append(("--reward.remote_url", url, "the reward function"))
    if args.train.agent_func_path:
        found.append(("--train.agent_func_path", args.train.agent_func_path, "the agent"))
    return [(flag, path, what) for flag, path, what in found if path and os.path.exists(path)]


# Roots under which a tool writes only its own subfolder (wandb/, Ray's session_*/): one that contains an input
# (WANDB_DIR=$HOME, say) touches nothing of it; being an input folder, or inside one, is still refused.
_ROOT_OUTPUTS = ("WANDB_DIR", "--ray.temp_dir")


def _inside(child: str, parent: str) -> bool:
    return child != parent and os.path.commonpath([child, parent]) == parent


def _check_outputs_are_not_inputs(args: types.SimpleNamespace) -> None:
    """No output, checkpoint or log folder is, contains or lies inside a model, prompt, reward or agent path.

    ``--ckpt.output_dir`` equal to ``--actor.model_name_or_path`` overwrote the input model (weights, config.json's
    dtype, tokenizer files) with the trained bf16 one, with exit 0; a folder that contains an input can lose it to
    upstream's rotation of old checkpoints (it deletes folders) or to save_pretrained's removal of old weight files.
    Paths are compared after resolving symlinks (``_ROOT_OUTPUTS`` may contain inputs). Checked before any folder
    is created."""
    inputs = [(flag, path, what, os.path.realpath(path)) for flag, path, what in input_paths(args)]
    for out_flag, out, writes in output_dirs(args):
        real_out = os.path.realpath(out)
        for in_flag, path, what, real_in in inputs:
            if real_out == real_in:
                relation = "is"
            elif _inside(real_in, real_out) and out_flag not in _ROOT_OUTPUTS:
                relation = "contains"
            elif _inside(real_out, real_in):
                relation = "is inside"
            else:
                continue
            raise ConfigError(
                f"{out_flag} {out} {relation} {in_flag} {path} ({what}). {out_flag} receives {writes}: writing "
                "there can overwrite or delete the input (the final save replaces weights, config.json and tokenizer "
                "files; upstream rotates old checkpoints by deleting folders). Outputs are never inputs: choose an "
                f"{out_flag} that neither is, contains nor lies inside an input (e.g. a new folder next to it)."
            )


def _check_resume_checkpoint(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--ckpt.load_enable: the checkpoint the resume will load (``trainer/resume.py::plan``: the one ``latest`` names,
    or the newest complete one before it) was written by this run (model, prompts, rollout sizes: its
    ``openrlhf_ess_run.json``) and has the ZeRO layout of this run. ZeRO-3 partitions the weights into one model
    states file per rank, ZeRO-0/1/2 keep them whole: DeepSpeed cannot load one into the other and fails on a policy
    rank at start-up. Broken checkpoints are not refused here: the resume moves them aside and loads the one before."""
    if not args.ckpt.load_enable:
        return
    from openrlhf_ess.trainer import resume

    found = resume.plan(args.ckpt.path, need_sidecar=resume.applies(args))
    if found is None or found.newest is None:
        return
    folder = os.path.join(found.folder, resume.tag_of(found.newest))
    saved = resume.read_identity(folder)
    differ = resume.identity_mismatch(saved, resume.run_identity(args)) if saved else []
    if differ:
        shown = "; ".join(f"{flag}: it was {was!r}, this run has {now!r}" for flag, was, now in differ)
        raise ConfigError(
            f"--ckpt.load_enable: the checkpoint it would load, {folder} (--ckpt.path {args.ckpt.path}), was written "
            f"by another run: {shown}. Resuming it would continue that run's weights and data position. Pass this "
            "run's own --ckpt.path (or a new one to start fresh), or drop --ckpt.load_enable. (Same run, files "
            f"moved? Remove {os.path.join(folder, resume.IDENTITY)} to load it anyway.)"
        )
    try:
        layout = resume.checkpoint_layout(folder)
    except ValueError:
        return  # unreadable: the resume moves it aside (plan saw it whole only if it could not inspect it)
    if layout is None:
        return
    saved, now = layout["zero_stage"], args.ds.zero_stage
    if (saved == 3) != (now == 3):
        what = f"ZeRO-3's partitioned weights into ZeRO-{now}" if saved == 3 else "whole-model weights into ZeRO-3"
        raise ConfigError(
            f"--ckpt.load_enable: the checkpoint {folder} (--ckpt.path {args.ckpt.path}) was written with ZeRO stage "
            f"{saved}, but this run has --ds.zero_stage {now}: DeepSpeed cannot load {what}. Resume with "
            f"--ds.zero_stage {saved}, or drop --ckpt.load_enable (or pass another --ckpt.path) to start fresh."
        )
