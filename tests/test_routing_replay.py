"""MoE routing replay (openrlhf_ess.models.routing_replay) on tiny Qwen2-MoE / Qwen3-MoE models, CPU fp32.

The expected values of a replayed MoE block are computed here from the checkpoint's own tensors
(safetensors, per-expert gate/up/down matrices) in float64, with the gate rule written out by hand;
nothing in the expected path goes through the seam under test. The slow test runs the real vLLM CPU
engine, records its expert ids with a hook on vLLM's router, and replays them in HF.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from openrlhf_ess.models.routing_replay import (
    disagree_frac,
    moe_layers,
    record_routes,
    replay_routes,
    require_supported,
    route_bytes_per_token,
    route_dtype,
    supported,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ["qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def moe_world(request, tmp_path_factory):
    from openrlhf_ess.tiny.world_moe import build_moe_world

    return build_moe_world(str(tmp_path_factory.mktemp(request.param)), seed=0, n_prompts=4, family=request.param)


def _load(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _batch(model_dir):
    """Two right-padded prompts, [2, S] ids and mask."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(["ab12 = 7x9q", "hello ="], return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def _block_input(model, input_ids, attention_mask, layer=0):
    """[B, S, H] input of decoder layer ``layer``'s MoE block in a plain forward (a torch hook, not the seam)."""
    seen = {}
    handle = model.model.layers[layer].mlp.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask)
    handle.remove()
    return seen["x"].detach()


def _manual_block(model_dir, layer, x, expert_ids, router_weight=None):
    """Reference MoE block in float64 from the safetensors file: y = Σ_{e ∈ ids} g_e·Expert_e(x) (+ shared).

    g = softmax(x W_rᵀ) gathered at ids, divided by its sum iff config.norm_topk_prob;
    Expert_e(x) = W_down,e (silu(W_gate,e x) ⊙ W_up,e x); Qwen2-MoE adds sigmoid(x w_sg) · Shared(x).
    ``router_weight`` overrides W_r (a leaf, to differentiate the reference).
    """
    from safetensors.torch import load_file

    w = load_file(os.path.join(model_dir, "model.safetensors"))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    p = f"model.layers.{layer}.mlp."
    x = x.reshape(-1, x.shape[-1]).double()
    w_r = w[p + "gate.weight"].double() if router_weight is None else router_weight
    probs = torch.softmax(x @ w_r.T, dim=-1)
    g = probs.gather(-1, expert_ids)
    if config["norm_topk_prob"]:
        g = g / g.sum(-1, keepdim=True)

    def mlp(prefix, v):
        gate, up, down = (w[f"{prefix}{n}_proj.weight"].double() for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(v @ gate.T) * (v @ up.T)) @ down.T

    y = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[n, j])
            y[n] += g[n, j] * mlp(f"{p}experts.{e}.", x[n])
    if config["model_type"] == "qwen2_moe":
        y = y + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].double().T) * mlp(p + "shared_expert.", x)
    return y


def _own_top_k(model_dir, layer, x, k):
    """The router's own choice, by hand: top-k of x W_rᵀ (float64)."""
    from safetensors.torch import load_file

    w_r = load_file(os.path.join(model_dir, "model.safetensors"))[f"model.layers.{layer}.mlp.gate.weight"].double()
    return (x.reshape(-1, x.shape[-1]).double() @ w_r.T).topk(k, dim=-1).indices


def test_replaying_own_routes_is_bit_identical(moe_world):
    model = _load(moe_world["model"])
    ids, mask = _batch(moe_world["model"])
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with record_routes(model) as rec:
            model(input_ids=ids, attention_mask=mask)
        own = rec.routes
        assert own.shape == (*ids.shape, 2, 2)
        with replay_routes(model, own.to(torch.uint8)):
            replayed = model(input_ids=ids, attention_mask=mask).logits
        # 255 in uint8 = "no route recorded": every token falls back to the model's own top-k.
        with replay_routes(model, torch.full_like(own, 255, dtype=torch.uint8)):
            sentinel = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(replayed, plain)
    assert torch.equal(sentinel, plain)
    # The recorded routes are the router's top-k, checked by hand on layer 0.
    x0 = _block_input(model, ids, mask)
    hand = _own_top_k(moe_world["model"], 0, x0, 2)
    assert torch.equal(own[:, :, 0].reshape(-1, 2).sort(-1).values, hand.sort(-1).values)


def _bottom_k_routes(model_dir, model, ids, mask):
    """Routes [B, S, 2, 2]: layer 0 = each token's two LEAST likely experts (disjoint from its top-2 of 4), as
    int16; layer 1 = -1 (no route: own top-k). Returns routes and layer 0's block input."""
    x0 = _block_input(model, ids, mask)
    from safetensors.torch import load_file

    w_r = load_file(os.path.join(model_dir, "model.safetensors"))["model.layers.0.mlp.gate.weight"].double()
    bottom = (x0.reshape(-1, x0.shape[-1]).double() @ w_r.T).topk(2, dim=-1, largest=False).indices
    routes = torch.full((*ids.shape, 2, 2), -1, dtype=torch.int16)
    routes[:, :, 0] = bottom.reshape(*ids.shape, 2).to(torch.int16)
    return routes, x0


