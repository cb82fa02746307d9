"""Shared fixtures: the offline tiny world, built once per test session under pytest's temp dir; and the
session-wide check that every process the tests start ends with them (tests/helpers/leak_check.py)."""

import atexit
import os
import shutil
import tempfile

import pytest

# The session-wide check that no process a test started outlives the session (issue 21, item 12): pytest hooks.
from tests.helpers.leak_check import (  # noqa: F401
    pytest_runtest_logfinish,
    pytest_runtest_logstart,
    pytest_sessionfinish,
    pytest_sessionstart,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM CPU lets this variable replace any engine's own KV-cache size: the tests' engines size theirs (64 MiB
# in-process, --vllm.cpu_kv_cache_gb in CLI runs), whatever the developer's shell exports.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
# The runs' /dev/shm ledgers (openrlhf_ess/runtime/shm_cleanup.py) in the suite's own folder, not the user's state
# folder.
if "OPENRLHF_ESS_STATE_DIR" not in os.environ:
    os.environ["OPENRLHF_ESS_STATE_DIR"] = tempfile.mkdtemp(prefix="ess_state_")
    atexit.register(shutil.rmtree, os.environ["OPENRLHF_ESS_STATE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    from openrlhf_ess.tiny.world import build_world

    return build_world(str(tmp_path_factory.mktemp("tiny_world")), seed=0, n_prompts=32)
