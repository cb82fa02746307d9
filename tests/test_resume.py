"""Async runs resume without losing prompts (openrlhf_ess/trainer/resume.py, docs/faults.md §4).

Expected values come from the prompt file (every prompt once per epoch, ``n_samples_per_prompt`` samples
each) and from the checkpoint the job left on disk (DeepSpeed's ``latest`` file, the folders the test
itself truncated); which prompts were trained comes from the audit trail (``--algo.prox_audit_dir``:
the batch the experience maker hands to the loss, written once per training step). The reward function
is not used for this: it runs at generation time, so it also sees the rollouts in flight at the kill,
which were never trained.
"""

import collections
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from openrlhf_ess.trainer import resume

N_PROMPTS, BATCH, N_SAMPLES, EPISODES = 32, 8, 4, 2  # tiny_world's 32 prompts, tiny_args' batches of 8
STEPS = N_PROMPTS // BATCH * EPISODES  # 8


# ---- the sidecar and the choice of checkpoint (no Ray) -------------------------------------------------


def _fake_checkpoint(ckpt: str, step: int, complete: bool, latest: bool = True) -> str:
    """A DeepSpeed-like step folder written by the test: one file of 'weights'; the sidecar if complete."""
    folder = os.path.join(ckpt, "_actor", f"global_step{step}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "mp_rank_00_model_states.pt"), "w") as f:
        f.write("x" * 100)
    if complete:
        resume.write_sidecar(ckpt, step, {"replay": [("p", "l", None)] * step, "weight_version": step})
    if latest:
        with open(os.path.join(ckpt, "_actor", "latest"), "w") as f:
            f.write(f"global_step{step}")
    return folder


def test_a_half_written_checkpoint_is_never_loaded(tmp_path):
    """Simulates a kill during the save of step 3 (its folder written, DeepSpeed's ``latest`` already naming
    it, no sidecar): the resume loads step 2, says so, and moves step 3 out of DeepSpeed's and upstream's
    rotation's sight."""
    ckpt = str(tmp_path)
    _fake_checkpoint(ckpt, 1, complete=True)
    _fake_checkpoint(ckpt, 2, complete=True)
    _fake_checkpoint(ckpt, 3, complete=False)
    lines = []
    restored = resume.prepare(ckpt, log=lines.append)
    assert restored["global_step"] == 2 and len(restored["replay"]) == 2
    assert open(os.path.join(ckpt, "_actor", "latest")).read() == "global_step2"
    assert sorted(os.listdir(os.path.join(ckpt, "_actor"))) == ["global_step1", "global_step2", "latest"]
    assert len(lines) == 1 and "global_step3 is incomplete" in lines[0] and "loading global_step2" in lines[0]
    assert os.listdir(os.path.join(ckpt, "_actor.incomplete"))[0].startswith("global_step3-")


def test_a_save_killed_before_latest_was_written_is_moved_aside(tmp_path):
    ckpt = str(tmp_path)
    _fake_checkpoint(ckpt, 1, complete=True)
    _fake_checkpoint(ckpt, 2, complete=False, latest=False)  # DeepSpeed writes `latest` last
    lines = []
    assert resume.prepare(ckpt, log=lines.append)["global_step"] == 1
    assert open(os.path.join(ckpt, "_actor", "latest")).read() == "global_step1" and len(lines) == 1


def test_no_sidecar_without_deepspeed_files(tmp_path):
    assert resume.write_sidecar(str(tmp_path), 1, {}) is None and not os.listdir(tmp_path)


def test_no_complete_checkpoint_starts_fresh_and_says_so(tmp_path):
    ckpt = str(tmp_path)
    _fake_checkpoint(ckpt, 1, complete=False)
    lines = []
    assert resume.prepare(ckpt, log=lines.append) is None
    assert not os.path.exists(os.path.join(ckpt, "_actor"))  # upstream then starts fresh
    assert "starting fresh" in lines[-1]


def test_a_truncated_sidecar_is_incomplete(tmp_path):
    ckpt = str(tmp_path)
    _fake_checkpoint(ckpt, 1, complete=True)
    folder = _fake_checkpoint(ckpt, 2, complete=True)
    with open(os.path.join(folder, resume.SIDECAR), "r+b") as f:
        f.truncate(5)
    assert resume.prepare(ckpt, log=lambda _: None)["global_step"] == 1


def _args(async_enable: bool, load: bool = True, save_steps: int = 1):
    return types.SimpleNamespace(
        train=types.SimpleNamespace(async_enable=async_enable),
        ckpt=types.SimpleNamespace(load_enable=load, save_steps=save_steps),
    )


def test_resume_handling_is_off_without_async():
    """Default off: without --train.async_enable nothing of ours runs at save or load (upstream's own
    checkpoint and data loader state, untouched); with async but no checkpoints, nothing either."""
    from openrlhf_ess import config

    assert not resume.applies(_args(False)) and not resume.applies(_args(False, load=False, save_steps=5))
    assert not resume.applies(_args(True, load=False, save_steps=-1))
    assert not resume.applies(_args(True, load=False, save_steps=float("inf")))  # upstream's -1 in the actors
    assert resume.applies(_args(True)) and resume.applies(_args(True, load=False, save_steps=2))
    assert not config.needs_our_controllers(_parsed())  # the sync controller is upstream's: its fit() saves
    assert config.needs_our_controllers(_parsed("--train.async_enable"))  # ours: it writes the sidecar


def _parsed(*extra):
    from openrlhf_ess.cli.train_ppo_ray import parse_args

    args, _ = parse_args(
        ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p", "--reward.remote_url", "r.py"]
        + ["--ckpt.save_steps", "1", "--ckpt.load_enable", "--ds.attn_implementation", "sdpa", *extra]
    )
    return args


def test_untrained_prompts_are_the_buffer_then_the_replay_not_yet_drawn():
    """The prompts queued with a batch as 'dispatched, not trained': one per buffered prompt group (its
    n samples are adjacent), then the replayed prompts not drawn yet; replay comes before the loader."""
    from openrlhf_ess.trainer.ppo_utils.samples_generator import SamplesGenerator

    gen = SamplesGenerator.__new__(SamplesGenerator)
    gen.args = types.SimpleNamespace(rollout=types.SimpleNamespace(n_samples_per_prompt=2))
    exp = [types.SimpleNamespace(prompts=[p], labels=["l"], images=[None]) for p in ("a", "a", "b", "b")]
    gen._sample_buffer = exp
    gen.replay_first([("c", "l", None), ("d", "l", None)])
    assert gen.untrained_prompts() == [("a", "l", None), ("b", "l", None), ("c", "l", None), ("d", "l", None)]
    drawn = gen._replaying(iter([(None, ["e"], ["l"], [None])]))
    assert next(drawn)[1] == ["c"]
    assert gen.untrained_prompts()[-1] == ("d", "l", None)
    assert [b[1][0] for b in drawn] == ["d", "e"]


# ---- the real stack: kill at a random point, resume with the same command ---------------------------


def _prompt_texts(path: str) -> collections.Counter:
    with open(path) as f:
        return collections.Counter(json.loads(line)["input"] for line in f if line.strip())


def _trained(audit: str, tokenizer, prompts, last_step=None) -> collections.Counter:
    """Prompt -> number of samples trained, from the audit trail's batches (batch_v<V>: step V + 1 in a run
    that has not resumed, whose versions count the syncs after each step); only steps <= ``last_step``."""
    count = collections.Counter()
    for path in glob.glob(f"{audit}/batch_v*.pt"):
        if last_step is not None and int(path.rsplit("_v", 1)[1][:-3]) + 1 > last_step:
            continue
        for mb in torch.load(path)["micro_batches"]:
            for seq, mask in zip(mb["sequences"], mb["attention_mask"]):
                text = tokenizer.decode(seq[mask.bool()], skip_special_tokens=True)
                match = [p for p in prompts if text.startswith(p)]
                assert match, text
                count[max(match, key=len)] += 1
    return count


def _saved_step(ckpt: str) -> int:
    try:
        tag = open(os.path.join(ckpt, "_actor", "latest")).read().strip()
    except OSError:
        return 0
    return int(tag[len("global_step") :]) if tag.startswith("global_step") else 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,seed,gen_batch,half_written",
    [
        ("interrupt", 0, None, False),  # exact mode; partial rollouts, one vLLM call per step
        ("snapshot", 1, 16, False),  # exact mode; one vLLM call per 2 steps: prompts buffered at the checkpoint
        ("ewma", 2, 16, True),  # and the newest checkpoint left half-written (simulated after the kill)
    ],
)
def test_killed_at_a_random_point_resumes_without_losing_prompts(
    tiny_world, tmp_path, mode, seed, gen_batch, half_written
):
    """SIGKILL to the job's process group a seeded random 0-6 s after its step-1 checkpoint (step 2 with
    ``half_written``), so between steps, mid-generation, mid-training or mid-save; then the same command
    again. Trained prompts: those of the first run's steps up to the checkpoint the second run loaded, plus
    all of the second run's, are the prompt file's, each n_samples_per_prompt x 2 episodes times; exact
    modes are exact after the resume.

    ``half_written``: after the kill the test truncates the newest checkpoint's weights file and deletes its
    sidecar (a kill during the save, simulated); the resume must load the previous one and say so."""
    from transformers import AutoTokenizer

    from tests.helpers.e2e import REPO as E2E_REPO
    from tests.helpers.e2e import tiny_args
    from tests.helpers.faults import _Tree, end_processes
    from tests.test_prox_modes import audit_exactness

    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=N_PROMPTS)
    args += ["--train.async_enable", "--train.partial_rollout_enable", "--ds.param_dtype", "fp32"]
    args += ["--vllm.dtype", "float32", "--algo.prox_mode", mode, "--algo.prox_audit_dir", audit]
    args += ["--ckpt.save_steps", "1", "--ckpt.load_enable"]  # upstream keeps the newest 3
    args += ["--train.num_episodes", str(EPISODES)]
    for flag, value in (("--rollout.max_new_tokens", "48"), ("--data.max_len", "96")):  # steps of a few s
        args[args.index(flag) + 1] = value
    if gen_batch:
        args += ["--rollout.vllm_generate_batch_size", str(gen_batch)]
    ckpt = args[args.index("--ckpt.path") + 1]
    ray_dir = args[args.index("--ray.temp_dir") + 1]
    cmd = [sys.executable, "-m", "openrlhf_ess.cli.train_ppo_ray", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": run_dir}

    t0 = time.time()
    with open(os.path.join(run_dir, "first.txt"), "w") as log:
        first = subprocess.Popen(
            cmd, cwd=E2E_REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    with _Tree(first.pid) as tree:
        deadline = time.time() + 600
        while _saved_step(ckpt) < 1 + half_written:  # half-written: keep one complete checkpoint before
            assert first.poll() is None, open(os.path.join(run_dir, "first.txt")).read()[-4000:]
            assert time.time() < deadline, "no step-1/2 checkpoint within 10 minutes"
            time.sleep(0.2)
        time.sleep(random.Random(seed).uniform(0, 6))
        tree.sample()
        os.killpg(first.pid, signal.SIGKILL)  # the job, its Ray head and workers started in its session
        first.wait(timeout=60)
    end_processes(tree.alive(), grace=5)  # Ray daemons that left the session: by PID, recorded above
    shutil.rmtree(ray_dir, ignore_errors=True)

    newest = _saved_step(ckpt)
    assert 1 <= newest < STEPS, newest  # it really stopped early
    sidecar_of_newest = os.path.join(ckpt, "_actor", f"global_step{newest}", resume.SIDECAR)
    if half_written:
        for path in glob.glob(os.path.join(ckpt, "_actor", f"global_step{newest}", "*model_states.pt")):
            with open(path, "r+b") as f:
                f.truncate(1000)
        if os.path.exists(sidecar_of_newest):
            os.remove(sidecar_of_newest)
    # The checkpoint the resume must load: `latest`'s unless that save had not completed (killed between
    # DeepSpeed's files and our sidecar, or truncated above); then the one before (saved every step).
    restored = newest if os.path.exists(sidecar_of_newest) else newest - 1
    shutil.move(audit, audit + "_first")  # the audit trail restarts with the run's versions
    first_seconds = time.time() - t0

    with open(os.path.join(run_dir, "second.txt"), "w") as log:
        rc = subprocess.run(cmd, cwd=E2E_REPO, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    second_log = open(os.path.join(run_dir, "second.txt")).read()
    assert rc == 0, second_log[-5000:]
    if restored < newest:
        assert f"checkpoint global_step{newest} is incomplete" in second_log
    assert f"resume: restored global_step{restored} (step {restored}," in second_log, second_log[-3000:]

    prompts = _prompt_texts(tiny_world["prompts"])
    assert sum(prompts.values()) == N_PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    before = _trained(audit + "_first", tokenizer, prompts, last_step=restored)
    after = _trained(audit, tokenizer, prompts)
    expected = collections.Counter({p: k * N_SAMPLES * EPISODES for p, k in prompts.items()})
    assert before + after == expected, (restored, before, after)
    assert sum(before.values()) == restored * BATCH * N_SAMPLES

    batches = len(glob.glob(f"{audit}/batch_v*.pt"))
    assert batches == STEPS - restored, (batches, restored)
    if mode in ("interrupt", "snapshot"):
        checked, stale, mixed, worst, gap = audit_exactness(audit, tiny_world["model"], batches)
        assert checked > 50 and worst < 1e-4, (checked, worst)
    print(f"[timing] {mode}: first run {first_seconds:.0f} s, killed after step {newest}, resumed from {restored}")
