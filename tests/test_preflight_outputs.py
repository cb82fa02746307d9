"""Pre-flight, outputs (checks/preflight/outputs.py): the checkpoint folder probed only when saving, a wandb
root may hold the inputs but no output may be one, another run's checkpoint refused before Ray starts.

Shared inputs (the tiny run's flags, FILES): tests/helpers/preflight_inputs.py."""

import json
import os
import re

import pytest

from openrlhf_ess.checks import preflight
from openrlhf_ess.config import ConfigError
from tests.helpers.preflight_inputs import (
    _args,
    _offline,  # noqa: F401  (autouse: the hub offline)
    _zero2_checkpoint,
)


def test_checkpoint_folder_is_probed_only_when_saving(tiny_world, tmp_path):
    folders = [(flag, d) for flag, d, _ in preflight.outputs.output_dirs(_args(tiny_world, tmp_path))]
    run = tmp_path / "run"
    assert folders == [("--ckpt.output_dir", str(run / "ckpt")), ("--logger.tensorboard_dir", str(run / "tb"))]
    flags = ["--ckpt.save_steps", "5", "--ray.temp_dir", "/tmp/ray_x"]
    saving = [(flag, d) for flag, d, _ in preflight.outputs.output_dirs(_args(tiny_world, tmp_path, flags))]
    assert set(saving) - set(folders) == {
        ("--ckpt.path", str(run / "ckpt" / "checkpoints")),
        ("--ray.temp_dir", "/tmp/ray_x"),
    }


def test_a_wandb_root_may_hold_the_inputs_but_no_output_may_be_one(tiny_world, tmp_path, monkeypatch):
    """WANDB_DIR (wandb writes only its wandb/ subfolder) may contain the model and prompts, as
    WANDB_DIR=$HOME does; an output folder inside an input, or the input itself, is refused."""
    root = os.path.dirname(tiny_world["model"])
    monkeypatch.setenv("WANDB_DIR", root)
    preflight.outputs._check_outputs_are_not_inputs(
        _args(tiny_world, tmp_path, ["--logger.wandb.key", "offline-" + "0" * 32])
    )
    monkeypatch.setenv("WANDB_DIR", tiny_world["model"])
    with pytest.raises(ConfigError, match=f"WANDB_DIR {re.escape(tiny_world['model'])} is --actor.model_name_or_path"):
        preflight.outputs._check_outputs_are_not_inputs(_args(tiny_world, tmp_path, ["--logger.wandb.key", "x" * 40]))
    link = tmp_path / "link_to_model"
    os.symlink(tiny_world["model"], link)  # compared after resolving symlinks
    with pytest.raises(ConfigError, match="is --actor.model_name_or_path"):
        preflight.outputs._check_outputs_are_not_inputs(_args(tiny_world, tmp_path, ["--ckpt.output_dir", str(link)]))


def test_a_checkpoint_of_another_run_is_refused_before_ray_starts(tiny_world, tmp_path):
    """The checkpoint `latest` names was written by a run of another model and prompt set; the
    resume names both and the fix. The same run's checkpoint (identity written by this run's flags) passes."""

    from openrlhf_ess.trainer import resume

    ckpt = tmp_path / "ckpt_reused"
    _zero2_checkpoint(str(ckpt))
    args = _args(tiny_world, tmp_path, ["--ckpt.load_enable", "--ckpt.path", str(ckpt)])
    ours = resume.run_identity(args)
    resume.write_identity(str(ckpt), "global_step1", dict(ours, model="/models/other", model_config="sha256:0"))
    with pytest.raises(ConfigError) as info:
        preflight.check(args)
    message = str(info.value)
    assert "was written by another run: --actor.model_name_or_path: it was '/models/other', this run has" in message
    assert tiny_world["model"] in message and "Pass this run's own --ckpt.path" in message
    resume.write_identity(str(ckpt), "global_step1", ours)
    preflight.check(args)  # the same run: resumes
    identity = json.load(open(ckpt / "_actor" / "global_step1" / resume.IDENTITY))
    assert identity["rollout_batch_size"] == 8 and identity["n_samples_per_prompt"] == 4


def _without_ckpt_path(argv):
    i = argv.index("--ckpt.path")
    return argv[:i] + argv[i + 2 :]


def _tree(folder):
    return sorted(
        (os.path.relpath(os.path.join(root, name), folder), os.path.getsize(os.path.join(root, name)))
        for root, _, names in os.walk(folder)
        for name in names
    )


