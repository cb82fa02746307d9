"""The real pipeline end to end: our CLI -> upstream's Ray job -> vLLM (CPU) + DeepSpeed, with metrics."""

import glob
import os

import pytest

from tests.helpers import fault_injection
from tests.helpers.e2e import CPU_ENGINE_LAYOUT, LAST_RUN, read_tensorboard, run_cli, tiny_args
from tests.helpers.wandb_offline import history


def _ray_processes_left(run_dir):
    """Processes still running from the run's own Ray instance (its temp dir is in their command line)."""
    import subprocess

    from tests.helpers.e2e import ray_temp_dir

    out = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if ray_temp_dir(run_dir) in line]


def _check_run(run_dir, rc, log, steps, tracked=True, rc_expected=0):
    """``tracked``: the run was started by run_cli (its processes and /dev/shm files were followed: LAST_RUN).
    ``rc_expected``: 1 for a run whose final save is made to fail (tests/test_e2e_scale.py), its steps all trained."""
    assert rc == rc_expected, log[-6000:]
    # quiet success: no traceback, no "Exception ignored in ActorHandle.__del__" at teardown
    # (worker_hook.py::setup_worker), no vLLM rotary-cache reload warning at each sync (openrlhf_ess/runtime/quiet.py)
    assert "Traceback" not in log and "Exception ignored" not in log, log[-6000:]
    assert "Failed to load weights" not in log, [line for line in log.splitlines() if "Failed to load weights" in line]
    # the start-up self-checks ran and passed: placement, collectives, memory (not measured on CPU)
    passed = "start-up self-check passed: placement:" in log and "collectives: all-reduce + all-gather" in log
    assert passed, log[-6000:]
    import time

    deadline = time.time() + 20  # ray.shutdown() signals its processes; give them a moment to exit
    while _ray_processes_left(run_dir) and time.time() < deadline:
        time.sleep(0.5)
    assert not _ray_processes_left(run_dir), "the CLI left processes of its Ray instance behind"
    if tracked:
        assert not LAST_RUN["leftovers"], LAST_RUN["leftovers"]  # tracked by PID: the whole tree, not only Ray's
        # no /dev/shm residue: vLLM's psm_* queues and multiprocessing's sem.mp-* that the run's
        # processes were seen using are gone (the CLI removes what they leave; others' files are never counted)
        assert not LAST_RUN["shm_left"], f"/dev/shm files of the run left behind: {LAST_RUN['shm_left']}"
    scalars = read_tensorboard(run_dir)
    assert len(scalars["train/reward"]) == steps, sorted(scalars)
    assert len(scalars["train/policy_loss"]) == steps
    # the weights really went to vLLM each step (our reload backend, timed by upstream's trainer)
    assert len(scalars["train/timing/broadcast"]) == steps
    return scalars


OUR_METRIC_PREFIXES = (
    "lr_scale",
    "rho_ess",
    "ess",
    "actor_lr_effective",
    "tis/",
    "mismatch/",
    "version_lag/",
    "prox/",
)


def _check_metric_channels(run_dir, log, scalars):
    """Every metric of ours reaches tensorboard, the wandb offline run (same values) and the console."""
    ours = sorted(t for t in scalars if t.split("/", 1)[1].startswith(OUR_METRIC_PREFIXES))
    assert len(ours) >= 20, ours
    wandb_history = history(run_dir)
    for tag in ours:
        tb_values = [v for _, v in sorted(scalars[tag])]
        assert wandb_history.get(tag) == pytest.approx(tb_values, rel=1e-5, abs=1e-6), tag
        assert f"'{tag.split('/', 1)[1]}':" in log, f"{tag} missing from the console step summary"


