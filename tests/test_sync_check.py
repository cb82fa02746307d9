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


def _engine_sums(layout):
    """What the engine reports of that layout: ``qkv_proj`` by its q, k and v rows (8, 4 and 4 here), the rest
    whole."""
    out = {}
    for name, t in layout.items():
        if "qkv_proj" in name:
            for part, rows in zip("qkv", (t[:8], t[8:12], t[12:])):
                out[f"{name}[{part}]"] = sync_check.checksum(rows)
        else:
            out[name] = sync_check.checksum(t)
    return out


def test_fused_and_padded_engine_tensors_match():
    hf = _hf_layer(torch.Generator().manual_seed(0))
    ours = sync_check.trainer_checksums(hf.items())
    theirs = _engine_sums(_engine_layout(hf))
    bad, compared = sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)
    assert bad == [] and compared == 5
    assert (
        sync_check.engine_name("model.layers.0.self_attn.k_proj.bias") == "model.layers.0.self_attn.qkv_proj.bias[k]"
    )


def test_a_whole_qkv_on_one_side_is_compared_with_the_sum_of_the_other_s_parts():
    """A checkpoint that stores qkv_proj fused (Phi-3), or an engine whose qkv_proj could not be split: the parts
    on the other side fold into the whole."""
    hf = _hf_layer(torch.Generator().manual_seed(0))
    ours = sync_check.trainer_checksums(hf.items())
    whole = {k: sync_check.checksum(v) for k, v in _engine_layout(hf).items()}
    mine = sync_check.fold_parts(ours, whole)
    assert sync_check.mismatched(mine, whole, sync_check.SAME_DTYPE_TOL) == ([], 3)
    phi3 = {k: v for k, v in hf.items() if "self_attn" not in k}
    phi3["model.layers.0.self_attn.qkv_proj.weight"] = _engine_layout(hf)["model.layers.0.self_attn.qkv_proj.weight"]
    ours = sync_check.trainer_checksums(phi3.items())
    theirs = sync_check.fold_parts(_engine_sums(_engine_layout(hf)), ours)
    assert sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL) == ([], 3)
    hf["model.layers.0.self_attn.v_proj.weight"][1, 1] += 1e-4
    theirs = sync_check.fold_parts(_engine_sums(_engine_layout(hf)), ours)
    assert sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)[0] == [
        "model.layers.0.self_attn.qkv_proj.weight"
    ]


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
    theirs = _engine_sums(rounded)
    assert sync_check.mismatched(ours, theirs, sync_check.CAST_TOL)[0] == []
    assert sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)[0]  # the strict tolerance sees rounding
    noise = _engine_sums({k: torch.randn_like(v.float()) for k, v in rounded.items()})
    assert len(sync_check.mismatched(ours, noise, sync_check.CAST_TOL)[0]) == 5


def test_names_on_one_side_only_are_not_compared():
    ours = {"lm_head.weight": (1.0, 1.0, 1)}
    assert sync_check.mismatched(ours, {"other": (5.0, 5.0, 1)}, 1e-9) == ([], 0)


def test_nan_weights_are_a_mismatch():
    ours = {"w": (1.0, 2.0, 4)}
    assert sync_check.mismatched(ours, {"w": (float("nan"), float("nan"), 4)}, 1e-2)[0] == ["w"]


# ---- MoE experts, tensor-parallel engines, and how much a check compared


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


