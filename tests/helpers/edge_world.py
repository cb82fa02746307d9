"""Edge inputs for the real CLI (tests/test_faults.py): a tiny model that often answers with nothing, prompts
longer than --data.max_len, and a reward file that reports what it saw.

The model is a copy of the tiny world's with a few weights edited so that, whatever the prompt, the next
token is one of ``</s>``, ``<pad>`` and ``7`` with probability ~1/3 each. vLLM never samples EOS as the
first token (upstream sets ``min_tokens=1``), so the shortest response is one token and then EOS; with
``<pad>`` first it is a response with no text at all (what a user sees as an empty answer). Responses that
reach --rollout.max_new_tokens without EOS are truncated.

How: one residual-stream coordinate (0) is made a large constant for every token (embedding column 0
set to 10, and no layer writes to it: row 0 of every o_proj and down_proj is zero). After the final RMS
norm that coordinate is ~8 for every position and the others ~0.02, so the logits are ~8 * lm_head[:, 0]:
zero for every token except the three above (1.5 each, logit ~12, the other 65 tokens share ~4e-4).
"""

import os
import shutil

CHOICES = ("</s>", "<pad>", "7")


def build_eos_model(src_dir: str, out_dir: str, strength: float = 1.5) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src_dir)
    model = AutoModelForCausalLM.from_pretrained(src_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        for tok in CHOICES:
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(tok), 0] = strength
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(src_dir):  # tokenizer and generation config, unchanged
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges")):
            shutil.copy(os.path.join(src_dir, name), os.path.join(out_dir, name))
    return out_dir


def write_prompts(path: str, n_short: int = 12, n_long: int = 4, long_chars: int = 100) -> str:
    """``n_short`` prompts of the tiny world's kind and ``n_long`` of ``long_chars`` characters (one token each)."""
    import json
    import random

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    rows = []
    for i in range(n_short + n_long):
        n = long_chars - 2 if i % ((n_short + n_long) // n_long) == 0 else rng.randint(4, 10)
        rows.append({"input": "".join(rng.choice(alphabet) for _ in range(n)) + " =", "label": "digits"})
    assert sum(len(r["input"]) == long_chars for r in rows) == n_long
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


# Reward file: the tiny world's digit-fraction reward on the response text, plus two per-sample logs
# (upstream averages a reward function's extra_logs into train/<key>): whether the response has no text,
# and whether the prompt reached the engine truncated. Prompts end in " =", so the response is what follows
# the last " =" of the query; the query holds the prompt as the engine saw it, ``prompts`` the original.
EDGE_REWARD = """
import torch

_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def reward_func(queries, prompts, labels):
    rewards, empty, truncated = [], [], []
    for query, prompt in zip(queries, prompts):
        text = query.rsplit(" =", 1)[-1]
        for tok in _SPECIALS:
            text = text.replace(tok, "")
        rewards.append(sum(ch.isdigit() for ch in text) / len(text) if text else 0.0)
        empty.append(float(text == ""))
        truncated.append(float(not query.startswith(prompt)))
    logs = {"edge_empty_response": torch.tensor(empty), "edge_prompt_truncated": torch.tensor(truncated)}
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards), "extra_logs": logs}
"""


def write_edge_reward(path: str) -> str:
    with open(path, "w") as f:
        f.write(EDGE_REWARD)
    return path
