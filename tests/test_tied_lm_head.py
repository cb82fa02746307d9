"""The reload sync with tied input and output embeddings (``tie_word_embeddings``): the engine's LM head must compute
with the trained weights.

A tied model's trainer sends no ``lm_head.weight`` (``named_parameters`` yields the shared parameter once, as the
embedding), and vLLM skips ``lm_head.*`` for a tied model anyway: its head shares the embedding's parameter. vLLM's
``reload_weights`` writes the new values into that parameter but never re-processes the head, and on the CPU backend
the head computes from a kernel handle packed at start-up, so the engine went on sampling from the trained body and
the pretrained head (``vllm_worker_wrap.refresh_tied_heads``). Here a real vLLM CPU engine (in a subprocess:
``python -m tests.test_tied_lm_head MODEL OUT``, vLLM keeps process-wide state) takes two syncs through the reload
path in several messages: the first with the refresh switched off, which reproduces the stale head (the test can see
the fault), the second as shipped. Its prompt log-probs are compared with HF's forward of the weights sent, and its
checksums as the sync check reads them. Tied Qwen2 by default; tied Qwen3 and Llama with ``-m slow``
(``openrlhf_ess.tiny.families``).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from openrlhf_ess.trainer import sync_check

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = [5, 17, 30, 41, 12, 9, 60, 33, 21, 8, 44, 3, 27]
BOUND = 16 << 10  # the tiny model (~0.4 MB) in dozens of messages, its larger tensors split


def _trained(folder: str, seed: int):
    """The tied model with every parameter moved (the embedding, hence the head, by 0.2 per element), and what a
    trainer's sync sends of it: its ``named_parameters``, the shared one once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def _hf_log_probs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0]


