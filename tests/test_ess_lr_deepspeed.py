"""ESS-guided LR scaling on the real DeepSpeed engine, ZeRO 0-3 x fp32/bf16 x grad accumulation 1/2.

For the fixed rollouts of tests/helpers/ess_ds.py the trajectory weights alternate 1 and 5, so by hand
Σw = 3n, Σw² = 13n, ρ = 9/13 and lr_scale = √(9/13) ≈ 0.83205. Three runs per configuration:
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 1e-3
SCALE = math.sqrt(9 / 13)  # hand-derived, see module docstring

FAST = [(0, "fp32", 1), (1, "bf16", 2), (2, "bf16", 1), (3, "fp32", 2)]
MATRIX = [(z, d, a) for z in range(4) for d in ("fp32", "bf16") for a in (1, 2)]


def _run(tiny_world, tmp_path, zero, dtype, accum, variant, lr=LR):
    out = tmp_path / f"{variant}_{lr}.pt"
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
        "--variant",
        variant,
        "--lr",
        repr(lr),
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return torch.load(out)


def _max_diff(a, b):
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def _check(tiny_world, tmp_path, zero, dtype, accum):
    on = _run(tiny_world, tmp_path, zero, dtype, accum, "ours_on")
    off = _run(tiny_world, tmp_path, zero, dtype, accum, "ours_off")
    up = _run(tiny_world, tmp_path, zero, dtype, accum, "upstream")
    up_scaled = _run(tiny_world, tmp_path, zero, dtype, accum, "upstream", lr=LR * SCALE)

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


@pytest.mark.parametrize("zero,dtype,accum", FAST, ids=lambda v: str(v))
def test_ess_lr_on_deepspeed(tiny_world, tmp_path, zero, dtype, accum):
    _check(tiny_world, tmp_path, zero, dtype, accum)


@pytest.mark.slow
@pytest.mark.parametrize("zero,dtype,accum", [c for c in MATRIX if c not in FAST], ids=lambda v: str(v))
def test_ess_lr_on_deepspeed_full_matrix(tiny_world, tmp_path, zero, dtype, accum):
    _check(tiny_world, tmp_path, zero, dtype, accum)
