"""The offline tiny world: tokenizer round trip, model loads in HF, reward values by hand."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from openrlhf_ess.tiny import reward
from openrlhf_ess.tiny.world import CHARS


def test_tokenizer_round_trips_every_character(tiny_world):
    tok = AutoTokenizer.from_pretrained(tiny_world["model"])
    ids = tok(CHARS, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(CHARS)  # one token per character, spaces and newlines included
    assert tok.decode(ids) == CHARS
    assert tok.decode(tok("ab 12 =")["input_ids"] + [tok.eos_token_id]) == "ab 12 =</s>"


def test_model_shape_fits_vllm_cpu(tiny_world):
    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM's CPU attention rejects head_dim < 32
    out = model(torch.tensor([[5, 6, 7]]))
    assert out.logits.shape == (1, 3, cfg.vocab_size)


def test_prompts_file(tiny_world):
    import json

    rows = [json.loads(line) for line in open(tiny_world["prompts"])]
    assert len(rows) == 32 and all(r["input"].endswith(" =") for r in rows)


def test_reward_by_hand():
    # "12ab" after the prompt "x =": 2 digits of 4 characters -> 0.5; the eos token is not a character.
    out = reward.reward_func(["x =12ab</s>", "x =</s>", "y =7"], ["x =", "x =", "y ="], [None] * 3)
    assert out["rewards"].tolist() == [0.5, 0.0, 1.0]
    assert reward.digit_fraction("") == 0.0


def test_target_reward_by_hand():
    from openrlhf_ess.tiny import reward_target

    # f* = 0.5: "12ab" is half digits -> 1; "1234" all digits and "abcd" none -> 0; "1abc" (0.25) -> 0.5
    out = reward_target.reward_func(["x =12ab</s>", "x =1234", "x =abcd", "x =1abc"], ["x ="] * 4, [None] * 4)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0, 0.5]
    assert out["extra_logs"]["digit_fraction"].tolist() == [0.5, 1.0, 0.0, 0.25]
    # another target: f* = 0.8 normalises by 0.8, so f = 0 scores 0 and f = 1 scores 0.75
    assert reward_target.target_reward(0.0, 0.8) == 0.0
    assert abs(reward_target.target_reward(1.0, 0.8) - 0.75) < 1e-12