def main(folder: str, out: str) -> None:
    """The engine side: two syncs of :func:`_trained` weights (seeds 1 and 2) through the reload path, the first with
    ``refresh_tied_heads`` switched off; the engine's prompt log-probs of :data:`IDS` after each, written to ``out``.
    The engine's worker runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the switch reaches it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from openrlhf_ess.tiny.engine import tiny_engine
    from openrlhf_ess.trainer.ray import vllm_worker_wrap as wire
    from openrlhf_ess.trainer.ray.vllm_engine import WORKER_EXTENSION

    llm = tiny_engine(folder, "float32", worker_extension_cls=WORKER_EXTENSION)

    def engine_log_probs():
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        final = llm.generate(TokensPrompt(prompt_token_ids=IDS), params, use_tqdm=False)[0]
        return [step[t].logprob for step, t in zip(final.prompt_logprobs[1:], IDS[1:])]

    def sync(state):
        messages = list(wire.weight_messages(state.items(), BOUND))
        for blob, last in messages:
            llm.collective_rpc(
                "load_weights_from_safetensors" if last else "stage_weights_from_safetensors", args=(blob,)
            )
        llm.reset_prefix_cache()
        return len(messages)

    def checksums():  # what the worker reports to the trainer's sync check
        ((dtype, sums),) = llm.collective_rpc("weight_checksums")
        return {name: list(c) for name, c in sums.items()}

    result = {"start": engine_log_probs()}
    shipped = wire.refresh_tied_heads
    wire.refresh_tied_heads = lambda model: []  # the sync as it was: the head never re-processed
    try:
        result["messages"] = sync(_trained(folder, 1)[1])
        result["unrefreshed"], result["unrefreshed_sums"] = engine_log_probs(), checksums()
    finally:
        wire.refresh_tied_heads = shipped
    sync(_trained(folder, 2)[1])
    result["refreshed"], result["refreshed_sums"] = engine_log_probs(), checksums()
    result["heads"] = llm.collective_rpc(lambda self: wire.refresh_tied_heads(self.model_runner.model))
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize(
    "family",
    [
        "qwen2_tied",
        pytest.param("qwen3_tied", marks=pytest.mark.slow),
        pytest.param("llama_tied", marks=pytest.mark.slow),
    ],
)
def test_a_tied_lm_head_takes_the_trained_weights_on_a_real_engine(tmp_path, family):
    """fp32 engine and fp32 HF agree to ~1e-5 nats; the head left at the pretrained embedding is ~1 nat away."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from openrlhf_ess.tiny.families import build_family_model

    folder, out = str(tmp_path / "model"), tmp_path / "log_probs.json"
    build_family_model(folder, family)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    run = subprocess.run(
        [sys.executable, "-m", "tests.test_tied_lm_head", folder, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["messages"] > 1
    assert result["heads"] == [["lm_head"]]  # the worker finds the tied head

    pretrained = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert pretrained.lm_head.weight is pretrained.model.embed_tokens.weight
    assert (torch.tensor(result["start"]) - _hf_log_probs(pretrained)).abs().max().item() < 1e-4

    def body_and_head(seed, head):
        """HF's forward of the ``seed`` weights with the LM head replaced by ``head`` (untied)."""
        model, sent = _trained(folder, seed)
        assert "lm_head.weight" not in sent and "model.embed_tokens.weight" in sent  # what the trainer sends
        untied = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, tie_word_embeddings=False).eval()
        untied.load_state_dict(
            {**sent, "lm_head.weight": head if head is not None else sent["model.embed_tokens.weight"]}
        )
        return _hf_log_probs(untied)

    old_head = load_file(os.path.join(folder, "model.safetensors"))["model.embed_tokens.weight"]
    # the fault reproduced (refresh off): the engine is the trained body under the pretrained head
    unrefreshed = torch.tensor(result["unrefreshed"])
    assert (unrefreshed - body_and_head(1, old_head)).abs().max().item() < 1e-4
    assert (unrefreshed - body_and_head(1, None)).abs().max().item() > 0.1
    # as shipped: the engine computes the sent model, head included
    refreshed = torch.tensor(result["refreshed"])
    assert (refreshed - _hf_log_probs(_trained(folder, 2)[0])).abs().max().item() < 1e-4
    assert (refreshed - body_and_head(2, old_head)).abs().max().item() > 0.1

    # The sync check's view. The shared parameter holds the sent embedding either way, so its sums cannot tell; the
    # head's logits for one-hot hidden states (lm_head.weight[applied]) are the columns its kernel computes with.
    cols = sync_check.probe_columns(old_head.shape[1])
    for key, seed, head_source in (("unrefreshed_sums", 1, "pretrained"), ("refreshed_sums", 2, "sent")):
        theirs, sent = result[key], _trained(folder, seed)[1]["model.embed_tokens.weight"]
        assert _close(theirs["model.embed_tokens.weight"], _sums(sent))
        head = old_head if head_source == "pretrained" else sent
        assert _close(theirs["lm_head.weight[applied]"], _sums(head[:, cols])), key
        assert not _close(theirs["lm_head.weight[applied]"], _sums((sent if head is old_head else old_head)[:, cols]))
    # what the trainer's check makes of the stale head: named, at the first sync
    ours = sync_check.trainer_checksums(_trained(folder, 1)[1].items())
    ours["lm_head.weight[applied]"] = _sums(_trained(folder, 1)[1]["model.embed_tokens.weight"][:, cols])
    stale = {k: tuple(v) for k, v in result["unrefreshed_sums"].items()}
    assert sync_check.mismatched(ours, stale, sync_check.SAME_DTYPE_TOL)[0] == ["lm_head.weight[applied]"]


def _sums(t: torch.Tensor):
    """(Σx, Σx², n) in float64, written here independently of sync_check."""
    x = t.detach().double().reshape(-1)
    return float(x.sum()), float((x * x).sum()), x.numel()


def _close(a, b, tol: float = 1e-9) -> bool:
    """Both sums within ``tol`` of their scale (the vocabulary padding adds zeros, and n with them)."""
    scale = (b[2] * b[1]) ** 0.5
    return abs(a[0] - b[0]) <= tol * scale and abs(a[1] - b[1]) <= tol * b[1]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
