"""Unit tests of the rollout-side pieces: version bookkeeping, lag masking, μ sanitising, TIS maths,
sequence-level TIS in the policy loss, mismatch metrics. Hand-derived numbers in comments."""

import math

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf.models.loss import PolicyLoss as UpstreamPolicyLoss  # noqa: E402

from openrlhf_ess.models import corrections as C  # noqa: E402
from openrlhf_ess.models.loss import PolicyLoss  # noqa: E402
from openrlhf_ess.trainer.ppo_utils.experience_maker import mask_stale_tokens, rollout_metrics  # noqa: E402
from openrlhf_ess.trainer.ray.rollout_tags import NO_VERSION, _Progress, versions_for_observation  # noqa: E402


def test_progress_records_one_boundary_per_sync():
    p = _Progress(version=3)
    p.streamed = 5
    p.switch(4)  # 5 tokens by v3, then v4
    p.streamed = 5
    p.switch(5)  # no token by v4: the stretch is relabelled, not split
    p.streamed = 9
    assert p.token_versions(9) == [3] * 5 + [5] * 4


def test_queued_request_takes_the_new_version():
    p = _Progress(version=0)
    p.switch(1)  # synced before its first token
    p.streamed = 4
    assert p.token_versions(4) == [1, 1, 1, 1]


def test_versions_for_multi_turn_observation():
    # prompt 3 tokens, action 2 (v0), env feedback 2, action 3 (v0, v1, v1)
    out = versions_for_observation(10, [(3, 5), (7, 10)], [[0, 0], [0, 1, 1]])
    assert out == [NO_VERSION] * 3 + [0, 0] + [NO_VERSION] * 2 + [0, 1, 1]


def test_versions_left_untagged_on_mismatch():
    assert versions_for_observation(5, [(2, 5)], [[0, 0], [1]]) == [NO_VERSION] * 5
    assert versions_for_observation(5, [(2, 5)], [[0, 0]]) == [NO_VERSION] * 5


def test_mask_stale_tokens():
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    versions = torch.tensor([[1, 2, 3, NO_VERSION, 3]])
    new_mask, lag, sampled, n = mask_stale_tokens(mask, versions, version=4, max_lag=2)
    # lags 3, 2, 1 on the tagged tokens; only lag 3 > 2 is masked; the untagged token stays
    assert lag.tolist() == [[3, 2, 1, 0, 0]]
    assert new_mask.tolist() == [[0, 1, 1, 1, 0]] and n == 1
    assert sampled.tolist() == [[False, True, True, False, False]]
    same, _, _, n0 = mask_stale_tokens(mask, versions, version=4, max_lag=None)
    assert torch.equal(same, mask) and n0 == 0


def test_rollout_metrics_histogram_and_mismatch():
    lags = torch.tensor([0, 1, 1, 4])
    prox = [torch.tensor([-1.0, -2.0])]
    mu = [torch.tensor([-1.0, -2.0 - math.log(2.0)])]  # r = 1, 2
    out = rollout_metrics(lags, torch.tensor(3.0), prox, mu, [torch.tensor([True, True])])
    assert out["version_lag/mean"] == 1.5 and out["version_lag/max"] == 4
    assert out["version_lag/frac_0"] == 0.25 and out["version_lag/frac_1"] == 0.5
    assert out["version_lag/frac_2"] == 0.0 and out["version_lag/frac_3+"] == 0.25
    assert out["version_lag/stale_masked_tokens"] == 3.0
    # k1 = mean(-log r) = -log2/2; k3 = mean(r-1-log r) = (0 + 1 - log2)/2; chi2 = mean(r^2) - 1 = 1.5
    assert out["mismatch/k1"] == pytest.approx(-math.log(2) / 2)
    assert out["mismatch/k3"] == pytest.approx((1 - math.log(2)) / 2)
    assert out["mismatch/chi2"] == pytest.approx(1.5)
    assert out["mismatch/max_abs_log_ratio"] == pytest.approx(math.log(2))
    assert "mismatch/ess_frac" not in out  # no per-trajectory weights given


