"""The tiny model in a real vLLM (CPU) engine: sampled-token log-probs equal HF's in fp32."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_logprobs(model, prompt_ids, token_ids, temperature):
    seq = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def test_vllm_and_hf_agree_in_fp32(tiny_world, tmp_path):
    out = tmp_path / "samples.json"
    temperature = 0.8
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.helpers.vllm_sample",
            tiny_world["model"],
            str(out),
            "--temperature",
            str(temperature),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_world["model"], dtype=torch.float32).eval()
    max_diff, n_tokens = 0.0, 0
    for row in rows:
        assert len(row["token_ids"]) > 0
        hf = _hf_logprobs(model, row["prompt_ids"], row["token_ids"], temperature)
        vllm_lp = torch.tensor(row["logprobs"])
        max_diff = max(max_diff, (hf - vllm_lp).abs().max().item())
        n_tokens += len(row["token_ids"])
        # Without the temperature the numbers must NOT match: the engine reports the sampled distribution.
        untempered = _hf_logprobs(model, row["prompt_ids"], row["token_ids"], 1.0)
        assert (untempered - vllm_lp).abs().max().item() > 1e-3
    assert n_tokens >= 30
    assert max_diff < 1e-4, f"max |logprob_vllm - logprob_hf| = {max_diff:.2e} over {n_tokens} tokens"
