"""The offline tiny world: a character tokenizer, a random Qwen2 model, prompts and a learnable reward.

Nothing here touches the network. Everything is deterministic given a seed, so tests and the demo can
rebuild it on a fresh machine in a second. The model is small enough for 2 CPU cores but keeps the
shapes the real stack needs: vLLM's CPU attention backend rejects head_dim < 32.

The task: the reward is the fraction of digit characters in the response (see ``reward.py``). A
random model starts near the digit share of its vocabulary (~0.1-0.3) and a few dozen PPO steps at
lr 1e-3 push it towards 1, so a short run shows learning rather than noise.
"""

from __future__ import annotations

import json
import os
import random
import string
from dataclasses import dataclass

# Printable characters a prompt or a response can contain. Digits come first so the
# reward's target set is a contiguous block of token ids (handy when reading logits).
CHARS = string.digits + string.ascii_letters + " .,:;!?+-=*/()[]'\"#_<>@&%$\n"
SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny causal LM (Qwen2 architecture)."""

    hidden_size: int = 64
    num_attention_heads: int = 2  # head_dim = 32, the minimum vLLM's CPU backend accepts
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512


def _byte_level(ch: str) -> str:
    """GPT-2's byte-to-unicode image of a one-byte character (printable ASCII maps to itself)."""
    (b,) = ch.encode()
    if 33 <= b <= 126:
        return ch
    # GPT-2 maps the 188 non-printable/space bytes to U+0100 upwards, in byte order.
    unprintable = [x for x in range(256) if not (33 <= x <= 126 or 161 <= x <= 172 or 174 <= x <= 255)]
    return chr(256 + unprintable.index(b))


def build_tokenizer(out_dir: str):
    """Write a character-level fast tokenizer to ``out_dir`` and return it.

    One token per character in :data:`CHARS` plus four special tokens. Decoding concatenates
    characters (no spaces inserted), so ``decode(encode(s)) == s`` for any string over CHARS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # transformers 5 loads any qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which imposes a
    # byte-level pre-tokenizer and decoder. So the vocabulary is written in the byte-level alphabet
    # (" " is "Ġ", "\n" is "Ċ") and the same pipeline is set here: HF, vLLM and this object agree.
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for ch in CHARS:
        vocab[_byte_level(ch)] = len(vocab)
    # BPE with no merges splits each pre-token into its characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk"]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        unk_token=SPECIAL_TOKENS["unk"],
        model_max_length=TinyModelSpec.max_position_embeddings,
    )
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_model(out_dir: str, seed: int = 0, spec: TinyModelSpec = TinyModelSpec(), dtype: str = "float32"):
    """Write a randomly initialised Qwen2ForCausalLM (safetensors + config) to ``out_dir``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(out_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.do_sample = True
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, tokenizer


def build_prompts(path: str, n: int = 64, seed: int = 0) -> str:
    """Write ``n`` prompts as JSON lines ``{"input": ..., "label": ...}`` and return ``path``.

    Prompts are short random strings ending in ``" ="``; the label records the task for readers
    (the reward ignores it).
    """
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + string.digits
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            body = "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 10)))
            f.write(json.dumps({"input": f"{body} =", "label": "digits"}) + "\n")
    return path


def build_world(root: str, seed: int = 0, n_prompts: int = 64) -> dict:
    """Build model, tokenizer and prompts under ``root``; return their paths.

    Idempotent: an existing, complete world is reused (same seed gives the same files).
    """
    model_dir = os.path.join(root, "model")
    prompts = os.path.join(root, "prompts.jsonl")
    stamp = os.path.join(root, f".built-seed{seed}-n{n_prompts}")
    if not os.path.exists(stamp):
        build_model(model_dir, seed=seed)
        build_prompts(prompts, n=n_prompts, seed=seed)
        open(stamp, "w").close()
    reward = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward.py")
    return {"model": model_dir, "prompts": prompts, "reward": reward}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build the offline tiny world (model, tokenizer, prompts).")
    parser.add_argument("root", help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n_prompts", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(build_world(args.root, seed=args.seed, n_prompts=args.n_prompts)))


if __name__ == "__main__":
    main()
