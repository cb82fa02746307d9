"""The tiny models of each family (``openrlhf_ess.tiny.families``): the architecture and tie each name promises, the
shapes vLLM's CPU backend needs, and what a trainer's sync sends of them."""

import pytest
import torch

from openrlhf_ess.tiny.families import FAMILIES, build_family_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_builds_offline_with_its_tie_and_head_dim_32(tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    build_family_model(str(tmp_path), family)
    config = AutoConfig.from_pretrained(str(tmp_path))
    assert config.model_type == family.removesuffix("_tied")
    assert config.num_hidden_layers == 2 and config.hidden_size // config.num_attention_heads == 32
    assert getattr(config, "head_dim", 32) == 32
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    tied = family.endswith("_tied")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    # what the trainer's sync sends: the shared tensor once, as the input embedding
    assert ("lm_head.weight" in dict(model.named_parameters())) == (not tied)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 30]])).logits
    assert logits.shape == (1, 3, config.vocab_size) and torch.isfinite(logits).all()


def test_an_unknown_family_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="qwen2_tied"):
        build_family_model(str(tmp_path), "gpt2")
