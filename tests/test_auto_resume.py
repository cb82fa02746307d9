"""--train.auto_resume N (openrlhf_ess/cli/auto_resume.py, docs/faults.md §4a): the CLI supervises its run and starts
it again from the newest complete checkpoint after a death during training.

The decision and the command rewriting are pure functions, tested case by case; the supervisor's loop runs a fake
child (a tiny ``python -c`` script that reports through the same status file the CLI writes) and a fake checkpoint
folder; the real-stack test (slow) SIGKILLs the policy rank of a real run once and checks with the audit trail that
the supervised run trains every prompt exactly as often as an uninterrupted one.
"""

import collections
import glob
import json
import os
import re
import shutil
import signal
import sys
import threading
import time

import pytest

from openrlhf_ess.cli import auto_resume
from openrlhf_ess.cli.auto_resume import child_argv, decide

# ---- the decision ---------------------------------------------------------------------------------------------------

BEGAN = {"training_began": True}


def _failed(kind, began=True, message="it died"):
    return {"training_began": began, "failure": kind, "message": message}


@pytest.mark.parametrize(
    "rc,status,newest,restarts,signalled,restart,code,why",
    [
        (0, BEGAN, 2, 0, None, False, 0, "the run finished"),
        (2, {}, None, 0, None, False, 2, "bad input (exit 2"),
        # the CLI stopped by a signal: 128 + the signal's number
        (143, BEGAN, 2, 0, None, False, 143, "stopped by SIGTERM (exit 143): not restarted"),
        (130, BEGAN, 2, 0, None, False, 130, "stopped by SIGINT"),
        (129, BEGAN, 2, 0, None, False, 129, "stopped by SIGHUP"),
        # the CLI process itself killed by a signal (Popen's returncode -9): the shell's 137
        (-9, BEGAN, 2, 0, None, False, 137, "killed by SIGKILL"),
        # the supervisor signalled: whatever the child's code
        (1, _failed("ActorDied"), 2, 0, signal.SIGTERM, False, 143, "SIGTERM received: stopped"),
        # start-up: classified, or the child ended before it said anything (no status file)
        (1, _failed("StartupFailed", began=False), 2, 0, None, False, 1, "a start-up failure"),
        (1, _failed("StartupFailed", began=True), 2, 0, None, False, 1, "a start-up failure"),  # an init seen late
        (1, _failed("EngineDied", began=False), 2, 0, None, False, 1, "before training began"),
        (1, {}, 2, 0, None, False, 1, "an unclassified error: (no message; the traceback is above) -- before"),
        # during training, but a restart would meet the same failure
        (1, _failed("OutputFailed"), 2, 0, None, False, 1, "an output could not be written"),
        (1, _failed("RewardFailed"), 2, 0, None, False, 1, "the reward function failed"),
        # during training: restarted while a complete checkpoint exists and restarts are left
        (1, _failed("ActorDied"), None, 0, None, False, 1, "nothing to resume from"),
        (1, _failed("ActorDied"), 2, 0, None, True, 1, "ActorDied: it died"),
        (1, _failed("EngineDied"), 0, 1, None, True, 1, "EngineDied: it died"),  # step 0 is a checkpoint too
        (1, _failed("EngineHung"), 3, 1, None, True, 1, "EngineHung"),
        (1, _failed("RayTaskError(RuntimeError)", message="RuntimeError: CUDA error"), 2, 0, None, True, 1, "CUDA"),
        (1, BEGAN, 2, 0, None, True, 1, "an unclassified error"),  # began, then no classified failure
        (1, _failed("ActorDied"), 2, 2, None, False, 1, "ActorDied: it died -- all 2 restart(s) used"),
        # another exit code: not ours
        (3, BEGAN, 2, 0, None, False, 3, "exited with code 3"),
    ],
)
def test_every_exit_kind_is_decided(rc, status, newest, restarts, signalled, restart, code, why):
    decision = decide(rc, status, newest, restarts, 2, signalled, ckpt_path="/ckpt")
    assert (decision.restart, decision.exit_code) == (restart, code), decision
    assert why in decision.why, decision.why