def test_replaying_a_hand_route_equals_the_hand_computed_block(moe_world):
    model_dir = moe_world["model"]
    model = _load(model_dir)
    ids, mask = _batch(model_dir)
    routes, x0 = _bottom_k_routes(model_dir, model, ids, mask)
    chosen = routes[:, :, 0].reshape(-1, 2).long()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        plain_block = block(x0)
        plain_logits = model(input_ids=ids, attention_mask=mask).logits
        with replay_routes(model, routes):
            replayed_block = block(x0)
            replayed_logits = model(input_ids=ids, attention_mask=mask).logits
    expected = _manual_block(model_dir, 0, x0, chosen).reshape(x0.shape)
    # fp32 model vs float64 reference on O(0.1) activations: agreement to ~1e-7; 1e-5 leaves rounding room.
    torch.testing.assert_close(replayed_block.double(), expected, rtol=0, atol=1e-5)
    # The plain block is the reference with the router's own top-2, and the hand route changes it.
    own = _manual_block(model_dir, 0, x0, _own_top_k(model_dir, 0, x0, 2)).reshape(x0.shape)
    torch.testing.assert_close(plain_block.double(), own, rtol=0, atol=1e-5)
    assert (replayed_block - plain_block).abs().max() > 1e-3
    assert (replayed_logits - plain_logits).abs().max() > 1e-3


def test_gradient_reaches_the_router_and_matches_the_hand_gradient(moe_world):
    model_dir = moe_world["model"]
    model = _load(model_dir)
    ids, mask = _batch(model_dir)
    routes, x0 = _bottom_k_routes(model_dir, model, ids, mask)
    chosen = routes[:, :, 0].reshape(-1, 2).long()
    probe = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    router = model.model.layers[0].mlp.gate
    with replay_routes(model, routes):
        (model.model.layers[0].mlp(x0) * probe).sum().backward()
    # Same loss on the float64 reference, differentiated w.r.t. its own copy of W_r.
    from safetensors.torch import load_file

    w_r = load_file(os.path.join(model_dir, "model.safetensors"))["model.layers.0.mlp.gate.weight"].double()
    w_r.requires_grad_(True)
    reference = _manual_block(model_dir, 0, x0, chosen, router_weight=w_r)
    (reference * probe.double().reshape(reference.shape)).sum().backward()
    assert router.weight.grad.abs().max() > 1e-4
    torch.testing.assert_close(router.weight.grad.double(), w_r.grad, rtol=1e-4, atol=1e-6)

    # Whole model under replay (routes on both layers): every router gets a gradient.
    model.zero_grad()
    with torch.no_grad(), record_routes(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    with replay_routes(model, rec.routes):
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.log_softmax(-1)[..., 5].sum().backward()
    for layer in moe_layers(model):
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().max() > 0


def test_disagree_frac_by_hand():
    # B=1, S=3, L=2, k=2.
    trainer = torch.tensor([[[[0, 1], [0, 1]], [[2, 3], [0, 1]], [[1, 2], [0, 1]]]])
    engine = torch.tensor([[[[1, 0], [0, 2]], [[2, 3], [0, 1]], [[1, 3], [3, 2]]]], dtype=torch.uint8)
    # Layer 0: tokens 0 ({0,1} vs {1,0}: same set) and 1 agree, token 2 differs -> 1/3.
    # Layer 1: token 0 ({0,1} vs {0,2}) and token 2 differ -> 2/3.   Mean: (1/3 + 2/3) / 2 = 0.5.
    assert disagree_frac(trainer, engine, torch.ones(1, 3, dtype=torch.bool)).item() == pytest.approx(0.5)
    # Mask out token 2: layer 0 -> 0/2, layer 1 -> 1/2; mean 0.25.
    assert disagree_frac(trainer, engine, torch.tensor([[1, 1, 0]])).item() == pytest.approx(0.25)
    assert disagree_frac(trainer, engine, torch.zeros(1, 3)).item() == 0.0


def test_route_storage_rule():
    # 48 layers x top-8 x 1 byte (Qwen3-30B-A3B: 128 experts) = 384; DeepSeek-V3: 61 x 8, 256 experts -> uint8.
    assert route_bytes_per_token(48, 8, 128) == 384
    assert route_bytes_per_token(61, 8, 256) == 488
    assert route_bytes_per_token(10, 2, 300) == 40  # int16
    assert route_dtype(256) == torch.uint8 and route_dtype(257) == torch.int16


def test_dense_model_is_rejected_with_the_flag_and_model_type(tmp_path):
    from transformers import Qwen2ForCausalLM

    from openrlhf_ess.tiny.world import build_model

    build_model(str(tmp_path / "dense"))
    model = Qwen2ForCausalLM.from_pretrained(str(tmp_path / "dense"))
    assert not supported(model) and not supported(model.config)
    with pytest.raises(ValueError, match=r"--algo\.routing_replay.*qwen2_moe, qwen3_moe.*'qwen2'"):
        require_supported(model.config)
    with pytest.raises(ValueError, match="'qwen2'"):
        with replay_routes(model, torch.zeros(1, 1, 2, 2, dtype=torch.uint8)):
            pass


def _in_memory(model_type, **extra):
    """A tiny randomly initialised model of another family (no checkpoint needed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab_size=40, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    shape.update(num_key_value_heads=2, num_experts_per_tok=2)
    config = AutoConfig.for_model(model_type, **{**shape, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.normal_(0.0, 0.125)
    return model


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("mixtral", {"num_local_experts": 4}),
        ("olmoe", {"num_experts": 4, "norm_topk_prob": True}),
        ("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [0], "num_hidden_layers": 3}),
    ],
)
def test_other_families_and_decoder_layer_layout(model_type, extra):
    model = _in_memory(model_type, **extra)
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with record_routes(model) as rec:
            model(input_ids=ids)
        own = rec.routes
        layers = moe_layers(model)
        # vLLM's layout has one row per decoder layer; dense layers' rows (here garbage 0s) are ignored.
        full = torch.zeros(*ids.shape, model.config.num_hidden_layers, 2, dtype=torch.long)
        full[:, :, [layer.layer_idx for layer in layers]] = own
        with replay_routes(model, full):
            replayed = model(input_ids=ids).logits
        flipped = own.clone()
        flipped[:, :, 0] = (own[:, :, 0] + 1) % 4  # a different expert pair for every token of the first MoE layer
        with replay_routes(model, flipped):
            changed = model(input_ids=ids).logits
    assert torch.equal(replayed, plain)
    assert (changed - plain).abs().max() > 1e-4
    if "mlp_only_layers" in extra:
        assert [layer.layer_idx for layer in layers] == [1, 2]


def _engine_routes(model_dir: str, out: str) -> None:
    """Subprocess body of the slow test: generate with the vLLM CPU engine (fp32, in-process engine core) and record
    each forwarded token's expert ids with a hook on vLLM's router (``BaseRouter.set_capture_fn``, the hook vLLM's
    own RoutedExpertsCapturer uses). One request at a time, so a step's rows are that request's tokens; prefix
    caching off, so every token goes through the routers."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    captured = []  # (decoder layer id, topk_ids [tokens in step, k]) in call order

    def install(model):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        layer_ids = []
        for module in model.modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                lid = module.layer_id
                router.set_capture_fn(lambda ids, lid=lid: captured.append((lid, ids.detach().clone())))
                layer_ids.append(lid)
        return layer_ids

    llm = LLM(
        model=model_dir,
        dtype="float32",
        seed=0,
        max_model_len=64,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_logprobs=1,
        logprobs_mode="processed_logprobs",
    )
    (layer_ids,) = llm.apply_model(install)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for i, text in enumerate(["ab12 =", "hello world =", "x ="]):
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        captured.clear()
        params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=i, ignore_eos=True)
        sample = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
        routes = torch.stack([torch.cat([ids for lid, ids in captured if lid == want]) for want in layer_ids], dim=1)
        rows.append(
            {
                "prompt": prompt,
                "response": list(sample.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)],
                "routes": routes.tolist(),  # [P + G - 1, L, k]: the last sampled token is never forwarded
            }
        )
    with open(out, "w") as f:
        json.dump({"layer_ids": layer_ids, "rows": rows}, f)


