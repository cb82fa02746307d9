"""M2PO (openrlhf_ess/models/m2po.py, trainer/m2po.py, the loss in models/loss.py), CPU.

Expected values come from a hand enumeration (dyadic numbers, exact in binary) or from brute-force references
written here: Algorithm 1 as a literal loop, and the code style's bound as a search over every candidate value.
"""

import random
import types

import numpy as np
import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()

from openrlhf.models.loss import PolicyLoss as UpstreamPolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer  # noqa: E402

from openrlhf_ess.models import m2po  # noqa: E402
from openrlhf_ess.models.loss import PolicyLoss  # noqa: E402
from openrlhf_ess.trainer import carried  # noqa: E402
from openrlhf_ess.trainer import m2po as m2po_trainer  # noqa: E402

# The hand batch, in batch order: (log r, A). Trust region: A > 0 and r > 1, or A < 0 and r < 1.
HAND = [
    (1.0, 1.0),  # t0 in, (log r)^2 = 1
    (0.5, 1.0),  # t1 in, 0.25
    (-0.25, -1.0),  # t2 in, 0.0625
    (2.0, -1.0),  # t3 out: A < 0, r > 1 (never masked, however large)
    (-3.0, 1.0),  # t4 out: A > 0, r < 1
    (1.5, 0.0),  # t5 out: A = 0
    (0.125, 1.0),  # t6 in, 0.015625
    (-0.5, -2.0),  # t7 in, 0.25 (ties t1)
]


def hand():
    log_r = torch.tensor([x for x, _ in HAND], dtype=torch.float64)
    adv = torch.tensor([a for _, a in HAND], dtype=torch.float64)
    return log_r, adv


def test_trust_region_by_hand():
    log_r, adv = hand()
    assert m2po.trust_region(log_r, adv).tolist() == [True, True, True, False, False, False, True, True]


@pytest.mark.parametrize(
    "tau,masked,after",
    [
        # trust region {1, .25, .25, .0625, .015625}: mean .315625 > tau; drop 1 -> .14453125; drop t1 (the earlier
        # of the tied .25) -> .109375 = 7/64
        (0.12, [0, 1], 0.109375),
        (0.109375, [0, 1], 0.109375),  # the mean equal to tau stops (<=)
        (0.1, [0, 1, 7], 0.0390625),  # one more: (.0625 + .015625) / 2
        (0.32, [], 0.315625),  # already within the budget
        (0.01, [0, 1, 2, 6, 7], 0.0),  # every trust-region token: the empty set's mean is 0
    ],
)
def test_paper_mask_by_hand(tau, masked, after):
    log_r, adv = hand()
    out, before, m2_after, n_trust = m2po.masked_by_budget(log_r, adv, tau)
    assert torch.nonzero(out).flatten().tolist() == masked
    assert before.item() == 0.315625  # over the 5 trust-region tokens, not the 8 valid ones (0.3925...)
    assert m2_after.item() == after
    assert n_trust.item() == 5


def algorithm_1(log_r, adv, tau):
    """Algorithm 1 of the paper as written: a loop, argmax taking the first of equal values in batch order."""
    m2 = [x * x for x in log_r]
    trust = [i for i, (x, a) in enumerate(zip(log_r, adv)) if (a > 0 and x > 0) or (a < 0 and x < 0)]
    masked = []
    while trust and sum(m2[i] for i in trust) / len(trust) > tau:
        j = max(trust, key=lambda i: (m2[i], -i))  # the largest; among equals the earliest
        masked.append(j)
        trust.remove(j)
    return sorted(masked)


@pytest.mark.parametrize("seed", range(40))
def test_paper_mask_matches_the_literal_algorithm(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 60)
    # values on a coarse grid so that ties are frequent; zeros in both A and log r
    log_r = [rng.choice([-1, 1, 0]) * rng.randint(0, 12) / 16 for _ in range(n)]
    adv = [rng.choice([-1.5, -1.0, 0.0, 0.5, 2.0]) for _ in range(n)]
    tau = rng.choice([0.01, 0.04, 0.1, 0.2])
    out, *_ = m2po.masked_by_budget(torch.tensor(log_r, dtype=torch.float64), torch.tensor(adv), tau)
    assert torch.nonzero(out).flatten().tolist() == algorithm_1(log_r, adv, tau)


def code_bound_reference(log_r, adv, tau):
    """The released code's bound by search: b^2 is the largest trust-region value v whose cap keeps
    sum(min(v_j, v)) < tau n (0 if none); no bound if the mean is already <= tau."""
    v = [x * x for x, a in zip(log_r, adv) if (a > 0 and x > 0) or (a < 0 and x < 0)]
    if not v or sum(v) / len(v) <= tau:
        return None
    fits = [c for c in v if sum(min(x, c) for x in v) < tau * len(v)]
    return max(fits) ** 0.5 if fits else 0.0


