"""KL-to-reference loss (openrlhf_ess.models.corrections.kl_loss_k2): hand values, autograd against the
analytic gradient, a Monte-Carlo check of unbiasedness against the exact reverse-KL gradient, the TIS cap,
and extreme log-probs."""

import math

import pytest
import torch

from openrlhf_ess.models import corrections as C

F64 = torch.float64


def _upstream_compute_approx_kl():
    """Upstream's ``compute_approx_kl``, imported the way the product imports upstream (CPU patches first)."""
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()
    from openrlhf.models.utils import compute_approx_kl

    return compute_approx_kl


def _hand_value(lp, ref, est):
    # Independent forms: k3 = r − 1 − log r with r = π_ref/π_θ (Schulman's blog form).
    r = torch.exp(ref - lp)
    return {"k1": lp - ref, "k2": (lp - ref) ** 2 / 2, "k3": r - 1 - torch.log(r)}[est]


def _hand_weight(lp, prox, mu, cap):
    # w = min((π_θ/π_prox) · min(π_prox/μ, C), 10) as plain ratios (no log space); π_prox = π_θ when prox is None.
    prox_eff = lp if prox is None else prox
    staleness = torch.ones_like(lp) if prox is None else torch.exp(lp) / torch.exp(prox)
    if mu is None:
        return staleness.clamp(max=10.0)
    disc = torch.exp(prox_eff) / torch.exp(mu)
    w = staleness * (disc if cap is None else torch.minimum(disc, torch.tensor(cap, dtype=lp.dtype)))
    return w.clamp(max=10.0)


def _value_and_grad(lp, *args, **kwargs):
    lp = lp.detach().clone().requires_grad_(True)
    out = C.kl_loss_k2(lp, *args, **kwargs)
    out.sum().backward()
    return out.detach(), lp.grad


# ---- 1. autograd vs the analytic gradient w·(log π_θ − log π_ref), forward value vs hand k1/k2/k3 --------

CONFIGS = {  # (use prox, use rollout, tis_cap)
    "on_policy": (False, False, None),
    "prox_only": (True, False, None),
    "rollout_no_prox_capped": (False, True, 1.5),
    "decoupled_capped": (True, True, 1.5),
    "decoupled_uncapped": (True, True, None),
}


@pytest.mark.parametrize("est", C.KL_VALUE_ESTIMATORS)
@pytest.mark.parametrize("config", CONFIGS)
def test_grad_is_weight_times_k1_and_value_is_estimator(est, config):
    use_prox, use_mu, cap = CONFIGS[config]
    g = torch.Generator().manual_seed(1)
    lp, ref, prox, mu = (-torch.rand(3, 4, generator=g, dtype=F64) * 3 for _ in range(4))
    prox_arg = prox.clone().requires_grad_(True) if use_prox else None
    mu_arg = mu.clone().requires_grad_(True) if use_mu else None

    value, grad = _value_and_grad(lp, ref, prox_arg, mu_arg, tis_cap=cap, value_estimator=est)

    w = _hand_weight(lp, prox if use_prox else None, mu if use_mu else None, cap)
    torch.testing.assert_close(grad, w * (lp - ref), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(value, _hand_value(lp, ref, est), rtol=1e-12, atol=1e-12)
    # The weight is detached: nothing flows to π_prox or μ.
    assert all(t is None or t.grad is None for t in (prox_arg, mu_arg))


def test_hand_values():
    lp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -0.8, -1.0]], dtype=F64)  # x = log π_θ − log π_ref = [0.5, 0.3, −1.0]
    # k1 = x; k2 = x²/2 = [0.125, 0.045, 0.5]; k3 = e^{−x} − 1 + x = [e^{−.5} − .5, e^{−.3} − .7, e − 2]
    expected = {
        "k1": [0.5, 0.3, -1.0],
        "k2": [0.125, 0.045, 0.5],
        "k3": [0.10653065971263342, 0.04081822068171792, 0.7182818284590451],
    }
    for est, want in expected.items():
        value, grad = _value_and_grad(lp, ref, value_estimator=est)
        assert value[0].tolist() == pytest.approx(want, abs=1e-15)
        assert grad[0].tolist() == pytest.approx([0.5, 0.3, -1.0], abs=1e-15)  # on-policy, w = 1: grad = x


# ---- 2. Monte-Carlo: unbiased for ∇KL(π_θ‖π_ref); k3-as-loss and upstream's weight are not ------------------