def test_nothing_to_resume_from_names_the_folder_and_the_flag():
    why = decide(1, _failed("ActorDied"), None, 0, 3, ckpt_path="/runs/a/ckpt").why
    assert "no complete checkpoint under /runs/a/ckpt" in why and "--ckpt.save_steps" in why


def test_a_long_failure_message_is_cut():
    text = auto_resume.failure_text(_failed("ActorDied", message="x" * 1000), limit=50)
    assert len(text) == 50 and text.startswith("ActorDied: xxx") and text.endswith("...")


# ---- the command of each attempt ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,resume,expected",
    [
        (["--a", "1", "--train.auto_resume", "3", "--b"], False, ["--a", "1", "--b"]),
        (["--a", "1", "--train.auto_resume", "3", "--b"], True, ["--a", "1", "--b", "--ckpt.load_enable"]),
        (["--train.auto_resume=2", "--a", "1"], True, ["--a", "1", "--ckpt.load_enable"]),
        # --ckpt.load_enable given: kept where it is, never twice
        (["--ckpt.load_enable", "--train.auto_resume", "1"], True, ["--ckpt.load_enable"]),
        (["--ckpt.load_enable", "--train.auto_resume", "1"], False, ["--ckpt.load_enable"]),
        # a value that only looks like the flag's is another flag's value; a longer flag is another flag
        (["--train.auto_resume_x", "1", "--train.auto_resume", "1"], False, ["--train.auto_resume_x", "1"]),
    ],
)
def test_the_flag_is_removed_and_load_enable_added_once(argv, resume, expected):
    assert child_argv(argv, resume) == expected
    assert child_argv(child_argv(argv, resume), resume) == expected  # a restart's command rewritten again: the same


def test_the_rewritten_command_parses_to_the_same_run_without_the_supervisor(tmp_path):
    """The child's flags, parsed by the CLI's parser: auto-resume off, --ckpt.load_enable on, the rest unchanged."""
    argv = _flags("--train.auto_resume", "2", "--ckpt.save_steps", "1", "--ckpt.path", str(tmp_path))
    supervisor = _parse(argv)
    child = _parse(child_argv(argv, resume=True))
    assert supervisor.train.auto_resume == 2 and child.train.auto_resume == 0
    assert not supervisor.ckpt.load_enable and child.ckpt.load_enable
    assert (child.ckpt.path, child.ckpt.save_steps) == (str(tmp_path), 1)


def test_every_attempt_runs_the_command_that_started_the_supervisor():
    """``sys.orig_argv`` up to the flags: the interpreter's options and a launcher module in front of the CLI stay."""
    flags = ["--a", "1", "--train.auto_resume", "2"]
    python = sys.executable
    cli = auto_resume.CLI_MODULE
    launched = ["python3", "-X", "dev", "-m", "tests.helpers.fault_injection", cli, *flags]
    assert auto_resume.launch_command(flags, launched) == [
        python,
        "-X",
        "dev",
        "-m",
        "tests.helpers.fault_injection",
        cli,
    ]
    assert auto_resume.launch_command(flags, ["python", "-m", cli, *flags]) == [python, "-m", cli]
    # main(argv) called with flags of its own (not this process's command line): the CLI module
    assert auto_resume.launch_command(flags, ["pytest", "-q", "tests"]) == [python, "-m", cli]


# ---- validation -----------------------------------------------------------------------------------------------------


def _flags(*extra):
    return ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p", "--reward.remote_url", "r.py"] + [
        "--ds.attn_implementation",
        "sdpa",
        *extra,
    ]


def _parse(argv):
    from openrlhf_ess.cli.train_ppo_ray import parse_args

    return parse_args(argv)[0]


