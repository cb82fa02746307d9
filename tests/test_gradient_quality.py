"""benchmarks/gradient_quality.py: its gradient function against hand-derived policy gradients, lag-0
identities on the tiny model, and the --quick run end to end."""

import json
import math

import pytest
import torch

from benchmarks import gradient_quality as gq

CAP, EPS = 2.0, 0.2  # TIS cap and PPO clip the benchmark's losses use


def _toy(seed=0, B=6, A=5, S=3, V=4):
    """A 1-layer softmax policy π(a|x) = softmax(xᵀW) over V actions, B sequences of A tokens with random
    features x, actions drawn from a behaviour policy μ = softmax(xᵀW_μ) far enough from W that the
    TIS cap and the PPO clip both fire."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, A, S, generator=g, dtype=torch.float64)
    W = torch.randn(S, V, generator=g, dtype=torch.float64).requires_grad_()
    W_mu = W.detach() + 1.5 * torch.randn(S, V, generator=g, dtype=torch.float64)
    mu_all = (x @ W_mu).log_softmax(-1)
    actions = torch.multinomial(mu_all.exp().reshape(B * A, V), 1, generator=g).reshape(B, A)
    mask = torch.ones(B, A, dtype=torch.float64)
    mask[0, 3:] = 0  # a shorter sequence
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, A) * mask
    mu = mu_all.gather(-1, actions[..., None])[..., 0] * mask

    def log_prob_fn():
        return (x @ W).log_softmax(-1).gather(-1, actions[..., None])[..., 0] * mask

    ewma = (x @ (W.detach() + 0.3 * torch.randn(S, V, generator=g, dtype=torch.float64))).log_softmax(-1)
    ewma = ewma.gather(-1, actions[..., None])[..., 0] * mask
    ref = (x @ (W.detach() + 0.5 * torch.randn(S, V, generator=g, dtype=torch.float64))).log_softmax(-1)
    ref = ref.gather(-1, actions[..., None])[..., 0] * mask
    with torch.no_grad():
        current = log_prob_fn()
    prox = {"current": current, "exact": mu, "ewma": ewma, "ref": ref}
    batch = gq.StaleBatch(adv, mask, mu, lag=3, prox=prox)
    return x, W, actions, batch, log_prob_fn


def _analytic(x, W, actions, batch, coef):
    """∂/∂W of −(1/n) Σ_t c_t A_t log π(a_t|x_t) = −(1/n) Σ_t c_t A_t x_t (onehot(a_t) − π(·|x_t))ᵀ."""
    pi = (x @ W.detach()).softmax(-1)
    onehot = torch.nn.functional.one_hot(actions, pi.shape[-1]).to(pi.dtype)
    c = coef * batch.advantages * batch.action_mask
    grad = -torch.einsum("bt,bts,btv->sv", c, x, onehot - pi) / batch.action_mask.sum()
    return grad.reshape(-1)


def _ppo_coef(cur, prox, mu, adv):
    """Coefficient of A_t ∇log π at θ for the decoupled loss −w·min(rA, clip(r)A), w = min(π_prox/μ, C):
    w·r where the unclipped term is the minimum, 0 where the clipped (constant) one is."""
    r = (cur - prox).exp()
    w = (prox - mu).exp().clamp(max=CAP)
    clipped = ((adv > 0) & (r > 1 + EPS)) | ((adv < 0) & (r < 1 - EPS))
    return torch.where(clipped, torch.zeros_like(r), w * r)


def _ess_scale(prox, mu, mask):
    # w_i = exp(mean_t log(π_prox/μ)); ρ = (Σw)² / (B Σw²); scale = clamp(√ρ, 0.1, 1)
    w = (((prox - mu) * mask).sum(-1) / mask.sum(-1)).exp()
    rho = w.sum() ** 2 / (len(w) * (w**2).sum())
    return min(max(math.sqrt(rho), 0.1), 1.0)


def test_gradient_function_matches_hand_derived_policy_gradients_on_a_softmax_policy():
    x, W, actions, batch, log_prob_fn = _toy()
    cur, mu, adv, mask = batch.prox["current"], batch.rollout_log_probs, batch.advantages, batch.action_mask
    m = mask.bool()
    # the toy must exercise the cap and the clip, or the comparison below proves less than it says
    assert ((cur - mu)[m] > math.log(CAP)).any() and ((cur - mu)[m] < 0).any()
    assert (_ppo_coef(cur, mu, mu, adv)[m] == 0).any()
    loglinear = mu + 3 / 4 * (cur - mu)  # AReaL: α = L/(L+1), L = 3
    tis_coef = (cur - mu).exp().clamp(max=CAP)  # π_prox = π_θ (recompute): ratio 1, weight min(π_θ/μ, C)
    expected = {
        "none": torch.ones_like(cur),
        "TIS": tis_coef,
        # seq level: the sequence's geometric-mean weight min(exp(mean_t log(π_θ/μ)), C) on each of its tokens
        "TIS (seq)": (((cur - mu) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).exp().clamp(max=CAP),
        "IS, no cap": (cur - mu).exp(),
        "TIS + ESS-LR (recompute)": tis_coef * _ess_scale(cur, mu, mask),
        "snapshot + TIS": _ppo_coef(cur, mu, mu, adv),
        "snapshot + TIS + ESS-LR": _ppo_coef(cur, mu, mu, adv) * _ess_scale(mu, mu, mask),
        "EWMA β=0.9 + TIS": _ppo_coef(cur, batch.prox["ewma"], mu, adv),
        "loglinear + TIS": _ppo_coef(cur, loglinear, mu, adv),
    }
    assert _ess_scale(cur, mu, mask) < 0.99  # the recompute weights π_θ/μ do lower the ESS here
    for correction, coef in expected.items():
        got = gq.estimator_gradient(log_prob_fn, [W], batch, correction)
        want = _analytic(x, W, actions, batch, coef)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=correction)
    # the corrections do differ from one another on this batch (else the loop above could not tell them apart)
    g_none = gq.estimator_gradient(log_prob_fn, [W], batch, "none")
    g_snap = gq.estimator_gradient(log_prob_fn, [W], batch, "snapshot + TIS")
    assert gq.cosine(g_none, g_snap) < 0.99


def test_kl_gradients_match_hand_derived_ones_on_a_softmax_policy():
    x, W, actions, batch, log_prob_fn = _toy(seed=9)  # a seed where the cap, the W bound and no k3 clamp hold
    cur, mu, ref, mask = batch.prox["current"], batch.rollout_log_probs, batch.prox["ref"], batch.action_mask
    kl = cur - ref  # x_t = log π_θ − log π_ref
    m = mask.bool()
    assert ((cur - mu)[m] > math.log(CAP)).any()  # the TIS cap fires
    # k3's clamps stay inactive: the value e^{−x} − 1 + x below 10, the exponent's bound x ≥ −10
    assert ((-kl).exp() - 1 + kl)[m].max() < 10 and kl[m].min() > -10

    # d_t = ∂(per-token loss)/∂log π_θ(a_t); the gradient is (1/n) Σ_t d_t x_t (onehot(a_t) − π(·|x_t))ᵀ
    def analytic(d):
        pi = (x @ W.detach()).softmax(-1)
        onehot = torch.nn.functional.one_hot(actions, pi.shape[-1]).to(pi.dtype)
        return (torch.einsum("bt,bts,btv->sv", d * mask, x, onehot - pi) / mask.sum()).reshape(-1)

    expected = {
        "reference": kl,  # ∇½x² with weight 1
        "k3 as loss (upstream default)": 1 - (-kl).exp(),  # ∂(e^{−x} − 1 + x)/∂x
        "upstream unbiased_gradient (recompute)": kl,  # w = π_θ/π_old = 1 at θ
        "ours k2 + TIS (recompute)": (cur - mu).exp().clamp(max=CAP) * kl,  # w = min(π_θ/μ, C)
        "ours k2 + TIS (exact π_prox)": (cur - mu).exp().clamp(max=10.0) * kl,  # (π_θ/μ)·min(1, C), bound W = 10
    }
    assert ((cur - mu)[m] > math.log(10.0)).any()  # the W = 10 bound fires too
    for kind, d in expected.items():
        got = gq.kl_gradient(log_prob_fn, [W], batch, kind)
        # atol 1e-7: upstream's compute_approx_kl works in float32 (entries here are up to ~0.4)
        torch.testing.assert_close(got, analytic(d), rtol=1e-6, atol=1e-7, msg=kind)


def test_quality_metrics_by_hand():
    ref = torch.tensor([1.0, 0.0])
    q = gq.quality([torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0])], ref)
    assert q["cos_mean"] == pytest.approx(1 / math.sqrt(2))  # each at 45°
    assert q["rel_mean"] == pytest.approx(1.0)  # ‖(0, ±1)‖ / ‖(1, 0)‖
    assert q["pooled_cos"] == pytest.approx(1.0)  # mean (1, 0)
    assert q["spread"] == pytest.approx(1.0)  # deviations (0, ±1): mean squared norm 1, ‖mean‖² = 1
    assert q["pairwise_cos"] == pytest.approx(0.0)


@pytest.fixture(scope="module")
def trained(tiny_world):
    tiny = gq.Tiny(tiny_world, max_new_tokens=8, samples_per_prompt=4)
    torch.manual_seed(0)
    states, _ = gq.train_versions(tiny, steps=3, lr=1e-2, n_prompts=2, gen=torch.Generator().manual_seed(0))
    return tiny, states


def test_at_lag_zero_every_exact_correction_is_the_on_policy_gradient(trained):
    tiny, states = trained
    tiny.model.load_state_dict(states[-1])
    r = tiny.sample(2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        current = tiny.log_probs(r)
    # the sampler's own log-probs equal a separate forward of the same weights
    assert (current - r.rollout_log_probs)[r.action_mask.bool()].abs().max() < 1e-5
    ewma_auto = gq.ewma_state(states, gq.ewma_decay_for_lag(0), tiny.model)  # β = 0: the current weights
    ewma_fixed = gq.ewma_state(states, 0.9, tiny.model)
    prox = {
        "current": current,
        "exact": current.clone(),
        "ewma_auto": tiny.log_probs_with(ewma_auto, r),
        "ewma": tiny.log_probs_with(ewma_fixed, r),
    }
    batch = tiny.batch(r, 0, prox)
    g_star = tiny.gradient(r, batch, "none")
    assert g_star.norm() > 0
    for c in gq.CORRECTIONS:
        if c == "EWMA β=0.9 + TIS" or "OPOB" in c or "held-out" in c:
            continue  # an average of past weights: not θ_N even at lag 0 (checked below); another baseline
        g = tiny.gradient(r, batch, c)
        assert gq.cosine(g, g_star) == pytest.approx(1.0, abs=1e-5), c
        assert gq.rel_error(g, g_star) < 1e-4, c
    assert (prox["ewma"] - current).abs().max() > 1e-3
    # the KL term at lag 0: every importance-weighted k2 gradient is the on-policy one; k3 as a loss is not
    prox["ref"] = tiny.log_probs_with(states[0], r)
    kl_star = tiny.kl_gradient(r, batch, "reference")
    for kind in gq.KL_CORRECTIONS[1:]:
        assert gq.cosine(tiny.kl_gradient(r, batch, kind), kl_star) == pytest.approx(1.0, abs=1e-5), kind
    assert gq.rel_error(tiny.kl_gradient(r, batch, gq.KL_CORRECTIONS[0]), kl_star) > 1e-2


def test_chunked_reference_gradient_equals_one_batch(trained):
    tiny, states = trained
    tiny.model.load_state_dict(states[-1])
    r = tiny.sample(4, torch.Generator().manual_seed(2))  # 16 sequences of different lengths
    whole = gq.on_policy_gradient(tiny, r, chunk=16)
    chunked = gq.on_policy_gradient(tiny, r, chunk=3)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-7)


def test_quick_run_writes_its_results(tmp_path):
    results = gq.main(["--quick", "--out", str(tmp_path)])
    for name in ("results.json", "results.md", "gradient_quality.png"):
        assert (tmp_path / name).stat().st_size > 0
    on_disk = json.loads((tmp_path / "results.json").read_text())
    (regime,) = on_disk["regimes"].values()
    assert set(regime["lags"]) == {"1", "2"}
    for lag in regime["lags"].values():
        assert set(lag["corrections"]) == set(gq.CORRECTIONS)
        for q in lag["corrections"].values():
            assert -1 <= q["cos_mean"] <= 1 and q["rel_mean"] >= 0 and math.isfinite(q["spread"])
        assert lag["diagnostics"]["mu_err"] < 1e-4  # μ = the sampler's log-probs, checked by a separate forward
        # the control: sync's on-policy gradient at θ_{N−L}, on the K stale batches and on a fresh g*-sized batch
        ctrl = lag["control"]
        for key in ("cos_mean", "pooled_cos", "large_cos"):
            assert math.isfinite(ctrl[key]) and -1 <= ctrl[key] <= 1, key
        assert ctrl["rel_mean"] >= 0 and 0 <= ctrl["large_reward"] <= 1
    assert regime["g_star_norm"] > 0
    assert results["seconds"] < 60
    # the control row sits in the tables beside the estimators, and the per-seed control table is there
    md = (tmp_path / "results.md").read_text()
    assert md.count(f"| **{gq.CONTROL}** |") == 4  # per-batch cosine, pooled cosine, relative error, spread
    assert f"| {gq.CONTROL_LARGE} |" in md
    assert "| lag | seed | reward θ_{N−L} → θ_N | control (g*-sized) | control (K batches) |" in md


def test_seed_aggregation_keeps_every_seed():
    """mean_over_seeds: the mean, and every seed's value in order (the tables print them), control included."""

    def run(x):
        q = {"cos_mean": x, "pooled_cos": -x, "rel_mean": 1 + x, "spread": 1.0}
        lag = {"corrections": {c: dict(q) for c in gq.CORRECTIONS}, "control": {**q, "large_cos": x / 2}}
        kl = {"noise_floor": dict(q), "lags": {"2": {k: dict(q) for k in gq.KL_CORRECTIONS}}}
        return {"noise_floor": dict(q), "lags": {"2": lag}, "kl": kl, "train_reward": [x, x]}

    out = gq.mean_over_seeds([run(0.1), run(0.5), run(-0.3)])
    ctrl = out["lags"]["2"]["control"]
    assert ctrl["pooled_cos"] == pytest.approx(-0.1) and ctrl["pooled_cos_seeds"] == [-0.1, -0.5, 0.3]
    assert ctrl["large_cos_seeds"] == [0.05, 0.25, -0.15] and ctrl["large_cos_min"] == -0.15
    assert out["lags"]["2"]["corrections"]["TIS"]["cos_mean_seeds"] == [0.1, 0.5, -0.3]
    assert out["noise_floor"]["rel_mean_max"] == 1.5 and out["train_reward"] == pytest.approx([0.1, 0.1])
    assert gq._cell(ctrl, "pooled_cos") == "-0.100 [-0.10, -0.50, 0.30]"
    assert gq._seed_range([0, 1, 2, 3, 4]) == "0–4" and gq._seed_range([0, 2]) == "0, 2"


@pytest.mark.engine
def test_quick_run_with_the_real_engine_sampling_stale_batches(tmp_path):
    """--sampler vllm-fp32: the stale batches come from the real vLLM CPU engine, its weights set to θ_{N−L}
    through the package's sync path at each lag. In fp32 its μ matches the separate HF forward at θ_{N−L}
    (mu_err); an engine still holding other weights (θ_0, or the previous lag's) would miss by far more, since
    three Adam steps at lr 1e-2 move every log-prob by ~1e-2. Own process: vLLM keeps process-wide state."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "benchmarks.gradient_quality", "--quick", "--sampler", "vllm-fp32"]
    cmd += ["--task", "target", "--out", str(tmp_path)]
    run = subprocess.run(
        cmd, cwd=gq.REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["task"] == "target" and "vLLM CPU engine in fp32" in results["sampler"]
    (regime,) = results["regimes"].values()
    for lag in regime["lags"].values():
        assert lag["diagnostics"]["mu_err"] < 1e-3
        assert 0 <= lag["diagnostics"]["reward_stale"] <= 1
