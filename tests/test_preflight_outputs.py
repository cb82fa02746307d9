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
