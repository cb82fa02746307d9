"""A multi-node Ray cluster on this machine, for one test: a head and worker nodes started with `ray start` on
127.0.0.1, each with its own resources (and environment), all under one temp dir of the test's.

Stopped exactly: every process that carries this cluster's token in its environment (set for `ray start`, so
inherited by every daemon, worker and helper it spawns, even re-parented ones such as Ray's client server) or whose
command line names the cluster's temp dir, and nothing else; SIGTERM then SIGKILL, on every exit; the test fails if
one survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from tests.helpers.ports import free_port

TOKEN_ENV = "OPENRLHF_ESS_TEST_RAY_CLUSTER"


def _pids_naming(text: str) -> List[int]:
    """This cluster's processes: ``text`` (its temp dir) in the command line or as the token in the environment."""
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid():
            continue
        try:
            if text in " ".join(p.info["cmdline"] or []) or p.environ().get(TOKEN_ENV) == text:
                pids.append(p.pid)
        except psutil.Error:
            continue
    return pids


@contextlib.contextmanager
def ray_cluster(head: Dict, workers: List[Dict] = (), dashboard: bool = False):
    """Yields ``(address, dashboard_url)``. ``head`` / each worker: ``num_cpus``, ``num_gpus`` (logical) and an
    optional ``env`` dict added to that node's environment (its raylet's, so its workers' too)."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    temp_dir = tempfile.mkdtemp(prefix="ray_c_", dir="/tmp")  # short: Ray's socket paths are length-limited
    port, dash = free_port(), free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_process_group_cleanup_enabled": "true", TOKEN_ENV: temp_dir}
    base.pop("RAY_ADDRESS", None)

    def start(node: Dict, extra: List[str]) -> None:
        cmd = [ray_bin, "start", "--node-ip-address", "127.0.0.1", "--temp-dir", temp_dir, "--disable-usage-stats"]
        cmd += ["--num-cpus", str(node.get("num_cpus", 2)), "--num-gpus", str(node.get("num_gpus", 0)), *extra]
        env = {**base, **node.get("env", {})}
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=180)

    try:
        dash_flags = ["--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash)]
        start(head, ["--head", "--port", str(port), *(dash_flags if dashboard else ["--include-dashboard", "false"])])
        for worker in workers:
            start(worker, ["--address", f"127.0.0.1:{port}"])
        yield f"127.0.0.1:{port}", (f"http://127.0.0.1:{dash}" if dashboard else None)
    finally:
        stop(temp_dir)


def stop(temp_dir: Optional[str]) -> None:
    pids = _pids_naming(temp_dir)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
    subprocess.run(["rm", "-rf", temp_dir])
    left = _pids_naming(temp_dir)
    assert not left, f"processes of the test's Ray cluster survived: {left}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
