"""A real DeepSpeed actor step (upstream's Actor and strategy) for ZeRO stages 0-3 on CPU."""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_actor(tiny_world, tmp_path, **kw):
    out = tmp_path / f"ds_{kw}.json".replace(" ", "").replace("'", "")
    cmd = [sys.executable, "-m", "tests.helpers.ds_actor", tiny_world["model"], tiny_world["prompts"], str(out)]
    for key, value in kw.items():
        cmd += [f"--{key}", str(value)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.bf16  # DeepSpeed's bf16 optimizer path at each stage, what GPU runs take
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_actor_step_each_zero_stage(tiny_world, tmp_path, zero_stage):
    res = run_actor(tiny_world, tmp_path, zero_stage=zero_stage, param_dtype="bf16", steps=3)
    assert all(math.isfinite(x) for x in res["losses"])
    assert res["after"] != res["before"]  # the optimizer changed the weights
    # maximising log-likelihood of a fixed batch at lr 1e-3: the NLL goes down
    assert res["losses"][-1] < res["losses"][0]
