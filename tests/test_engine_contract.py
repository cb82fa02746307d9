"""The sampling mask's engine contract: the engine reports k_t, not vLLM's own rank.

vLLM 0.29's default GPU runner (Model Runner V2) never runs the V1 ``Sampler`` our patch replaces; the rank it
returns is the sampled token's rank inside the kept set. No CPU engine runs V2, so the check the engine runs at
start-up (``vllm_engine.RolloutRayActorImpl._check_kept_count_contract``) is tested here on ranks built the way
V2 builds them (``vllm/v1/worker/gpu/sample/logprob.py``: 1 + the number of kept logits >= the sampled one),
from a real top-k sampling of random logits, and on the counts our patch reports (#finite of the masked row).
The real-stack sampling-mask tests run the check on a real (V1) engine, where it must pass.
"""

import pytest
import torch

from openrlhf_ess.trainer.engine_contract import CONTRACT_TOP_K, EngineContractError, check_kept_count_contract


def _top_k_generation(steps=8, vocab=50, k=CONTRACT_TOP_K, seed=0):
    g = torch.Generator().manual_seed(seed)
    v2_ranks, kept_counts = [], []
    for _ in range(steps):
        logits = torch.randn(vocab, generator=g) * 3
        kth = logits.topk(k).values[-1]
        masked = logits.masked_fill(logits < kth, float("-inf"))
        token = torch.multinomial(masked.softmax(-1), 1, generator=g).item()
        v2_ranks.append(int((masked >= masked[token]).sum()))  # V2: rank inside the kept set
        kept_counts.append(int(torch.isfinite(masked).sum()))  # our patch: k_t
    return v2_ranks, kept_counts


def test_counts_from_the_patch_pass():
    _, kept = _top_k_generation()
    assert kept == [CONTRACT_TOP_K] * 8
    check_kept_count_contract(kept, CONTRACT_TOP_K, [8])


def test_an_engine_that_returns_rank_in_kept_set_fails_with_the_fix():
    ranks, _ = _top_k_generation()
    assert min(ranks) < CONTRACT_TOP_K  # what V2 returns for this generation
    with pytest.raises(EngineContractError, match=r"engine contract.*must be >= 3.*VLLM_USE_V2_MODEL_RUNNER=0"):
        check_kept_count_contract(ranks, CONTRACT_TOP_K, [8])


def test_a_patch_that_never_ran_fails_even_when_ranks_look_right():
    # e.g. a runner whose own ranks happened to be >= K on every token: the worker counter still tells
    with pytest.raises(EngineContractError, match=r"never ran in the engine's worker.*calls per worker \[0, 4\]"):
        check_kept_count_contract([3] * 8, CONTRACT_TOP_K, [0, 4])


def test_a_mask_that_kept_more_than_it_sampled_from_fails():
    """The lower bound alone once accepted k_t = V (a mask that kept the whole vocabulary) and counts
    that are mostly above K; a few ties above K (vLLM's PyTorch path keeps tied boundary values) still pass."""
    with pytest.raises(EngineContractError, match=r"kept counts up to 50 .*vocabulary 50"):
        check_kept_count_contract([3] * 7 + [50], CONTRACT_TOP_K, [8], vocab=50)
    with pytest.raises(EngineContractError, match=r"only 2 of 8 equal to 3"):
        check_kept_count_contract([3, 3, 4, 5, 4, 4, 6, 4], CONTRACT_TOP_K, [8], vocab=50)
    check_kept_count_contract([3] * 6 + [4, 4], CONTRACT_TOP_K, [8], vocab=50)  # two boundary ties
