"""Check 2: ``sync_check.checksum`` on a large bf16 tensor: peak device memory (one float64 chunk), throughput, and
its sums against an independent host float64 sum."""

import math
import time

import numpy as np
import pytest
import torch

from openrlhf_ess.trainer import sync_check
from tests.gpu.conftest import expect
from tests.gpu.harness import SLACK_BYTES

chunk = sync_check.CHUNK_ELEMENTS
chunk_bytes = chunk * 8


def timed(t, cuda, repeats=3):
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sums = sync_check.checksum(t)  # .item() waits for the device
        times.append(time.perf_counter() - t0)
    return sums, sorted(times)[len(times) // 2]


def test_checksum_memory(check, args):
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with check("2.checksum_memory", "sync_check.checksum: peak device memory on a large bf16 tensor") as e:
        if not cuda:
            pytest.skip("CPU: torch has no peak-allocation counter for host memory (torch.cuda.max_memory_allocated)")
        torch.cuda.set_device(0)
        free, total = torch.cuda.mem_get_info()
        nbytes = min(args.checksum_gib << 30, free // 4)
        n = nbytes // 2
        t = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
        sync_check.checksum(t[: 2 * chunk])  # warm-up: kernels loaded, allocator primed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        s, ss, count = sync_check.checksum(t)
        first = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base
        (_, _, _), median = timed(t, cuda)
        bound = chunk_bytes + SLACK_BYTES
        e["numbers"].update(
            tensor_bytes=t.numel() * 2,
            elements=t.numel(),
            chunks=-(-t.numel() // chunk),
            chunk_elements=chunk,
            chunk_float64_bytes=chunk_bytes,
            peak_extra_bytes=peak,
            peak_extra_in_chunks=round(peak / chunk_bytes, 3),
            bound_bytes=bound,
            free_bytes_before=free,
            seconds_first=round(first, 4),
            seconds_median_of_3=round(median, 4),
            throughput_gb_s=round(t.numel() * 2 / median / 1e9, 1),
        )
        expect(e, count == t.numel() and math.isfinite(s) and math.isfinite(ss), f"bad sums {(s, ss, count)}")
        expect(
            e,
            peak <= bound,
            f"checksum added {peak} bytes ({peak / chunk_bytes:.2f} float64 chunks) to the peak, above one chunk "
            f"({chunk_bytes}) + {SLACK_BYTES} slack",
        )
        e["summary"] = (
            f"{t.numel() * 2 / 2**30:.2f} GiB bf16: peak +{peak / 2**20:.1f} MiB "
            f"({peak / chunk_bytes:.2f} chunks of {chunk_bytes >> 20} MiB; bound {bound / 2**20:.2f} MiB), "
            f"{e['numbers']['throughput_gb_s']} GB/s"
        )
        del t
        torch.cuda.empty_cache()


def test_checksum_correctness(check, args):
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with check("2.checksum_correctness", "sync_check.checksum vs an independent float64 sum on the host") as e:
        n = 2 * chunk + 12345  # three chunks, the last one partial
        g = torch.Generator(device=device).manual_seed(0)
        t = torch.empty(n, dtype=torch.bfloat16, device=device).normal_(1.0, 1.0, generator=g)  # mean 1: no cancel
        (s, ss, count), median = timed(t, cuda)
        host = t.float().cpu().numpy().astype(np.float64)  # bf16 -> fp32 -> fp64 is exact
        s_ref, ss_ref = float(host.sum()), float((host * host).sum())  # numpy's pairwise sums
        rel_s, rel_ss = abs(s - s_ref) / abs(s_ref), abs(ss - ss_ref) / ss_ref
        e["numbers"].update(
            elements=n,
            chunks=-(-n // chunk),
            sum=s,
            sum_host=s_ref,
            sum_sq=ss,
            sum_sq_host=ss_ref,
            rel_err_sum=rel_s,
            rel_err_sum_sq=rel_ss,
            tolerance=1e-12,
            seconds_median_of_3=round(median, 4),
            throughput_gb_s=round(n * 2 / median / 1e9, 2),
        )
        expect(e, count == n, f"n = {count}, expected {n}")
        expect(e, rel_s <= 1e-12 and rel_ss <= 1e-12, f"relative errors {rel_s:.2e}, {rel_ss:.2e} above 1e-12")
        e["summary"] = (
            f"{n} elements on {device} ({-(-n // chunk)} chunks): rel err {rel_s:.1e} / {rel_ss:.1e} (<= 1e-12), "
            f"{e['numbers']['throughput_gb_s']} GB/s"
        )
    assert e["numbers"]["chunks"] == 3 and e["numbers"]["throughput_gb_s"] > 0, e["numbers"]
