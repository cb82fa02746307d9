"""--algo.advantage.baseline opob in the trainer (openrlhf_ess/trainer/opob.py): upstream's real
compute_advantages_and_returns with its baseline replaced, checked per estimator against advantages written out
here from the definitions; the norms' round trip through the actor's forward result; the flags; a real run."""

import decimal
import math
import types

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402

from openrlhf_ess.trainer import opob  # noqa: E402

N = 4  # samples per prompt


def _args(estimator, tis_cap=None, weight="tis", tis_level="token"):
    return types.SimpleNamespace(
        algo=types.SimpleNamespace(
            advantage=types.SimpleNamespace(
                estimator=estimator, gamma=1.0, lambd=1.0, no_std_norm=False, opob_weight=weight
            ),
            ess_lr_weight="geo_mean",
            tis_cap=tis_cap,
            tis_level=tis_level,
        ),
        rollout=types.SimpleNamespace(n_samples_per_prompt=N, max_new_tokens=6),
        reward=types.SimpleNamespace(clip_range=(-10, 10), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        data=types.SimpleNamespace(max_len=16),
    )


def _batch(seed=0):
    """Two micro-batches of 4 samples (2 prompts x 4), in shuffled prompt order; response lengths 2-6."""
    g = torch.Generator().manual_seed(seed)
    exps = []
    for index in ([3, 0, 5, 6], [1, 2, 7, 4]):
        mask = torch.zeros(4, 6, dtype=torch.bool)
        for row, length in enumerate(torch.randint(2, 7, (4,), generator=g).tolist()):
            mask[row, :length] = True
        mu = -torch.rand(4, 6, generator=g) * 2
        exps.append(
            Experience(
                action_mask=mask,
                rewards=torch.rand(4, generator=g),
                kl=torch.zeros(4, 6),
                action_log_probs=mu + 0.3 * torch.randn(4, 6, generator=g),
                rollout_log_probs=mu,
                index=index,
                info={"reward": None},
            )
        )
    for exp in exps:
        exp.info["reward"] = exp.rewards.clone()  # what upstream logs as train/reward
    norms = [torch.rand(4, generator=g) * 5 + 0.1 for _ in exps]
    return exps, norms


def _maker(args):
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy = types.SimpleNamespace(args=args)
    maker.kl_ctl = types.SimpleNamespace(value=0.0)
    maker.advantage_estimator = args.algo.advantage.estimator
    return maker


def _expected_baselines(exps, norms, tis_cap=None, weight="tis", level="token"):
    """{prompt-order index: b*} from the definition, in decimal arithmetic (whose exponent range holds a trajectory
    ratio exp(Σ_t log π/μ) far past float64's): w = the loss's geometric-mean weight truncated at the cap (``tis``,
    1 without a cap), or the product exp(Σ_t log π/μ), truncated at the cap or not."""
    rows = {}
    for exp, nrm in zip(exps, norms):
        for r, i in enumerate(exp.index):
            diffs = [
                decimal.Decimal(float(a)) - decimal.Decimal(float(b))
                for a, b, m in zip(exp.action_log_probs[r], exp.rollout_log_probs[r], exp.action_mask[r])
                if m
            ]
            if weight == "tis":
                log_w = sum(diffs) / len(diffs)
            else:
                log_w = sum(diffs)
            w = log_w.exp()
            if weight == "seq_product_truncated" or (weight == "tis" and tis_cap is not None):
                w = min(w, decimal.Decimal(tis_cap))
            elif weight == "tis":
                w = decimal.Decimal(1)  # no IS in the loss: w = 1
            if weight != "tis" and level == "seq_product":
                # the reference's ‖g_i‖ is that of the IS-weighted loss: the loss's min(product, C) once more
                w = w * min(sum(diffs).exp(), decimal.Decimal(tis_cap))
            rows[i] = (decimal.Decimal(exp.rewards[r].item()), w, decimal.Decimal(nrm[r].item()))
    out = {}
    for g in range(len(rows) // N):
        members = range(g * N, (g + 1) * N)
        num = sum(rows[i][1] ** 2 * rows[i][2] * rows[i][0] for i in members)
        den = sum(rows[i][1] ** 2 * rows[i][2] for i in members)
        for i in members:
            out[i] = float(num / den)
    return out, {i: float(v[0]) for i, v in rows.items()}


@pytest.mark.parametrize("estimator", ["rloo", "dr_grpo", "group_norm", "reinforce_baseline"])
@pytest.mark.parametrize(
    "tis_cap,weight,level",
    [
        (None, "tis", "token"),
        (1.1, "tis", "token"),
        (None, "seq_product", "token"),
        (1.1, "seq_product_truncated", "token"),
        (1.5, "seq_product", "seq_product"),  # VCPO's recipe: the loss weights each trajectory by min(product, C)
    ],
)
def test_advantages_use_the_optimal_baseline(estimator, tis_cap, weight, level):
    args = _args(estimator, tis_cap, weight, level)
    exps, norms = _batch()
    b, R = _expected_baselines(exps, norms, tis_cap, weight, level)
    maker = _maker(args)
    out, metrics = opob.replace_baseline(
        maker, exps, lambda e: RemoteExperienceMaker.compute_advantages_and_returns(maker, e), norms
    )
    assert args.algo.advantage.estimator == estimator and maker.advantage_estimator == estimator  # restored
    groups = {g: [R[i] for i in range(g * N, (g + 1) * N)] for g in range(2)}
    raw = {}  # per prompt-order index: the per-token advantage before any batch whitening
    for i in R:
        a = R[i] - b[i]
        if estimator == "group_norm":
            mean = sum(groups[i // N]) / N
            std = math.sqrt(sum((x - mean) ** 2 for x in groups[i // N]) / (N - 1))
            a = a / (std + 1e-9)
        raw[i] = a
    if estimator == "reinforce_baseline":  # upstream whitens over every response token of the batch
        tokens = [(raw[i], int(exp.action_mask[r].sum())) for exp in exps for r, i in enumerate(exp.index)]
        count = sum(n for _, n in tokens)
        mean = sum(a * n for a, n in tokens) / count
        std = math.sqrt(sum((a - mean) ** 2 * n for a, n in tokens) / count)
        raw = {i: (a - mean) / std for i, a in raw.items()}
    for exp in out:
        for r, i in enumerate(exp.index):
            m = exp.action_mask[r]
            expected = torch.full((int(m.sum()),), raw[i], dtype=torch.float64)
            torch.testing.assert_close(exp.advantages[r][m].double(), expected, rtol=1e-5, atol=1e-5)
            assert exp.rewards[r].item() == pytest.approx(R[i])  # the reward itself is kept
            assert exp.info["reward"][r].item() == pytest.approx(R[i])  # and so is the logged one
    assert metrics["opob/baseline"] == pytest.approx(sum(b.values()) / len(b), rel=1e-6)
    assert metrics["opob/grad_norm_rel_spread"] > 0


def test_an_untruncated_product_past_floats_range_gives_the_exact_baseline():
    """4,096-token responses whose log ratios add up to ±(hundreds to thousands): exp(Σ_t log π/μ) is inf or 0 in
    float64, yet b* (which depends only on the weights' ratios within a group) must come out as the exact
    decimal computation says, finite and different from the plain mean."""
    g = torch.Generator().manual_seed(3)
    exps = []
    for index in ([0, 1, 2, 3], [4, 5, 6, 7]):
        mu = -torch.rand(4, 4096, generator=g) * 2
        shift = torch.tensor([0.25, 0.2, -0.3, 0.22])[:, None]  # Σ_t: +1024, +819, -1229, +901 nats
        exps.append(
            Experience(
                action_mask=torch.ones(4, 4096, dtype=torch.bool),
                rewards=torch.rand(4, generator=g),
                kl=torch.zeros(4, 4096),
                action_log_probs=mu + shift + 0.01 * torch.randn(4, 4096, generator=g),
                rollout_log_probs=mu,
                index=index,
                info={"reward": None},
            )
        )
    for exp in exps:
        exp.info["reward"] = exp.rewards.clone()
    norms = [torch.rand(4, generator=g) * 5 + 0.1 for _ in exps]
    assert torch.isinf(torch.tensor(1024.0, dtype=torch.float64).exp())  # the product itself overflows float64
    b, R = _expected_baselines(exps, norms, None, "seq_product")
    args = _args("dr_grpo", None, "seq_product")
    maker = _maker(args)
    out, metrics = opob.replace_baseline(
        maker, exps, lambda e: RemoteExperienceMaker.compute_advantages_and_returns(maker, e), norms
    )
    for exp in out:
        for r, i in enumerate(exp.index):
            m = exp.action_mask[r]
            assert torch.isfinite(exp.advantages[r][m]).all()
            assert exp.advantages[r][m][0].item() == pytest.approx(R[i] - b[i], abs=1e-5)
    means = [sum(R[i] for i in range(k * N, (k + 1) * N)) / N for k in range(2)]
    assert abs(b[0] - means[0]) > 1e-3  # the weights moved b* away from the mean: the check above could fail


def test_equal_norms_and_weights_give_upstreams_advantages():
    """On-policy (μ = π_prox) with equal norms, OPOB is the group mean: Dr. GRPO's advantages come out unchanged."""
    exps, _ = _batch(1)
    for exp in exps:
        exp.rollout_log_probs = exp.action_log_probs.clone()
    norms = [torch.full((4,), 2.0) for _ in exps]
    args = _args("dr_grpo")
    maker = _maker(args)
    import copy

    reference = RemoteExperienceMaker.compute_advantages_and_returns(maker, copy.deepcopy(exps))
    out, _ = opob.replace_baseline(
        maker, exps, lambda e: RemoteExperienceMaker.compute_advantages_and_returns(maker, e), norms
    )
    for a, b in zip(out, reference):
        torch.testing.assert_close(a.advantages, b.advantages, rtol=1e-6, atol=1e-6)


def test_norms_ride_with_the_log_probs_and_come_back_in_upstreams_order():
    """The actor returns (B, A + 1); split_norms strips the column in upstream's flattened order, ring/TP copies
    counted once (what RemoteExperienceMaker._flatten_results reads)."""
    lp = [torch.randn(2, 3) for _ in range(4)]
    nrm = [torch.rand(2) for _ in range(4)]
    rows = [opob.with_norms(a, b) for a, b in zip(lp, nrm)]
    per_actor = [[rows[0], rows[1]], [rows[0], rows[1]], [rows[2], rows[3]], [rows[2], rows[3]]]  # duplicate 2
    stripped, norms = opob.split_norms(per_actor, duplicate_factor=2)
    assert [t.shape for t in stripped[0]] == [(2, 3), (2, 3)]
    torch.testing.assert_close(stripped[2][1], lp[3])
    assert len(norms) == 4
    for got, want in zip(norms, nrm):
        torch.testing.assert_close(got, want)


def test_the_hook_scores_the_actions_before_the_temperature_is_applied():
    """norms_captured on a real (tiny) HF forward, then the logits divided in place as upstream's Actor does:
    the norms equal those computed from the unscaled logits with the temperature."""
    from openrlhf_ess.models import opob as maths
    from tests.test_opob import _tiny_qwen2

    model = _tiny_qwen2().float()
    seq = torch.randint(0, 40, (2, 10))
    mask = torch.ones(2, 4)
    captured = {}
    h = model.lm_head.register_forward_hook(lambda m, i, o: captured.update(h=i[0].detach(), z=o.detach().clone()))
    with opob.norms_captured(model.lm_head, seq, mask, temperature=0.7) as out, torch.no_grad():
        logits = model(seq).logits
        logits.div_(0.7)  # upstream Actor.forward, in place
    h.remove()
    expected = maths.lm_head_sq_grad_norms(captured["h"][:, -5:-1], captured["z"][:, -5:-1], seq[:, -4:], mask, 0.7)
    assert len(out) == 1
    torch.testing.assert_close(out[0], expected)


def test_bypass_weighs_the_baseline_by_the_current_weights_log_probs():
    """--algo.prox_mode bypass: the experience's π_prox is μ, so without θ's log-probs every weight would be 1; with
    them the trajectory ratio is exp(Σ_t m_t (log π_θ − log μ)), written out here."""
    mu = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -4.0]])
    theta = torch.tensor([[-0.8, -2.5, -0.5], [-0.2, -0.1, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    exp = types.SimpleNamespace(action_log_probs=mu.clone(), rollout_log_probs=mu, action_mask=mask)
    algo = types.SimpleNamespace(
        advantage=types.SimpleNamespace(opob_weight="seq_product"), tis_cap=None, tis_level="token"
    )
    want = [(-0.8 + 1.0) + (-2.5 + 2.0), (-0.2 + 0.3) + (-0.1 + 0.7) + (-9.0 + 4.0)]
    assert opob.sequence_log_weights(exp, algo).tolist() == [0.0, 0.0]
    got = opob.sequence_log_weights(exp, algo, theta)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
