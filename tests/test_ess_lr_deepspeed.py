"""ESS-guided LR scaling on the real DeepSpeed engine, ZeRO 0-3 x fp32/bf16 x grad accumulation 1/2.

For the fixed rollouts of tests/helpers/ess_ds.py the trajectory weights alternate 1 and 5, so by hand
Σw = 3n, Σw² = 13n, ρ = 9/13 and lr_scale = √(9/13) ≈ 0.83205. Four runs per configuration, one after the other
in one process (upstream's first; bit-identical to one process each, checked when this was introduced):
- ours with --algo.ess_lr_enable                 -> must equal upstream at lr × √(9/13), same LR schedule
- ours without it                                -> must be bit-identical to upstream at lr
- upstream ActorPPOTrainer at lr and at lr × scale
"""

import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 1e-3
SCALE = math.sqrt(9 / 13)  # hand-derived, see module docstring

FAST = [(0, "fp32", 1), (1, "bf16", 2), (2, "bf16", 1), (3, "fp32", 2)]
MATRIX = [(z, d, a) for z in range(4) for d in ("fp32", "bf16") for a in (1, 2)]


def _marked(cases):
    """The bf16 cases marked ``bf16``: the hook's place in DeepSpeed's bf16 optimizer wrapper, kept on every CPU."""
    return [pytest.param(*c, marks=pytest.mark.bf16) if c[1] == "bf16" else c for c in cases]


