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
    """--data.max_len is the engines' max_model_len: pre-flight's bound for a model is the longest vLLM's
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


# ---- the tokenizer's ids within the model's vocabulary -------------------------------------------------------------

TINY_TOKENS = 93  # the tiny world's character tokenizer: 4 special tokens + 89 characters (openrlhf_ess/tiny/world.py)


def _resized_model(world, folder, rows, config_vocab=None):
    """The tiny model with ``rows`` embedding rows (resize_token_embeddings, as a user shrinking or growing a
    vocabulary does), saved with the tiny tokenizer; ``config_vocab``: a config.json vocab_size that disagrees."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(world["model"], folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(rows)
    model.save_pretrained(folder, safe_serialization=True)
    if config_vocab is not None:
        _model_variant(world, folder + ".tmp", {"vocab_size": config_vocab})  # a config.json with only that change
        shutil.copy(os.path.join(folder + ".tmp", "config.json"), folder)
        shutil.rmtree(folder + ".tmp")
    return folder


def test_the_tiny_tokenizer_size_is_known():
    """The numbers the messages below are checked against."""
    from openrlhf_ess.tiny.world import CHARS, SPECIAL_TOKENS

    assert len(CHARS) + len(SPECIAL_TOKENS) == TINY_TOKENS


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused_in_preflight(tiny_world, tmp_path):
    """config.json vocab_size 64 with a 93-token tokenizer: vLLM would die on IndexError mid-rollout; refused before
    any Ray start, naming the flag, both numbers and a fix."""
    import ray

    from openrlhf_ess.config import ConfigError

    folder = _resized_model(tiny_world, str(tmp_path / "small"), 64)
    with pytest.raises(ConfigError) as info:
        preflight.check(_args(tiny_world, tmp_path, ["--actor.model_name_or_path", folder]))
    message = str(info.value)
    assert message.startswith(
        f"--actor.model_name_or_path {folder}: the tokenizer has {TINY_TOKENS} token ids but the model has 64 "
        "(vocab_size in its config.json), so ids from 64 on reach past the model's embedding"
    ), message
    assert "Pass the tokenizer the model was trained with" in message and "\n" not in message
    assert not ray.is_initialized()


def test_an_embedding_smaller_than_config_vocab_size_is_read_from_the_weights_header(tiny_world, tmp_path):
    """config.json says 93 but the saved embedding has 64 rows: read from the safetensors header, no weight loaded."""
    from openrlhf_ess.config import ConfigError

    folder = _resized_model(tiny_world, str(tmp_path / "lying"), 64, config_vocab=TINY_TOKENS)
    assert preflight.model.embedding_rows(folder) == (64, "lm_head.weight")  # and model.embed_tokens.weight: 64
    with pytest.raises(ConfigError, match=r"has 93 token ids but the model has 64 \(rows of its weight "):
        preflight.check(_args(tiny_world, tmp_path, ["--actor.model_name_or_path", folder]))


def _without_pad(world, folder, pad=None):
    """The tiny model whose tokenizer_config.json names ``pad`` as its pad token (None: names none)."""
    _model_variant(world, folder)
    path = os.path.join(folder, "tokenizer_config.json")
    data = json.load(open(path))
    del data["pad_token"]
    if pad is not None:
        data["pad_token"] = pad
    json.dump(data, open(path, "w"))
    return folder


@pytest.mark.parametrize(
    "named, pad",
    [("<newpad>", "<newpad>"), (None, "<|endoftext|>")],  # named by tokenizer_config.json / Qwen2Tokenizer's default
    ids=["named-pad-not-in-vocabulary", "no-pad-token"],
)
def test_a_pad_token_missing_from_the_vocabulary_is_refused_naming_it(tiny_world, tmp_path, named, pad):
    """A pad token the vocabulary lacks (named in tokenizer_config.json, or none named: transformers then gives the
    Qwen2 tokenizer its class's default) is added by transformers at id 93, one past the model's 93 rows: the first
    padded forward's bare IndexError. Refused naming the pad token, both numbers and the fix."""
    from openrlhf_ess.config import ConfigError

    folder = _without_pad(tiny_world, str(tmp_path / "pad"), named)
    with pytest.raises(ConfigError) as info:
        preflight.check(_args(tiny_world, tmp_path, ["--actor.model_name_or_path", folder]))
    message = str(info.value)
    assert message.startswith(
        f"--actor.model_name_or_path {folder}: the tokenizer has 94 token ids but the model has 93 (vocab_size in "
        f"its config.json): its pad token {pad!r} is not in the vocabulary, so transformers added it at id 93"
    ), message
    assert message.endswith(
        'Set "pad_token" in the folder\'s tokenizer_config.json to a token of the vocabulary, e.g. its eos '
        "token '</s>'."
    ), message


def test_the_eos_token_as_pad_and_a_padded_vocabulary_pass(tiny_world, tmp_path):
    """The fix the message suggests passes; a vocabulary larger than the tokenizer (padded to a multiple of 64, as
    Qwen's) is normal."""
    folder = _without_pad(tiny_world, str(tmp_path / "eospad"), "</s>")
    preflight.check(_args(tiny_world, tmp_path, ["--actor.model_name_or_path", folder]))
    padded = _resized_model(tiny_world, str(tmp_path / "padded"), 128)
    preflight.check(_args(tiny_world, tmp_path, ["--actor.model_name_or_path", padded]))


def test_a_reward_model_fed_ids_past_its_vocabulary_is_refused(tiny_world, tmp_path):
    """The reward model and the critic score the policy's token ids: their vocabulary must cover the policy's
    tokenizer, whatever their own tokenizer says."""
    from openrlhf.utils.utils import get_tokenizer

    from openrlhf_ess.config import ConfigError

    small = _resized_model(tiny_world, str(tmp_path / "rm"), 64)
    tokenizer = get_tokenizer(tiny_world["model"], None, "left", None)
    with pytest.raises(ConfigError) as info:
        preflight.model._check_fed_actor_ids("--reward.model_name_or_path", small, tiny_world["model"], tokenizer)
    assert str(info.value).startswith(
        f"--reward.model_name_or_path {small}: the policy's tokenizer (--actor.model_name_or_path "
        f"{tiny_world['model']}), whose ids it scores, has 93 token ids but the model has 64"
    ), str(info.value)
    preflight.model._check_fed_actor_ids("--critic.model_name_or_path", tiny_world["model"], small, tokenizer)
