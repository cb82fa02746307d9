"""Pre-flight, models (openrlhf_ess/checks/preflight/model.py): --data.max_len against the context vLLM accepts.

Shared inputs (the tiny run's flags, FILES): tests/helpers/preflight_inputs.py."""

import json
import os
import shutil

import pytest

from openrlhf_ess.checks import preflight
from tests.helpers.preflight_inputs import (
    _args,
    _offline,  # noqa: F401  (autouse: the hub offline)
)


def _model_variant(world, folder, config=None, tokenizer_config=None):
    shutil.copytree(world["model"], folder)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if changes:
            path = os.path.join(folder, name)
            data = json.load(open(path))
            data.update(changes)
            json.dump(data, open(path, "w"))
    return folder


def test_model_max_len_is_what_vllm_accepts(tiny_world, tmp_path):
    """--data.max_len is the engines' max_model_len (item 10): pre-flight's bound for a model is the longest vLLM's
    ModelConfig accepts for it (one more is vLLM's '1 validation error for ModelConfig'), with RoPE scaling taken into
    account as vLLM does."""
    from vllm.config import ModelConfig

    variants = {
        "as built": (tiny_world["model"], 512),
        "linear RoPE x2": (
            _model_variant(
                tiny_world,
                str(tmp_path / "rope"),
                {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}},
            ),
            1024,
        ),
        # vLLM reads the tokenizer's model_max_length only for pooling models
        "short tokenizer": (_model_variant(tiny_world, str(tmp_path / "tok"), None, {"model_max_length": 300}), 512),
    }
    for name, (folder, expected) in variants.items():
        length, _ = preflight.model.model_max_len(folder)
        assert length == expected, name
        assert ModelConfig(model=folder, max_model_len=int(length)).max_model_len == expected, name
        with pytest.raises(Exception, match="1 validation error for ModelConfig"):
            ModelConfig(model=folder, max_model_len=int(length) + 1)


def test_max_len_within_the_model_passes(tiny_world, tmp_path, monkeypatch):
    preflight.check(_args(tiny_world, tmp_path, ["--data.max_len", "512"]))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override: left to it
    preflight.check(_args(tiny_world, tmp_path, ["--data.max_len", "1024"]))
