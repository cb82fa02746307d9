"""Tiny random dense models of the families users start with: Qwen2 (tied and untied embeddings), Qwen3, Llama and
Mistral.

Same character tokenizer as :mod:`openrlhf_ess.tiny.world`; 2 decoder layers and head_dim 32 (vLLM's CPU attention
minimum), so each runs through the real stack on 2 CPU cores. Tied input and output embeddings
(``tie_word_embeddings``) are the norm for small checkpoints (Qwen2.5 up to 3B, Llama 3.2 1B and 3B): the tied
variants exercise the weight sync of a head that shares the embedding's tensor. Random weights at the config's
init; nothing touches the network.
"""

from __future__ import annotations

import os

from openrlhf_ess.tiny.world import TinyModelSpec, build_prompts, build_tokenizer

# name -> (transformers config class, tie_word_embeddings)
FAMILIES = {
    "qwen2": ("Qwen2Config", False),
    "qwen2_tied": ("Qwen2Config", True),
    "qwen3": ("Qwen3Config", False),
    "qwen3_tied": ("Qwen3Config", True),
    "llama": ("LlamaConfig", False),
    "llama_tied": ("LlamaConfig", True),
    "mistral": ("MistralConfig", False),
}


def build_family_model(out_dir: str, family: str, seed: int = 0, spec: TinyModelSpec = TinyModelSpec()):
    """Write a random fp32 model of ``family`` (a key of :data:`FAMILIES`) and the tiny tokenizer to ``out_dir``;
    return (model, tokenizer)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    config_name, tied = FAMILIES[family]
    tokenizer = build_tokenizer(out_dir)
    extra = {"head_dim": spec.hidden_size // spec.num_attention_heads} if config_name == "Qwen3Config" else {}
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config.do_sample = True
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, tokenizer


def build_family_world(root: str, family: str, seed: int = 0, n_prompts: int = 64) -> dict:
    """The tiny world (:func:`openrlhf_ess.tiny.world.build_world`'s prompts and digit reward) with a ``family``
    model; idempotent like it. Returns the paths."""
    model_dir = os.path.join(root, "model")
    prompts = os.path.join(root, "prompts.jsonl")
    stamp = os.path.join(root, f".built-{family}-seed{seed}-n{n_prompts}")
    if not os.path.exists(stamp):
        build_family_model(model_dir, family, seed=seed)
        build_prompts(prompts, n=n_prompts, seed=seed)
        open(stamp, "w").close()
    reward = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward.py")
    return {"model": model_dir, "prompts": prompts, "reward": reward}