def test_rollout_metrics_ess_of_the_geometric_mean_weights():
    # micro-batch 1: w = exp(mean(0, 0)) = 1; its second trajectory has one response token (its second column is
    # masked) with log π_prox − log μ = log 4, so w = 4; micro-batch 2 (another width): one trajectory, w = exp(0) = 1.
    # ESS/B = (1 + 4 + 1)^2 / (3 · (1 + 16 + 1)) = 36/54 = 2/3
    prox_1, mu_1 = (
        torch.tensor([[-1.0, -2.0], [-1.0, -5.0]]),
        torch.tensor([[-1.0, -2.0], [-1.0 - math.log(4.0), -9.0]]),
    )
    mask_1 = torch.tensor([[True, True], [True, False]])
    prox_2, mu_2, mask_2 = torch.tensor([[-3.0, -1.0, -2.0]]), torch.tensor([[-3.0, -1.5, -1.5]]), torch.ones(1, 3) > 0
    seq = [C.sequence_log_weights(p, m, k) for p, m, k in ((prox_1, mu_1, mask_1), (prox_2, mu_2, mask_2))]
    flat = [t.flatten() for t in (prox_1, prox_2)], [t.flatten() for t in (mu_1, mu_2)]
    masks = [mask_1.flatten(), mask_2.flatten()]
    out = rollout_metrics(torch.tensor([0, 0, 0]), torch.tensor(0.0), *flat, masks, seq)
    assert out["mismatch/ess_frac"] == pytest.approx(2 / 3)


def test_tis_weights_token_and_seq():
    prox = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mu = torch.tensor([[0.0, -math.log(3.0), math.log(2.0)], [-math.log(4.0), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tok = C.tis_weights(prox, mu, mask, cap=2.0, level="token")
    # ratios: [1, 3 -> capped 2, 1/2], [4 -> 2, 1, masked 0]
    assert torch.allclose(tok, torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 0.0]]), atol=1e-6)
    seq = C.tis_weights(prox, mu, mask, cap=2.0, level="seq")
    # row 1: geo mean = exp((0 + log3 - log2)/3) = 1.5^(1/3) = 1.1447; row 2: exp(log4/2) = 2 (= cap)
    assert torch.allclose(seq, torch.tensor([[1.5 ** (1 / 3)] * 3, [2.0, 2.0, 0.0]]), atol=1e-6)


def test_tis_weights_seq_product_against_float64_on_long_responses():
    """The trajectory ratio exp(Σ_t log π_prox/μ), truncated at C, against a float64 computation (Python floats,
    token by token): 4,096-token responses whose sums reach ±800 nats (exp overflows float64 at 709) give the
    cap or 0 without inf/NaN, and sums near log C are truncated exactly at C."""
    g = torch.Generator().manual_seed(0)
    B, T, cap = 6, 4096, 8.0
    mu = -torch.rand(B, T, generator=g) * 3
    shift = torch.tensor([0.2, -0.2, 0.0, math.log(cap) / 1000, 0.0, 1e-4])[:, None]
    prox = mu + shift + 1e-3 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[3, 1000:] = 0  # Σ over 1,000 tokens ≈ log C: right at the cap
    mask[4, :] = 0  # no response token
    mask[5, :2000] = 0  # left padding
    w = C.tis_weights(prox, mu, mask, cap, "seq_product")
    assert torch.isfinite(w).all()
    for i in range(B):
        total = sum(float(p) - float(m) for p, m, k in zip(prox[i].tolist(), mu[i].tolist(), mask[i].tolist()) if k)
        expected = min(math.exp(min(total, 700.0)), cap) if mask[i].any() else 0.0
        on = mask[i].bool()
        assert torch.all(w[i][~on] == 0)
        if on.any():
            assert w[i][on].unique().numel() == 1  # one weight for every token of the sequence
            assert w[i][on][0].item() == pytest.approx(expected, rel=1e-5, abs=1e-30)
    assert w[0].max().item() == cap and w[1].max().item() == 0.0  # +819 nats: the cap; -819: underflow to 0
    assert C.tis_truncated(w[0], cap).any() and not C.tis_truncated(w[5], cap).any()


def test_sequence_product_tis_loss_matches_hand_computation():
    torch.manual_seed(1)
    B, T = 3, 5
    log_probs = (-torch.rand(B, T)).requires_grad_()
    old = log_probs.detach() + 0.3 * torch.randn(B, T)
    mu = old - torch.tensor([[0.7], [-0.2], [0.1]])  # per token; Σ over 4, 3, 4 tokens: 2.8, -0.6, 0.4
    adv = torch.randn(B, T)
    mask = torch.ones(B, T)
    mask[:, 0] = 0
    mask[1, 1] = 0
    base = UpstreamPolicyLoss(clip_eps_low=1.0, clip_eps_high=1e9)  # VCPO's recipe: no clip
    ours = PolicyLoss.from_upstream(base, tis_cap=8.0, tis_level="seq_product")
    loss, *_, clipped = ours(log_probs, old, adv, action_mask=mask, rollout_log_probs=mu)
    w = torch.tensor([min(math.exp(2.8), 8.0), math.exp(-0.6), math.exp(0.4)])[:, None]  # e^2.8 = 16.4 -> 8
    r = torch.exp(log_probs - old)
    expected = ((-w * r * adv) * mask).sum() / mask.sum()  # no clip: the plain IS-weighted surrogate
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    g_ours = torch.autograd.grad(loss, log_probs)[0]
    g_hand = torch.autograd.grad(expected, log_probs)[0]
    assert torch.allclose(g_ours, g_hand, atol=1e-6)
    assert clipped.item() == pytest.approx(1 / 3)  # the first sequence is truncated