N_SAMPLES = 200_000
THETA = [0.5, -0.3, 1.0, 0.0, -1.0]
REF = [0.0, 0.4, 0.2, -0.5, 0.3]
MU = [-0.5, 0.5, 0.3, 0.8, 0.0]  # behaviour policy: π_θ/μ ∈ [0.39, 2.87]
PROX = [0.2, 0.0, 0.6, 0.5, -0.5]  # between π_θ and μ: π_prox/μ ∈ [0.66, 2.18], π_θ/π_prox ∈ [0.59, 1.45]
N_SE = 5.0  # |z| < 5 per component: a false alarm has probability ≈ 6e-7 each (Gaussian, N = 2e5)


def _log_softmax(logits):
    return torch.tensor(logits, dtype=F64).log_softmax(0)


def _exact_reverse_kl_grad(theta):
    # Autograd of the analytic KL(π_θ‖π_ref) = Σ_a π_θ(a) (log π_θ(a) − log π_ref(a)) w.r.t. the logits.
    log_p = theta.log_softmax(0)
    (grad,) = torch.autograd.grad((log_p.exp() * (log_p - _log_softmax(REF))).sum(), theta)
    return grad


def _mc_grad_and_se(theta, actions, coef):
    """Per-sample gradient of coef(a)·log π_θ(a) w.r.t. the logits is coef(a)·(e_a − π_θ): its mean is what
    autograd returns for the batch mean, its standard deviation / √N is the standard error."""
    p = theta.detach().softmax(0)
    per_sample = coef[:, None] * (torch.nn.functional.one_hot(actions, 5).to(F64) - p)
    return per_sample.mean(0), per_sample.std(0) / math.sqrt(len(actions))


@pytest.mark.parametrize("with_prox", [True, False])
def test_monte_carlo_unbiased_off_policy(with_prox):
    theta = torch.tensor(THETA, dtype=F64, requires_grad=True)
    ref, mu, prox = _log_softmax(REF), _log_softmax(MU), _log_softmax(PROX)
    g_true = _exact_reverse_kl_grad(theta)  # ≈ [0.0289, −0.1243, 0.1736, 0.0175, −0.0958]

    actions = torch.multinomial(mu.exp(), N_SAMPLES, replacement=True, generator=torch.Generator().manual_seed(0))
    log_p = theta.log_softmax(0)
    loss = C.kl_loss_k2(
        log_p[actions], ref[actions], prox[actions] if with_prox else None, mu[actions], tis_cap=10.0
    ).mean()  # cap 10 > max π_prox/μ = 2.87: never binds, so w = π_θ/μ exactly
    (g_hat,) = torch.autograd.grad(loss, theta)

    lp = log_p.detach()
    mean, se = _mc_grad_and_se(theta, actions, ((lp - mu).exp() * (lp - ref))[actions])
    torch.testing.assert_close(g_hat, mean, rtol=1e-9, atol=1e-12)  # autograd = mean of hand per-sample grads
    z = (g_hat - g_true) / se  # observed |z| ≤ 0.6 with seed 0; SE ≈ [7, 3, 8, 3, 4]e-4
    assert z.abs().max() < N_SE, z


def test_monte_carlo_k3_as_loss_is_biased():
    # k3 as a loss, on-policy (a ~ π_θ), with upstream's legacy path: pathwise gradient (1 − π_ref/π_θ)∇log π_θ,
    # whose expectation Σ_a (π_θ − π_ref)(a) ∇log π_θ(a) = π_θ − π_ref (w.r.t. the logits) is ∇KL(π_ref‖π_θ).
    compute_approx_kl = _upstream_compute_approx_kl()
    theta = torch.tensor(THETA, dtype=F64, requires_grad=True)
    ref = _log_softmax(REF)
    g_true = _exact_reverse_kl_grad(theta)  # ≈ [0.0289, −0.1243, 0.1736, 0.0175, −0.0958]
    p = theta.detach().softmax(0)
    g_forward_kl = p - ref.exp()  # ≈ [0.0782, −0.1487, 0.2043, 0.0474, −0.1813]

    actions = torch.multinomial(p, N_SAMPLES, replacement=True, generator=torch.Generator().manual_seed(0))
    log_p = theta.log_softmax(0)[actions]
    loss = compute_approx_kl(log_p, ref[actions], kl_estimator="k3", unbiased_gradient=False).mean()
    (g_k3,) = torch.autograd.grad(loss, theta)  # the ±10 value clamp never binds: π_ref/π_θ ≤ 4.2 here

    lp = theta.detach().log_softmax(0)
    _, se = _mc_grad_and_se(theta, actions, (1 - (ref - lp).exp())[actions])
    assert ((g_k3 - g_forward_kl) / se).abs().max() < N_SE  # it estimates the forward-KL gradient ...
    assert ((g_k3 - g_true) / se).abs().max() > 10 * N_SE  # ... not the reverse one: observed max |z| ≈ 86


