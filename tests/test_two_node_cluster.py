"""A run across a two-node Ray cluster on this machine: users outgrow one machine through Ray.

A head and a worker node started with `ray start` on 127.0.0.1, one logical GPU each, so upstream's placement
puts the policy (DeepSpeed) on one node and the vLLM engine on the other; the driver sees no accelerator
(``CUDA_VISIBLE_DEVICES=""``, as under ``ray job submit``). Async + partial rollouts + an exact π_prox mode
(interrupt) + the weight-sync check: the weights cross nodes at every sync (reload backend: a safetensors blob
through Ray's object store), the checkpoint is written by the node that holds the policy, and the start-up
self-checks and the accelerator probe run against the cluster.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.e2e import run_cli, tiny_args
from tests.helpers.ray_cluster import ray_cluster
from tests.test_e2e_cli import _check_run


def _actors(address):
    """(class name, node id) of every actor the cluster has seen, dead ones included (Ray's state API)."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray_bin, "list", "actors", "--address", address, "--format", "json", "--limit", "1000", "--detail"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [(a["class_name"], a["node_id"]) for a in json.loads(out.stdout)]


@pytest.mark.real_stack
@pytest.mark.slow
def test_async_partial_interrupt_run_across_two_nodes(tiny_world, tmp_path):
    run_dir = str(tmp_path)
    args = [a for a in tiny_args(tiny_world, run_dir) if a]
    i = args.index("--ray.temp_dir")
    del args[i : i + 2]
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.prox_mode", "interrupt"]
    flags += ["--ckpt.save_steps", "1"]
    with ray_cluster({"num_cpus": 6, "num_gpus": 1}, [{"num_cpus": 6, "num_gpus": 1}], dashboard=True) as (
        address,
        dashboard,
    ):
        rc, log = run_cli(args + flags + ["--ray.address", address], run_dir, env={"CUDA_VISIBLE_DEVICES": ""})
        _check_run(run_dir, rc, log, steps=2)
        assert "accelerator: cpu (the cluster at 127.0.0.1" in log and "declares GPUs but none" in log
        actors = _actors(dashboard)
    policy = {node for name, node in actors if name.startswith("PolicyModelActor")}
    engines = {node for name, node in actors if "RolloutRayActor" in name}
    assert len(policy) == 1 and len(engines) == 1, actors
    assert policy != engines, f"policy and engine on the same node: {actors}"
    # a checkpoint written across the cluster, where --ckpt.path says
    saved = [d for _, dirs, _ in os.walk(os.path.join(run_dir, "ckpt", "checkpoints")) for d in dirs]
    assert any(d.startswith("global_step") for d in saved), saved
