"""A HOME the run cannot write (openrlhf_ess/runtime/caches.py). Before the fix ``import deepspeed``
(through our CLI's first import) raised FileNotFoundError / OSError from ``os.makedirs(~/.triton/autotune)``
with no line of ours. A folder under /proc stands in for a read-only HOME: nothing can be created there, for root
too (as on a read-only mount), which mode bits cannot arrange for root."""

import os
import subprocess
import sys

import pytest

from openrlhf_ess.runtime import caches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNWRITABLE_HOME = "/proc/openrlhf-ess-no-home"


def test_an_unwritable_home_moves_the_caches_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", UNWRITABLE_HOME)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(caches.tempfile, "gettempdir", lambda: str(tmp_path))
    env = {}
    notices = caches.redirect_unwritable_caches(env)
    uid = os.getuid()
    assert env == {
        "TRITON_CACHE_DIR": f"{tmp_path}/openrlhf-ess-{uid}/triton_cache_dir",
        "VLLM_CACHE_ROOT": f"{tmp_path}/openrlhf-ess-{uid}/vllm_cache_root",
    }
    assert all(os.path.isdir(folder) for folder in env.values())
    assert len(notices) == 2
    assert notices[0].startswith(f"[openrlhf-ess] {UNWRITABLE_HOME}/.triton/cache cannot be created (HOME ")
    assert "set TRITON_CACHE_DIR to keep the cache elsewhere" in notices[0]
    assert f"{UNWRITABLE_HOME}/.cache/vllm cannot be created" in notices[1]


def test_a_writable_home_or_a_set_variable_changes_nothing(monkeypatch, tmp_path):
    """Default off is upstream: nothing is set when the defaults can be created, or when the user set the
    variable (even with HOME unwritable)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    env = {}
    assert caches.redirect_unwritable_caches(env) == [] and env == {}
    monkeypatch.setenv("HOME", UNWRITABLE_HOME)
    env = {"TRITON_CACHE_DIR": "/mine/triton", "VLLM_CACHE_ROOT": "/mine/vllm"}
    assert caches.redirect_unwritable_caches(env) == []
    assert env == {"TRITON_CACHE_DIR": "/mine/triton", "VLLM_CACHE_ROOT": "/mine/vllm"}


@pytest.mark.engine
@pytest.mark.before_ray  # the CLI stops before Ray: no need to wait for the real-stack group
def test_the_cli_starts_with_an_unwritable_home():
    """The CLI's imports (DeepSpeed creates Triton's autotune folder at import) and its --help, as a user with a
    read-only HOME runs them: exit 0 and our notice, where before the fix the import raised."""
    env = {**os.environ, "HOME": UNWRITABLE_HOME, "OMP_NUM_THREADS": "1"}
    for key in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "XDG_CACHE_HOME"):
        env.pop(key, None)
    run = subprocess.run(
        [sys.executable, "-m", "openrlhf_ess.cli.train_ppo_ray", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--vllm.sync_check_tol" in run.stdout
    assert f"[openrlhf-ess] {UNWRITABLE_HOME}/.triton/cache cannot be created" in run.stdout + run.stderr
