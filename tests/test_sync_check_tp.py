"""The sync check against a real tensor-parallel vLLM CPU engine whose KV heads are replicated across its workers.

A Qwen2 layer with 4 query heads and 2 KV heads (head size 32, vLLM CPU's minimum) in a TP 4 engine: each KV head
sits on two workers. The engine (in a subprocess: ``python -m tests.test_sync_check_tp MODEL OUT``, vLLM keeps
process-wide state) takes new weights through the reload path, in several messages, and every worker reports its
checksums as the trainer's check asks for them; the test merges them against the trainer's sums of the weights it
sent.
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
TP = 4
ATTN = "model.layers.0.self_attn."


def _build_model(folder: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_ess.tiny.world import build_tokenizer

    tok = build_tokenizer(folder)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)


def _new_weights(folder: str):
    from safetensors.torch import load_file

    old = load_file(os.path.join(folder, "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    return {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in old.items()}


def main(folder: str, out: str) -> None:
    """The engine side: a TP 4 engine, new weights loaded through the reload path in 64 KiB messages, and every
    worker's ``weight_checksums`` (with replica counts), written to ``out``. The engine is shut down in any case."""
    from openrlhf_ess.tiny.engine import tiny_engine
    from openrlhf_ess.trainer.ray import vllm_worker_wrap as wire
    from openrlhf_ess.trainer.ray.vllm_engine import WORKER_EXTENSION

    llm = tiny_engine(
        folder,
        "float32",
        worker_extension_cls=WORKER_EXTENSION,
        tensor_parallel_size=TP,
        distributed_executor_backend="mp",
    )
    try:
        messages = list(wire.weight_messages(_new_weights(folder).items(), 64 << 10))
        for blob, last in messages:
            llm.collective_rpc(
                "load_weights_from_safetensors" if last else "stage_weights_from_safetensors", args=(blob,)
            )
        workers = llm.collective_rpc("weight_checksums", args=(True,))
        with open(out, "w") as f:
            json.dump({"messages": len(messages), "workers": workers}, f)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tp_above_the_kv_head_count_on_a_real_engine(tmp_path):
    """Identical weights pass through the real layout (before: every KV part counted twice); the workers report the
    KV parts replicated on 2 ranks each; a one-element change of a KV bias on the trainer's side is named."""
    folder, out = str(tmp_path / "model"), tmp_path / "sums.json"
    _build_model(folder)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    run = subprocess.run(
        [sys.executable, "-m", "tests.test_sync_check_tp", folder, str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["messages"] > 1
    workers = [({k: tuple(v) for k, v in sums.items()}, replicas) for _, sums, replicas in result["workers"]]
    assert len(workers) == TP
    assert all(r[f"{ATTN}qkv_proj.bias[k]"] == 2 and r[f"{ATTN}qkv_proj.bias[q]"] == 1 for _, r in workers)

    sent = _new_weights(folder)
    trainer = sync_check.trainer_checksums(sent.items())
    sums, replicas = [s for s, _ in workers], [r for _, r in workers]
    merged = sync_check.merge_tensor_parallel(sums, trainer, replicas)
    bad, compared = sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL)
    assert bad == [] and compared == len(sums[0]) and compared >= 10, (bad, compared, sorted(sums[0]))
    assert f"{ATTN}qkv_proj.bias[v]" in merged and f"{ATTN}qkv_proj.weight[k]" in merged  # loaded, then repacked

    by_count = sync_check.merge_tensor_parallel(sums, trainer)  # without the workers' replica counts
    assert sorted(sync_check.mismatched(trainer, by_count, sync_check.SAME_DTYPE_TOL)[0]) == [
        f"{ATTN}qkv_proj.bias[k]",
        f"{ATTN}qkv_proj.bias[v]",
    ]

    sent[f"{ATTN}k_proj.bias"][40] += 1e-4  # KV head 1, on ranks 2 and 3
    changed = sync_check.trainer_checksums(sent.items())
    assert sync_check.mismatched(changed, merged, sync_check.SAME_DTYPE_TOL)[0] == [f"{ATTN}qkv_proj.bias[k]"]


if __name__ == "__main__":
    main(*sys.argv[1:3])
