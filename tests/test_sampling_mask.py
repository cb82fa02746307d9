"""Log-probs under the engine's truncated (top-p / top-k) sampling distribution (docs/sampling_mask.md).

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


def test_ties_at_the_kth_value_are_trimmed_to_exactly_k_as_vllms_triton_kernel():
    # vLLM's Triton top-k/top-p (CUDA, batches >= 8) keeps exactly k, tied boundary values in
    # vocabulary order; its PyTorch path keeps every tie and counts it in k_t (here: k_t = 3 keeps all three)
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert support_mask(logits, torch.tensor([2])).tolist() == [[True, True, False, False]]
    assert support_mask(logits, torch.tensor([3])).tolist() == [[True, True, True, False]]
    # Z counts one of the two tied tokens either way: log π̃(token 2) = 1 − log(e³ + e), not 1 − log(e³ + 2e)
    expected = 1 - math.log(math.e**3 + math.e)
    assert masked_log_probs(logits, torch.tensor([2]), torch.tensor([2])).item() == pytest.approx(expected, abs=1e-6)


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


@pytest.mark.engine
def test_real_engine_top_p_support_from_processed_logprobs(tiny_world, tmp_path):
    # No engine change: logprobs=-1 under processed_logprobs; k_t = number of finite entries.
    data = _run_engine(tiny_world, tmp_path, "--top_p", "0.8", "--num_logprobs", "-1")
    min_gap, kept = _check_against_hf(tiny_world, data, "k_topn")
    # Top-p 0.8 keeps the smallest prefix with mass > 0.8: Z in (0.8, 0.8 + max prob], |log Z| >= ~0.01.
    assert kept.min().item() >= 0.8 - 1e-4 and kept.max().item() < 0.999
    assert min_gap > 1e-3


@pytest.mark.engine
def test_real_engine_top_k_support_from_rank_patch(tiny_world, tmp_path):
    # Sampler-side patch (what a worker extension would install): k_t in the sampled token's rank, logprobs=0.
    data = _run_engine(tiny_world, tmp_path, "--top_k", "5", "--num_logprobs", "0", "--rank_patch")
    assert {k for row in data["rows"] for k in row["k_rank"]} == {5}
    min_gap, kept = _check_against_hf(tiny_world, data, "k_rank")
    assert kept.max().item() < 0.999 and min_gap > 1e-3


# ---- the trainer's truncated log-probs (truncated_log_probs: one autograd function over every row) ----------------


def _sorted_reference(z: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor, stop_ids=()):
    """Independent of the code under test: per row, sort the allowed tokens (stop ids removed where k < 0) by
    (logit descending, id ascending), S = the first |k| (exactly |k| tokens, ties trimmed in vocabulary order as
    vLLM's Triton kernel does; every allowed token if |k| >= their number; the whole row if k = 0) plus the sampled
    token when its logit is below the |k|-th value (a token tied with it was kept by the engine in its place: equal
    values, same Z). Returns (log-prob over S, log Z = log Σ_S softmax(z), support)."""
    n, vocab = z.shape
    support = torch.zeros(n, vocab, dtype=torch.bool)
    for i in range(n):
        k = int(kept[i])
        allowed = [a for a in range(vocab) if not (k < 0 and a in stop_ids)]
        y = int(tokens[i])
        if k == 0 or abs(k) >= len(allowed):
            chosen = list(range(vocab)) if k == 0 else allowed
            chosen = chosen + [y]
        else:
            ranked = sorted(allowed, key=lambda a: (-z[i, a].item(), a))
            chosen = ranked[: abs(k)]
            if y not in chosen and z[i, y].item() < z[i, ranked[abs(k) - 1]].item():
                chosen = chosen + [y]
            elif y not in chosen and (k > 0 or y not in stop_ids):  # tied with the |k|-th: swap in, same Z
                chosen = chosen[:-1] + [y] if z[i, chosen[-1]].item() == z[i, y].item() else chosen + [y]
            elif y not in chosen:  # a banned stop token sampled anyway: kept
                chosen = chosen + [y]
        support[i, chosen] = True
    kept_lse = z.masked_fill(~support, float("-inf")).logsumexp(-1)
    picked = z.gather(-1, tokens[:, None])[:, 0]
    return picked - kept_lse, kept_lse - z.logsumexp(-1), support


def _path_batch(vocab, low, high, n=48, seed=0, dtype=torch.float64):
    """Rows for one k-range: ties (bf16-rounded and constant rows), banned rows, sampled tokens outside the
    support, and the sentinels (0, V, -V, -(V - 1), V + 3)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=dtype) * 3
    z[: n // 3] = z[: n // 3].to(torch.bfloat16).to(dtype)  # many exact ties, also at τ
    z[n // 3] = 0.5  # a constant row: every token tied
    kept = torch.randint(low, high + 1, (n,), generator=g)
    kept = torch.where(torch.rand(n, generator=g) < 0.3, -kept, kept)
    kept[-5:] = torch.tensor([0, vocab, -vocab, -(vocab - 1), vocab + 3])
    order = z.argsort(-1, descending=True)
    # half the rows sample a token far outside the top-|k| (a boundary swap in the engine), the rest inside it
    rank = torch.where(torch.rand(n, generator=g) < 0.5, vocab - 1, 0)
    tokens = order.gather(-1, rank[:, None])[:, 0]
    tokens[:4] = 3  # a banned stop token sampled anyway: kept
    return z, tokens, kept


PATHS = {  # path: (V, k range, constants) such that the k-th-value search takes that path
    "blocks": (2048, (1, 40), {"OVERSAMPLE": 4, "MIN_BLOCK": 8}),
    "bound": (2048, (50, 200), {}),
    "direct": (2048, (300, 2000), {}),
}


def _spy_paths(monkeypatch):
    """Count the calls of each k-th-value search path."""
    from openrlhf_ess.models import sampling_mask as maths

    calls = {}
    for name in ("_kth_by_blocks", "_kth_by_bound", "_kth_direct"):
        real = getattr(maths, name)

        def spy(*args, _real=real, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(maths, name, spy)
    return calls


@pytest.mark.parametrize("path", list(PATHS))
def test_truncated_log_probs_matches_sorted_reference(monkeypatch, path):
    from openrlhf_ess.models import sampling_mask as maths

    vocab, (low, high), constants = PATHS[path]
    for name, value in constants.items():
        monkeypatch.setattr(maths, name, value)
    monkeypatch.setattr(maths, "CHUNK_ROWS", 16)  # several chunks, the last one partial
    calls = _spy_paths(monkeypatch)
    stops = (3, 7, vocab - 1)
    z, tokens, kept = _path_batch(vocab, low, high)
    log_probs, log_z, selected = maths.truncated_log_probs(z, tokens, kept, stops)
    expected, expected_lz, _ = _sorted_reference(z, tokens, kept, stops)
    assert calls.get(f"_kth_{'by_' if path != 'direct' else ''}{path}", 0) > 0, calls
    assert torch.allclose(log_probs, expected, rtol=0, atol=1e-10)
    assert torch.equal(selected, kept != 0) and torch.allclose(log_z, expected_lz[selected].float(), atol=1e-6)
    # the batch does exercise the rules: truncated rows, forced tokens, ties at τ, a constant row
    assert (expected_lz[kept != 0] < -1e-3).sum() > 10
    assert log_probs[16].item() == pytest.approx(expected[16].item(), abs=1e-12)
    # apply_to_log_probs (full log-probs from the caller) gives the same rows
    full = z.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    out, lz2, _ = maths.apply_to_log_probs(z, tokens, full, kept, stops)
    assert torch.allclose(out, torch.where(kept != 0, expected, full), rtol=0, atol=1e-10)
    assert torch.allclose(lz2, log_z, atol=1e-6)


def test_truncated_log_probs_hand_numbers_and_ties():
    from openrlhf_ess.models import sampling_mask as maths

    # top-2 of [2, 1, 0, -1, -2]: token 1 -> 1 - logsumexp(2, 1) = -1.3133, log Z = -0.1387 (first test above);
    # k = 0 is the plain log-softmax, log 0.2341 = -1.4519; k = -2 with stop 0 banned keeps {1, 2}: 1 - log(e + 1)
    logits = LOGITS5.expand(3, 5).clone()
    lp, lz, sel = maths.truncated_log_probs(logits, torch.tensor([1, 1, 1]), torch.tensor([2, 0, -2]), (0,))
    assert lp.tolist() == pytest.approx([-1.3133, -1.4519, 1 - math.log(math.e + 1)], abs=1e-4)
    assert sel.tolist() == [True, False, True] and lz[0].item() == pytest.approx(-0.1387, abs=1e-4)
    # exactly k tokens: [3, 1, 1, 0] top-2 counts one of the tied 1s, whichever was sampled;
    # a constant row with k = 1 keeps the sampled token alone
    tied = torch.tensor([[3.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    lp, _, _ = maths.truncated_log_probs(tied, torch.tensor([2, 2]), torch.tensor([2, 1]))
    assert lp.tolist() == pytest.approx([1 - math.log(math.e**3 + math.e), 0.0], abs=1e-6)


@pytest.mark.parametrize("path", ["blocks", "bound", "direct"])
def test_truncated_log_probs_gradcheck(monkeypatch, path):
    """torch.autograd.gradcheck (float64, finite differences) of the custom backward, on each search path."""
    from openrlhf_ess.models import sampling_mask as maths

    vocab = 64
    constants, (low, high) = {
        "blocks": ({"OVERSAMPLE": 2, "MIN_BLOCK": 2}, (1, 6)),
        "bound": ({}, (1, 6)),
        "direct": ({}, (9, 63)),
    }[path]
    for name, value in constants.items():
        monkeypatch.setattr(maths, name, value)
    monkeypatch.setattr(maths, "CHUNK_ROWS", 4)
    calls = _spy_paths(monkeypatch)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(10, vocab, generator=g, dtype=torch.float64) * 2  # distinct values: gaps >> gradcheck's eps
    kept = torch.randint(low, high + 1, (10,), generator=g) * torch.tensor([1, -1] * 5)
    kept[0] = 0
    tokens = torch.randint(0, vocab, (10,), generator=g)
    tokens[1] = 3  # a banned stop sampled: forced into the support
    z.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: maths.truncated_log_probs(x, tokens, kept, (3, 5))[0], (z,))
    assert calls.get(f"_kth_{'by_' if path != 'direct' else ''}{path}", 0) > 0, calls


@pytest.mark.parametrize("path", list(PATHS))
def test_truncated_log_probs_gradient_equals_masked_log_softmax(monkeypatch, path):
    """The custom backward against autograd through a plain masked log_softmax on the reference support."""
    from openrlhf_ess.models import sampling_mask as maths

    vocab, (low, high), constants = PATHS[path]
    for name, value in constants.items():
        monkeypatch.setattr(maths, name, value)
    monkeypatch.setattr(maths, "CHUNK_ROWS", 16)
    z, tokens, kept = _path_batch(vocab, low, high, seed=1)
    weight = _tie_weights(z, tokens, kept, (3, 7, vocab - 1))
    w = torch.randn(z.shape[0], generator=torch.Generator().manual_seed(2), dtype=z.dtype)
    xa, xb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    (maths.truncated_log_probs(xa, tokens, kept, (3, 7, vocab - 1))[0] * w).sum().backward()
    plain = (xb + weight.log()).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]  # log 0 = -inf: off the support
    (plain * w).sum().backward()
    assert torch.allclose(xa.grad, xb.grad, rtol=0, atol=1e-12)
    assert (xa.grad[weight == 0] == 0).all()  # nothing flows to tokens outside the support
    assert ((weight > 0) & (weight < 1)).any()  # the batch has ties at τ that share the k_t slots


def _tie_weights(z, tokens, kept, stop_ids):
    """Independent: the smooth function that equals log π̃ and whose gradient the backward must give: Z = Σ_{a > τ}
    e^{z_a} + (n/m)·Σ_{a = τ} e^{z_a} (m tokens tied at τ, n = |k| − #(> τ) of them kept: equal values, so the
    same Z), + e^{z_y} for a sampled token below τ. Returns the [N, V] weights 1 / (n/m) / 0 of each e^{z_a}."""
    n_rows, vocab = z.shape
    weight = torch.zeros_like(z)
    for i in range(n_rows):
        k, y = int(kept[i]), int(tokens[i])
        allowed = [a for a in range(vocab) if not (k < 0 and a in stop_ids)]
        if k == 0 or abs(k) >= len(allowed):
            weight[i, list(range(vocab)) if k == 0 else allowed] = 1.0
        else:
            tau = sorted((z[i, a].item() for a in allowed), reverse=True)[abs(k) - 1]
            above = [a for a in allowed if z[i, a].item() > tau]
            tied = [a for a in allowed if z[i, a].item() == tau]
            weight[i, above] = 1.0
            weight[i, tied] = (abs(k) - len(above)) / len(tied)
        if weight[i, y] == 0:
            weight[i, y] = 1.0
    return weight


def test_unmasked_rows_are_upstream_bit_for_bit(monkeypatch):
    """k_t = 0 rows: the value and the gradient are upstream's ``log_probs_from_logits`` (fp32, no flash-attn) bit for
    bit, across upstream's 1024-row logsumexp chunks and our backward chunks; the masked rows differ."""
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()
    from openrlhf.models.utils import log_probs_from_logits

    from openrlhf_ess.models import sampling_mask as maths

    monkeypatch.setattr(maths, "CHUNK_ROWS", 100)
    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, 600, 257, generator=g) * 4  # 1,200 rows: two upstream chunks
    tokens = torch.randint(0, 257, (2, 600), generator=g)
    kept = torch.randint(1, 40, (2, 600), generator=g)
    kept[:, :250] = 0  # "prompt" rows
    kept[1, 300:320] = 0
    w = torch.randn(2, 600, generator=g)
    xa, xb = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    ours, _, selected = maths.truncated_log_probs(xa, tokens, kept, (2,))
    theirs = log_probs_from_logits(xb, tokens)
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    full = ~selected
    assert torch.equal(ours[full], theirs[full]) and torch.equal(xa.grad[full], xb.grad[full])
    assert (ours[selected] - theirs[selected]).abs().min() > 0


def test_installed_actor_backward_matches_plain_masked_log_softmax(tiny_world):
    """The seam under autograd (training step): an upstream ``Actor`` (fp32, T = 0.7) installed with our
    ``log_probs_from_logits``, inside ``applied``: its action log-probs and the gradient of a weighted sum of them
    w.r.t. every weight equal those of the plain formula (the model's logits / T, masked log_softmax over the
    sorted reference support, gather) computed with autograd."""
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()
    from openrlhf.models.actor import Actor

    from openrlhf_ess.trainer import sampling_mask

    torch.manual_seed(0)
    actor = Actor(tiny_world["model"], attn_implementation="sdpa", param_dtype="fp32", temperature=0.7)
    sampling_mask.install(actor)
    g = torch.Generator().manual_seed(5)
    vocab = actor.model.config.vocab_size
    seqs = torch.randint(4, vocab, (2, 12), generator=g)
    attn = torch.ones_like(seqs)
    attn[1, :3] = 0
    action_mask = torch.ones(2, 5)
    kept = torch.tensor([[-4, 7, 0, 30, 2], [1, 12, 12, 0, vocab]])
    w = torch.randn(2, 5, generator=g)
    with sampling_mask.applied(kept, seqs, attn, stop_ids=(2,)):
        ours = actor(seqs, action_mask, attn)
    (ours * w).sum().backward()
    ours_grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    actor.zero_grad()

    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = actor.model(seqs, attention_mask=attn, position_ids=pos).logits.float() / 0.7
    z = logits[:, -6:-1].reshape(10, vocab)  # the positions that predict the 5 action tokens
    tokens = seqs[:, -5:].reshape(10)
    _, _, support = _sorted_reference(z.detach().double(), tokens, kept.reshape(10), (2,))
    plain = z.masked_fill(~support, float("-inf")).log_softmax(-1).gather(-1, tokens[:, None]).view(2, 5)
    (plain * w).sum().backward()
    assert torch.allclose(ours, plain, atol=1e-5)
    full = z.detach().log_softmax(-1).gather(-1, tokens[:, None]).view(2, 5)
    assert (ours.detach() - full).abs().max() > 1e-3  # the mask changed the numbers: the check could fail
    assert ours_grads.keys() == {n for n, p in actor.named_parameters() if p.grad is not None}
    for name, p in actor.named_parameters():
        assert torch.allclose(ours_grads[name], p.grad, atol=1e-5, rtol=1e-4), name