def _run_all(tiny_world, tmp_path, zero, dtype, accum, runs):
    """The variants ``runs`` = [(variant, lr), ...] one after the other in one process (tests/helpers/ess_ds.py
    ``--variants``: each a fresh model from the same checkpoint and seed): {(variant, lr): result}."""
    out = tmp_path / "ess_ds"
    entries = [f"{variant}@{lr!r}" for variant, lr in runs]
    cmd = [
        sys.executable,
        "-m",
        "tests.helpers.ess_ds",
        tiny_world["model"],
        tiny_world["prompts"],
        str(out),
        "--zero_stage",
        str(zero),
        "--param_dtype",
        dtype,
        "--accum",
        str(accum),
        "--variants",
        ",".join(entries),
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return {key: torch.load(f"{out}.{entry}.pt") for key, entry in zip(runs, entries)}


def _max_diff(a, b):
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def _check(tiny_world, tmp_path, zero, dtype, accum):
    # upstream's first, before anything of ours has trained in the process
    runs = [("upstream", LR), ("upstream", LR * SCALE), ("ours_off", LR), ("ours_on", LR)]
    up, up_scaled, off, on = _run_all(tiny_world, tmp_path, zero, dtype, accum, runs).values()

    # the scale the actor computed equals the hand-derived one
    for status in on["statuses"]:
        assert status["rho_ess"] == pytest.approx(9 / 13, abs=1e-6)  # inputs are fp32 log-probs
        assert status["lr_scale"] == pytest.approx(SCALE, abs=1e-6)
        assert status["actor_lr_effective"] == pytest.approx(status["actor_lr"] * SCALE, rel=1e-6)
    # default off: bit-identical to upstream
    assert all(torch.equal(off["params"][k], up["params"][k]) for k in up["params"])
    assert off["lrs"] == up["lrs"]
    # on: the update equals upstream's at the scaled LR, and differs from the unscaled one
    assert _max_diff(on, up_scaled) <= 1e-6, _max_diff(on, up_scaled)
    assert _max_diff(on, up) > 1e-5
    # the scheduler's sequence is unchanged (the unscaled LR was restored before it advanced)
    assert on["lrs"] == up["lrs"]
    assert len(set(on["lrs"])) == len(on["lrs"])  # cosine: the LR really moves every rollout


@pytest.mark.parametrize("zero,dtype,accum", _marked(FAST), ids=lambda v: str(v))
def test_ess_lr_on_deepspeed(tiny_world, tmp_path, zero, dtype, accum):
    _check(tiny_world, tmp_path, zero, dtype, accum)


@pytest.mark.slow
@pytest.mark.parametrize("zero,dtype,accum", _marked([c for c in MATRIX if c not in FAST]), ids=lambda v: str(v))
def test_ess_lr_on_deepspeed_full_matrix(tiny_world, tmp_path, zero, dtype, accum):
    _check(tiny_world, tmp_path, zero, dtype, accum)


# ---- the hook and the scale on their own (CPU, no DeepSpeed): failures must not leak a scaled LR ------------


class _FlakySGD(torch.optim.SGD):
    """SGD that records the LR each step runs at and raises once when told to (an OOM, a NaN check)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen, self.fail_next = [], False

    def step(self, closure=None):
        self.seen.append(self.param_groups[0]["lr"])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("step failed")
        return super().step(closure)


def _flaky_optimizer():
    from openrlhf_ess.trainer import ess_lr

    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    opt = _FlakySGD([param], lr=0.1)
    return opt, ess_lr.LrScaleHook(opt)


def test_lr_restored_when_step_raises_out_of_the_block():
    opt, hook = _flaky_optimizer()
    opt.fail_next = True
    with pytest.raises(RuntimeError, match="step failed"):
        with hook.applied(0.5):
            opt.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # the post-hook never ran; applied() restored it
    with hook.applied(0.5):
        opt.step()
    # both steps ran at 0.1 × 0.5 = 0.05; without the restore the second would run at 0.05 × 0.5 = 0.025
    assert opt.seen == pytest.approx([0.05, 0.05])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_lr_not_compounded_when_step_raises_inside_the_block():
    opt, hook = _flaky_optimizer()
    with hook.applied(0.5):
        opt.fail_next = True
        with pytest.raises(RuntimeError, match="step failed"):
            opt.step()
        opt.step()  # the caller caught it and goes on: the pre-hook must not save 0.05 as the "original"
    assert opt.seen == pytest.approx([0.05, 0.05])  # not [0.05, 0.025]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def _items(prox):
    """Replay-buffer items of two 3-token responses with μ = 0 and π_prox = ``prox``, left-padded by one."""
    from openrlhf.trainer.ppo_utils.experience import Experience, split_experience_batch

    exp = Experience(
        sequences=torch.zeros(2, 5, dtype=torch.long),
        action_mask=torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]]),
        attention_mask=torch.ones(2, 5, dtype=torch.long),
        action_log_probs=prox,
        rollout_log_probs=torch.zeros(2, 4),
    )
    return split_experience_batch(exp)


def test_finite_scale_by_hand():
    from openrlhf_ess.trainer import ess_lr

    log5 = math.log(5.0)
    scale, metrics = ess_lr.global_lr_scale(
        _items(torch.tensor([[0.0] * 4, [0.0] + [log5] * 3])), "geo_mean", "sqrt", 0.1
    )
    # w = [1, 5]: ρ = (Σw)² / (B Σw²) = 36 / (2·26) = 9/13, scale = √(9/13)
    assert scale == pytest.approx(SCALE, rel=1e-6) and metrics["rho_ess"] == pytest.approx(9 / 13, rel=1e-6)
    assert metrics["ess_lr_nonfinite"] == 0.0 and metrics["ess_lr_missing"] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_rho_falls_back_to_scale_one(bad, caplog):
    from openrlhf_ess.trainer import ess_lr

    prox = torch.zeros(2, 4)
    prox[0, 2] = bad  # a response token: log w_0 = bad/3, so log Σw and ρ = exp(2 log Σw − log Σw²)/B are NaN
    with caplog.at_level("WARNING", logger=ess_lr.__name__):
        scale, metrics = ess_lr.global_lr_scale(_items(prox), "geo_mean", "sqrt", 0.1)
    assert scale == 1.0 and metrics["lr_scale"] == 1.0
    assert metrics["ess_lr_nonfinite"] == 1.0 and metrics["ess_lr_missing"] == 0.0
    assert "not finite" in caplog.text and "rho=nan" in caplog.text
