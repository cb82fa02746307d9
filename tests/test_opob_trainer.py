"""--algo.advantage.baseline opob in the trainer (openrlhf_ess/trainer/opob.py): upstream's real
compute_advantages_and_returns with its baseline replaced, checked per estimator against advantages written out
here from the definitions; the norms' round trip through the actor's forward result; the flags; a real run."""

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


def _args(estimator, tis_cap=None):
    return types.SimpleNamespace(
        algo=types.SimpleNamespace(
            advantage=types.SimpleNamespace(estimator=estimator, gamma=1.0, lambd=1.0, no_std_norm=False),
            ess_lr_weight="geo_mean",
            tis_cap=tis_cap,
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


def _expected_baselines(exps, norms, tis_cap=None):
    """{prompt-order index: b*} from the definition, with plain Python arithmetic."""
    rows = {}
    for exp, nrm in zip(exps, norms):
        for r, i in enumerate(exp.index):
            m = exp.action_mask[r].double()
            log_w = ((exp.action_log_probs[r].double() - exp.rollout_log_probs[r].double()) * m).sum() / m.sum()
            w = min(math.exp(log_w.item()), tis_cap) if tis_cap is not None else 1.0  # no IS in the loss: w = 1
            rows[i] = (exp.rewards[r].item(), w, nrm[r].item())
    out = {}
    for g in range(len(rows) // N):
        members = range(g * N, (g + 1) * N)
        num = sum(rows[i][1] ** 2 * rows[i][2] * rows[i][0] for i in members)
        den = sum(rows[i][1] ** 2 * rows[i][2] for i in members)
        for i in members:
            out[i] = num / den
    return out, {i: v[0] for i, v in rows.items()}


@pytest.mark.parametrize("estimator", ["rloo", "dr_grpo", "group_norm", "reinforce_baseline"])
@pytest.mark.parametrize("tis_cap", [None, 1.1])
def test_advantages_use_the_optimal_baseline(estimator, tis_cap):
    args = _args(estimator, tis_cap)
    exps, norms = _batch()
    b, R = _expected_baselines(exps, norms, tis_cap)
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
