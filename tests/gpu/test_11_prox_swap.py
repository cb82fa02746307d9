"""Check 11: the π_prox weight swap (``prox.swapped_weights``, ``ProxSources.grouped_forwards``, docs/prox_modes.md):
this machine's host -> device copy rate, pinned and pageable (the swap's cost per byte), and a snapshot
make-experience grouped by version on a 1 GiB bf16 model: each stale version swapped in once (bytes = distinct
stale versions × stored bytes), its stored copy pinned, the swap's own rate, and the swapped values equal to
scoring with each version's weights directly. On the CPU the rate entry SKIPs and the model is small."""

import time
import types

import pytest
import torch

from tests.gpu.conftest import expect

RATE_BYTES = 1 << 30  # the copied tensor
LAYERS = 8
CUDA_WIDTH = 8192  # 8 layers of 8192 x 8192 bf16: 1 GiB per version
CPU_WIDTH = 64
ROWS, COLUMNS, MICRO_BATCHES = 4, 16, 4
GB = 1e9
QWEN_7B_BYTES = 15.23e9  # Qwen2.5-7B's 7.62e9 parameters in bf16: one ZeRO-2 rank's snapshot


def _copy_rate(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> float:
    """Bytes per second of ``dst.copy_(src)`` host -> device (non-blocking, then synchronised), best of ``reps``."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best


def test_h2d_rate(check, args):
    with check("11.h2d_rate", "host -> device copy rate, pinned and pageable: what a π_prox swap moves at") as e:
        if args.device != "cuda":
            pytest.skip("CPU: no host -> device link (11.grouped_swap checks the bytes a make-experience moves)")
        torch.cuda.set_device(0)
        pageable = torch.ones(RATE_BYTES // 2, dtype=torch.bfloat16)
        pinned = pageable.pin_memory()
        dst = torch.empty_like(pageable, device="cuda")
        rates = {"pinned": _copy_rate(pinned, dst), "pageable": _copy_rate(pageable, dst)}
        e["numbers"].update({f"{k}_gb_per_s": round(v / GB, 2) for k, v in rates.items()}, bytes=RATE_BYTES)
        swap_s = QWEN_7B_BYTES / rates["pinned"]
        e["numbers"]["qwen2.5_7b_zero2_swap_seconds_pinned"] = round(swap_s, 3)
        expect(e, rates["pinned"] >= rates["pageable"] * 0.9, f"pinned slower than pageable: {rates}")
        expect(e, rates["pinned"] > 5 * GB, f"pinned host -> device at {rates['pinned'] / GB:.1f} GB/s")
        e["summary"] = (
            f"pinned {rates['pinned'] / GB:.1f} GB/s, pageable {rates['pageable'] / GB:.1f} GB/s; a 7B bf16 "
            f"snapshot (15.2 GB) swaps in {swap_s:.2f} s pinned"
        )


def _model(width: int, device: str, dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)]
    for layer in layers:
        torch.nn.init.normal_(layer.weight, std=width**-0.5)
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)


def test_grouped_swap(check, args):
    with check("11.grouped_swap", "a snapshot make-experience swaps each stale version in once, pinned") as e:
        from openrlhf_ess.trainer.prox_sources import ProxSources

        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_device(0)
        width, dtype = (CUDA_WIDTH, torch.bfloat16) if cuda else (CPU_WIDTH, torch.float32)
        module = _model(width, args.device, dtype)
        algo = types.SimpleNamespace(prox_mode="snapshot", prox_snapshots=3)
        engine = types.SimpleNamespace(module=module, global_steps=0)
        src = ProxSources(types.SimpleNamespace(algo=algo), engine, 0, partitioned=False)
        weights = {0: {n: p.detach().clone() for n, p in module.named_parameters()}}
        for v in (1, 2, 3):  # 3 kept: versions 1, 2, 3 (3 live)
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(torch.randn_like(p) * width**-0.5)
            src.after_sync(v)
            weights[v] = {n: p.detach().clone() for n, p in module.named_parameters()}
        stored = sum(p.numel() * p.element_size() for p in module.parameters())
        g = torch.Generator().manual_seed(1)
        inputs = [torch.randn(ROWS, width, generator=g).to(args.device, dtype) for _ in range(MICRO_BATCHES)]
        # versions 1 and 2 stale in every micro-batch, 3 the live one
        versions = torch.tensor([[1] * (COLUMNS // 2) + [2] * (COLUMNS // 4) + [3] * (COLUMNS // 4)] * ROWS)

        def score(x):
            with torch.no_grad():
                return module(x)[:, :COLUMNS].float().cpu()

        def loop():
            return [src.log_probs(score(x), versions, lambda x=x: score(x), 3) for x in inputs]

        results = src.grouped_forwards(loop, 3)
        metrics = src.metrics()
        worst = 0.0
        spread = 0.0
        for x, got in zip(inputs, results):
            direct = {}
            for v in (1, 2, 3):
                with torch.no_grad():
                    direct[v] = torch.func.functional_call(module, weights[v], (x,))[:, :COLUMNS].float().cpu()
                worst = max(worst, (got[versions == v] - direct[v][versions == v]).abs().max().item())
            spread = max(spread, (direct[1] - direct[3]).abs().max().item())
        pinned = [t.is_pinned() for v in src.snapshots.versions() for t in src.snapshots.get(v).values()]
        rate = metrics["prox/swap_bytes"] / max(metrics["prox/swap_seconds"], 1e-9)
        e["numbers"].update(
            stored_bytes=stored,
            swap_bytes=metrics["prox/swap_bytes"],
            swap_seconds=round(metrics["prox/swap_seconds"], 4),
            swap_gb_per_s=round(rate / GB, 2),
            extra_forwards=metrics["prox/extra_forwards"],
            worst_abs_diff=worst,
            version_spread=spread,
            pinned_tensors=sum(pinned),
            stored_tensors=len(pinned),
        )
        expect(e, metrics["prox/swap_bytes"] == 2 * stored, f"moved {metrics['prox/swap_bytes']}, want 2 x {stored}")
        expect(e, metrics["prox/extra_forwards"] == 2 * MICRO_BATCHES, f"{metrics['prox/extra_forwards']} forwards")
        # the same kernels on the same values: equal up to the last bits, far below what tells versions apart
        expect(e, worst <= 1e-4 * spread, f"swapped scores differ from each version's own by up to {worst}")
        expect(e, spread > 1e-3, f"versions 1 and 3 score alike ({spread}): the check could not tell them apart")
        expect(e, all(pinned) == cuda, f"{sum(pinned)} of {len(pinned)} stored tensors pinned (CUDA: all; CPU: none)")
        e["summary"] = (
            f"{MICRO_BATCHES} micro-batches x 2 stale versions: {metrics['prox/swap_bytes'] / 2**20:,.0f} MiB moved "
            f"(2 x {stored / 2**20:,.0f} MiB) in {metrics['prox/swap_seconds']:.3f} s ({rate / GB:.1f} GB/s)"
        )
