"""Per-tensor checksums of the weight-sync check, against hand-built fused tensors."""

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