@pytest.mark.stack
def test_sync_run_writes_tensorboard_and_wandb(tiny_world, tmp_path):
    run_dir = str(tmp_path)
    # The engine as users get it by default (torch.compile), here and in the all-corrections run below.
    # With a held-out eval and none of our controllers' features, the CLI runs upstream's sync controller with our
    # eval schedule (trainer/ppo_trainer.py::PPOTrainerEvalImpl): every step evaluated, the final one included.
    args = tiny_args(tiny_world, run_dir, compiled=True, kv_cache_gb=None) + [
        "--logger.wandb.key",
        "offline-" + "0" * 32,
        "--eval.dataset",
        tiny_world["prompts"],
        "--eval.steps",
        "1",
    ]
    rc, log = run_cli(args, run_dir)
    _check_run(run_dir, rc, log, steps=2)
    assert "PPOTrainerEvalImpl" in log
    assert "--vllm.sync_backend nccl -> reload" in log
    assert "Explicitly set (1.0/" in log  # vLLM CPU's KV cache at --vllm.cpu_kv_cache_gb's default, 1 GiB
    scalars = read_tensorboard(run_dir)
    diffs = [v for _, v in scalars["train/sync/canary_mean_abs_diff"]]
    assert diffs and max(diffs) < 0.5  # the first sync's canary: the engine matches the trainer
    assert sorted(step for step, _ in scalars["eval/eval_default_pass1"]) == [1, 2]
    compared = [v for _, v in scalars["train/sync/checksum_tensors_compared"]]
    assert compared and min(compared) >= 25  # every tensor of the tiny model (q/k/v as parts), at every checked sync
    # wandb offline run folder with the history of our metrics
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))
    assert runs, os.listdir(run_dir)
    assert os.path.getsize(runs[0]) > 0


@pytest.mark.real_stack
@pytest.mark.slow
def test_async_run(tiny_world, tmp_path):
    run_dir = str(tmp_path)
    rc, log = run_cli(tiny_args(tiny_world, run_dir) + ["--train.async_enable"], run_dir)
    _check_run(run_dir, rc, log, steps=2)


@pytest.mark.stack
@pytest.mark.bf16  # --vllm.fp32_lm_head: the fp32 head of a bf16 engine (refused with an fp32 one)
def test_async_partial_run_with_all_corrections(tiny_world, tmp_path):
    run_dir = str(tmp_path)
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.ess_lr_enable"]
    flags += ["--algo.tis_cap", "2", "--algo.max_version_lag", "3"]
    flags += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--algo.kl.off_policy_k2_enable"]
    flags += ["--algo.prox_mode", "snapshot", "--algo.prox_snapshots", "3"]
    flags += ["--vllm.fp32_lm_head"]  # vLLM's fp32 head in the bf16 engine, checked in its worker at start-up
    flags += ["--algo.advantage.baseline", "opob"]  # with ESS-LR: VCPO in full
    args = tiny_args(tiny_world, run_dir, steps_prompts=24, compiled=True, dtype="bf16")
    args[args.index("--algo.kl.init_coef") + 1] = "0.01"  # a reference model and a KL loss
    wandb = ["--logger.wandb.key", "offline-" + "0" * 32]
    # vLLM CPU's own variable set as env_cpu.sh once did: --vllm.cpu_kv_cache_gb (64 MiB here) must still win
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **CPU_ENGINE_LAYOUT}
    rc, log = run_cli(args + flags + wandb + ["--ref.num_gpus_per_node", "1"], run_dir, env=env)
    scalars = _check_run(run_dir, rc, log, steps=3)
    assert "VLLM_CPU_KVCACHE_SPACE=1 (which vLLM CPU would let override it) is not passed" in log
    assert "Explicitly set (0.06/" in log and "Explicitly set (1.0/" not in log  # vLLM's own line: 64 MiB
    assert "--vllm.fp32_lm_head: LM head dtypes per worker [['torch.float32']]" in log, log[-6000:]
    _check_metric_channels(run_dir, log, scalars)
    # the plots command on this real run's logs: every figure has data
    from openrlhf_ess.tools.plots import make_plots

    written, skipped = make_plots(os.path.join(run_dir, "tb"), os.path.join(run_dir, "plots"))
    assert not skipped and len(written) == 5
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in written)
    last = {tag: values[-1][1] for tag, values in scalars.items()}
    # ESS LR
    scale = [v for _, v in scalars["train/lr_scale"]]
    rho = [v for _, v in scalars["train/rho_ess"]]
    lr = [v for _, v in scalars["train/actor_lr"]]
    eff = [v for _, v in scalars["train/actor_lr_effective"]]
    assert len(scale) == len(rho) == 3
    for s, r, a, e in zip(scale, rho, lr, eff):
        assert 0 < r <= 1 + 1e-6
        assert s == pytest.approx(max(0.1, min(1.0, r**0.5)), rel=1e-5)  # sqrt rule, floor 0.1
        assert e == pytest.approx(a * s, rel=1e-5)
    assert [v for _, v in scalars["train/ess_lr_missing"]] == [0.0] * 3
    # OPOB: a baseline per step inside the rewards' range, from positive, unequal gradient norms
    assert len(scalars["train/opob/baseline"]) == 3
    assert all(0 <= v <= 1 for _, v in scalars["train/opob/baseline"])  # digit-fraction rewards are in [0, 1]
    assert all(v > 0 for _, v in scalars["train/opob/grad_norm_mean"])
    assert all(v > 0 for _, v in scalars["train/opob/grad_norm_rel_spread"])
    # versions: partial rollouts span weight versions, so some tokens lag by >= 1 after the first step
    assert max(v for _, v in scalars["train/version_lag/max"]) >= 1
    fracs = [last[f"train/version_lag/frac_{b}"] for b in ("0", "1", "2", "3+")]
    assert sum(fracs) == pytest.approx(1.0)
    # TIS (token level, through upstream's PolicyLoss) and mismatch
    assert 0 <= last["train/tis/clip_frac"] <= 1 and last["train/tis/max_weight"] <= 2 + 1e-5
    assert "train/is_filter_ratio" in scalars and "train/vllm_kl" in scalars  # upstream's own IS metrics
    for key in ("k1", "k3", "chi2", "max_abs_log_ratio"):
        assert f"train/mismatch/{key}" in scalars
    assert last["train/mismatch/k3"] >= 0
    # k2 KL loss with a reference model
    assert "train/kl" in scalars
    assert [v for _, v in scalars["train/rollout_logprob_nonfinite"]] == [0.0] * 3
    # exact pi_prox from weight snapshots: stale versions were scored, nothing was missing
    assert sum(v for _, v in scalars["train/prox/extra_forwards"]) >= 1
    assert last["train/prox/host_memory_mb"] > 0
    assert [v for _, v in scalars["train/prox/masked_missing_tokens"]] == [0.0] * 3