def test_sequence_tis_loss_matches_hand_computation():
    torch.manual_seed(0)
    B, T = 3, 4
    log_probs = (-torch.rand(B, T)).requires_grad_()
    old = log_probs.detach() + 0.3 * torch.randn(B, T)
    # per-sequence discrepancy log(π_prox/μ) = [0.6, −0.3, 0.1]: w = [min(e^0.6 = 1.822, 1.5), e^−0.3, e^0.1]
    mu = old - torch.tensor([[0.6], [-0.3], [0.1]])
    adv = torch.randn(B, T)
    # Left-padded responses: the first columns are prompt/padding positions (action_mask 0), as in a real batch.
    mask = torch.ones(B, T)
    mask[:, 0] = 0
    mask[1, 1] = 0
    base = UpstreamPolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2)
    ours = PolicyLoss.from_upstream(base, tis_cap=1.5, tis_level="seq")
    loss, _, _, vllm_kl, clipped = ours(log_probs, old, adv, action_mask=mask, rollout_log_probs=mu)
    # by hand: w_i = min(exp(mean_t (old - mu)), 1.5); L = sum_it -w_i min(r A, clip(r) A) m / sum m
    w = torch.exp(((old - mu) * mask).sum(1) / mask.sum(1)).clamp(max=1.5)[:, None]
    r = torch.exp(log_probs - old)
    per_token = -w * torch.min(r * adv, r.clamp(0.8, 1.2) * adv)
    expected = (per_token * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    g_ours = torch.autograd.grad(loss, log_probs)[0]
    g_hand = torch.autograd.grad(expected, log_probs)[0]
    assert torch.allclose(g_ours, g_hand, atol=1e-7)
    assert clipped.item() == pytest.approx((w[:, 0] >= 1.5 * (1 - 1e-6)).float().mean().item())
    # w = [1.5 (capped), 0.741, 1.105]: one sequence of three truncated, whichever columns are masked
    assert clipped.item() == pytest.approx(1 / 3)
    assert vllm_kl.item() == pytest.approx((((mu - old) * mask).sum() / mask.sum()).item(), rel=1e-6)


def test_sequence_tis_clip_metric_counts_truncated_sequences_of_left_padded_batch():
    # Left-padded batch: column 0 is a prompt/padding position in every row, so it must not be read.
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]])
    prox = torch.zeros(4, 4)
    l4, l3 = math.log(4.0), math.log(3.0)
    mu = -torch.tensor([[9.0, 9.0, l4, l4], [9.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, l3], [0.0] * 4])
    # log(π_prox/μ) on response tokens: row 0 [log 4, log 4] -> w = min(4, 2) = 2, truncated;
    # row 1 [0, 0, 0] -> w = 1; row 2 [log 3] -> w = min(3, 2) = 2, truncated; row 3 has no response token.
    ours = PolicyLoss.from_upstream(UpstreamPolicyLoss(), tis_cap=2.0, tis_level="seq")
    *_, clipped = ours(prox, prox, torch.ones(4, 4), action_mask=mask, rollout_log_probs=mu)
    # 2 of the 3 sequences with a response are truncated; the empty row is not a sequence of the loss
    assert clipped.item() == pytest.approx(2 / 3)


# Upstream's own IS correction in clip mode at [0, C]: the same weight as --algo.tis_cap C at the token level.
_UPSTREAM_TOKEN_CLIP = dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0.0, 2.0])


@pytest.mark.parametrize("level", ["token", "seq", "seq_product"])
def test_tis_without_rollout_log_probs_names_the_flag(level):
    ours = PolicyLoss.from_upstream(UpstreamPolicyLoss(), tis_cap=2.0, tis_level=level)
    lp = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match=r"--algo\.tis_cap.*rollout log-probs \(μ\) are missing"):
        ours(lp, lp, torch.ones(2, 3), action_mask=torch.ones(2, 3), rollout_log_probs=None)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_token_tis_through_our_loss_equals_upstreams_is_correction_clip_mode(dual_clip):
    """Our token-level TIS (the weight from corrections.tis_weights, on advantages w·A) against upstream's own
    implementation of min(π_prox/μ, C), its is_correction clip mode: every output, loss gradient included."""
    torch.manual_seed(2)
    log_probs = (-torch.rand(3, 6)).requires_grad_()
    old = log_probs.detach() + 0.2 * torch.randn(3, 6)
    mu = old - torch.randn(3, 6)  # some π_prox/μ far above C = 2: truncated tokens
    adv = torch.randn(3, 6)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    upstream = UpstreamPolicyLoss(dual_clip=dual_clip, **_UPSTREAM_TOKEN_CLIP)
    ours = PolicyLoss.from_upstream(UpstreamPolicyLoss(dual_clip=dual_clip), tis_cap=2.0, tis_level="token")
    got = ours(log_probs, old, adv, action_mask=mask, rollout_log_probs=mu)
    want = upstream(log_probs, old, adv, action_mask=mask, rollout_log_probs=mu)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert 0 < want[4].item() < 1  # some tokens truncated, not all: the fraction can tell
    (g_ours,) = torch.autograd.grad(got[0], log_probs)
    (g_up,) = torch.autograd.grad(want[0], log_probs)
    torch.testing.assert_close(g_ours, g_up, rtol=1e-6, atol=1e-7)