@pytest.mark.slow
def test_vllm_cpu_engine_routes_match_hf_and_replay_keeps_logprobs(moe_world, tmp_path):
    out = tmp_path / "engine.json"
    code = f"from tests.test_routing_replay import _engine_routes as f; f({moe_world['model']!r}, {str(out)!r})"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    engine = json.loads(out.read_text())
    assert engine["layer_ids"] == [0, 1]
    model = _load(moe_world["model"])
    for row in engine["rows"]:
        n_prompt, n_resp = len(row["prompt"]), len(row["response"])
        forwarded = torch.tensor(row["routes"])
        assert forwarded.shape == (n_prompt + n_resp - 1, 2, 2)
        ids = torch.tensor([row["prompt"] + row["response"]])
        routes = torch.full((1, n_prompt + n_resp, 2, 2), 255, dtype=torch.uint8)  # last token: no route
        routes[0, :-1] = forwarded.to(torch.uint8)
        with torch.no_grad():
            with record_routes(model) as rec:
                plain = model(input_ids=ids).logits
            with replay_routes(model, routes):
                replayed = model(input_ids=ids).logits
        mask = torch.ones(1, n_prompt + n_resp, dtype=torch.bool)
        mask[0, -1] = False
        # fp32 engine and fp32 HF: same experts for every forwarded token and layer.
        assert disagree_frac(rec.routes, routes, mask).item() == 0.0
        assert torch.equal(replayed, plain)
        resp = torch.tensor(row["response"])
        hf = replayed[0, n_prompt - 1 : -1].log_softmax(-1).gather(-1, resp[:, None])[:, 0]
        # Measured gap ~5e-7 (fp32 kernels differ in summation order); 1e-4 is far below any routing flip's effect.
        torch.testing.assert_close(hf, torch.tensor(row["logprobs"]), rtol=0, atol=1e-4)
