"""A CPU-burning process beside a test, as a second job on the machine's cores would be: started and stopped by the
test (by handle), and bounded in time on its own (it exits after ``limit_s`` even if the test never stops it)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

_BURN = "import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def cpu_burner(limit_s: float = 600.0):
    """One busy process for the duration of the ``with`` block (at most ``limit_s``); yields its Popen."""
    proc = subprocess.Popen([sys.executable, "-c", _BURN.format(limit_s=float(limit_s))])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
