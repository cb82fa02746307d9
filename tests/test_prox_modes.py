"""π_prox modes on a real DeepSpeed actor (fp32): each token scored with the weights of its version.

The helper keeps its own copy of the weights at versions 0, 1, 2 (the actor keeps snapshots through
the code under test); the reference here recomputes every token with HF from those copies.
"""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tiny_world, tmp_path, **kw):
    out = tmp_path / "prox.pt"
    cmd = [sys.executable, "-m", "tests.helpers.prox_snapshot", tiny_world["model"], tiny_world["prompts"], str(out)]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return torch.load(out)


def _hf_log_probs(model_dir, state, sequences, n_actions):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        lp = model(sequences).logits.float().log_softmax(-1)[:, :-1]
    return lp.gather(-1, sequences[:, 1:, None])[..., 0][:, -n_actions:]


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_snapshot_scores_each_token_with_its_version(tiny_world, tmp_path, zero_stage):
    res = _run(tiny_world, tmp_path, zero_stage=zero_stage, mode="snapshot")
    seqs, n, versions = res["sequences"], res["n_actions"], res["versions"]
    hf = {v: _hf_log_probs(tiny_world["model"], res["states"][v], seqs, n) for v in (0, 1, 2)}
    expected = res["current"].clone()  # untagged tokens (-1) keep the live weights' log-prob
    for v in (0, 1, 2):
        expected[versions == v] = hf[v][versions == v]
    assert (res["prox"] - expected).abs().max().item() < 1e-5
    # recompute (upstream) differs on the stale tokens: the versions really are distinguishable
    stale = (versions == 0) | (versions == 1)
    assert (res["current"][stale] - res["prox"][stale]).abs().min().item() > 1e-4
    assert (res["current"] - hf[2]).abs().max().item() < 1e-5  # the live weights are version 2
    m = res["metrics"]
    assert m["prox/extra_forwards"] == 2.0  # versions 0 and 1; version 2 is the live forward
    assert m["prox/host_memory_mb"] > 0 and m["prox/missing_version_tokens"] == 0


def test_ewma_scores_with_bias_corrected_average(tiny_world, tmp_path):
    res = _run(tiny_world, tmp_path, zero_stage=0, mode="ewma")
    steps = res["step_states"]
    assert len(steps) == 4  # 2 rollouts x 2 optimizer steps
    beta = 0.9  # --algo.prox_ewma_decay default
    # independent PPO-EWMA: avg_n = beta avg_{n-1} + (1 - beta) theta_n, avg_0 = 0; theta_hat = avg_n / (1 - beta^n)
    avg = {k: torch.zeros_like(v) for k, v in steps[0].items()}
    for state in steps:
        avg = {k: beta * avg[k] + (1 - beta) * state[k] for k in avg}
    theta_hat = {k: v / (1 - beta ** len(steps)) for k, v in avg.items()}
    hf = _hf_log_probs(tiny_world["model"], theta_hat, res["sequences"], res["n_actions"])
    assert (res["prox"] - hf).abs().max().item() < 1e-5
    assert (res["prox"] - res["current"]).abs().max().item() > 1e-4  # not the live weights
    assert res["metrics"]["prox/extra_forwards"] == 1.0