@pytest.mark.parametrize(
    "tau,bound,after",
    [
        # tau n = 0.6; capped at .0625: .015625 + 4 x .0625 = .265625 < .6; at .25: .828125 >= .6, so b^2 = .0625
        (0.12, 0.25, 0.265625 / 5),
        # tau n = .265625 exactly: the cap at .0625 reaches it (>=), so b^2 is the value below, .015625
        (0.053125, 0.125, 5 * 0.015625 / 5),
        (0.32, m2po.LOG_RATIO_CLAMP, 0.315625),  # within the budget: no bound
    ],
)
def test_code_bound_by_hand(tau, bound, after):
    log_r, adv = hand()
    b, before, m2_after, n_trust = m2po.code_clip_bound(log_r, adv, tau)
    assert b.item() == bound
    assert before.item() == 0.315625
    assert m2_after.item() == pytest.approx(after, rel=1e-15)
    assert n_trust.item() == 5


@pytest.mark.parametrize("seed", range(40))
def test_code_bound_matches_the_search(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 50)
    log_r = [rng.choice([-1, 1]) * rng.randint(0, 12) / 16 for _ in range(n)]
    adv = [rng.choice([-1.0, 0.0, 1.0]) for _ in range(n)]
    tau = rng.choice([0.01, 0.04, 0.1])
    bound, *_ = m2po.code_clip_bound(torch.tensor(log_r, dtype=torch.float64), torch.tensor(adv), tau)
    expected = code_bound_reference(log_r, adv, tau)
    assert bound.item() == (m2po.LOG_RATIO_CLAMP if expected is None else pytest.approx(expected, abs=0))


def test_tau_must_be_positive():
    log_r, adv = hand()
    for fn in (m2po.masked_by_budget, m2po.code_clip_bound):
        for tau in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="tau must be > 0"):
                fn(log_r, adv, tau)


# ---- one batch, split into 1, 2 and 4 micro-batches: the same mask ------------------------------------------------