def test_monte_carlo_upstream_weight_misses_discrepancy():
    # Upstream's unbiased_gradient weights by π_θ/π_old only. Fed π_prox as π_old while tokens come from μ ≠ π_prox,
    # its expectation is E_μ[(π_θ/π_prox) k1 ∇log π_θ] ≠ ∇KL; the factor π_prox/μ we add is what fixes it.
    compute_approx_kl = _upstream_compute_approx_kl()
    theta = torch.tensor(THETA, dtype=F64, requires_grad=True)
    ref, mu, prox = _log_softmax(REF), _log_softmax(MU), _log_softmax(PROX)
    g_true = _exact_reverse_kl_grad(theta)

    actions = torch.multinomial(mu.exp(), N_SAMPLES, replacement=True, generator=torch.Generator().manual_seed(0))
    log_p = theta.log_softmax(0)[actions]
    loss = compute_approx_kl(log_p, ref[actions], prox[actions], kl_estimator="k3", unbiased_gradient=True).mean()
    (g_up,) = torch.autograd.grad(loss, theta)  # its clamp at 10 never binds: π_θ/π_prox ≤ 1.45

    lp = theta.detach().log_softmax(0)
    _, se = _mc_grad_and_se(theta, actions, ((lp - prox).exp() * (lp - ref))[actions])
    assert ((g_up - g_true) / se).abs().max() > 10 * N_SE  # observed max |z| ≈ 167


# ---- 3. TIS cap binding --------------------------------------------------------------------------------------


def test_tis_cap_binds_with_hand_values():
    lp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -0.8, -1.0]], dtype=F64)  # x = [0.5, 0.3, −1.0]
    prox = torch.tensor([[-1.2, -0.4, -2.0]], dtype=F64)  # π_θ/π_prox = [e^{.2}, e^{−.1}, 1] = [1.2214, 0.9048, 1]
    mu = torch.tensor([[-1.0, -1.0, -2.5]], dtype=F64)  # π_prox/μ = [e^{−.2}, e^{.6}, e^{.5}] = [.819, 1.822, 1.649]

    # C = 1.5 binds on tokens 1 and 2: w = [e^{.2}·e^{−.2}, e^{−.1}·1.5, 1·1.5] = [1, 1.3572561, 1.5]
    _, grad = _value_and_grad(lp, ref, prox, mu, tis_cap=1.5)
    assert grad[0].tolist() == pytest.approx([0.5, 0.4071768381161818, -1.5], abs=1e-12)  # w·x

    # Uncapped: w = [1, e^{.5}, e^{.5}] = [1, 1.6487213, 1.6487213]
    _, grad = _value_and_grad(lp, ref, prox, mu, tis_cap=None)
    assert grad[0].tolist() == pytest.approx([0.5, 0.4946163812100384, -1.6487212707001282], abs=1e-12)

    # A cap above every ratio (1.8221) is the same as no cap.
    _, grad_loose = _value_and_grad(lp, ref, prox, mu, tis_cap=2.0)
    assert torch.equal(grad_loose, grad)


def test_whole_weight_is_bounded_by_upstreams_kl_is_weight_clip():
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()
    from openrlhf.models.utils import KL_IS_WEIGHT_CLIP

    assert C.K2_IS_WEIGHT_CLIP == KL_IS_WEIGHT_CLIP == 10.0  # one bound for both KL IS weights
    lp = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    ref = lp - 1.0  # x = 1 everywhere: grad = w
    prox = torch.tensor([[-3.0, -2.0, -1.0]], dtype=F64)  # π_θ/π_prox = [e³, e², e] = [20.09, 7.389, 2.718]
    mu = prox - 1.0  # π_prox/μ = e = 2.718, capped at C = 2
    _, grad = _value_and_grad(lp, ref, prox, mu, tis_cap=2.0)
    # w = min(π_θ/π_prox · 2, 10) = [min(40.17, 10), min(14.78, 10), 5.4366] = [10, 10, 2e]
    assert grad[0].tolist() == pytest.approx([10.0, 10.0, 2 * math.e], rel=1e-12)
    # Without μ the staleness factor alone is bounded too: [min(20.09, 10), 7.389, 2.718].
    _, grad = _value_and_grad(lp, ref, prox)
    assert grad[0].tolist() == pytest.approx([10.0, math.exp(2), math.e], rel=1e-12)