def test_token_tis_through_upstream_flags_equals_hand_computation():
    # --algo.tis_cap 2 (token) configures upstream's PolicyLoss: level token, clip mode, threshold [0, 2]
    torch.manual_seed(1)
    log_probs = -torch.rand(2, 5)
    old = log_probs + 0.2 * torch.randn(2, 5)
    mu = old - torch.randn(2, 5)
    adv = torch.randn(2, 5)
    mask = torch.ones(2, 5)
    loss_fn = UpstreamPolicyLoss(
        is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0.0, 2.0]
    )
    loss, *_ = loss_fn(log_probs, old, adv, action_mask=mask, rollout_log_probs=mu)
    r = torch.exp(log_probs - old)
    w = torch.exp(old - mu).clamp(max=2.0)  # min(pi_prox/mu, C)
    expected = (-w * torch.min(r * adv, r.clamp(0.8, 1.2) * adv)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_nonfinite_mu_sample_is_masked_and_counted():
    from types import SimpleNamespace

    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    gen = SamplesGenerator.__new__(SamplesGenerator)
    gen.args = SimpleNamespace(
        reward=SimpleNamespace(failure_policy="off"), algo=SimpleNamespace(nonfinite_logprobs="drop")
    )
    response = {
        "observation_tokens": [5, 6, 7, 8, 9],
        "action_ranges": [(2, 5)],
        "rollout_log_probs": [0.0, 0.0, -1.0, float("-inf"), -2.0],
        "rollout_versions": [-1, -1, 0, 0, 1],
        "prompt": "p",
        "label": None,
        "reward": 0.5,
        "scores": 0.5,
    }
    exp = gen._process_response_into_experience(response, max_len=64)
    assert exp.action_mask.sum().item() == 0  # the whole sample is dropped from the loss
    assert torch.isfinite(exp.rollout_log_probs).all()
    assert exp.info["rollout_logprob_nonfinite"].tolist() == [1.0]
    assert exp.rollout_versions.tolist() == [[-1, 0, 0, 1]]  # aligned with action_mask (shifted by one)
    response["rollout_log_probs"][3] = -0.5
    ok = gen._process_response_into_experience(response, max_len=64)
    assert ok.action_mask.tolist() == [[0, 1, 1, 1]] and ok.info["rollout_logprob_nonfinite"].tolist() == [0.0]


def test_loglinear_prox_by_hand():
    mu = torch.tensor([[-2.0, -2.0, -2.0, -2.0]])
    current = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    lag = torch.tensor([[0, 1, 3, 9]])
    out = C.loglinear_prox_log_probs(mu, current, lag)
    # alpha = L/(L+1): 0, 1/2, 3/4, 9/10 of the way from log mu (-2) to log pi_V (-1)
    assert torch.allclose(out, torch.tensor([[-2.0, -1.5, -1.25, -1.1]]))


@pytest.mark.parametrize("reward", [None, float("nan"), float("inf")])
def test_failed_reward_policies(reward):
    from types import SimpleNamespace

    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    gen = SamplesGenerator.__new__(SamplesGenerator)
    response = {
        "observation_tokens": [5, 6, 7, 8],
        "action_ranges": [(2, 4)],
        "rollout_log_probs": None,
        "prompt": "p =",
        "label": None,
        "reward": reward,
        "scores": reward,
    }
    gen.args = SimpleNamespace(
        reward=SimpleNamespace(failure_policy="stop"), algo=SimpleNamespace(sampling_mask="off")
    )
    with pytest.raises(RuntimeError, match="--reward.failure_policy drop"):
        gen._process_response_into_experience(response, max_len=64)
    gen.args.reward.failure_policy = "drop"
    exp = gen._process_response_into_experience(response, max_len=64)
    assert exp.action_mask.sum().item() == 0 and exp.rewards.tolist() == [0.0]
    assert exp.info["reward_failed"].tolist() == [1.0]
    ok = gen._process_response_into_experience({**response, "reward": 0.5, "scores": 0.5}, max_len=64)
    assert ok.info["reward_failed"].tolist() == [0.0] and ok.action_mask.sum().item() == 2