@pytest.mark.engine
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_moe_experts_are_compared_against_a_real_engines_names(tmp_path, family):
    """Against a real vLLM engine rather than names read in its code: the tiny MoE model loaded by
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
    theirs = {name: tuple(sums) for name, sums in json.loads(out.read_text())["plain"].items()}
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


@pytest.mark.engine
def test_an_engine_never_synced_reports_its_repacked_weights_from_its_checkpoint(tiny_world, tmp_path):
    """An engine that replaced a dead or hung one before the run's first sync holds the weights vLLM loaded at its
    start; vLLM CPU repacks its dense linears into 0-element placeholders, so their sums must come from what the
    loader received, and no sync has recorded that (the check after such a replacement once failed on coverage,
    13%). A real engine: its plain sums lack every linear; with its model config, as the worker has it, every
    trainer tensor is covered and equal, q's sum equal to the float64 sum of HF's own q_proj, and one element
    changed on the trainer's side is named."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    model, out = tiny_world["model"], tmp_path / "engine.json"
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.engine_sums", model, str(out), "float32"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    plain, start = ({n: tuple(v) for n, v in got[k].items()} for k in ("plain", "start"))
    assert any(n.endswith("qkv_proj.weight") for n in got["emptied"]), got["emptied"]  # vLLM CPU repacked them

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ours = sync_check.trainer_checksums(hf.named_parameters())
    assert sync_check.coverage(ours, plain) < 0.95  # the failure: the linears missing
    assert sync_check.coverage(ours, start) == 1.0, sorted(set(ours) - set(start))
    bad, compared = sync_check.mismatched(ours, start, sync_check.SAME_DTYPE_TOL)
    assert bad == [] and compared == len(ours), bad
    q = dict(hf.named_parameters())["model.layers.0.self_attn.q_proj.weight"].detach().double()
    s, ss, n = start["model.layers.0.self_attn.qkv_proj.weight[q]"]
    assert (
        n == q.numel() and s == pytest.approx(q.sum().item(), rel=1e-12) and ss == pytest.approx((q * q).sum().item())
    )

    with torch.no_grad():
        dict(hf.named_parameters())["model.layers.1.mlp.down_proj.weight"].view(-1)[3] += 1e-3
    bad, _ = sync_check.mismatched(sync_check.trainer_checksums(hf.named_parameters()), start, 1e-9)
    assert bad == ["model.layers.1.mlp.down_proj.weight"], bad


def test_a_worker_reports_the_checkpoint_only_until_weights_reach_it(monkeypatch):
    """The checkpoint's sums stand for the repacked weights only while no weight has reached the engine: a broadcast
    sync (upstream's ``update_weight``, per tensor) or CUDA IPC load marks them gone, and a ``reload`` sync's own
    record (``_loaded_checksums``) always wins."""
    from types import SimpleNamespace

    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap as Upstream

    from openrlhf_ess.trainer.ray import vllm_worker_wrap

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight = torch.nn.Parameter(torch.empty(0))  # emptied, as vLLM CPU leaves a repacked linear
    calls = []
    monkeypatch.setattr(vllm_worker_wrap, "checkpoint_files", lambda model, revision=None: ["ckpt.safetensors"])
    monkeypatch.setattr(
        sync_check,
        "checkpoint_checksums",
        lambda files, names, dtype: calls.append(list(names)) or {"weight": (1, 1, 4)},
    )
    monkeypatch.setattr(Upstream, "update_weight", lambda self, *a, **k: "loaded", raising=False)
    worker = vllm_worker_wrap.WorkerWrap.__new__(vllm_worker_wrap.WorkerWrap)
    worker.model_runner = SimpleNamespace(model=model, model_config=SimpleNamespace(model="m", dtype=torch.float32))
    assert vllm_worker_wrap.received_checksums(worker, model) == {"weight": (1, 1, 4)} and calls == [["weight"]]
    assert vllm_worker_wrap.received_checksums(worker, model) == {"weight": (1, 1, 4)} and len(calls) == 1  # read once
    assert worker.update_weight("weight", "float32", [2, 2]) == "loaded"
    assert vllm_worker_wrap.received_checksums(worker, model) == {}
    worker._loaded_checksums = {"weight": (2, 2, 4)}
    assert vllm_worker_wrap.received_checksums(worker, model) == {"weight": (2, 2, 4)}


# ---- tensor parallelism with KV heads replicated across workers
#
# vLLM's QKVParallelLinear splits the query heads over the TP ranks; with more ranks than KV heads each KV head is
# held by several ranks. Below, the TP workers' shards are cut by hand from a full q/k/v and placed in modules that
# carry the attributes vLLM's layer has; the worker's own ``engine_checksums`` reports them, and the trainer merges.

HIDDEN, HEAD = 4, 2
ATTN = "model.layers.0.self_attn."