def test_sequence_level_discrepancy_factor_is_the_policy_losss_weight():
    # --algo.tis_level seq: the factor π_prox/μ is each sequence's capped geometric mean, as in the policy loss.
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 left-padded: column 0 is a prompt position
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=F64)
    ref = lp - 1.0  # x = 1 everywhere: grad = w
    prox = lp - torch.tensor([[5.0, 0.1, -0.1], [0.0, 0.2, 2.0]], dtype=F64)  # log π_θ/π_prox
    mu = prox - torch.tensor([[7.0, 0.2, 0.6], [1.0, 1.0, 0.7]], dtype=F64)  # log π_prox/μ (row 0 col 0 masked)
    # row 0: d = min(exp((0.2 + 0.6)/2), 2) = e^0.4; w = [–, e^0.1·e^0.4, e^−0.1·e^0.4] = [–, e^0.5, e^0.3]
    # row 1: d = min(exp((1 + 1 + 0.7)/3), 2) = min(e^0.9 = 2.4596, 2) = 2; w = [2, 2e^0.2, min(2e², 10) = 10]
    want = [[math.exp(0.5), math.exp(0.3)], [2.0, 2 * math.exp(0.2), 10.0]]
    _, grad = _value_and_grad(lp, ref, prox, mu, tis_cap=2.0, tis_level="seq", action_mask=mask)
    assert grad[0, 1:].tolist() == pytest.approx(want[0], rel=1e-6)  # the TIS weight is float32
    assert grad[1].tolist() == pytest.approx(want[1], rel=1e-6)
    # token level (the default) would give row 0 [–, e^0.1·e^0.2, e^−0.1·e^0.6] = [–, e^0.3, e^0.5]
    _, grad_tok = _value_and_grad(lp, ref, prox, mu, tis_cap=2.0)
    assert grad_tok[0, 1:].tolist() == pytest.approx([math.exp(0.3), math.exp(0.5)], rel=1e-12)
    with pytest.raises(ValueError, match="action_mask"):
        C.kl_loss_k2(lp, ref, prox, mu, tis_cap=2.0, tis_level="seq")
    # seq_product: d = min(exp(Σ_t log π_prox/μ), C) with C = 8. Row 0: exp(0.8) = 2.2255; row 1: exp(2.7) =
    # 14.88 -> 8. w = [–, e^0.1·e^0.8, e^−0.1·e^0.8] = [–, e^0.9, e^0.7]; [8, min(8e^0.2, 10) = 9.771, 10]
    want = [[math.exp(0.9), math.exp(0.7)], [8.0, 8 * math.exp(0.2), 10.0]]
    _, grad = _value_and_grad(lp, ref, prox, mu, tis_cap=8.0, tis_level="seq_product", action_mask=mask)
    assert grad[0, 1:].tolist() == pytest.approx(want[0], rel=1e-6)
    assert grad[1].tolist() == pytest.approx(want[1], rel=1e-6)


# ---- 4. extreme log-probs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("est", C.KL_VALUE_ESTIMATORS)
@pytest.mark.parametrize("cap", [None, 2.0])
def test_extreme_log_probs_stay_finite(est, cap):
    big = 1e4
    lp = torch.tensor([[-big, 0.0, -big, -big, 0.0]])
    ref = torch.tensor([[0.0, -big, -big, 0.0, 0.0]])  # x = [−1e4, 1e4, 0, −1e4, 0]
    prox = torch.tensor([[0.0, 0.0, -big, -big, -big]])
    mu = torch.tensor([[-big, -big, 0.0, 0.0, -big]])  # log w before the ±20 bound: up to ±2e4
    value, grad = _value_and_grad(lp, ref, prox, mu, tis_cap=cap, value_estimator=est)
    assert torch.isfinite(value).all() and torch.isfinite(grad).all(), (value, grad)
    if est == "k1":
        # Bit-exact forward value even where the surrogate w·x²/2 ≈ 4.9e8·5e7 dwarfs it.
        assert torch.equal(value, lp - ref)
    if est == "k3":
        # x = −1e4 saturates at e^20 − 21 ≈ 4.852e8; x = +1e4 gives e^{−1e4} − 1 + 1e4 = 9999.
        assert value[0].tolist() == pytest.approx([485165174.41, 9999.0, 0.0, 485165174.41, 0.0], rel=1e-6)
    # Token 1 (x = 1e4): log w = (0 − 0) + min(0 + 1e4, log C) → w = C, or upstream's bound 10 uncapped.
    assert grad[0, 1].item() == pytest.approx((cap or 10.0) * big, rel=1e-6)


def test_rejects_bad_arguments():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="estimator 'k4'"):
        C.kl_loss_k2(lp, lp, value_estimator="k4")
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        C.kl_loss_k2(lp, lp, lp, lp, tis_cap=0.0)