def test_auto_resume_needs_checkpoints():
    from openrlhf_ess.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _parse(_flags("--train.auto_resume", "2"))
    assert str(info.value) == (
        "--train.auto_resume 2 restarts the run from its newest complete checkpoint, but --ckpt.save_steps -1 writes "
        "none: add --ckpt.save_steps K (a checkpoint every K steps; a restart repeats at most the K steps since the "
        "last one), or drop --train.auto_resume."
    )
    with pytest.raises(ConfigError, match="--train.auto_resume must be >= 0"):
        _parse(_flags("--train.auto_resume", "-1"))
    with pytest.raises(ConfigError, match="with --ckpt.disable_ds: the step checkpoints then hold no DeepSpeed"):
        _parse(_flags("--train.auto_resume", "1", "--ckpt.save_steps", "1", "--ckpt.disable_ds"))
    assert _parse(_flags()).train.auto_resume == 0  # default off
    assert _parse(_flags("--train.auto_resume", "1", "--ckpt.save_steps", "5")).train.auto_resume == 1


def test_the_fit_call_marks_training_began_for_a_supervisor(tmp_path, monkeypatch):
    """The CLI's controller wrapper writes the status file when upstream's train() calls fit(); unset, nothing."""
    from openrlhf_ess.cli.train_ppo_ray import _FitCall

    class Method:
        def remote(self):
            return "ref"

    monkeypatch.delenv(auto_resume.STATUS_ENV, raising=False)
    assert _FitCall(Method(), threading.Event()).remote() == "ref" and not os.listdir(tmp_path)
    status = tmp_path / "status.json"
    monkeypatch.setenv(auto_resume.STATUS_ENV, str(status))
    started = threading.Event()
    _FitCall(Method(), started).remote()
    assert started.is_set() and auto_resume.read_status(str(status)) == {"training_began": True}
    auto_resume.record_failure("ActorDied", "the rank\n  died")
    assert auto_resume.read_status(str(status)) == {
        "training_began": True,
        "failure": "ActorDied",
        "message": "the rank died",
    }


# ---- the supervisor's loop, with a fake child ----------------------------------------------------------------------

# A stand-in for the CLI: records its argv, then ends as the attempt's line of PLAN says (an exit code, and what it
# writes to the status file first), the last line for any later attempt.
FAKE_CHILD = """
import json, os, signal, sys, time
from openrlhf_ess.cli import auto_resume

folder = os.environ["FAKE_CHILD_DIR"]
attempt = len([n for n in os.listdir(folder) if n.startswith("argv")])
with open(os.path.join(folder, f"argv{attempt}.json"), "w") as f:
    json.dump(sys.argv[1:], f)
plan = json.load(open(os.path.join(folder, "plan.json")))
step = plan[min(attempt, len(plan) - 1)]
if step.get("began"):
    auto_resume.mark_training_began()
if step.get("failure"):
    auto_resume.record_failure(step["failure"], step["message"])
if step.get("wait_for_signal"):
    def stop(signum, frame):
        # written whole, then renamed: the test polls for the name and must never read it half-written
        path = os.path.join(folder, f"signalled{attempt}")
        with open(path + ".part", "w") as f:
            f.write(str(signum))
        os.replace(path + ".part", path)
        if step["wait_for_signal"] == "exit":
            sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    open(os.path.join(folder, "waiting"), "w").close()
    for _ in range(600):
        time.sleep(0.05)
sys.exit(step["rc"])
"""


def _fake_checkpoint(ckpt: str, step: int) -> None:
    """A complete sync checkpoint of ``step`` (DeepSpeed-like files, ``latest`` naming it: tests/test_resume.py)."""
    from tests.test_resume import _ds_files

    _ds_files(os.path.join(ckpt, "_actor", f"global_step{step}"))
    with open(os.path.join(ckpt, "_actor", "latest"), "w") as f:
        f.write(f"global_step{step}")