@pytest.mark.real_stack
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ewma", "loglinear"])
def test_async_partial_approximate_prox(tiny_world, tmp_path, mode):
    run_dir = str(tmp_path)
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.prox_mode", mode]
    rc, log = run_cli(tiny_args(tiny_world, run_dir, steps_prompts=24) + flags, run_dir)
    scalars = _check_run(run_dir, rc, log, steps=3)
    assert "train/version_lag/mean" in scalars and "train/mismatch/k3" in scalars
    if mode == "ewma":
        assert "train/prox/extra_forward_seconds" in scalars


@pytest.mark.real_stack
@pytest.mark.slow
def test_deepspeed_launcher(tiny_world, tmp_path):
    # `deepspeed --module` appends --local_rank and sets CUDA_VISIBLE_DEVICES=0 even on a CPU machine.
    run_dir = str(tmp_path)
    rc, log = run_cli(tiny_args(tiny_world, run_dir), run_dir, launcher=["deepspeed", "--module"])
    _check_run(run_dir, rc, log, steps=2)


@pytest.mark.real_stack
@pytest.mark.slow
def test_ray_job_submit(tiny_world, tmp_path):
    """`ray job submit` against a local cluster this test starts on loopback and stops (by PID). Its GPUs are
    logical (this machine has none) and the job's driver sees none: the accelerator probe decides cpu and says so."""
    import json
    import subprocess
    import sys
    import time

    from tests.helpers.ray_cluster import ray_cluster

    run_dir = str(tmp_path)
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    with ray_cluster({"num_cpus": 8, "num_gpus": 2}, dashboard=True) as (_, dashboard):
        args = [a for a in tiny_args(tiny_world, run_dir) if a]
        i = args.index("--ray.temp_dir")
        del args[i : i + 2]
        submit = [
            ray_bin,
            "job",
            "submit",
            "--address",
            dashboard,
            "--runtime-env-json",
            json.dumps({"env_vars": {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}}),
            "--",
            sys.executable,
            "-m",
            "openrlhf_ess.cli.train_ppo_ray",
            *args,
            "--ray.address",
            "auto",
        ]
        for _ in range(20):  # the dashboard agent takes a few seconds after `ray start` to accept jobs
            with open(os.path.join(run_dir, "log.txt"), "w") as log:
                rc = subprocess.run(submit, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900).returncode
            log_text = open(os.path.join(run_dir, "log.txt")).read()
            if "No available agent" not in log_text:
                break
            time.sleep(3)
        _check_run(run_dir, rc, log_text, steps=2, tracked=False)  # the job runs in the cluster, not under us
        assert "succeeded" in log_text
        assert "accelerator: cpu (the cluster at auto declares GPUs but none" in log_text