def batch(seed=0, samples=8):
    """Samples (log pi_old, log mu, advantage per token), of different lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for s in range(samples):
        n = 3 + (5 * s) % 7
        mu = -torch.rand(n, generator=g, dtype=torch.float64) * 3
        old = mu + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
        adv = torch.full((n,), float(torch.randn(1, generator=g)))  # one advantage per sequence, as GRPO's
        rows.append((old, mu, adv))
    return rows


def micro_batches(rows, pieces):
    """``rows`` as ``pieces`` Experiences, each padded to its own width with garbage (the mask hides it)."""
    out = []
    size = len(rows) // pieces
    for p in range(pieces):
        part = rows[p * size : (p + 1) * size]
        width = max(len(r[0]) for r in part) + p  # a wider pad on later pieces
        exp = types.SimpleNamespace(
            action_mask=torch.zeros(len(part), width, dtype=torch.bool),
            action_log_probs=torch.full((len(part), width), 5.0),
            rollout_log_probs=torch.full((len(part), width), -7.0),
            advantages=torch.full((len(part), width), 3.0),
            sequences=torch.zeros(len(part), width + 2, dtype=torch.long),
            info={},
        )
        for b, (old, mu, adv) in enumerate(part):
            n = len(old)
            exp.action_mask[b, :n] = True
            exp.action_log_probs[b, :n], exp.rollout_log_probs[b, :n], exp.advantages[b, :n] = (
                old.float(),
                mu.float(),
                adv.float(),
            )
        out.append(exp)
    return out


def per_sample_keep(experiences):
    return [
        exp.m2po_keep[b, : int(exp.action_mask[b].sum())].tolist()
        for exp in experiences
        for b in range(len(exp.action_mask))
    ]


@pytest.mark.parametrize("style", ["paper", "code"])
def test_same_mask_for_1_2_and_4_micro_batches(style):
    rows = batch()
    results = []
    for pieces in (1, 2, 4):
        exps = micro_batches(rows, pieces)
        metrics = m2po_trainer.mark_batch(exps, 0.04, style)
        if style == "paper":
            results.append((per_sample_keep(exps), metrics))
        else:
            bounds = {float(v) for exp in exps for v in exp.info[m2po_trainer.CLIP_BOUND_KEY]}
            results.append((bounds, metrics))
    assert results[0] == results[1] == results[2]
    assert results[0][1]["m2po/masked_frac"] > 0  # the batch does cut something: the equality is not vacuous


def test_mark_batch_masks_what_algorithm_1_masks_on_the_whole_batch():
    rows = batch(seed=3)
    exps = micro_batches(rows, 4)
    metrics = m2po_trainer.mark_batch(exps, 0.04, "paper")
    log_r = [float(x) for old, mu, _ in rows for x in (old.float().double() - mu.float().double())]
    adv = [float(a) for _, _, advs in rows for a in advs.float()]
    expected = set(algorithm_1(log_r, adv, 0.04))
    flat_keep = [k for row in per_sample_keep(exps) for k in row]
    assert {i for i, k in enumerate(flat_keep) if not k} == expected
    assert metrics["m2po/masked_frac"] == len(expected) / len(log_r)
    trust = [x * x for x, a in zip(log_r, adv) if (a > 0 and x > 0) or (a < 0 and x < 0)]
    assert metrics["m2po/m2_before"] == pytest.approx(np.mean(trust), rel=1e-12)
    kept = [
        x * x
        for i, (x, a) in enumerate(zip(log_r, adv))
        if ((a > 0 and x > 0) or (a < 0 and x < 0)) and i not in expected
    ]
    assert metrics["m2po/m2_after"] == pytest.approx(np.mean(kept), rel=1e-12)
    assert metrics["m2po/m2_after"] <= 0.04 < metrics["m2po/m2_before"]


def test_mark_batch_refuses_missing_mu_and_nonfinite_log_ratios():
    exps = micro_batches(batch(), 2)
    exps[1].rollout_log_probs = None
    with pytest.raises(RuntimeError, match="came without rollout log-probs"):
        m2po_trainer.mark_batch(exps, 0.04, "paper")
    exps = micro_batches(batch(), 2)
    exps[0].rollout_log_probs[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="NaN/inf on 1 response tokens"):
        m2po_trainer.mark_batch(exps, 0.04, "paper")


# ---- the mask through the replay buffer, into the loss ----------------------------------------------------------


def test_keep_mask_survives_the_replay_buffer():
    exps = micro_batches(batch(), 1)
    m2po_trainer.mark_batch(exps, 0.04, "paper")
    src = exps[0]
    b, width = src.action_mask.shape
    exp = Experience(
        sequences=torch.arange(1, b * (width + 1) + 1).reshape(b, width + 1),
        attention_mask=torch.cat([torch.ones(b, 1, dtype=torch.long), src.action_mask.long()], 1),
        action_mask=src.action_mask,
        action_log_probs=src.action_log_probs,
        advantages=src.advantages,
        info={},
    )
    exp.m2po_keep = src.m2po_keep
    buffer = carried.adopt_replay_buffer(NaiveReplayBuffer(sample_batch_size=3, limit=0, cpu_offload=False))
    buffer.append(exp)
    collated = buffer.collate_fn(buffer.items[2:5])
    n = collated.action_mask.shape[1]
    for row, src_row in enumerate(range(2, 5)):
        valid = collated.action_mask[row]
        assert collated.m2po_keep[row][valid].tolist() == src.m2po_keep[src_row][src.action_mask[src_row]].tolist()
        assert collated.m2po_keep[row][~valid].all()  # padding: True, outside the loss anyway
    assert collated.m2po_keep.shape == (3, n)


def ours(style):
    return PolicyLoss.from_upstream(UpstreamPolicyLoss(), None, "token", style)


def test_paper_loss_by_hand_masked_tokens_count_in_the_normaliser():
    lp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[-1.5, -1.0, -0.5, 0.0]], dtype=torch.float64)
    old = lp.detach().clone()
    adv = torch.tensor([[2.0, -1.0, 1.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    keep = torch.tensor([[False, True, True, True]])
    loss_fn = ours("paper")
    loss_fn.m2po_keep = keep
    loss, cut, _, _, filtered = loss_fn(lp, old, adv, mask, mu)
    r = np.exp([0.5, -1.0, 0.0])
    expected = -(0 + r[1] * -1.0 + r[2] * 1.0) / 3  # 3 valid tokens, the masked one included
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert cut.item() == pytest.approx(1 / 3) and filtered.item() == pytest.approx(1 / 3)
    loss.backward()
    # d/d log pi of -M r A / N = -M r A / N
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -r[1] * -1.0 / 3, -r[2] * 1.0 / 3, 0.0], rel=1e-12)


def test_code_loss_by_hand_clips_the_ratio_to_mu():
    lp = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[-0.5, 0.5, -0.1, 0.5]], dtype=torch.float64)  # log r = .5, -.5, .1, -.5
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss_fn = ours("code")
    loss_fn.m2po_log_bound = torch.tensor(0.25)
    loss, cut, *_ = loss_fn(lp, lp.detach(), adv, mask, mu)
    e = np.exp
    # t0: A > 0, r = e^.5 > e^.25: clipped to e^.25; t1: A < 0, r = e^-.5 < e^-.25: clipped to e^-.25 (times -1);
    # t2: inside the bound; t3: A > 0 with r < 1: min keeps the unclipped r A
    per_token = [-e(0.25), e(-0.25), -e(0.1), -e(-0.5)]
    assert loss.item() == pytest.approx(sum(per_token) / 4, rel=1e-12)
    assert cut.item() == 0.5
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -e(0.1) / 4, -e(-0.5) / 4], rel=1e-12)


def test_the_loss_refuses_missing_mu():
    loss_fn = ours("paper")
    loss_fn.m2po_keep = torch.ones(1, 2, dtype=torch.bool)
    x = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match="rollout log-probs"):
        loss_fn(x, x, x, torch.ones(1, 2, dtype=torch.bool), None)


@pytest.mark.parametrize("style", ["paper", "code"])
def test_applied_sets_the_micro_batch_and_clears_it(style):
    exps = micro_batches(batch(), 1)
    m2po_trainer.mark_batch(exps, 0.04, style)
    loss_fn = ours(style)
    with m2po_trainer.applied(loss_fn, exps[0], style):
        if style == "paper":
            assert loss_fn.m2po_keep is exps[0].m2po_keep and loss_fn.m2po_log_bound is None
        else:
            assert loss_fn.m2po_keep is None
            assert loss_fn.m2po_log_bound.item() == exps[0].info[m2po_trainer.CLIP_BOUND_KEY][0].item()
    assert loss_fn.m2po_keep is None and loss_fn.m2po_log_bound is None


def test_applied_refuses_a_micro_batch_without_its_mask():
    exps = micro_batches(batch(), 1)
    with pytest.raises(RuntimeError, match="no M2PO mask"):
        with m2po_trainer.applied(ours("paper"), exps[0], "paper"):
            pass


# ---- the experience maker: after upstream's advantages, over the whole batch ------------------------------------


@pytest.mark.parametrize("style", ["paper", "code"])
def test_experience_maker_marks_the_batch_after_the_advantages(style):
    from openrlhf_ess.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    args = types.SimpleNamespace(
        algo=types.SimpleNamespace(
            advantage=types.SimpleNamespace(
                estimator="group_norm", gamma=1.0, lambd=1.0, no_std_norm=False, baseline="estimator"
            ),
            m2po_tau=0.04,
            m2po_style=style,
        ),
        rollout=types.SimpleNamespace(n_samples_per_prompt=4, max_new_tokens=6),
        reward=types.SimpleNamespace(clip_range=(-10, 10), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        data=types.SimpleNamespace(max_len=16),
    )
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy = types.SimpleNamespace(args=args)
    maker.args, maker.kl_ctl, maker.advantage_estimator = args, types.SimpleNamespace(value=0.0), "group_norm"
    maker.last_metrics = {"version_lag/mean": 0.0}
    g = torch.Generator().manual_seed(7)
    exps = []
    for index in ([3, 0, 5, 6], [1, 2, 7, 4]):
        mask = torch.zeros(4, 6, dtype=torch.bool)
        for row, length in enumerate(torch.randint(2, 7, (4,), generator=g).tolist()):
            mask[row, :length] = True
        mu = -torch.rand(4, 6, generator=g) * 2
        rewards = torch.rand(4, generator=g)
        exps.append(
            Experience(
                action_mask=mask,
                rewards=rewards,
                kl=torch.zeros(4, 6),
                action_log_probs=mu + 0.4 * torch.randn(4, 6, generator=g),
                rollout_log_probs=mu,
                sequences=torch.ones(4, 8, dtype=torch.long),
                index=index,
                info={"reward": rewards.clone()},
            )
        )
    exps = maker.compute_advantages_and_returns(exps)
    assert "version_lag/mean" in maker.last_metrics  # the batch's other metrics kept
    # the reference, on the advantages upstream computed (read back), the whole batch in order
    log_r, adv = [], []
    for exp in exps:
        valid = exp.action_mask
        log_r += (exp.action_log_probs.double() - exp.rollout_log_probs.double())[valid].tolist()
        adv += exp.advantages.double()[valid].tolist()
    if style == "paper":
        flat_keep = [k for exp in exps for k in exp.m2po_keep[exp.action_mask].tolist()]
        masked = algorithm_1(log_r, adv, 0.04)
        assert masked and {i for i, k in enumerate(flat_keep) if not k} == set(masked)
        assert maker.last_metrics["m2po/masked_frac"] == len(masked) / len(log_r)
    else:
        expected = code_bound_reference(log_r, adv, 0.04)
        assert expected is not None
        assert maker.last_metrics[m2po_trainer.CLIP_BOUND_KEY] == pytest.approx(expected, abs=1e-12)
        for exp in exps:
            assert exp.info[m2po_trainer.CLIP_BOUND_KEY].tolist() == [pytest.approx(expected, rel=1e-6)] * 4


def test_training_step_hands_the_loss_this_micro_batchs_mask():
    """``ActorPPOTrainer._training_step`` (the real method, a stand-in trainer): the upstream step it wraps calls the
    loss as upstream's does and gets M2PO's loss on this micro-batch's mask; the mask is cleared afterwards."""
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    exps = micro_batches(batch(seed=5), 2)
    m2po_trainer.mark_batch(exps, 0.04, "paper")
    exp = exps[1]
    assert not exp.m2po_keep[exp.action_mask].all()  # something is masked in this micro-batch
    loss_fn = ours("paper")
    seen = []

    def upstream_step(experience, kl_ctl, step, loss_batch_info):
        log_probs = experience.action_log_probs.double()  # pi_theta = pi_old at the step's forward
        loss, *_ = loss_fn(
            log_probs, log_probs, experience.advantages, experience.action_mask, experience.rollout_log_probs
        )
        seen.append(loss.item())
        return {"metrics": {}, "weights": {}}

    trainer = types.SimpleNamespace(m2po_style="paper", actor_loss_fn=loss_fn, _upstream_step=upstream_step)
    ActorPPOTrainer._training_step(trainer, exp, 0.0, 0)
    log_r = exp.action_log_probs.double() - exp.rollout_log_probs.double()
    valid, keep = exp.action_mask, exp.m2po_keep
    expected = -(torch.exp(log_r) * exp.advantages * (valid & keep)).sum() / valid.sum()
    assert seen == [pytest.approx(expected.item(), rel=1e-12)]
    assert loss_fn.m2po_keep is None