def _supervise(tmp_path, monkeypatch, plan, max_restarts=2, checkpoint_step=None, **kwargs):
    ckpt = str(tmp_path / "ckpt")
    if checkpoint_step is not None:
        _fake_checkpoint(ckpt, checkpoint_step)
    folder = tmp_path / "child"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps(plan))
    monkeypatch.setenv("FAKE_CHILD_DIR", str(folder))
    lines = []
    argv = ["--x", "1", "--train.auto_resume", str(max_restarts)]
    rc = auto_resume.supervise(
        argv,
        max_restarts,
        ckpt,
        need_sidecar=False,
        command=[sys.executable, "-c", FAKE_CHILD],
        log=lines.append,
        **kwargs,
    )
    argvs = [json.loads((folder / f"argv{i}.json").read_text()) for i in range(len(glob.glob(f"{folder}/argv*")))]
    return rc, lines, argvs, folder


DIED = {"rc": 1, "began": True, "failure": "ActorDied", "message": "the DeepSpeed policy (actor) model rank died"}


def test_a_death_during_training_is_resumed_once_then_the_run_finishes(tmp_path, monkeypatch):
    rc, lines, argvs, _ = _supervise(tmp_path, monkeypatch, [DIED, {"rc": 0}], checkpoint_step=2)
    assert rc == 0
    assert argvs == [["--x", "1"], ["--x", "1", "--ckpt.load_enable"]]
    restarts = [line for line in lines if "attempt" in line]
    assert len(restarts) == 1 and len(lines) == 3, lines  # the "on" line, one restart line, the summary
    assert restarts[0].startswith(
        "[openrlhf-ess] auto-resume: attempt 1/2: the run failed during training (ActorDied: "
    )
    assert "restarting from global_step2 (step 2, the newest complete checkpoint under " in restarts[0]
    assert lines[-1].startswith("[openrlhf-ess] auto-resume: the run finished after 1 restart(s); failures in order: ")
    assert re.search(
        r"1\) from the start, after \d+ s: ActorDied: the DeepSpeed policy \(actor\) model rank died$", lines[-1]
    )


def test_all_restarts_used_exits_with_the_last_failure_and_lists_every_one(tmp_path, monkeypatch):
    engine = {"rc": 1, "began": True, "failure": "EngineDied", "message": "a vLLM engine's processes died"}
    rc, lines, argvs, _ = _supervise(tmp_path, monkeypatch, [DIED, DIED, engine], checkpoint_step=1)
    assert rc == 1 and len(argvs) == 3
    assert [line.split(":")[1].strip() for line in lines if "attempt" in line] == ["attempt 1/2", "attempt 2/2"]
    assert lines[-2].startswith("[openrlhf-ess] auto-resume: not restarted: EngineDied: a vLLM engine's processes")
    assert lines[-2].endswith("all 2 restart(s) used")
    final = lines[-1]
    assert final.startswith("[openrlhf-ess] auto-resume: exit 1 after 2 restart(s); failures in order: 1) from the ")
    order = [final.index(s) for s in ("1) from the start", "2) resumed from step 1", "3) resumed from step 1")]
    assert order == sorted(order) and final.count("ActorDied") == 2 and "EngineDied" in final


def test_no_checkpoint_no_restart(tmp_path, monkeypatch):
    rc, lines, argvs, _ = _supervise(tmp_path, monkeypatch, [DIED, {"rc": 0}], checkpoint_step=None)
    assert rc == 1 and len(argvs) == 1
    assert "nothing to resume from" in lines[-1] and "--ckpt.save_steps" in lines[-1]


@pytest.mark.parametrize(
    "plan,code",
    [
        ({"rc": 2}, 2),
        ({"rc": 1, "failure": "StartupFailed", "message": "start-up failed, before training began"}, 1),
        ({"rc": 143, "began": True}, 143),
    ],
    ids=["bad-input", "start-up", "signal-stop"],
)
def test_never_restarted(tmp_path, monkeypatch, plan, code):
    rc, lines, argvs, _ = _supervise(tmp_path, monkeypatch, [plan, {"rc": 0}], checkpoint_step=2)
    assert (rc, len(argvs)) == (code, 1), lines
    assert "not restarted" in lines[-1] and not [line for line in lines if "attempt" in line]


