"""Per-tensor checksums of the weight-sync check, against hand-built fused tensors."""

import os

import pytest
import torch

from openrlhf_ess.trainer import sync_check


def _hf_layer(g):
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(4, 4, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(6, 4, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
    }


def _engine_layout(hf):
    """What vLLM holds: q/k/v and gate/up concatenated, the vocabulary zero-padded to 16 rows."""
    p = "model.layers.0."
    qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    embed = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(6, 4)])
    return {
        p + "self_attn.qkv_proj.weight": qkv,
        p + "mlp.gate_up_proj.weight": gate_up,
        "model.embed_tokens.weight": embed,
    }


def test_fused_and_padded_engine_tensors_match():
    hf = _hf_layer(torch.Generator().manual_seed(0))
    ours = sync_check.trainer_checksums(hf.items())
    theirs = {k: sync_check.checksum(v) for k, v in _engine_layout(hf).items()}
    bad, compared = sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)
    assert bad == [] and compared == 3


def test_one_small_change_is_named():
    hf = _hf_layer(torch.Generator().manual_seed(0))
    ours = sync_check.trainer_checksums(hf.items())
    engine = _engine_layout(hf)
    engine["model.layers.0.mlp.gate_up_proj.weight"][7, 2] += 1e-4
    theirs = {k: sync_check.checksum(v) for k, v in engine.items()}
    bad, _ = sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)
    assert bad == ["model.layers.0.mlp.gate_up_proj.weight"]


def test_cast_tolerance_accepts_bf16_rounding_but_not_noise():
    hf = _hf_layer(torch.Generator().manual_seed(1))
    ours = sync_check.trainer_checksums(hf.items())
    rounded = {k: v.to(torch.bfloat16) for k, v in _engine_layout(hf).items()}
    theirs = {k: sync_check.checksum(v) for k, v in rounded.items()}
    assert sync_check.mismatched(ours, theirs, sync_check.CAST_TOL)[0] == []
    assert sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)[0]  # the strict tolerance sees rounding
    noise = {k: sync_check.checksum(torch.randn_like(v.float())) for k, v in rounded.items()}
    assert len(sync_check.mismatched(ours, noise, sync_check.CAST_TOL)[0]) == 3


def test_names_on_one_side_only_are_not_compared():
    ours = {"lm_head.weight": (1.0, 1.0, 1)}
    assert sync_check.mismatched(ours, {"other": (5.0, 5.0, 1)}, 1e-9) == ([], 0)


def test_nan_weights_are_a_mismatch():
    ours = {"w": (1.0, 2.0, 4)}
    assert sync_check.mismatched(ours, {"w": (float("nan"), float("nan"), 4)}, 1e-2)[0] == ["w"]


# ---- issue 29, item 5: MoE experts, tensor-parallel engines, and how much a check compared


def test_moe_experts_are_compared_through_vllm_fused_names():
    """HF Qwen-MoE keeps one gate/up/down per expert; vLLM's FusedMoE stacks them into experts.w13_weight
    [E, 2I, H] and experts.w2_weight [E, H, I]. Built here by hand from the HF tensors, as vLLM's loader does."""
    g = torch.Generator().manual_seed(3)
    p = "model.layers.0.mlp."
    hf = {}
    for e in range(3):
        for proj, shape in (("gate_proj", (6, 4)), ("up_proj", (6, 4)), ("down_proj", (4, 6))):
            hf[f"{p}experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=g)
    hf[p + "gate.weight"] = torch.randn(3, 4, generator=g)  # the router: unfused
    w13 = torch.stack(
        [torch.cat([hf[f"{p}experts.{e}.gate_proj.weight"], hf[f"{p}experts.{e}.up_proj.weight"]]) for e in range(3)]
    )
    w2 = torch.stack([hf[f"{p}experts.{e}.down_proj.weight"] for e in range(3)])
    engine = {p + "experts.w13_weight": w13, p + "experts.w2_weight": w2, p + "gate.weight": hf[p + "gate.weight"]}
    ours = sync_check.trainer_checksums(hf.items())
    theirs = {k: sync_check.checksum(v) for k, v in engine.items()}
    assert sorted(ours) == sorted(engine)  # every expert tensor maps onto an engine name
    assert sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL) == ([], 3)
    assert sync_check.coverage(ours, theirs) == 1.0
    engine[p + "experts.w2_weight"][1, 2, 3] += 1e-3  # one expert's weight off by a little
    theirs = {k: sync_check.checksum(v) for k, v in engine.items()}
    assert sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)[0] == [p + "experts.w2_weight"]
    assert sync_check.engine_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"


