"""The real pipeline end to end: our CLI -> upstream's Ray job -> vLLM (CPU) + DeepSpeed, with metrics."""

import glob
import os

import pytest

from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args


def _check_run(run_dir, rc, log, steps):
    assert rc == 0, log[-6000:]
    assert "Traceback" not in log, log[-6000:]
    scalars = read_tensorboard(run_dir)
    assert len(scalars["train/reward"]) == steps, sorted(scalars)
    assert len(scalars["train/policy_loss"]) == steps
    # the weights really went to vLLM each step (our reload backend, timed by upstream's trainer)
    assert len(scalars["train/timing/broadcast"]) == steps
    return scalars


def test_sync_run_writes_tensorboard_and_wandb(tiny_world, tmp_path):
    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir) + ["--logger.wandb.key", "offline-" + "0" * 32]
    rc, log = run_cli(args, run_dir)
    _check_run(run_dir, rc, log, steps=2)
    assert "--vllm.sync_backend nccl -> reload" in log
    # wandb offline run folder with the history of our metrics
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))
    assert runs, os.listdir(run_dir)
    assert os.path.getsize(runs[0]) > 0


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(["--train.async_enable"], id="async", marks=pytest.mark.slow),
        pytest.param(["--train.async_enable", "--train.partial_rollout_enable"], id="async-partial"),
    ],
)
def test_async_runs(tiny_world, tmp_path, mode):
    run_dir = str(tmp_path)
    rc, log = run_cli(tiny_args(tiny_world, run_dir) + mode, run_dir)
    _check_run(run_dir, rc, log, steps=2)


@pytest.mark.slow
def test_deepspeed_launcher(tiny_world, tmp_path):
    # `deepspeed --module` appends --local_rank and sets CUDA_VISIBLE_DEVICES=0 even on a CPU machine.
    run_dir = str(tmp_path)
    rc, log = run_cli(tiny_args(tiny_world, run_dir), run_dir, launcher=["deepspeed", "--module"])
    _check_run(run_dir, rc, log, steps=2)