def _worker_rows(w: int, tp: int, heads: int, kv_heads: int):
    """The query and KV heads TP rank ``w`` holds: query heads in ``tp`` equal runs; KV heads in ``tp`` equal runs
    when there are at least as many, else rank ``w`` holds KV head ``floor(w * kv_heads / tp)`` (consecutive ranks
    share one)."""
    q = range(w * heads // tp, (w + 1) * heads // tp)
    kv = range(w * kv_heads // tp, (w + 1) * kv_heads // tp) if tp <= kv_heads else [w * kv_heads // tp]
    return list(q), list(kv)


def _rows(t: torch.Tensor, heads):
    return torch.cat([t[h * HEAD : (h + 1) * HEAD] for h in heads])


class _QKVLayer(torch.nn.Module):
    """A worker's ``qkv_proj``: its [q; k; v] rows, with the attributes vLLM's QKVParallelLinear carries."""

    def __init__(self, weight, bias, heads, kv_heads, tp):
        super().__init__()
        self.num_heads, self.head_size, self.tp_size = heads // tp, HEAD, tp
        self.num_kv_heads, self.num_kv_head_replicas = max(1, kv_heads // tp), max(1, tp // kv_heads)
        self.weight, self.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
        self.weight.output_dim = self.bias.output_dim = 0  # as vLLM sets on its linear parameters


def _engine_model(qkv_proj: torch.nn.Module) -> torch.nn.Module:
    root, layer = torch.nn.Module(), torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = qkv_proj
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    return root


def _hf_attention(heads: int, kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for part, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        out[f"{ATTN}{part}_proj.weight"] = torch.randn(n * HEAD, HIDDEN, generator=g)
        out[f"{ATTN}{part}_proj.bias"] = torch.randn(n * HEAD, generator=g)
    return out


def _tp_workers(hf, heads: int, kv_heads: int, tp: int):
    """Each TP worker's (sums, replicas), from the worker's own ``engine_checksums`` over its hand-cut shard."""
    workers = []
    for w in range(tp):
        q_heads, kv = _worker_rows(w, tp, heads, kv_heads)
        shard = {
            kind: torch.cat(
                [
                    _rows(hf[f"{ATTN}q_proj.{kind}"], q_heads),
                    _rows(hf[f"{ATTN}k_proj.{kind}"], kv),
                    _rows(hf[f"{ATTN}v_proj.{kind}"], kv),
                ]
            )
            for kind in ("weight", "bias")
        }
        model = _engine_model(_QKVLayer(shard["weight"], shard["bias"], heads, kv_heads, tp))
        workers.append(sync_check.engine_checksums(model, tp))
    return workers


LAYOUTS = [(8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 2, 8), (8, 1, 4)]  # (heads, kv_heads, tp): tp <, =, > kv_heads


@pytest.mark.parametrize("heads,kv_heads,tp", LAYOUTS)
def test_qkv_merges_across_tp_workers_whatever_the_kv_replication(heads, kv_heads, tp):
    """Identical weights pass at TP below, equal to and above the KV-head count (Qwen2.5-0.5B: 2 KV heads at TP 4
    failed before: its summed k and v counted each head twice); a one-element change is named."""
    hf = _hf_attention(heads, kv_heads)
    trainer = sync_check.trainer_checksums(hf.items())
    assert sorted(trainer) == sorted(f"{ATTN}qkv_proj.{k}[{p}]" for k in ("weight", "bias") for p in "qkv")
    workers = _tp_workers(hf, heads, kv_heads, tp)
    sums, replicas = [w for w, _ in workers], [r for _, r in workers]
    merged = sync_check.merge_tensor_parallel(sums, trainer, replicas)
    assert sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL) == ([], 6)
    assert all(merged[name][2] == trainer[name][2] for name in trainer)  # every element counted once

    hf[f"{ATTN}k_proj.weight"][HEAD * kv_heads - 1, 3] += 1e-4  # the last KV head, on the trainer's side
    changed = sync_check.trainer_checksums(hf.items())
    assert sync_check.mismatched(changed, merged, sync_check.SAME_DTYPE_TOL)[0] == [f"{ATTN}qkv_proj.weight[k]"]
    hf[f"{ATTN}k_proj.weight"][HEAD * kv_heads - 1, 3] -= 1e-4
    hf[f"{ATTN}q_proj.bias"][0] += 1e-4
    changed = sync_check.trainer_checksums(hf.items())
    assert sync_check.mismatched(changed, merged, sync_check.SAME_DTYPE_TOL)[0] == [f"{ATTN}qkv_proj.bias[q]"]


@pytest.mark.parametrize("heads,kv_heads,tp", [lay for lay in LAYOUTS if lay[2] > lay[1]])
def test_a_kv_replica_that_missed_the_update_is_named(heads, kv_heads, tp):
    """With replicated KV heads, one worker's copy of a head differs from its twin's: the merge names the tensor
    (the replicas are compared, not just counted once)."""
    hf = _hf_attention(heads, kv_heads)
    trainer = sync_check.trainer_checksums(hf.items())
    workers = _tp_workers(hf, heads, kv_heads, tp)
    stale = dict(hf)
    stale[f"{ATTN}v_proj.bias"] = hf[f"{ATTN}v_proj.bias"].clone()
    stale[f"{ATTN}v_proj.bias"][0] += 1e-4  # KV head 0, held by ranks 0 .. tp/kv_heads - 1; rank 1 keeps it stale
    workers[1] = _tp_workers(stale, heads, kv_heads, tp)[1]
    merged = sync_check.merge_tensor_parallel([w for w, _ in workers], trainer, [r for _, r in workers])
    assert sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL)[0] == [f"{ATTN}qkv_proj.bias[v]"]


def test_summing_replicated_kv_shards_fails_identical_weights():
    """The failure the replica count removes: the same shards merged by element count alone (every worker's k
    smaller than the trainer's, so taken for a shard and summed) count each KV head twice at TP 4 with 2 KV heads."""
    hf = _hf_attention(8, 2)
    trainer = sync_check.trainer_checksums(hf.items())
    workers = _tp_workers(hf, 8, 2, 4)
    merged = sync_check.merge_tensor_parallel([w for w, _ in workers], trainer)
    assert sorted(sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL)[0]) == sorted(
        f"{ATTN}qkv_proj.{k}[{p}]" for k in ("weight", "bias") for p in "kv"
    )


class _VocabShard(torch.nn.Module):
    """A worker's vocabulary-parallel embedding: its rows of the padded vocabulary, with vLLM's attributes."""

    def __init__(self, rows, tp):
        super().__init__()
        self.num_embeddings_per_partition, self.tp_size = rows.shape[0], tp
        self.weight = torch.nn.Parameter(rows)


def test_a_small_padded_vocabulary_is_summed_not_taken_for_a_replica():
    """A 10-token vocabulary padded to 64 rows at TP 2: each worker's 32 rows outnumber the trainer's 10, which the
    element count alone reads as a replica (and the two halves then disagree); the worker says it is a shard."""
    embed = torch.randn(10, 4, generator=torch.Generator().manual_seed(5))
    padded = torch.cat([embed, torch.zeros(54, 4)])
    trainer = {"model.embed_tokens.weight": sync_check.checksum(embed)}
    workers = []
    for w in range(2):
        root = torch.nn.Module()
        root.model = torch.nn.Module()
        root.model.embed_tokens = _VocabShard(padded[w * 32 : (w + 1) * 32].clone(), 2)
        workers.append(sync_check.engine_checksums(root, 2))
    merged = sync_check.merge_tensor_parallel([w for w, _ in workers], trainer, [r for _, r in workers])
    assert sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL) == ([], 1)
    by_count = sync_check.merge_tensor_parallel([w for w, _ in workers], trainer)
    assert sync_check.mismatched(trainer, by_count, sync_check.SAME_DTYPE_TOL)[0] == ["model.embed_tokens.weight"]


