"""The cache folders our libraries create under HOME, moved to a writable place when HOME is not.

DeepSpeed creates Triton's autotune folder (``~/.triton/autotune``) at import, so on a read-only HOME (a container
image, a cluster that mounts home read-only on compute nodes) ``import deepspeed`` raised ``FileNotFoundError`` or
``OSError: [Errno 30] Read-only file system`` from ``os.makedirs`` with no line of ours. vLLM's compile cache
(``~/.cache/vllm``) would fail the same way when the engine starts. For each such cache whose variable the user did
not set and whose default folder cannot be created, the CLI sets the variable to a folder under the system's
temporary directory before anything imports those libraries, and says so in one line; the variables reach every
Ray worker (``cli/ray_start.py::_FORWARDED_ENV``). Nothing is moved when HOME is writable: default off is
upstream.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, List


def _defaults(home: str) -> Dict[str, str]:
    """Each cache variable -> its default folder as the library computes it (Triton: ~/.triton/cache, DeepSpeed's
    autotune beside it; vLLM: $XDG_CACHE_HOME/vllm or ~/.cache/vllm)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return {"TRITON_CACHE_DIR": os.path.join(home, ".triton", "cache"), "VLLM_CACHE_ROOT": os.path.join(xdg, "vllm")}


def creatable(folder: str) -> bool:
    """Whether ``folder`` exists or can be created, by creating it as the library would at import (a read-only
    mount fails for root too, which mode bits and ``os.access`` do not tell)."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def redirect_unwritable_caches(environ=None) -> List[str]:
    """Set each cache variable of :func:`_defaults` that is unset and whose default folder cannot be created
    to ``<tmp>/openrlhf-ess-<uid>/<name>``; returns one notice per variable set (empty when HOME is writable)."""
    env = os.environ if environ is None else environ
    home = os.path.expanduser("~")
    notices = []
    for name, default in _defaults(home).items():
        if env.get(name) or creatable(default):
            continue
        folder = os.path.join(tempfile.gettempdir(), f"openrlhf-ess-{os.getuid()}", name.lower())
        os.makedirs(folder, exist_ok=True)
        env[name] = folder
        notices.append(
            f"[openrlhf-ess] {default} cannot be created (HOME {home} is not writable): {name}={folder} for this run "
            f"and its workers; set {name} to keep the cache elsewhere"
        )
    return notices