@pytest.mark.parametrize("child_exits", [True, False], ids=["child-exits", "child-ignores-sigterm"])
def test_a_signal_to_the_supervisor_is_forwarded_and_never_restarted(tmp_path, monkeypatch, child_exits):
    """SIGTERM to the supervisor reaches the child's process group; the child that ends by itself is waited for, one
    that does not is SIGKILLed after the grace; the supervisor exits 128 + 15 and restarts nothing."""
    folder = tmp_path / "child"
    waiting = folder / "waiting"

    def signal_when_waiting():
        deadline = time.time() + 60
        while not waiting.exists() and time.time() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_when_waiting, daemon=True)
    sender.start()
    wait = {"rc": 1, "began": True, "wait_for_signal": "exit" if child_exits else "ignore"}
    previous = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    rc, lines, argvs, _ = _supervise(tmp_path, monkeypatch, [wait, {"rc": 0}], checkpoint_step=2, grace_s=1.0)
    seconds = time.monotonic() - t0
    sender.join()
    assert rc == 143 and len(argvs) == 1, lines
    assert (folder / "signalled0").read_text() == str(int(signal.SIGTERM))
    assert "SIGTERM received: stopping the run (forwarded to its process group; SIGKILL after 1 s)" in lines[1]
    assert not [line for line in lines if "attempt" in line]
    assert signal.getsignal(signal.SIGTERM) is previous  # the supervisor's handlers are gone with it
    if not child_exits:
        assert 1.0 <= seconds < 20, seconds  # SIGKILLed after the grace (the child would sleep 30 s)


def test_a_killed_supervisor_stops_its_run(tmp_path):
    """SIGKILL to the supervisor (nothing it can forward): its child, in a process group of its own, gets SIGTERM
    from the kernel (PR_SET_PDEATHSIG) and stops, instead of training on unsupervised."""
    import subprocess

    folder = tmp_path / "child"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps([{"rc": 1, "wait_for_signal": "exit"}]))
    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    call = f"auto_resume.supervise(['--x'], 1, {str(tmp_path / 'ckpt')!r}, False, [sys.executable, {str(script)!r}])"
    supervisor = f"import sys; from openrlhf_ess.cli import auto_resume; sys.exit({call})"
    env = {**os.environ, "FAKE_CHILD_DIR": str(folder)}
    proc = subprocess.Popen([sys.executable, "-c", supervisor], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not (folder / "waiting").exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.02)
        proc.kill()
        proc.wait()
        while not (folder / "signalled0").exists():
            assert time.time() < deadline, "the child of a SIGKILLed supervisor got no SIGTERM"
            time.sleep(0.02)
        assert (folder / "signalled0").read_text() == str(int(signal.SIGTERM))
    finally:
        proc.kill()


# ---- the real stack: one policy rank SIGKILLed after checkpoint 2, the supervised run finishes --------------------

N_PROMPTS, BATCH, N_SAMPLES, EPISODES = 16, 8, 4, 2
STEPS = N_PROMPTS // BATCH * EPISODES  # 4


def _policy_rank_pids(tree) -> list:
    import psutil

    tree.sample(shm=False)
    pids = []
    for p in tree.alive():
        try:
            if " ".join(p.cmdline()).startswith("ray::PolicyModelActor"):
                pids.append(p.pid)
        except psutil.Error:
            pass
    return pids