def check_m2po_run(log: str, scalars: dict, style: str, steps: int, tau: float) -> None:
    """What an M2PO run through the CLI logs, at every one of its ``steps``: the metrics come from the controller, the
    loss trains on the mask (the actors' cut fraction logged). Shared with the set-lag CLI run
    (tests/test_stale_lag.py), which takes the code style."""
    assert "the policy loss is M2PO's" in log
    before, after = scalars["train/m2po/m2_before"], scalars["train/m2po/m2_after"]
    assert len(before) == len(after) == len(scalars["train/policy_loss"]) == steps
    assert all(a[1] <= tau + 1e-12 for a in after), after
    frac = [v for _, v in scalars["train/m2po/masked_frac"]]
    assert all(0 <= f <= 1 for f in frac) and frac[-1] > 0, (frac, before, after)
    # the actors' per-micro-batch cut fraction, averaged over tokens, is the batch's (one step, every token once);
    # code style: the token whose |log r| is the bound b itself may round either way in the loss's float32
    tol = 1e-6 if style == "paper" else 0.01
    assert [v for _, v in scalars["train/ppo_clip_ratio"]] == pytest.approx(frac, abs=tol)
    if style == "code":
        bounds = [v for _, v in scalars["train/m2po/clip_log_bound"]]
        assert bounds[0] == m2po.LOG_RATIO_CLAMP and 0 <= bounds[-1] < 0.1, bounds  # step 1 within the budget


@pytest.mark.real_stack
@pytest.mark.stack
def test_m2po_run_through_the_cli(tiny_world, tmp_path):
    """The tiny async run (rollout 8 x 4 = one optimizer batch of 32) with M2PO as the paper describes it: the
    metrics come from the controller at every step, the loss trains on the mask (the run ends cleanly and logs the
    actors' cut fraction). Async: the second batch was sampled by the weights before the first step, so log
    pi_theta/mu is more than the engine's numerical mismatch there. The code style runs in the set-lag CLI run
    (tests/test_stale_lag.py), synchronous at a lag of up to 2 steps: the mask is computed by the same code for
    both styles, so one async run covers the async controller."""
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir) + ["--algo.m2po_tau", "1e-4", "--algo.m2po_style", "paper"]
    rc, log = run_cli(args + ["--train.async_enable"], run_dir)
    assert rc == 0 and "Traceback" not in log, log[-6000:]
    check_m2po_run(log, read_tensorboard(run_dir), "paper", steps=2, tau=1e-4)
