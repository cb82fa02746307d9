"""The run's accelerator is decided from the Ray cluster, not the driver.

A CPU-only head node, or ``ray job submit`` (its driver gets ``CUDA_VISIBLE_DEVICES=""``), used to make a GPU
cluster run in CPU mode: GPU recipes rejected, NCCL switched to reload, engines given a 1 GiB KV cache. Here a
two-node Ray cluster on this machine, the head without GPUs (where the driver is, no CUDA), a worker node that
declares GPUs. This machine has no GPU, so the worker node's GPU is stated in its environment
(``OPENRLHF_ESS_DEVICE=cuda``, what :func:`cpu_compat.cuda_available` reads before NVML); everything else — the
probe pinned to that node, the decision, the validation of a real GPU recipe — is what a user's cluster runs.
"""

import os
import types

import pytest

from tests.helpers.ray_cluster import ray_cluster


def _args(address, accelerator="auto"):
    return types.SimpleNamespace(ray=types.SimpleNamespace(address=address, accelerator=accelerator))


@pytest.mark.real_stack
def test_gpu_cluster_seen_from_a_driver_without_cuda(monkeypatch, tmp_path):
    from openrlhf_ess import config
    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.runtime import cpu_compat
    from tests.test_recipes import SCRIPTS, _argv

    monkeypatch.delenv(cpu_compat.DEVICE_ENV, raising=False)
    assert not cpu_compat.cuda_available()  # the driver: no CUDA here
    gpu_node = {"num_cpus": 1, "num_gpus": 2, "env": {cpu_compat.DEVICE_ENV: "cuda"}}
    with ray_cluster({"num_cpus": 1, "num_gpus": 0}, [gpu_node]) as (address, _):
        args = _args(address)
        line = cli.resolve_accelerator(args)
        assert args.ray.accelerator == "cuda", line
        assert "1 GPU node(s)" in line and "not by this driver" in line
        # a real GPU recipe (flash-attn, Adam offload, NCCL sync) validates as on the GPU cluster it targets
        recipes = [s for s in SCRIPTS if not os.path.basename(s).startswith("_")]  # _*.sh: blocks others source
        recipe = next(s for s in recipes if "cpu" not in s and "agent" not in s)
        parsed, notices = cli.parse_args(_argv(recipe, tmp_path) + ["--ray.address", address])
        notices = cli.check_with_cluster(parsed, notices)  # parsing does no I/O: the cluster is joined after it
        assert parsed.ray.accelerator == "cuda" and config.on_cuda(parsed)
        assert parsed.vllm.sync_backend == "nccl", notices
        assert not any("no CUDA here" in n for n in notices), notices
    # a cluster whose GPUs are all logical (our CPU test clusters) decides cpu:
    # tests/test_e2e_cli.py::test_ray_job_submit


def test_disagreeing_gpu_nodes_are_refused_with_the_flag(monkeypatch):
    from openrlhf_ess import config
    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.runtime import cpu_compat

    monkeypatch.setattr(cli, "_probe_gpu_nodes", lambda address: {"10.0.0.1 (a)": True, "10.0.0.2 (b)": False})
    with pytest.raises(config.ConfigError, match="--ray.accelerator cuda"):
        cli.resolve_accelerator(_args("10.0.0.1:6379"))
    args = _args("10.0.0.1:6379", accelerator="cpu")  # stated: no probe
    monkeypatch.setattr(cli, "_probe_gpu_nodes", lambda address: pytest.fail("probed despite the flag"))
    assert "--ray.accelerator" in cli.resolve_accelerator(args) and args.ray.accelerator == "cpu"
    monkeypatch.delenv(cpu_compat.DEVICE_ENV, raising=False)
    args = _args(None)  # a private instance: this machine
    assert "this machine has no CUDA" in cli.resolve_accelerator(args) and args.ray.accelerator == "cpu"