def test_checkpoints_go_under_the_output_dir_and_another_runs_are_never_rotated(tiny_world, tmp_path, monkeypatch):
    """A first run left a best checkpoint in ./ckpt/checkpoints_ppo_ray of the working directory (upstream's
    --ckpt.path default). A second run there with an eval and its own --ckpt.output_dir, no --ckpt.path: its
    checkpoints go under its output folder, the notice says so, and nothing of the first run's is touched. The same
    run with the default --ckpt.output_dir (./ckpt) would save into the first run's folder: refused before Ray starts,
    unless it continues that run (--ckpt.load_enable)."""
    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.runtime import run_lock
    from tests.helpers.preflight_inputs import _argv

    workdir = tmp_path / "workdir"
    first = workdir / "ckpt" / "checkpoints_ppo_ray"
    os.makedirs(first / "_actor" / "best_global_step4")
    (first / "_actor" / "best_global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    monkeypatch.chdir(workdir)
    before = _tree(workdir)

    evals = ["--eval.dataset", tiny_world["prompts"], "--eval.steps", "1"]
    argv = _without_ckpt_path(_argv(tiny_world, tmp_path, evals))
    args, _ = cli.parse_args(argv)
    own = str(tmp_path / "run" / "ckpt" / "checkpoints_ppo_ray")  # <--ckpt.output_dir>/checkpoints_ppo_ray
    assert args.ckpt.path == own
    assert ("--ckpt.path", own) in run_lock.lock_dirs(args, saves_best=True)  # the run lock covers it
    notices = preflight.check(args)
    (line,) = [n for n in notices if n.startswith("outputs: ")]
    assert f"the trained model, at the end of the run -> {tmp_path / 'run' / 'ckpt'} (--ckpt.output_dir)" in line
    assert f"at each eval that improves the best metric (the previous best is deleted) -> {own} (--ckpt.path)" in line
    assert "--ckpt.path not passed" in line and "./ckpt/checkpoints_ppo_ray" in line
    assert _tree(workdir) == before

    default_out = list(argv)
    i = default_out.index("--ckpt.output_dir")
    default_out = default_out[:i] + default_out[i + 2 :]  # upstream's ./ckpt: the first run's folder
    args, _ = cli.parse_args(default_out)
    assert args.ckpt.path == os.path.join("./ckpt", "checkpoints_ppo_ray")
    with pytest.raises(ConfigError) as info:
        preflight.check(args)
    message = str(info.value)
    assert message.startswith(
        "--ckpt.path (by default) ./ckpt/checkpoints_ppo_ray holds the checkpoints of an earlier run "
        "(_actor/best_global_step4)."
    )
    assert "pass --ckpt.load_enable" in message and "pass a new --ckpt.output_dir (or --ckpt.path)" in message
    assert _tree(workdir) == before
    args, _ = cli.parse_args(default_out + ["--ckpt.load_enable"])
    preflight.outputs._check_checkpoints_of_another_run(args)  # continuing that run: its own checkpoints
    args, _ = cli.parse_args(default_out + ["--eval.steps", "-1"])  # no eval, no --ckpt.save_steps: nothing saved
    preflight.outputs._check_checkpoints_of_another_run(args)


def test_a_checkpoint_folder_in_use_is_left_to_the_run_lock(tiny_world, tmp_path):
    """A running run's checkpoints are not "an earlier run's": the run lock refuses the folder, naming that run."""
    from openrlhf_ess.runtime import run_lock

    ckpt = tmp_path / "ckpt_in_use"
    _zero2_checkpoint(str(ckpt))
    args = _args(tiny_world, tmp_path, ["--ckpt.save_steps", "1", "--ckpt.path", str(ckpt)])
    holder = run_lock.acquire("--ckpt.path", str(ckpt), log=lambda line: None)  # this process: alive
    try:
        preflight.outputs._check_checkpoints_of_another_run(args)
        with pytest.raises(ConfigError, match="in use by another run"):
            run_lock.acquire_all(args, log=lambda line: None)
    finally:
        holder.release()
    with pytest.raises(ConfigError, match="holds the checkpoints of an earlier run \\(_actor/global_step1\\)"):
        preflight.outputs._check_checkpoints_of_another_run(args)  # that run has ended


def test_eval_steps_are_named_with_the_runs_step_count(tiny_world, tmp_path):
    """tiny_args: 16 prompts in rollout batches of 8, one episode = 2 steps (16 / 8, worked by hand)."""
    evals = ["--eval.dataset", tiny_world["prompts"]]
    notices = []
    args = _args(tiny_world, tmp_path, evals + ["--eval.steps", "100"])
    preflight.outputs._check_eval_steps(args, 16, notices)
    assert notices == [
        "--eval.steps 100 is more than the run's 2 steps (16 prompts / --rollout.batch_size 8 = 2 per episode x "
        "--train.num_episodes 1): no multiple of it is reached; the one eval runs after the final step 2. For more "
        "evals, pass --eval.steps 1 or less."
    ]
    notices = []
    args = _args(tiny_world, tmp_path, evals + ["--eval.steps", "2", "--train.num_episodes", "3"])
    preflight.outputs._check_eval_steps(args, 12, notices)  # 12 prompts: batches of 8 and 4, x 3 = 6 steps
    assert notices == [
        "evals at steps 2, 4, 6 of 6 steps (12 prompts / --rollout.batch_size 8 = 2 per episode x "
        "--train.num_episodes 3): every --eval.steps 2 and after the final step."
    ]
    notices = []
    preflight.outputs._check_eval_steps(_args(tiny_world, tmp_path, evals), 16, notices)
    assert notices == [
        f"--eval.dataset {tiny_world['prompts']} with --eval.steps -1: no eval runs (upstream's -1 means never). "
        "Pass --eval.steps N to evaluate every N steps and after the final step."
    ]
    notices = []
    preflight.outputs._check_eval_steps(_args(tiny_world, tmp_path, ["--eval.steps", "2"]), 16, notices)
    assert notices == []  # no eval set: nothing to say
