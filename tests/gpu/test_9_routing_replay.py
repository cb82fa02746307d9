"""Check 9: MoE routing replay's seam (``models/routing_replay.py``, --algo.routing_replay) with the device's MoE
kernels in bf16: a model's own routes replayed are bit-identical, other routes change the logits, the router keeps a
gradient; and the hook's cost on one Qwen3-30B-A3B decoder layer (the ratio a number to read, not a bound; asserted:
finite positive timings and ratio, and the timed layer replaying its own routes computing the plain function)."""

import contextlib
import math
import tempfile

import torch

from openrlhf_ess.models import routing_replay as seam
from openrlhf_ess.tiny.world_moe import FAMILIES, build_moe_model
from tests.gpu.conftest import expect


def _device(args):
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(0)
    return cuda, device, dtype


def test_replay_bitexact(check, args):
    cuda, device, dtype = _device(args)
    with check("9.replay_bitexact", "replaying a MoE model's own routes reproduces its forward bit for bit") as e:
        e["notes"].append(
            f"the tiny {', '.join(FAMILIES)} models of openrlhf_ess/tiny/world_moe.py, {dtype} on {device}: the "
            "routes the model chose itself, replayed, must give identical logits (the family's own gate rule with "
            "top-k replaced by a lookup); routes shifted by one expert must change them; the router must get a "
            "finite, nonzero gradient through the replayed gate weights"
        )
        for family in FAMILIES:
            with tempfile.TemporaryDirectory() as tmp:
                model, _ = build_moe_model(tmp, family=family, seed=0)
            model = model.to(device=device, dtype=dtype)
            ids = torch.randint(4, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
            ids = ids.to(device)
            with torch.no_grad(), seam.record_routes(model) as rec_own:
                plain = model(input_ids=ids).logits
            own = rec_own.routes.to(torch.uint8)
            with torch.no_grad(), seam.replay_routes(model, own):
                replayed = model(input_ids=ids).logits
            shifted = ((own.long() + 1) % model.config.num_experts).to(torch.uint8)
            with torch.no_grad(), seam.replay_routes(model, shifted):
                other = model(input_ids=ids).logits
            model.zero_grad(set_to_none=True)
            with seam.replay_routes(model, shifted):
                model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            grads = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
            diff = (replayed.float() - plain.float()).abs().max().item()
            moved = (other.float() - plain.float()).abs().max().item()
            e["numbers"][f"{family}_own_max_diff"] = diff
            e["numbers"][f"{family}_shifted_max_diff"] = moved
            expect(e, torch.equal(replayed, plain), f"{family}: own routes replayed changed the logits by {diff:.2e}")
            expect(e, moved > 0, f"{family}: shifted routes left the logits unchanged (replay not applied?)")
            expect(
                e,
                bool(grads)
                and all(g is not None and bool(torch.isfinite(g).all()) and g.abs().sum() > 0 for g in grads),
                f"{family}: a router got no finite nonzero gradient under replay",
            )
        e["summary"] = f"{', '.join(FAMILIES)}: own routes bit-identical, shifted routes change the logits"


def test_replay_cost(check, args):
    cuda, device, dtype = _device(args)
    with check("9.replay_cost", "the replay hook's share of a decoder layer's forward + backward") as e:
        from benchmarks import routing_replay as bench

        sizes = dict(bench.QWEN3_30B_A3B)
        tokens = 2048 if cuda else 32
        if not cuda:  # the host's copy of Qwen3-30B-A3B's layer (2.4 GB fp32) would be most of this check's time
            sizes.update(num_experts=16, moe_intermediate_size=128, intermediate_size=512)
        model = bench.build(device, dtype, sizes)
        m = bench.measure(model, tokens, repeats=5)
        p_med, r_med = m["off_s"], m["replay_s"]
        ratio = r_med / p_med if p_med > 0 else float("nan")
        e["numbers"].update(
            tokens=tokens,
            off_s=p_med,
            replay_s=r_med,
            ratio=ratio,
            saved_off_bytes=m["saved_off"],
            saved_replay_bytes=m["saved_replay"],
        )
        e["notes"].append(
            f"one Qwen3-MoE decoder layer ({sizes['num_experts']} experts, top-{sizes['num_experts_per_tok']}, "
            f"hidden {sizes['hidden_size']}, expert width {sizes['moe_intermediate_size']}), {tokens} tokens, "
            f"{dtype}, medians of 5 interleaved; the ratio is a number to read, not a bound "
            "(benchmarks/routing_replay.py); what is asserted: every timing finite and positive, the ratio finite "
            "and positive, autograd saving something both ways, and the timed layer replaying its own routes "
            "computing the plain forward and backward exactly (what makes the two timings comparable)"
        )
        times = m["plain"] + m["replayed"]
        expect(e, len(m["plain"]) == len(m["replayed"]) == 5, f"{len(m['plain'])}, {len(m['replayed'])} repeats")
        expect(e, all(math.isfinite(t) and t > 0 for t in times), f"timings not all finite and positive: {times}")
        expect(e, math.isfinite(ratio) and ratio > 0, f"cost ratio {ratio} not finite and positive")
        saved = [m["saved_off"], m["saved_replay"]]
        expect(e, min(saved) > 0, f"bytes saved for backward (off, replay): {saved}")
        # the function timed with the hook is the plain one: the layer's own routes replayed, logits and gradients
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
        ids = ids.to(device)
        with torch.no_grad(), seam.record_routes(model) as rec:
            model(input_ids=ids)
        routes = rec.routes.to(seam.route_dtype(model.config.num_experts))
        outs = {}
        for name, ctx in (("plain", contextlib.nullcontext()), ("replayed", seam.replay_routes(model, routes))):
            model.zero_grad(set_to_none=True)
            with ctx:
                logits = model(input_ids=ids).logits
            logits.float().mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            outs[name] = (logits.detach(), grads)
        (plain, g_plain), (replayed, g_replayed) = outs["plain"], outs["replayed"]
        diff = (replayed.float() - plain.float()).abs().max().item()
        bad = [n for n in g_plain if n not in g_replayed or not torch.equal(g_plain[n], g_replayed[n])]
        e["numbers"].update(own_routes_max_diff=diff, grads_compared=len(g_plain), grads_differing=bad[:5])
        expect(e, torch.equal(replayed, plain), f"own routes replayed changed the timed layer's logits by {diff:.2e}")
        expect(e, bool(g_plain) and not bad, f"own routes replayed changed the gradients of {bad[:5]}")
        e["summary"] = (
            f"forward+backward {p_med:.4f} s off, {r_med:.4f} s with replay ({ratio:.3f}x); own routes replayed: "
            f"logits and {len(g_plain)} gradients identical"
        )
    assert e["numbers"]["tokens"] == (2048 if cuda else 32) and e["numbers"]["ratio"] > 0, e["numbers"]