def test_repacked_qkv_is_reported_by_what_each_worker_loaded():
    """vLLM CPU empties its dense linears after loading; each TP worker then reports the sums of the whole tensors
    its loader received (``_loaded_checksums``), the same on every worker: merged once, not tp times."""
    heads, kv_heads, tp = 8, 2, 4
    hf = _hf_attention(heads, kv_heads)
    trainer = sync_check.trainer_checksums(hf.items())
    workers = []
    for _ in range(tp):
        layer = _QKVLayer(torch.zeros(0, HIDDEN), torch.zeros(0), heads, kv_heads, tp)  # repacked away
        workers.append(sync_check.engine_checksums(_engine_model(layer), tp, loaded=trainer))
    assert sorted(workers[0][0]) == sorted(trainer)
    merged = sync_check.merge_tensor_parallel([w for w, _ in workers], trainer, [r for _, r in workers])
    assert sync_check.mismatched(trainer, merged, sync_check.SAME_DTYPE_TOL) == ([], 6)


# ---- a tied LM head, checked by what it computes
#
# vLLM ties its head by registering the embedding's parameter on it; on its CPU backend the head computes the logits
# from a kernel handle packed from that weight. Below, a head whose "kernel" holds its own copy of the weight (the
# packed handle), sharded over the vocabulary like vLLM's, against the trainer's embedding.


