"""A random 2-layer Qwen2 with hidden size 32 and, by default, Qwen2's full vocabulary (V = 151,936: ~9.8M
parameters, 39 MB in fp32), its LM head drawn N(0, 0.5²) so next-token distributions are peaked and a wrong row or
support shows. Torch and transformers only: the GPU checks (tests/gpu/) build it on a machine without DeepSpeed,
Ray or vLLM, and the scoring-memory tests build it on CPU."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

QWEN2_VOCAB = 151_936


def tiny_qwen2(vocab: int = QWEN2_VOCAB, seed: int = 0, **extra) -> Qwen2ForCausalLM:
    cfg = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    cfg.update(extra)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model
