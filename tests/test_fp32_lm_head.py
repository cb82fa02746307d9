"""--vllm.fp32_lm_head: vLLM's own fp32 LM head in the engines, and its start-up check.

The flag's pre-flight rejections are rows of docs/bad_inputs.md (tests/test_config.py); the real actor's
start-up check runs in tests/test_e2e_cli.py::test_async_partial_run_with_all_corrections; the mismatch it
removes (or not) is measured by benchmarks/mismatch_sources.py (docs/mismatch_sources.md)."""

import json
import os
import subprocess
import sys

import pytest

from openrlhf_ess.cli import train_ppo_ray as cli
from openrlhf_ess.trainer.engine_contract import EngineContractError, check_lm_head_contract
from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs
from tests.test_config import _base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flag_reaches_the_engine_kwargs_and_off_is_upstream(tiny_world):
    on = engine_kwargs(cli.parse_args(_base(tiny_world) + ["--vllm.fp32_lm_head"])[0])
    off = engine_kwargs(cli.parse_args(_base(tiny_world))[0])
    assert on.pop("fp32_lm_head") is True
    assert on == off and "fp32_lm_head" not in off and "hf_overrides" not in off


@pytest.mark.parametrize(
    "per_worker",
    [[["torch.bfloat16"]], [["torch.float32"], ["torch.bfloat16"]], [[]], []],
    ids=["bf16", "one-worker-bf16", "no-logits-processor", "no-worker"],
)
def test_contract_refuses_any_worker_without_an_fp32_head(per_worker):
    with pytest.raises(EngineContractError, match="--vllm.fp32_lm_head.*Fix:"):
        check_lm_head_contract(per_worker)


def test_contract_accepts_fp32_heads():
    check_lm_head_contract([["torch.float32"], ["torch.float32", "torch.float32"]])


def _engine_heads(model, tmp_path, fp32_head):
    out = tmp_path / f"heads_{fp32_head}.json"
    cmd = [sys.executable, "-m", "benchmarks.mismatch_sources", "--engine-worker", model, str(out)]
    cmd += ["--max-tokens", "2"]
    run = subprocess.run(
        cmd + (["--fp32-head"] if fp32_head else []),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())["head_dtypes"]


@pytest.mark.slow
@pytest.mark.bf16
def test_real_bf16_engine_honours_the_override(tiny_world, tmp_path):
    """vLLM CPU 0.31 in bf16: hf_overrides head_dtype=float32 makes its LogitsProcessor fp32; without it, bf16.
    (The default suite covers the same through the CLI's engine actor in the e2e run.)"""
    assert _engine_heads(tiny_world["model"], tmp_path, True) == ["torch.float32"]
    assert _engine_heads(tiny_world["model"], tmp_path, False) == ["torch.bfloat16"]