class _Kernel:
    """``quant_method`` of a head: computes x @ Wᵀ from the copy of W it packed (``pack``), not from the parameter."""

    def pack(self, layer):
        layer.packed = layer.weight.detach().clone()

    def apply(self, layer, x, bias=None):
        return x @ layer.packed.t()


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter, tp: int):
        super().__init__()
        self.weight, self.tp_size, self.num_embeddings_per_partition = weight, tp, weight.shape[0]
        self.quant_method = _Kernel()
        self.quant_method.pack(self)


def _tied_engine(shard: torch.Tensor, tp: int):
    """A worker's model: ``model.embed_tokens`` and ``lm_head`` registering one parameter (its vocabulary shard)."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.embed_tokens = torch.nn.Module()
    root.model.embed_tokens.weight = torch.nn.Parameter(shard.clone())
    root.model.embed_tokens.num_embeddings_per_partition = shard.shape[0]
    root.lm_head = _Head(root.model.embed_tokens.weight, tp)
    return root


def _tied_trainer_sums(embedding: torch.Tensor):
    """What the trainer reports of a tied model: the embedding once, and its probe columns as the head's (by hand:
    the float64 sums of the chosen columns)."""
    ours = sync_check.trainer_checksums([("model.embed_tokens.weight", embedding)])
    cols = embedding[:, sync_check.probe_columns(embedding.shape[1])].double()
    ours["lm_head.weight[applied]"] = (cols.sum().item(), (cols * cols).sum().item(), cols.numel())
    return ours


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stale_tied_head_is_named_though_its_parameter_holds_the_new_weights(tp):
    """The trainer's embedding (10 tokens, padded to 12, hidden 16) is loaded into the shared parameter; the head's
    kernel still holds the old one. The parameter's sums match, the head's applied columns do not, and only they are
    named; once the kernel is repacked (vLLM's processing re-run), everything matches."""
    g = torch.Generator().manual_seed(0)
    old, new = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g)
    padded = lambda t: torch.cat([t, torch.zeros(2, 16)])  # noqa: E731
    models = [_tied_engine(padded(old).chunk(tp)[w], tp) for w in range(tp)]
    for model, shard in zip(models, padded(new).chunk(tp)):
        model.model.embed_tokens.weight.data.copy_(shard)  # the reload: through the embedding, into the shared tensor
    assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in models)
    ours = _tied_trainer_sums(new)

    def check():
        workers = [sync_check.engine_checksums(m, tp, tied_heads=["lm_head"]) for m in models]
        if tp == 1:
            theirs = workers[0][0]
        else:
            theirs = sync_check.merge_tensor_parallel([s for s, _ in workers], ours, [r for _, r in workers])
        return sync_check.mismatched(ours, theirs, sync_check.SAME_DTYPE_TOL)

    assert check() == (["lm_head.weight[applied]"], 2)
    for m in models:
        m.lm_head.quant_method.pack(m.lm_head)
    assert check() == ([], 2)


def test_the_applied_columns_are_the_weight_s_columns_exactly_in_bf16():
    """One-hot hidden states make the head's logits its weight's columns with no rounding, in bf16 as in fp32, so the
    comparison keeps the same-dtype tolerance."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    head = _Head(torch.nn.Parameter(w), 1)
    cols = w[:, sync_check.probe_columns(64)].double()
    s, ss, n = sync_check.applied_head_checksum(head)
    assert (s, ss, n) == (cols.sum().item(), (cols * cols).sum().item(), cols.numel())
    assert sync_check.probe_columns(64) == [0, 9, 18, 27, 36, 45, 54, 63] and sync_check.probe_columns(3) == [0, 1, 2]


def test_tied_head_finds_an_hf_model_s_shared_embedding_and_nothing_when_untied():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    tied = Qwen2ForCausalLM(Qwen2Config(**cfg, tie_word_embeddings=True))
    name, weight = sync_check.tied_head(tied)
    assert name == "lm_head" and weight is tied.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())  # the trainer sends the shared tensor once
    assert sync_check.tied_head(Qwen2ForCausalLM(Qwen2Config(**cfg, tie_word_embeddings=False))) is None
    assert sync_check.tied_head(torch.nn.Linear(2, 2)) is None