def test_tensor_parallel_workers_merge_by_shard_or_replica():
    """TP 2, by hand: a row-sharded tensor (each worker half the rows), a vocabulary-sharded embedding padded to 16
    rows (8 per worker), and a replicated norm; a replica that differs between workers is named."""
    g = torch.Generator().manual_seed(4)
    attn, embed, norm = torch.randn(8, 4, generator=g), torch.randn(10, 4, generator=g), torch.randn(4, generator=g)
    trainer = {
        "attn": sync_check.checksum(attn),
        "embed": sync_check.checksum(embed),
        "norm": sync_check.checksum(norm),
    }
    padded = torch.cat([embed, torch.zeros(6, 4)])
    workers = [
        {
            "attn": sync_check.checksum(attn[:4]),
            "embed": sync_check.checksum(padded[:8]),
            "norm": sync_check.checksum(norm),
        },
        {
            "attn": sync_check.checksum(attn[4:]),
            "embed": sync_check.checksum(padded[8:]),
            "norm": sync_check.checksum(norm),
        },
    ]
    merged = sync_check.merge_tensor_parallel(workers, trainer)
    assert sorted(merged) == ["attn", "embed", "norm"] and merged["norm"] == trainer["norm"]
    assert merged["embed"][2] == 64 and merged["attn"][2] == 32  # n: padded vocabulary, whole tensor
    assert sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL) == ([], 3)
    workers[1]["norm"] = sync_check.checksum(norm + 1e-3)  # worker 1's replica missed the update
    merged = sync_check.merge_tensor_parallel(workers, trainer)
    assert sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL)[0] == ["norm"]


def test_coverage_counts_elements_not_names():
    trainer = {"big": (0.0, 1.0, 90), "small": (0.0, 1.0, 10)}
    assert sync_check.coverage(trainer, {"big": (0.0, 1.0, 90)}) == 0.9
    assert sync_check.coverage(trainer, {"other": (0.0, 1.0, 100)}) == 0.0


def test_expert_names_follow_the_engine_s_nesting():
    trainer = {"model.layers.1.mlp.experts.w13_weight": (1.0, 2.0, 3), "model.layers.1.mlp.gate.weight": (0.0, 1.0, 2)}
    engine = ["model.layers.1.mlp.experts.routed_experts.w13_weight", "model.layers.1.mlp.gate.weight"]
    aligned = sync_check.align_experts(trainer, engine)
    assert sorted(aligned) == sorted(engine)
    assert sync_check.align_experts(trainer, ["model.layers.1.mlp.experts.w13_weight"]) == trainer


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_moe_experts_are_compared_against_a_real_engines_names(tmp_path, family):
    """Issue 29 item 5, against a real vLLM engine rather than names read in its code: the tiny MoE model loaded by
    vLLM CPU (0.31) names its experts ``mlp.experts.routed_experts.w13_weight`` / ``w2_weight``, while transformers 5
    stores them fused as ``mlp.experts.gate_up_proj`` / ``down_proj`` (not the per-expert names of transformers 4,
    the only ones mapped before: no expert was compared). Every engine tensor with data is matched to the trainer's,
    equal; and one element of one expert changed on the trainer's side is named."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from openrlhf_ess.tiny.world_moe import build_moe_world

    model = build_moe_world(str(tmp_path / "world"), seed=0, n_prompts=8, family=family)["model"]
    out = tmp_path / "engine.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.engine_sums", model, str(out)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = {name: tuple(sums) for name, sums in json.loads(out.read_text()).items()}
    experts = sorted(n for n in theirs if ".experts." in n)
    assert len(experts) == 4 and all(n.endswith(("w13_weight", "w2_weight")) for n in experts), experts

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ours = sync_check.align_experts(sync_check.trainer_checksums(hf.named_parameters()), theirs)
    bad, compared = sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)
    assert bad == [] and compared == len(theirs), (bad, compared, sorted(set(theirs) - set(ours)))

    with torch.no_grad():
        dict(hf.named_parameters())["model.layers.1.mlp.experts.down_proj"].view(-1)[7] += 1e-3
    ours = sync_check.align_experts(sync_check.trainer_checksums(hf.named_parameters()), theirs)
    bad, _ = sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)
    assert bad == ["model.layers.1.mlp.experts.routed_experts.w2_weight"], bad
