"""The user's outputs on the real stack (docs/faults.md §8), in one sequence of runs:

1. a sync run (2 steps, a checkpoint after each) whose final save fails (a write failure injected into rank 0's
   save_pretrained with OPENRLHF_ESS_TEST_FAULT_FINAL_SAVE=EACCES under the test launcher
   tests/helpers/fault_injection.py, as an output folder that became unwritable makes it fail): exit 1, our last
   line names --ckpt.output_dir, the cause and the fallback folder, which holds the trained model (it loads);
   nothing partial in the output folder;
2. while it runs, the same command again: refused at once (exit 2), naming the first run's PID and command;
3. the newest checkpoint cut short, then the same command with --ckpt.load_enable: the broken step is moved aside,
   the one before loaded (a line says so), the run trains the last step again and saves the model in place.

The same failure (ENOSPC) under ZeRO-3 with two policy ranks (no rank is left waiting in a collective) is the final
save of the stack tier's two-rank run (tests/test_e2e_scale.py), which needs that run anyway.
Every run is tracked by PID and ended on any exit (tests/helpers/faults.py::run_cli_tracked). The runs take the
engine's process layout GPU users get (tests/helpers/e2e.py::GPU_ENGINE_LAYOUT): what is tested here does not depend
on it, and vLLM CPU's own layout adds a worker process pinned to one core (~20-40 s of each run's start here).
"""

import glob
import json
import os
import re
import shutil
import threading
import time

import pytest

from openrlhf_ess.runtime import run_lock
from openrlhf_ess.trainer import saving
from tests.helpers import fault_injection
from tests.helpers.e2e import GPU_ENGINE_LAYOUT, tiny_args
from tests.helpers.faults import run_cli_tracked


@pytest.mark.real_stack
def test_a_failed_final_save_a_second_run_and_a_broken_checkpoint(tiny_world, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    args = tiny_args(tiny_world, run_dir) + ["--ckpt.save_steps", "1"]
    output_dir, ckpt = (args[args.index(flag) + 1] for flag in ("--ckpt.output_dir", "--ckpt.path"))
    fallback, thread = None, None
    try:
        # 1 and 2: the failing final save, and a second run started meanwhile
        first = {}
        thread = threading.Thread(
            target=lambda: first.update(
                run=run_cli_tracked(
                    args,
                    run_dir,
                    timeout=900,
                    env={fault_injection.FINAL_SAVE_ENV: "EACCES", **GPU_ENGINE_LAYOUT},
                    launcher=fault_injection.LAUNCHER,
                )
            )
        )
        thread.start()
        lock_path = os.path.join(output_dir, run_lock.LOCK_NAME)
        deadline = time.time() + 300
        while not os.path.exists(lock_path) and thread.is_alive() and time.time() < deadline:
            time.sleep(0.5)
        holder = json.load(open(lock_path))
        second_dir = str(tmp_path / "second")
        os.makedirs(second_dir)
        second_args = list(args)
        second_args[second_args.index("--ray.temp_dir") + 1] = "/tmp/ray_ess_second_" + str(os.getpid())
        start = time.time()
        second = run_cli_tracked(second_args, second_dir, timeout=300, settle=5, env=GPU_ENGINE_LAYOUT)
        second_seconds = time.time() - start
        thread.join()
        run = first["run"]
        assert second.rc == 2, second.log[-3000:]
        assert (
            f"openrlhf-ess: error: --ckpt.output_dir {output_dir}: in use by another run (PID {holder['pid']} on host"
            in second.log
        )
        assert "Started a local Ray instance" not in second.log and not second.leftovers

        assert run.rc == 1 and not run.timed_out, run.log[-5000:]
        errors = [i for i, line in enumerate(run.log.splitlines()) if line.startswith("openrlhf-ess: error:")]
        assert errors and errors[-1] >= len(run.log.splitlines()) - 5, run.log[-5000:]  # our line ends the run
        last = run.log.splitlines()[errors[-1]]
        match = re.search(r"it was written to (\S+) instead", last)
        assert (
            last.startswith(
                f"openrlhf-ess: error: the trained model could not be written to --ckpt.output_dir {output_dir} "
                f"(Permission denied (injected by {fault_injection.FINAL_SAVE_ENV})"
            )
            and match
        ), last
        fallback = match.group(1)
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(os.listdir(fallback))
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(fallback)  # a whole model
        assert sorted(os.listdir(output_dir)) == ["checkpoints"]  # no partial model, no staging, no lock
        assert not os.path.exists(os.path.join(ckpt, run_lock.LOCK_NAME)) and not run.leftovers
        assert not run.shm_left, run.shm_left  # /dev/shm as before the failed run
        assert open(os.path.join(ckpt, "_actor", "latest")).read().strip() == "global_step2"

        # 3: the newest checkpoint cut short, then a resume
        states = os.path.join(ckpt, "_actor", "global_step2", "mp_rank_00_model_states.pt")
        with open(states, "r+b") as f:
            f.truncate(os.path.getsize(states) // 2)
        third = run_cli_tracked(args + ["--ckpt.load_enable"], run_dir, timeout=900, env=GPU_ENGINE_LAYOUT)
        assert third.rc == 0 and not third.leftovers and not third.shm_left, (third.shm_left, third.log[-5000:])
        assert "checkpoint global_step2 is broken (mp_rank_00_model_states.pt is truncated" in third.log
        assert "loading global_step1, the newest complete one" in third.log
        assert f"resume: loading global_step1 from {ckpt}/_actor (the newest complete checkpoint)" in third.log
        (aside,) = glob.glob(os.path.join(ckpt, "_actor.incomplete", "global_step2-*"))
        assert os.path.getsize(os.path.join(aside, "mp_rank_00_model_states.pt")) > 0  # moved, not deleted
        assert os.path.isdir(os.path.join(ckpt, "_actor", "global_step2"))  # step 2 trained and saved again
        assert {"config.json", "model.safetensors"} <= set(os.listdir(output_dir))
        assert not os.path.exists(os.path.join(output_dir, saving.STAGING))
        with capsys.disabled():
            print(
                f"\nfailed final save {run.seconds:.0f} s, second run refused after {second_seconds:.0f} s, "
                f"resume {third.seconds:.0f} s"
            )
    finally:
        if thread is not None:
            thread.join()  # run_cli_tracked ends every process of the first run by its timeout at the latest
        if fallback and os.path.basename(fallback).startswith("openrlhf_ess_model_"):
            shutil.rmtree(fallback, ignore_errors=True)
