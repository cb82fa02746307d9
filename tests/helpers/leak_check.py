"""Session-wide check: no process a test started outlives the test session.

A failing real-stack test used to leave its whole run alive (the CLI, Ray, the actors, vLLM), slowing and breaking
the tests after it. Tests end what they start (``tests/helpers/faults.py::_Tree``, ``tests/helpers/e2e.py::run_cli``);
this pytest plugin is the backstop, registered by ``tests/conftest.py``:

- at session start it sets :data:`MARKER` in the environment to a token of this session, so every process started
  from now on by the tests, directly or not (the CLI, its Ray instance and workers, vLLM's processes), inherits it;
  and it remembers the children the session already had;
- at session end (every fixture torn down) a process is the session's if it carries the token in its initial
  environment (``/proc/<pid>/environ``: found even after it was re-parented to init) or descends from this pytest
  process. The interpreter's own helpers that live until it exits (multiprocessing's resource tracker and
  forkserver, torch's compile workers) are not leaks. Those still alive after :data:`GRACE_S` (a last run's
  processes finishing their shutdown) are reported with their command line and the test that was running when
  each started, ended by PID, and the session fails.

Under pytest-xdist (scripts/test.sh: two workers) each worker is a session of its own with its own token, and checks
the processes its tests started. xdist reads a worker's exit status before this check runs and drops it, so a worker
hands its report to the controller (``workeroutput``), which prints it and fails the run; the controller leaves the
workers' processes (those carrying ``PYTEST_XDIST_WORKER``) to them.
"""

from __future__ import annotations

import os
import time
from typing import List, Optional, Tuple

import psutil
import pytest

MARKER = "OPENRLHF_ESS_TEST_SESSION"
WORKER_ENV = "PYTEST_XDIST_WORKER"  # set by pytest-xdist in each worker, inherited by what its tests start
GRACE_S = float(os.environ.get("OPENRLHF_ESS_LEAK_GRACE_S", "30"))
# Helpers of the pytest interpreter itself, which end when it does (not started by a test's run).
_SESSION_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "_inductor/compile_worker")


class LeakCheck:
    def __init__(self, controller: bool = False):
        self.controller = controller  # the xdist controller: its workers check their own tests' processes
        self.pid = os.getpid()
        self.token = f"{self.pid}-{time.time():.6f}"
        os.environ[MARKER] = self.token
        self.before = {(p.pid, _created(p)) for p in _children(self.pid)}
        self.tests: List[Tuple[str, float, float]] = []  # (test id, start, end)
        self._current: Optional[Tuple[str, float]] = None

    def test_started(self, nodeid: str) -> None:
        self._current = (nodeid, _now())

    def test_finished(self, nodeid: str) -> None:
        if self._current is not None:
            self.tests.append((self._current[0], self._current[1], _now()))
            self._current = None

    def _started_by(self, created: float) -> str:
        for nodeid, start, end in self.tests:
            if start - 0.5 <= created <= end + 0.5:
                return nodeid
        return "a session fixture or between tests"

    def ours(self) -> List[psutil.Process]:
        found = {p.pid: p for p in _children(self.pid)}
        for p in psutil.process_iter():
            if p.pid in found or p.pid == self.pid:
                continue
            try:
                if p.environ().get(MARKER) == self.token:
                    found[p.pid] = p
            except psutil.Error:
                continue
        if self.controller:
            found = {pid: p for pid, p in found.items() if WORKER_ENV not in _environ(p)}
        out = []
        for p in found.values():
            try:
                if (p.pid, _created(p)) in self.before or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                if any(helper in " ".join(p.cmdline()) for helper in _SESSION_HELPERS):
                    continue
            except psutil.Error:
                continue
            out.append(p)
        return out

    def finish(self, grace_s: float = GRACE_S) -> List[str]:
        """The session's processes still alive after ``grace_s`` (described), each then ended by its PID."""
        deadline = time.time() + grace_s
        left = self.ours()
        while left and time.time() < deadline:
            time.sleep(1.0)
            left = self.ours()
        report = []
        for p in left:
            try:
                report.append(
                    f"pid {p.pid} ({' '.join(p.cmdline())[:160]}), started during {self._started_by(p.create_time())}"
                )
            except psutil.Error:
                continue
        from tests.helpers.faults import end_processes

        end_processes(left)
        return report


def _now() -> float:
    """Now on psutil's create_time clock (boot time from /proc/stat, in whole seconds, + time since boot): the wall
    clock can differ from it by seconds."""
    return psutil.boot_time() + time.clock_gettime(time.CLOCK_BOOTTIME)


def _children(pid: int) -> List[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _environ(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _created(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except psutil.Error:
        return 0.0


# ---- pytest hooks (tests/conftest.py imports them; `-p tests.helpers.leak_check` loads them as a plugin) ----------

_check: Optional[LeakCheck] = None


_from_workers: List[str] = []  # the xdist controller: what its workers reported


def pytest_sessionstart(session) -> None:
    global _check
    _check = LeakCheck(controller=session.config.pluginmanager.hasplugin("dsession"))


def pytest_runtest_logstart(nodeid, location) -> None:
    if _check is not None:
        _check.test_started(nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    if _check is not None:
        _check.test_finished(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The xdist controller: an xdist worker has finished; its leak report (see the module's docstring)."""
    _from_workers.extend(f"[{node.gateway.id}] {line}" for line in getattr(node, "workeroutput", {}).get("leaks", []))


def pytest_sessionfinish(session, exitstatus) -> None:
    if _check is None:
        return
    leaks = _check.finish()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports and fails the run
        workeroutput["leaks"] = leaks
        return
    leaks += _from_workers
    if not leaks:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(leaks)} process(es) started by the tests outlived them (now ended by PID):"] + leaks
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line)
    session.exitstatus = 1