@pytest.mark.real_stack
@pytest.mark.slow
def test_a_killed_policy_rank_is_resumed_and_every_prompt_trained_once(tiny_world, tmp_path):
    """A supervised async run (--train.auto_resume 1, --ckpt.save_steps 1, no --ckpt.load_enable) whose only
    DeepSpeed policy rank is SIGKILLed once, after checkpoint 2 is complete (the run held by the test launcher's hold
    right after step 3's batch was written to the audit trail, before its update): the run dies during training
    (ActorDied), one restart line names global_step2, the restarted run finishes (exit 0), and the audit trail's
    trained prompts (steps 1-2 of the first attempt, steps 3-4 of the second) are the prompt file's, each
    n_samples_per_prompt x 2 episodes times. No process of either attempt is left."""
    from transformers import AutoTokenizer

    from tests.helpers import fault_injection
    from tests.helpers.e2e import GPU_ENGINE_LAYOUT, tiny_args
    from tests.helpers.faults import run_cli_tracked
    from tests.test_resume import _prompt_texts, _saved_step, _trained

    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=N_PROMPTS)
    args += ["--train.async_enable", "--ds.param_dtype", "fp32", "--vllm.dtype", "float32"]
    args += ["--algo.prox_mode", "snapshot", "--algo.prox_audit_dir", audit, "--train.num_episodes", str(EPISODES)]
    args += ["--ckpt.save_steps", "1", "--train.auto_resume", "1"]
    ckpt = args[args.index("--ckpt.path") + 1]
    release = os.path.join(run_dir, "release")
    env = {**GPU_ENGINE_LAYOUT, fault_injection.HOLD_ENV: "audit:2", fault_injection.HOLD_RELEASE_ENV: release}
    times = {}

    def kill_the_rank_once(proc, tree):
        deadline = time.time() + 600
        while not os.path.exists(os.path.join(audit, "batch_v2.pt")):  # step 3's batch: the run holds after it
            assert proc.poll() is None, open(os.path.join(run_dir, "log.txt")).read()[-4000:]
            assert time.time() < deadline, "step 3's batch not made within 10 minutes"
            time.sleep(0.05)
        assert _saved_step(ckpt) == 2, _saved_step(ckpt)
        assert os.path.exists(os.path.join(ckpt, "_actor", "global_step2", "openrlhf_ess_resume.pkl"))
        shutil.move(audit, audit + "_first")  # the restarted run's versions start at 0 again: its own trail
        (rank,) = _policy_rank_pids(tree)
        os.kill(rank, signal.SIGKILL)
        times["killed"] = time.time()
        open(release, "w").close()  # the held controller goes on to the update, on the dead rank
        while "auto-resume: attempt 1/1" not in open(os.path.join(run_dir, "log.txt")).read():
            assert proc.poll() is None, open(os.path.join(run_dir, "log.txt")).read()[-4000:]
            assert time.time() < deadline, "no restart within 10 minutes"
            time.sleep(0.05)
        times["restarted"] = time.time()
        while not glob.glob(os.path.join(audit, "batch_v*.pt")):  # the restarted run's first trained batch
            assert proc.poll() is None, open(os.path.join(run_dir, "log.txt")).read()[-4000:]
            assert time.time() < deadline, "the restarted run trained nothing within 10 minutes"
            time.sleep(0.05)
        times["first_batch"] = time.time()

    run = run_cli_tracked(
        args, run_dir, timeout=1200, env=env, during=kill_the_rank_once, launcher=fault_injection.LAUNCHER
    )
    log = run.log
    assert run.rc == 0 and not run.timed_out, log[-5000:]
    assert not run.leftovers, run.leftovers
    restarts = [line for line in log.splitlines() if "auto-resume: attempt" in line]
    assert len(restarts) == 1, restarts
    assert (
        "attempt 1/1: the run failed during training (ActorDied: the DeepSpeed policy (actor) model rank"
        in restarts[0]
    )
    assert "restarting from global_step2 (step 2," in restarts[0]
    assert "resume: restored global_step2 (step 2," in log

    prompts = _prompt_texts(tiny_world["prompts"], N_PROMPTS)
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    before = _trained(audit + "_first", tokenizer, prompts, last_step=2)
    after = _trained(audit, tokenizer, prompts)
    expected = collections.Counter({p: k * N_SAMPLES * EPISODES for p, k in prompts.items()})
    assert before + after == expected, (before, after)
    assert sum(before.values()) == 2 * BATCH * N_SAMPLES
    assert len(glob.glob(f"{audit}/batch_v*.pt")) == STEPS - 2
    print(
        f"[timing] auto-resume: run {run.seconds:.0f} s; from the SIGKILL to the restart line "
        f"{times['restarted'] - times['killed']:.1f} s, to the restarted run's first batch "
        f"{times['first_batch'] - times['killed']:.1f} s"
    )
