"""Log-probs under the engine's truncated (top-p / top-k) sampling distribution (DESIGN.md §6).

Unit tests of openrlhf_ess.models.sampling_mask against hand numbers and an independent
computation, and the real vLLM CPU engine (fp32): HF logits + the engine-reported support size
k_t give the engine's processed log-prob μ̃ to 1e-4, while the full-vocabulary log-prob differs
by log Z_t.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from openrlhf_ess.models.sampling_mask import count_kept, log_kept_mass, masked_log_probs, support_mask

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A 5-token vocabulary. softmax([2, 1, 0, -1, -2]) = [.6364, .2341, .0861, .0317, .0117] (sum e^z = 11.6106).
LOGITS5 = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])


def test_hand_numbers_top2():
    # Keep the top 2: Z = .6364 + .2341 = .8705, log Z = -0.1387.
    # Token 1: log(.2341 / .8705) = 1 - logsumexp(2, 1) = 1 - 2.3133 = -1.3133; token 0: 2 - 2.3133 = -0.3133.
    tokens = torch.tensor([1, 0])
    logits = LOGITS5.expand(2, 5)
    count = torch.tensor([2, 2])
    assert masked_log_probs(logits, tokens, count).tolist() == pytest.approx([-1.3133, -0.3133], abs=1e-4)
    assert log_kept_mass(logits, tokens, count).tolist() == pytest.approx([-0.1387, -0.1387], abs=1e-4)
    # Unmasked log-probs are log .2341 = -1.4519 and log .6364 = -0.4519: they differ by log Z.
    full = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    assert full.tolist() == pytest.approx([-1.4519, -0.4519], abs=1e-4)


def test_hand_numbers_temperature():
    # T = 0.5: z/T = [4, 2, 0, -2, -4]; top 2: token 1 -> 2 - (4 + log(1 + e^-2)) = -2 - 0.1269 = -2.1269.
    # Z = (e^4 + e^2) / (e^4 + e^2 + 1 + e^-2 + e^-4) = 61.99 / 63.14, log Z = -0.0184.
    lp = masked_log_probs(LOGITS5[None], torch.tensor([1]), torch.tensor([2]), temperature=0.5)
    assert lp.item() == pytest.approx(-2.1269, abs=1e-4)
    lz = log_kept_mass(LOGITS5[None], torch.tensor([1]), torch.tensor([2]), temperature=0.5)
    assert lz.item() == pytest.approx(
        math.log((math.e**4 + math.e**2) / sum(math.exp(v) for v in (4, 2, 0, -2, -4))), abs=1e-6
    )


def test_no_truncation_sentinels_and_forced_token():
    logits = LOGITS5.expand(3, 5)
    full = logits.log_softmax(-1)[:, 3]
    # count 0 (padding / untruncated) and count >= V keep everything: plain log-softmax, log Z = 0.
    for count in (0, 5, 9):
        c = torch.full((3,), count)
        assert torch.allclose(masked_log_probs(logits, torch.full((3,), 3), c), full)
        assert torch.allclose(log_kept_mass(logits, torch.full((3,), 3), c), torch.zeros(3))
    # A sampled token outside the trainer's top-k (boundary swap) is kept: S = {0, 1, 3}.
    mask = support_mask(logits[:1], torch.tensor([2]), torch.tensor([3]))
    assert mask.tolist() == [[True, True, False, True, False]]
    expected = -1.0 - math.log(math.e**2 + math.e + math.e**-1)
    assert masked_log_probs(logits[:1], torch.tensor([3]), torch.tensor([2])).item() == pytest.approx(
        expected, abs=1e-6
    )


def test_ties_at_the_kth_value_are_kept():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert support_mask(logits, torch.tensor([2])).tolist() == [[True, True, True, False]]


def test_against_independent_masking_random():
    # Independent computation: build S_t by explicit per-row sorting in Python, fill -inf, log_softmax.
    g = torch.Generator().manual_seed(0)
    B, T, V, temp = 3, 7, 11, 0.7
    logits = torch.randn(B, T, V, generator=g) * 2
    count = torch.randint(0, V + 2, (B, T), generator=g)
    z = logits / temp
    order = z.argsort(-1, descending=True)
    tokens = torch.empty(B, T, dtype=torch.long)
    expected = torch.empty(B, T)
    expected_lz = torch.empty(B, T)
    for b in range(B):
        for t in range(T):
            k = int(count[b, t])
            keep = list(range(V)) if k <= 0 or k >= V else order[b, t, :k].tolist()
            tokens[b, t] = keep[int(torch.randint(len(keep), (1,), generator=g))]
            row = torch.full((V,), float("-inf"))
            row[keep] = z[b, t, keep]
            expected[b, t] = row.log_softmax(-1)[tokens[b, t]]
            expected_lz[b, t] = torch.logsumexp(z[b, t, keep], -1) - torch.logsumexp(z[b, t], -1)
    assert torch.allclose(masked_log_probs(logits, tokens, count, temp), expected, atol=1e-5)
    assert torch.allclose(log_kept_mass(logits, tokens, count, temp), expected_lz, atol=1e-5)
    full = z.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(masked_log_probs(logits, tokens, count, temp) + expected_lz, full, atol=1e-5)


def test_matches_vllm_top_k_top_p_ops():
    # vLLM's own masking (the CPU engine path): log_softmax of the masked scaled logits is μ̃; its
    # finite count is k_t; our count-based masked log-prob must reproduce μ̃ on every kept token.
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(1)
    N, V, temp = 64, 50, 0.7
    logits = torch.randn(N, V, generator=g) * 3
    for k, p in (
        (torch.full((N,), 5), None),
        (None, torch.full((N,), 0.8)),
        (torch.full((N,), 7), torch.full((N,), 0.6)),
    ):
        processed = ops.apply_top_k_top_p_pytorch((logits / temp).clone(), k, p, allow_cpu_sync=True).log_softmax(-1)
        kept = count_kept(processed)
        tokens = processed.argmax(-1)  # any kept token; also check the smallest kept one below
        smallest = processed.masked_fill(~torch.isfinite(processed), float("inf")).argmin(-1)
        for tok in (tokens, smallest):
            ours = masked_log_probs(logits, tok, kept, temp)
            assert torch.allclose(ours, processed.gather(-1, tok[:, None])[:, 0], atol=1e-5)


def test_gradient_flows_only_through_the_support():
    logits = LOGITS5.clone()[None].requires_grad_(True)
    masked_log_probs(logits, torch.tensor([1]), torch.tensor([2])).sum().backward()
    grad = logits.grad[0]
    assert grad[2:].abs().max().item() == 0.0
    # d/dz_1 of z_1 - logsumexp(z_0, z_1) = 1 - σ(z_1 - z_0) = 1 - .2689.
    assert grad[1].item() == pytest.approx(1 - 0.2689, abs=1e-4)


def _run_engine(tiny_world, tmp_path, *flags):
    out = tmp_path / "support.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.vllm_support", tiny_world["model"], str(out), "--temperature", "0.7"]
        + list(flags),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _check_against_hf(tiny_world, data, key):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32).eval()
    max_masked, min_gap, n = 0.0, float("inf"), 0
    kept_masses = []
    for row in data["rows"]:
        assert not any(row["saturated"]) or key == "k_rank"
        prompt, tokens = row["prompt_ids"], torch.tensor(row["token_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + row["token_ids"]])).logits[0, len(prompt) - 1 : -1].float()
        count = torch.tensor(row[key])
        mu = torch.tensor(row["logprobs"])
        masked = masked_log_probs(logits, tokens, count, 0.7)
        lz = log_kept_mass(logits, tokens, count, 0.7)
        unmasked = (logits / 0.7).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        max_masked = max(max_masked, (masked - mu).abs().max().item())
        # The unmasked log-prob differs from μ̃ by exactly log Z_t, and that gap is not small.
        assert torch.allclose(unmasked - mu, lz, atol=1e-4)
        min_gap = min(min_gap, (unmasked - mu).abs().min().item())
        kept_masses.append(lz.exp())
        n += len(tokens)
    assert n >= 60
    assert max_masked < 1e-4, f"max |masked HF - μ| = {max_masked:.2e} over {n} tokens"
    return min_gap, torch.cat(kept_masses)


def test_real_engine_top_p_support_from_processed_logprobs(tiny_world, tmp_path):
    # No engine change: logprobs=-1 under processed_logprobs; k_t = number of finite entries.
    data = _run_engine(tiny_world, tmp_path, "--top_p", "0.8", "--num_logprobs", "-1")
    min_gap, kept = _check_against_hf(tiny_world, data, "k_topn")
    # Top-p 0.8 keeps the smallest prefix with mass > 0.8: Z in (0.8, 0.8 + max prob], |log Z| >= ~0.01.
    assert kept.min().item() >= 0.8 - 1e-4 and kept.max().item() < 0.999
    assert min_gap > 1e-3


def test_real_engine_top_k_support_from_rank_patch(tiny_world, tmp_path):
    # Sampler-side patch (what a worker extension would install): k_t in the sampled token's rank, logprobs=0.
    data = _run_engine(tiny_world, tmp_path, "--top_k", "5", "--num_logprobs", "0", "--rank_patch")
    assert {k for row in data["rows"] for k in row["k_rank"]} == {5}
    min_gap, kept = _check_against_hf(tiny_world, data, "k_rank")
    assert kept.max().item() < 0.999 and min_gap > 1e-3
