"""The offline tiny world with a mixture-of-experts model: Qwen2-MoE or Qwen3-MoE.

Same character tokenizer, prompts and reward as :mod:`openrlhf_ess.tiny.world`; only the model
changes. It exists to exercise MoE routing replay (``openrlhf_ess.models.routing_replay``) and the
engine's route capture on 2 CPU cores, so the shapes are the smallest the real stack accepts:
head_dim 32 (vLLM's CPU attention minimum), 2 decoder layers, both sparse, 4 experts, top-2.

Routers are re-initialised with std 1/sqrt(hidden) instead of the config's 0.02. With 0.02 the
router logits have std ~0.16, every token sits on a near-tie between experts, and any rounding
difference (bf16 vs fp32, vLLM vs HF kernels) flips the choice; a trained router is far more
peaked than that. Logit std ~1 keeps the tiny model's routing decisive, like a real one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from openrlhf_ess.tiny.world import build_prompts, build_tokenizer

FAMILIES = ("qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class TinyMoeSpec:
    """Shape of the tiny MoE causal LM (both families)."""

    hidden_size: int = 64
    num_attention_heads: int = 2  # head_dim = 32, the minimum vLLM's CPU backend accepts
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 64  # qwen2_moe only
    intermediate_size: int = 128  # dense MLP size, used by no layer here (all layers sparse)
    max_position_embeddings: int = 512


def _moe_config(family: str, tokenizer, spec: TinyMoeSpec, dtype: str):
    """The transformers config of the tiny model.

    qwen2_moe keeps ``norm_topk_prob=False`` (Qwen1.5-MoE's setting) and has a shared expert;
    qwen3_moe sets ``norm_topk_prob=True`` (Qwen3-MoE's setting) and has none. Between them the
    tests cover both gate-weight rules.
    """
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
    )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size, norm_topk_prob=False, **common
        )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=spec.hidden_size // spec.num_attention_heads, norm_topk_prob=True, **common)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def build_moe_model(
    out_dir: str, family: str = "qwen2_moe", seed: int = 0, spec: TinyMoeSpec = TinyMoeSpec(), dtype: str = "float32"
):
    """Write a randomly initialised Qwen2MoeForCausalLM / Qwen3MoeForCausalLM to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(out_dir)
    config = _moe_config(family, tokenizer, spec, dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the routers (see module docstring)
                param.normal_(0.0, spec.hidden_size**-0.5)
    model.generation_config.do_sample = True
    model.save_pretrained(out_dir, safe_serialization=True)
    return model, tokenizer


def build_moe_world(root: str, seed: int = 0, n_prompts: int = 64, family: str = "qwen2_moe") -> dict:
    """Build the MoE model, tokenizer and prompts under ``root``; return their paths.

    Same dict as :func:`openrlhf_ess.tiny.world.build_world` (``model``, ``prompts``, ``reward``) and
    idempotent the same way: an existing, complete world (same seed, prompt count, family) is reused.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    model_dir = os.path.join(root, "model")
    prompts = os.path.join(root, "prompts.jsonl")
    stamp = os.path.join(root, f".built-{family}-seed{seed}-n{n_prompts}")
    if not os.path.exists(stamp):
        # Another family or seed built here earlier: its stamp must not vouch for the new files.
        for old in os.listdir(root) if os.path.isdir(root) else []:
            if old.startswith(".built-"):
                os.remove(os.path.join(root, old))
        build_moe_model(model_dir, family=family, seed=seed)
        build_prompts(prompts, n=n_prompts, seed=seed)
        open(stamp, "w").close()
    reward = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward.py")
    return {"model": model_dir, "prompts": prompts, "reward": reward}
