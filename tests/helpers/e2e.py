"""Run the real CLI (Ray + vLLM CPU + DeepSpeed) on the tiny world in a subprocess, for tests."""

import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The engine process layout GPU users get for a tensor-parallel size of 1: upstream builds the engine with vLLM's "uni"
# executor, so the worker runs inside vLLM's EngineCore process. vLLM CPU replaces "uni" by its multiprocess executor
# (a worker process of its own, talking through /dev/shm queues) unless this variable is 0 (vllm/platforms/cpu.py).
# The feature runs of run_cli take GPU's layout: one process fewer to start, ~11 s a run here (docs/tests.md). The
# fault tests (tests/helpers/faults.py) and the runs that keep what a CPU user gets pass CPU_ENGINE_LAYOUT.
GPU_ENGINE_LAYOUT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
CPU_ENGINE_LAYOUT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
TEST_KV_GB = 0.0625  # the test runs' KV cache per engine (64 MiB), as the in-process test engines have


def ray_temp_dir(run_dir: str) -> str:
    """The private Ray temp dir of a test run (short: Ray's socket paths must stay under ~107 chars)."""
    return os.path.join("/tmp", "ray_ess_" + os.path.basename(run_dir.rstrip("/"))[-20:])


def tiny_args(world: dict, run_dir: str, steps_prompts: int = 16, compiled: bool = False, kv_cache_gb=TEST_KV_GB):
    """CLI flags for a short tiny run: ``steps_prompts`` prompts in batches of 8 (4 samples each). The engine runs
    eager (``--vllm.enforce_eager``) unless ``compiled``: torch.compile's warm-up takes 8-30 s of a 2-core machine
    per run (docs/tests.md); the runs that keep the compiled engine users get by default say so. Its KV cache is
    ``kv_cache_gb`` (``--vllm.cpu_kv_cache_gb``; ``None``: the CLI's default, 1 GiB, whose zeroing took 5-11 s of a
    run's start here); 64 MiB holds 65,536 tokens, 20x what the largest test run keeps at once."""
    args = [
        "--actor.model_name_or_path",
        world["model"],
        "--data.prompt_dataset",
        world["prompts"],
        "--data.max_samples",
        str(steps_prompts),
        "--data.input_key",
        "input",
        "--reward.remote_url",
        world["reward"],
        "--algo.advantage.estimator",
        "reinforce_baseline",
        "--algo.kl.init_coef",
        "0",
        "--actor.num_gpus_per_node",
        "1",
        "--vllm.num_engines",
        "1",
        "--rollout.batch_size",
        "8",
        "--rollout.n_samples_per_prompt",
        "4",
        "--rollout.micro_batch_size",
        "8",
        "--train.batch_size",
        "32",
        "--train.micro_batch_size",
        "8",
        "--rollout.max_new_tokens",
        "16",
        "--data.max_len",
        "64",
        "--actor.adam.lr",
        "1e-3",
        "--actor.lr_warmup_ratio",
        "0",
        "--ds.zero_stage",
        "2",
        "--ds.attn_implementation",
        "sdpa",
        "--ckpt.output_dir",
        os.path.join(run_dir, "ckpt"),
        "--ckpt.path",
        os.path.join(run_dir, "ckpt", "checkpoints"),
        "--logger.tensorboard_dir",
        os.path.join(run_dir, "tb"),
        "--logger.wandb.run_name",
        "e2e",
        "--ray.temp_dir",
        ray_temp_dir(run_dir),
    ]
    if not compiled:
        args.append("--vllm.enforce_eager")
    if kv_cache_gb is not None:
        args += ["--vllm.cpu_kv_cache_gb", str(kv_cache_gb)]
    return args


# What the last run_cli left: "leftovers" (processes of the run still alive 20 s after the CLI exited; then ended)
# and "shm_left" (/dev/shm files its processes used that are still there); tests/test_e2e_cli.py::_check_run.
LAST_RUN: dict = {}


def run_cli(args: list, run_dir: str, timeout: int = 600, launcher=None, env=None, settle: float = 20.0):
    """Run the CLI; (exit status, console log). Every process the run starts is tracked by PID (the CLI's tree,
    ``tests/helpers/faults.py::_Tree``) and none outlives this call: on a timeout (``subprocess.TimeoutExpired`` is
    raised, as ``subprocess.run`` did) or any exception all of them are ended; after a normal exit, those still
    there ``settle`` seconds later are recorded in :data:`LAST_RUN` and ended.

    The engine's worker runs inside vLLM's EngineCore process (:data:`GPU_ENGINE_LAYOUT`), unless ``env`` says
    otherwise."""
    from tests.helpers.faults import _Tree, end_processes

    cmd = (launcher or [sys.executable, "-m"]) + ["openrlhf_ess.cli.train_ppo_ray"] + args
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": run_dir}
    full_env.update({**GPU_ENGINE_LAYOUT, **(env or {})})
    LAST_RUN.clear()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        with _Tree(proc.pid) as tree:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise  # _Tree ends the rest of the run
    deadline = time.time() + settle
    while tree.alive() and time.time() < deadline:
        time.sleep(0.5)
    left = tree.alive()
    LAST_RUN.update(leftovers=[f"{p.pid} {tree.seen[p.pid][1]}" for p in left], shm_left=tree.shm_left())
    end_processes(left)
    return rc, open(os.path.join(run_dir, "log.txt")).read()


def read_tensorboard(run_dir: str) -> dict:
    """{tag: [(step, value), ...]} from the run's tensorboard folder."""
    from openrlhf_ess.tools.summary import read_scalars

    return read_scalars(os.path.join(run_dir, "tb"))


if __name__ == "__main__":
    print(" ".join(tiny_args({"model": "M", "prompts": "P", "reward": "R"}, sys.argv[1])))