@pytest.mark.real_stack
@pytest.mark.slow
def test_corrupt_weight_sync_stops_the_run(tiny_world, tmp_path):
    """A sync that leaves the engine on wrong weights (injected: noise loaded instead of the weights) is
    caught at the first sync: the run fails fast with a message naming the tensors and the flag. Injected by the
    test launcher (tests/helpers/fault_injection.py)."""
    run_dir = str(tmp_path)
    env = {fault_injection.CORRUPT_ENV: "1"}
    args = tiny_args(tiny_world, run_dir)
    rc, log = run_cli(args, run_dir, env=env, timeout=600, launcher=fault_injection.LAUNCHER)
    assert rc != 0
    assert "weight sync check failed after version 1" in log and "--vllm.sync_check_tol" in log
    assert "qkv_proj.weight" in log  # which tensors differ
    assert "Global step 2" not in log  # stopped at the first sync, no training on garbage rollouts


@pytest.mark.stack
def test_weight_sync_difference_below_canary_tolerance_is_named(tiny_world, tmp_path):
    """One element of one tensor off by 1e-3 after the sync (injected): far below what the canary's
    log-prob tolerance can see, but the per-tensor checksums catch it and name the tensor. Injected by the test
    launcher (tests/helpers/fault_injection.py)."""
    run_dir = str(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    env = {fault_injection.PERTURB_ENV: name}
    flags = ["--ds.param_dtype", "fp32", "--vllm.dtype", "float32"]
    args = tiny_args(tiny_world, run_dir) + flags
    rc, log = run_cli(args, run_dir, env=env, timeout=600, launcher=fault_injection.LAUNCHER)
    assert rc != 0, log[-3000:]
    assert "weight sync check failed after version 1" in log
    assert "1 of " in log and name in log, log[-3000:]


@pytest.mark.stack
def test_startup_canary_stops_an_engine_that_computes_another_function(tiny_world, tmp_path):
    """The start-up self-check's engine canary before the first rollout: the engine and the trainer differ by
    rounding (~1e-2 nats here in bf16, less in fp32, never 0: other kernels), so a tolerance of 1e-9 makes it fire,
    as an engine with another LM head or kernels would at the default; the run stops before training, naming the
    contract and the flags."""
    run_dir = str(tmp_path)
    rc, log = run_cli(tiny_args(tiny_world, run_dir) + ["--vllm.sync_check_tol", "1e-9"], run_dir, timeout=600)
    assert rc != 0
    assert "start-up self-check failed (engine contract): before any weight sync" in log, log[-3000:]
    assert "--selfcheck off" in log and "--vllm.sync_check_tol" in log
    assert "Global step 1" not in log  # no training on a mismatched engine


FAILING_REWARD = """
import torch


def reward_func(queries, prompts, labels):
    if "a" in prompts[0]:
        raise ValueError("reward service down")
    return {"rewards": torch.tensor([1.0]), "scores": torch.tensor([1.0]), "extra_logs": {}}
"""


@pytest.mark.real_stack
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["drop", "stop"])
def test_reward_function_failure_policy(tiny_world, tmp_path, policy):
    run_dir = str(tmp_path)
    reward = tmp_path / "reward.py"
    reward.write_text(FAILING_REWARD)
    args = tiny_args(tiny_world, run_dir)
    args[args.index("--reward.remote_url") + 1] = str(reward)
    rc, log = run_cli(args + ["--reward.failure_policy", policy], run_dir)
    if policy == "stop":
        assert rc != 0 and "the reward function returned None" in log and "--reward.failure_policy drop" in log
    else:
        scalars = _check_run(run_dir, rc, log, steps=2)
        failed = [v for _, v in scalars["train/reward_failed"]]
        assert 0 < max(failed) <= 1  # some samples' rewards failed, were counted and dropped
