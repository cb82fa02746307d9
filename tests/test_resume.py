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
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from openrlhf_ess.trainer import resume
from tests.helpers import fault_injection, span_gate

# The first 16 of tiny_world's 32 prompts (--data.max_samples: upstream selects the file's first lines), tiny_args'
# batches of 8: two steps an episode, so a resume after step 1 finishes the first episode and trains the second.
N_PROMPTS, BATCH, N_SAMPLES, EPISODES = 16, 8, 4, 2
STEPS = N_PROMPTS // BATCH * EPISODES  # 4


# ---- the sidecar and the choice of checkpoint (no Ray) -------------------------------------------------


def _ds_files(folder: str, stage: int = 2, dp: int = 1) -> None:
    """The files DeepSpeed writes for one step (names as its engine's; the model states' metadata as it saves them,
    tiny tensors): model states (one per rank with ZeRO-3) and one optimizer states file per data-parallel rank."""
    os.makedirs(folder, exist_ok=True)
    meta = {"module": {"w": torch.zeros(4)}, "dp_world_size": dp, "mp_world_size": 1}
    meta["ds_config"] = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}  # hence bf16_ names
    models = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)] if stage == 3 else []
    for name in models or ["mp_rank_00_model_states.pt"]:
        torch.save(meta, os.path.join(folder, name))
    for r in range(dp):
        torch.save(
            {"optimizer_state_dict": {"exp_avg": torch.ones(2)}},
            f"{folder}/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        )


def _fake_checkpoint(ckpt: str, step: int, complete: bool, latest: bool = True) -> str:
    """A DeepSpeed-like step folder written by the test (:func:`_ds_files`); the sidecar if complete."""
    folder = os.path.join(ckpt, "_actor", f"global_step{step}")
    _ds_files(folder)
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


def test_the_hold_parks_only_at_its_point_until_a_signal(monkeypatch):
    """The test launcher's hold (tests/helpers/fault_injection.py, HOLD_ENV) that pins the kill points of the
    kill-and-resume test: unset, another point or another step, no wait at all; its point, a wait that a signal's
    handler ends (Ray's worker handler raises SystemExit, as the handler here raises), and that is never silent: held
    past its limit, an error naming the variable; a value of another form, an error naming it."""

    def never(seconds):
        raise AssertionError("held where it must not wait")

    monkeypatch.delenv(fault_injection.HOLD_ENV, raising=False)
    fault_injection.hold_at("sidecar", 3, sleep=never)
    monkeypatch.setenv(fault_injection.HOLD_ENV, "sidecar:3")
    fault_injection.hold_at("sidecar", 2, sleep=never)
    fault_injection.hold_at("audit", 3, sleep=never)

    class Signalled(Exception):
        pass

    def handler(signum, frame):
        raise Signalled

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Signalled):
            fault_injection.hold_at("sidecar", 3, limit_s=60)
        assert 0.25 < time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    for wrong in ("sidecar", "save:3", "sidecar:three"):  # never a hold that silently does not come
        monkeypatch.setenv(fault_injection.HOLD_ENV, wrong)
        expected = f"{fault_injection.HOLD_ENV}='{wrong}': expected <point>:<n>, point one of"
        with pytest.raises(ValueError, match=expected):
            fault_injection.hold_at("sidecar", 3, sleep=never)
    monkeypatch.setenv(fault_injection.HOLD_ENV, "audit:1")
    expected = f"{fault_injection.HOLD_ENV}=audit:1: the run was held 0 s and not stopped"
    with pytest.raises(RuntimeError, match=expected):
        fault_injection.hold_at("audit", 1, limit_s=0.2)


def test_the_hold_wraps_the_product_functions_at_its_points(tmp_path, monkeypatch):
    """Where the launcher puts the hold: before ``resume.write_sidecar`` of the step (the sidecar not yet written)
    and after ``experience_maker.write_audit_batch`` of the version (the batch written); the wrapped functions
    still do their work."""
    calls = []
    monkeypatch.setattr(fault_injection, "hold_at", lambda point, n: calls.append(("hold", point, n)))
    sidecar = fault_injection.holding_before_sidecar(lambda ckpt, step, state: calls.append(("sidecar", step)))
    audit = fault_injection.holding_after_audit(lambda folder, version, exps: calls.append(("audit", version)))
    sidecar(str(tmp_path), 2, {})
    audit(str(tmp_path), 3, [])
    assert calls == [("hold", "sidecar", 2), ("sidecar", 2), ("audit", 3), ("hold", "audit", 3)]


def test_the_launcher_hook_wraps_the_product_functions_only_with_a_fault_set():
    """In a fresh process, as in a Ray worker: the launcher's set-up hook wraps ``resume.write_sidecar`` and
    ``saving.save_final_model`` when they are imported after it, and only when their variable is set."""
    code = (
        "from tests.helpers import fault_injection as fi; fi.install(); "
        "from openrlhf_ess.trainer import resume, saving; "
        "print(*(hasattr(f, '_fault_injection') for f in (resume.write_sidecar, saving.save_final_model)))"
    )
    env = {k: v for k, v in os.environ.items() if k not in fault_injection.ENVS}
    run = dict(env=env, cwd=fault_injection.REPO, capture_output=True, text=True, check=True)
    clean = subprocess.run([sys.executable, "-c", code], **run)
    env.update({fault_injection.HOLD_ENV: "sidecar:3", fault_injection.FINAL_SAVE_ENV: "EACCES"})
    faults = subprocess.run([sys.executable, "-c", code], **run)
    assert (clean.stdout.split(), faults.stdout.split()) == (["False", "False"], ["True", "True"])


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


# ---- the real stack: kill at a point of the run's progress, resume with the same command -----------------


def _prompt_texts(path: str, first: int) -> collections.Counter:
    """The prompts of the file's ``first`` lines (what --data.max_samples ``first`` trains), with their counts."""
    with open(path) as f:
        lines = [line for line in f if line.strip()][:first]
    return collections.Counter(json.loads(line)["input"] for line in lines)


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


def _kill_point(kill_at, ckpt: str, audit: str):
    """Whether the run has reached ``kill_at`` = (point, step), read from its own progress on disk (not the wall
    clock, so the kill lands where it says on any machine speed), and where it is: "after_save" = checkpoint
    ``step`` complete (our sidecar written), between steps; "mid_step" = the batch of step ``step`` + 1 made (its
    audit file written), its update not yet begun; "mid_save" = DeepSpeed writing checkpoint ``step`` or done with
    it, our sidecar not yet written (its folder there, no sidecar). The signalled runs are held at their point
    (:data:`HOLD_POINT`), so a look that comes late still finds them there (in CI a late look once found the
    run past its last step's save); the look fails if the run went past it."""
    point, step = kill_at
    folder = os.path.join(ckpt, "_actor", f"global_step{step}")
    complete = os.path.exists(os.path.join(folder, resume.SIDECAR))
    if point == "after_save":
        return "after the save" if complete else None
    if point == "mid_step":
        if not os.path.exists(os.path.join(audit, f"batch_v{step}.pt")):
            return None
        past = f"the run went past {fault_injection.HOLD_ENV}"
        assert not os.path.exists(os.path.join(audit, f"batch_v{step + 1}.pt")), past
        return "mid-step"
    if os.path.isdir(folder):
        assert not complete, f"the run went past {fault_injection.HOLD_ENV} before {folder}'s sidecar"
        return "mid-save"
    return None


# Where the signalled runs are held until the signal (the test launcher's hold, tests/helpers/fault_injection.py):
# mid-save, between DeepSpeed's files and our sidecar; mid-step, right after the batch is written to the audit
# trail, before its update.
HOLD_POINT = {"mid_save": "sidecar", "mid_step": "audit"}


def _queue_files_in_ledgers(state) -> list:
    """The vLLM queue files (psm_*) that the runs' /dev/shm ledgers in ``state`` name (shm_cleanup.py)."""
    names = []
    for ledger in state.glob("run-*.json"):
        try:
            with open(ledger) as f:
                names += [name for *_, name in json.load(f)["files"] if name.startswith("psm_")]
        except FileNotFoundError:  # the run ended and removed it between the listing and the read
            pass
    return names


@pytest.mark.real_stack
@pytest.mark.parametrize(
    "mode,kill_at,gen_batch,half_written,stop",
    [
        # exact mode; partial rollouts, one vLLM call per step; SIGKILL to the group: the engine in vLLM CPU's own
        # layout, whose /dev/shm queues the SIGKILL leaves for the resumed run to sweep
        ("interrupt", ("after_save", 1), None, False, "SIGKILL-group"),
        # exact, from weight snapshots; SIGTERM to the CLI alone mid-step (the run held after step 2's batch was made
        # until then); its resumed run is the snapshot mode's exact-π_prox pipeline run (below)
        ("snapshot", ("mid_step", 1), None, False, "SIGTERM"),
        # SIGTERM to the whole group mid-save (Slurm's scancel, Kubernetes; the run held before the sidecar until
        # then), and the newest checkpoint left half-written (simulated after the stop); one vLLM call per 2 steps:
        # prompts buffered at save
        ("ewma", ("mid_save", 3), 16, True, "SIGTERM-group"),
    ],
)
def test_killed_at_a_point_of_its_progress_resumes_without_losing_prompts(
    tiny_world, tmp_path, capsys, mode, kill_at, gen_batch, half_written, stop
):
    """A run stopped at a point of its own progress (:func:`_kill_point`: between steps after the step-1
    checkpoint, in step 2 once its batch is made, or during the step-3 save); then the same command again. Trained
    prompts: those of the first run's steps up to the checkpoint the second run loaded, plus all of the second
    run's, are the prompt file's, each n_samples_per_prompt x 2 episodes times; exact modes are exact after the
    resume. Every process of both runs is tracked by PID and ended on any exit (tests/helpers/faults.py).

    ``stop``: SIGKILL to the job's process group, or SIGTERM (to the CLI alone, or to the group: the scheduler's
    first signal), after which the signalled run must also have stopped cleanly: our line, exit 128 + 15, its
    /dev/shm files removed and no process left (``assert_stopped_by_signal``, the checks of
    tests/test_faults.py::test_a_signalled_run_cleans_up_at_any_point).

    ``half_written``: after the kill the test truncates the newest checkpoint's weights file and deletes its
    sidecar (a kill during the save, simulated); the resume must load the previous one and say so.

    SIGKILL (a preempted job resubmitted on the same node): the first run's engine runs in vLLM
    CPU's own layout, whose message queues live in /dev/shm. SIGKILL runs nothing of ours, so the queue files its
    ledger names stay (the test fails if none did: it would prove nothing); the resumed run frees them at start-up,
    from that ledger, and says so, naming them; none is left, and both runs' ledgers are gone after it. Killed only
    once the ledger names a queue file, so the files are the run's by its own record (the kill point comes later)."""
    from transformers import AutoTokenizer

    from openrlhf_ess.runtime import shm_cleanup
    from tests.helpers.e2e import CPU_ENGINE_LAYOUT, GPU_ENGINE_LAYOUT, read_tensorboard, tiny_args
    from tests.helpers.e2e import REPO as E2E_REPO
    from tests.helpers.faults import _Tree, assert_stopped_by_signal, end_processes, run_cli_tracked, signal_at
    from tests.test_prox_modes import audit_exactness

    sweep = stop == "SIGKILL-group"

    run_dir, audit = str(tmp_path), str(tmp_path / "audit")
    args = tiny_args(tiny_world, run_dir, steps_prompts=N_PROMPTS)
    args += ["--train.async_enable", "--train.partial_rollout_enable", "--ds.param_dtype", "fp32"]
    args += ["--vllm.dtype", "float32", "--algo.prox_mode", mode, "--algo.prox_audit_dir", audit]
    args += ["--ckpt.save_steps", "1", "--ckpt.load_enable"]  # upstream keeps the newest 3
    args += ["--train.num_episodes", str(EPISODES)]
    # Steps of a few s; the exact modes' responses are long, as test_prox_modes' pipeline run has them: generating
    # a batch takes longer than training on the one before, so responses in flight span the weight syncs
    pipeline = mode in ("interrupt", "snapshot")
    tokens, max_len = ("160", "192") if pipeline else ("48", "96")
    for flag, value in (("--rollout.max_new_tokens", tokens), ("--data.max_len", max_len)):
        args[args.index(flag) + 1] = value
    if mode == "snapshot":
        args += ["--algo.prox_snapshots", "3"]  # as test_prox_modes' pipeline run keeps them
    if gen_batch:
        args += ["--rollout.vllm_generate_batch_size", str(gen_batch)]
    ckpt = args[args.index("--ckpt.path") + 1]
    ray_dir = args[args.index("--ray.temp_dir") + 1]
    cmd = [sys.executable, "-m", "openrlhf_ess.cli.train_ppo_ray", *args]
    # The engine's process layout GPU users get (tests/helpers/e2e.py): the resume does not depend on it, and vLLM
    # CPU's own layout adds a worker process pinned to one core, ~20-40 s of a run's start here (docs/tests.md). The
    # sweep case's first run takes CPU's layout: its /dev/shm queues are what the SIGKILL leaves.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_DIR": run_dir, **GPU_ENGINE_LAYOUT}
    state = tmp_path / "state"  # both runs' /dev/shm ledgers (openrlhf_ess/runtime/shm_cleanup.py), this test's own
    runs_env = {shm_cleanup.STATE_ENV: str(state)}
    if sweep:
        env.update(CPU_ENGINE_LAYOUT)
    env.update(runs_env)

    t0 = time.time()
    recorded = []  # the queue files the first run's ledger names (SIGKILL)
    if sweep:
        with open(os.path.join(run_dir, "first.txt"), "w") as log:
            first = subprocess.Popen(
                cmd, cwd=E2E_REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        with _Tree(first.pid) as tree:  # an assertion below ends the whole run (by PID), not only this test
            deadline = time.time() + 600
            while (where := _kill_point(kill_at, ckpt, audit)) is None or not recorded:
                assert first.poll() is None, open(os.path.join(run_dir, "first.txt")).read()[-4000:]
                assert time.time() < deadline, f"the run did not reach {kill_at} within 10 minutes"
                if not recorded:
                    recorded = _queue_files_in_ledgers(state)
                time.sleep(0.01)
            tree.sample(shm=False)  # the processes of the moment (cheap: no /dev/shm look)
            os.killpg(first.pid, signal.SIGKILL)  # the job, its Ray head and workers started in its session
            first.wait(timeout=60)
        end_processes(tree.alive(), grace=5)  # Ray daemons that left the session: by PID, recorded above
        shutil.rmtree(ray_dir, ignore_errors=True)
    else:
        group = stop.endswith("-group")
        at_the_point = signal_at(
            lambda tree: _kill_point(kill_at, ckpt, audit), signal.SIGTERM, group, str(kill_at), run_dir, limit_s=600
        )
        env = {**GPU_ENGINE_LAYOUT, **runs_env}
        # The first run waits at the kill point for the signal (its resume does not): a late look still finds it
        env[fault_injection.HOLD_ENV] = f"{HOLD_POINT[kill_at[0]]}:{kill_at[1]}"
        first = run_cli_tracked(
            args,
            run_dir,
            timeout=900,
            env=env,
            during=at_the_point,
            new_session=group,
            launcher=fault_injection.LAUNCHER,
        )
        shutil.copy(os.path.join(run_dir, "log.txt"), os.path.join(run_dir, "first.txt"))  # the resume writes log.txt
        (where,) = at_the_point.points
        assert_stopped_by_signal(first, signal.SIGTERM, group)
        # stopped at its hold, not past it: mid-step, the next step's update never ran (no later checkpoint);
        # mid-save, the step's sidecar was never written
        point, step = kill_at
        if point == "mid_step":
            assert _saved_step(ckpt) == step, f"the run went past {fault_injection.HOLD_ENV}: {_saved_step(ckpt)}"
        if point == "mid_save":
            sidecar = os.path.join(ckpt, "_actor", f"global_step{step}", resume.SIDECAR)
            assert not os.path.exists(sidecar), f"the run went past {fault_injection.HOLD_ENV}: {sidecar}"

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
    shutil.move(os.path.join(run_dir, "tb"), os.path.join(run_dir, "tb_first"))  # and the metrics: the resumed run's
    first_seconds = time.time() - t0

    left = [name for name in recorded if os.path.exists(f"/dev/shm/{name}")]
    if sweep:
        assert left, f"SIGKILL left none of {recorded} in /dev/shm: the sweep is not tested"
    count = len(os.listdir("/dev/shm"))

    # same command; ended on any exit. The exact cases' resumed runs check responses spanning a sync: the engine
    # holds a batch in flight at the span gate until the sync (tests/helpers/span_gate.py), not by chance
    gate = os.path.join(run_dir, "span_gate") if pipeline else ""
    second = run_cli_tracked(
        args,
        run_dir,
        timeout=900,
        env={**GPU_ENGINE_LAYOUT, **runs_env, **({span_gate.ENV: gate} if gate else {})},
        launcher=span_gate.LAUNCHER if gate else None,
    )
    second_log, rc = second.log, second.rc
    assert rc == 0 and not second.timed_out, second_log[-5000:]
    assert not second.leftovers, second.leftovers
    # /dev/shm after the resumed run: its own files removed at its exit, and what the SIGKILL left of the first run
    # swept at its start from the first run's ledger (a queue made in the last 2 s is the documented limit)
    assert not second.shm_left, second.shm_left
    if sweep:
        with capsys.disabled():
            print(f"\nSIGKILL left {left}; /dev/shm entries before the resume {count}, after {second.shm_counts[1]}")
        line = next((x for x in second_log.splitlines() if "shared-memory file(s) (" in x), "")
        assert line.startswith("[openrlhf-ess] freed ") and "an earlier run (pid" in line, second_log[:3000]
        assert all(name in line for name in left[:6]), (left, line)
        assert not [name for name in left if os.path.exists(f"/dev/shm/{name}")]
        assert not list(state.glob("run-*.json"))  # the dead run's ledger swept, the second's removed at its end
    if restored < newest:
        assert f"checkpoint global_step{newest} is incomplete" in second_log
    assert f"resume: restored global_step{restored} (step {restored}," in second_log, second_log[-3000:]

    prompts = _prompt_texts(tiny_world["prompts"], N_PROMPTS)
    assert sum(prompts.values()) == N_PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(tiny_world["model"])
    before = _trained(audit + "_first", tokenizer, prompts, last_step=restored)
    after = _trained(audit, tokenizer, prompts)
    expected = collections.Counter({p: k * N_SAMPLES * EPISODES for p, k in prompts.items()})
    assert before + after == expected, (restored, before, after)
    assert sum(before.values()) == restored * BATCH * N_SAMPLES

    batches = len(glob.glob(f"{audit}/batch_v*.pt"))
    assert batches == STEPS - restored, (batches, restored)
    if pipeline:
        checked, stale, mixed, worst, gap = audit_exactness(audit, tiny_world["model"], batches)
        assert checked > 50 and worst < 1e-4, (checked, worst)
        # The resumed run is the exact-π_prox async pipeline run of its mode: the checks of
        # tests/test_prox_modes.py::test_exact_modes_through_the_whole_async_partial_pipeline, whose own interrupt and
        # snapshot runs are slow (the stack tier's broadcast run checks interrupt's over upstream's broadcast).
        # Interrupt scores every stale token at the sync that retired its version, in-flight prefixes included;
        # snapshot when the batch is consumed. Recompute (the current weights) would differ, so the test can fail.
        tb = read_tensorboard(run_dir)
        # the resumed run logged the steps after the loaded checkpoint, to the end (tests/test_prox_modes.py::
        # test_killed_between_steps_resumes_exactly, slow, checks the same after a kill at step 2)
        assert sorted({s for s, _ in tb["train/reward"]}) == list(range(restored + 1, STEPS + 1)), tb["train/reward"]
        assert sum(v for _, v in tb["train/prox/masked_missing_tokens"]) == 0
        if mode == "interrupt":
            assert sum(v for _, v in tb["train/prox/sync_scored_tokens"]) > 0
        print(f"[exactness] {mode}, resumed: {checked} tokens, {stale} stale, {mixed} spanning a sync, ", end="")
        print(f"worst {worst:.1e}, recompute off by {gap:.2e}")
        assert checked > 200 and stale > 0, (checked, stale)
        assert span_gate.held(gate), "the span gate never held a step: no sync was made to land inside a batch"
        assert mixed > 0, "no response spanned a weight sync: the partial-rollout case went untested"
        assert gap > 1e-3, "recompute would have been indistinguishable: the test could not fail"
    print(
        f"[timing] {mode}: first run {first_seconds:.0f} s, killed {where} ({kill_at}; latest: step {newest}), "
        f"resumed from {restored}"
    )


# ---- sync runs too; broken checkpoints; nothing to load (no Ray) ---------------------------------------------------


def _two_steps(ckpt: str, latest: str = "global_step2") -> str:
    for step in (1, 2):
        _ds_files(os.path.join(ckpt, "_actor", f"global_step{step}"))
    with open(os.path.join(ckpt, "_actor", "latest"), "w") as f:
        f.write(latest)
    return os.path.join(ckpt, "_actor", "global_step2")


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


BREAKS = {
    "truncated-model-states": (
        lambda d: _truncate(f"{d}/mp_rank_00_model_states.pt"),
        "is broken (mp_rank_00_model_states.pt is truncated or not a torch checkpoint file)",
    ),
    "truncated-optimizer-shard": (
        lambda d: _truncate(f"{d}/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        "is broken (bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt is truncated",
    ),
    "missing-optimizer-shard": (
        lambda d: os.remove(f"{d}/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        "is broken (the optimizer states of rank 0 are missing (bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt;",
    ),
    "no-model-states": (lambda d: os.remove(f"{d}/mp_rank_00_model_states.pt"), "is broken (no *_model_states.pt"),
}


@pytest.mark.parametrize("need_sidecar", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", sorted(BREAKS))
def test_a_broken_newest_checkpoint_is_moved_aside_and_the_one_before_loaded(tmp_path, fault, need_sidecar):
    """Sync runs too (README: a resume takes the newest complete checkpoint): the broken step is moved aside with
    every file it had (nothing deleted), `latest` names the one before, and a line says why."""
    ckpt = str(tmp_path)
    newest = _two_steps(ckpt)
    if need_sidecar:
        for step in (1, 2):
            resume.write_sidecar(ckpt, step, {"replay": []})
    break_it, why = BREAKS[fault]
    break_it(newest)
    files = sorted(os.listdir(newest))
    lines = []
    restored = resume.prepare(ckpt, log=lines.append, need_sidecar=need_sidecar)
    assert restored["global_step"] == 1
    assert open(os.path.join(ckpt, "_actor", "latest")).read() == "global_step1"
    assert f"checkpoint global_step2 {why}" in lines[0] and "loading global_step1, the newest complete one" in lines[0]
    (aside,) = glob.glob(os.path.join(ckpt, "_actor.incomplete", "global_step2-*"))
    assert sorted(os.listdir(aside)) == files
    if not need_sidecar:
        assert lines[-1].startswith("[openrlhf-ess] resume: loading global_step1 from ")


def test_a_sync_resume_of_whole_checkpoints_changes_nothing(tmp_path):
    ckpt = str(tmp_path)
    _two_steps(ckpt)
    before = {d: sorted(os.listdir(os.path.join(ckpt, "_actor", d))) for d in ("global_step1", "global_step2")}
    lines = []
    assert resume.prepare(ckpt, log=lines.append, need_sidecar=False) == {"global_step": 2}
    assert lines == [
        f"[openrlhf-ess] resume: loading global_step2 from {ckpt}/_actor (the newest complete checkpoint)"
    ]
    assert {d: sorted(os.listdir(os.path.join(ckpt, "_actor", d))) for d in before} == before
    assert sorted(os.listdir(ckpt)) == ["_actor"]


def test_garbage_in_latest_is_set_aside_and_the_newest_complete_checkpoint_loaded(tmp_path):
    ckpt = str(tmp_path)
    _two_steps(ckpt, latest="\x00\x17garbage")
    lines = []
    assert resume.prepare(ckpt, log=lines.append, need_sidecar=False)["global_step"] == 2
    assert "latest names '\\x00\\x17garbage', which is no checkpoint there; ignored" in lines[0]
    assert open(os.path.join(ckpt, "_actor", "latest")).read() == "global_step2"
    (kept,) = glob.glob(os.path.join(ckpt, "_actor", "latest.ignored-*"))
    assert open(kept).read() == "\x00\x17garbage"


def test_a_zero3_checkpoint_missing_a_ranks_model_states_is_broken(tmp_path):
    folder = str(tmp_path / "global_step1")
    _ds_files(folder, stage=3, dp=2)
    assert resume.checkpoint_problem(folder) is None
    assert resume.checkpoint_layout(folder) == {"zero_stage": 3, "dp": 2, "mp": 1, "bf16": True}
    os.remove(os.path.join(folder, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    assert resume.checkpoint_problem(folder) == (
        "zero_pp_rank_1_mp_rank_00_model_states.pt is missing (1 of the 2 model states files)"
    )


@pytest.mark.parametrize("need_sidecar", [False, True], ids=["sync", "async"])
def test_no_checkpoint_found_says_where_it_looked(tmp_path, need_sidecar):
    lines = []
    assert resume.prepare(str(tmp_path / "typo"), log=lines.append, need_sidecar=need_sidecar) is None
    assert lines == [
        "[openrlhf-ess] resume: --ckpt.load_enable, but there is no checkpoint to load: "
        f"{tmp_path}/typo/_actor does not exist (a run with --ckpt.save_steps writes its checkpoints to "
        "<--ckpt.path>/_actor/); training starts from step 0. To resume a run, pass the --ckpt.path it saved to."
    ]
    os.makedirs(tmp_path / "empty" / "_actor")
    lines.clear()
    assert resume.prepare(str(tmp_path / "empty"), log=lines.append, need_sidecar=need_sidecar) is None
    assert "_actor holds no global_step* checkpoint and no latest file" in lines[0] and len(lines) == 1


@pytest.mark.real_stack
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_cli_checks_the_checkpoint_before_ray_in_sync_and_async_runs(tmp_path, monkeypatch, capsys, mode):
    """Today's gap: a sync run with --ckpt.load_enable and a mistyped --ckpt.path said nothing and trained from
    step 0. The CLI's train() runs the resume's check (before Ray starts) in both modes."""
    from openrlhf_ess.cli import train_ppo_ray as cli

    class NoRay(Exception):
        pass

    def init_ray(args):
        raise NoRay

    monkeypatch.setattr(cli, "init_ray", init_ray)
    extra = ["--train.async_enable"] if mode == "async" else []
    args = _parsed("--ckpt.path", str(tmp_path / "typo"), *extra)
    with pytest.raises(NoRay):
        cli.train(args)
    out = capsys.readouterr().out
    assert f"resume: --ckpt.load_enable, but there is no checkpoint to load: {tmp_path}/typo/_actor does not" in out


def test_a_checkpoint_of_another_zero_layout_is_refused_in_preflight(tmp_path):
    from openrlhf_ess.checks import preflight
    from openrlhf_ess.config import ConfigError

    ckpt = str(tmp_path / "ckpt")
    _two_steps(ckpt)
    args = _parsed("--ckpt.path", ckpt, "--ds.zero_stage", "3")
    with pytest.raises(ConfigError) as info:
        preflight.outputs._check_resume_checkpoint(args, [])
    assert str(info.value) == (
        f"--ckpt.load_enable: the checkpoint {ckpt}/_actor/global_step2 (--ckpt.path {ckpt}) was written with ZeRO "
        "stage 2, but this run has --ds.zero_stage 3: DeepSpeed cannot load whole-model weights into ZeRO-3. Resume "
        "with --ds.zero_stage 2, or drop --ckpt.load_enable (or pass another --ckpt.path) to start fresh."
    )
    preflight.outputs._check_resume_checkpoint(
        _parsed("--ckpt.path", ckpt, "--ds.zero_stage", "1"), []
    )  # 1 and 2 load


def test_a_checkpoint_that_passes_the_checks_but_does_not_load_names_ckpt_flags_not_the_model(tmp_path):
    """What the checks cannot see (damaged data inside whole files, other GPU counts) fails in DeepSpeed's load on a
    policy rank at start-up; the fix names --ckpt.path / --ckpt.load_enable, not the model folder."""
    from ray.exceptions import RayTaskError

    from openrlhf_ess.cli import train_ppo_ray as cli

    traceback_text = (
        "Traceback (most recent call last):\n"
        '  File "/venv/openrlhf/trainer/ray/ppo_actor.py", line 577, in init_model_from_pretrained\n'
        "    _, states = strategy.load_ckpt(self.actor.model, ckpt_path)\n"
        '  File "/venv/deepspeed/runtime/engine.py", line 3100, in load_checkpoint\n'
        "    load_path, client_states = self._load_checkpoint(load_dir, tag)\n"
        "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory\n"
    )
    cause = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
    exc = RayTaskError(
        "PolicyModelActorImpl.init_model_from_pretrained",
        traceback_text,
        cause,
        pid=9,
        ip="127.0.0.1",
        proctitle="ray::PolicyModelActorImpl.init_model_from_pretrained",
    ).as_instanceof_cause()
    args = _parsed("--ckpt.path", str(tmp_path), "--ray.temp_dir", "/tmp/ray_x")
    message = str(cli.classify_failure(exc, args, started=False))
    assert "raised: RuntimeError: PytorchStreamReader failed reading zip archive" in message, message
    assert (
        f"Fix: the DeepSpeed policy (actor) model rank loads the checkpoint that --ckpt.load_enable resumes from "
        f"(--ckpt.path {tmp_path}), and it does not load" in message
    )
    assert f"Move its global_step* folder out of {tmp_path}/_actor" in message
    assert "check that folder" not in message


# ---- `latest` is followed; another run's checkpoint is refused; rotation after the save


def test_resume_follows_latest_and_sets_a_newer_folder_aside(tmp_path):
    """Run A left global_step4 in the folder; run B saved global_step2 there (DeepSpeed wrote `latest` =
    global_step2). B's resume loads B's step 2, as upstream would, not A's step 4 (before: step 4, and B's model
    became A's)."""
    ckpt = str(tmp_path)
    _fake_checkpoint(ckpt, 4, complete=True)  # A's
    _fake_checkpoint(ckpt, 2, complete=True)  # B's, written last: `latest` names it
    lines = []
    restored = resume.prepare(ckpt, log=lines.append)
    assert restored["global_step"] == 2
    assert open(os.path.join(ckpt, "_actor", "latest")).read() == "global_step2"
    assert "global_step4 is newer than global_step2, the checkpoint `latest` names" in lines[0], lines
    assert os.listdir(os.path.join(ckpt, "_actor.incomplete"))[0].startswith("global_step4-")  # kept, not deleted


def test_an_incomplete_latest_falls_back_to_the_one_before_it_not_to_a_newer_one(tmp_path):
    ckpt = str(tmp_path)
    _fake_checkpoint(ckpt, 6, complete=True, latest=False)  # another run's, newer
    _fake_checkpoint(ckpt, 1, complete=True)
    _fake_checkpoint(ckpt, 3, complete=False)  # `latest` names it; killed before the sidecar
    assert resume.prepare(ckpt, log=lambda line: None)["global_step"] == 1


class _Args:
    def __init__(self, model, prompts, batch=8, n=4):
        self.actor = types.SimpleNamespace(model_name_or_path=model)
        self.data = types.SimpleNamespace(prompt_dataset=prompts)
        self.rollout = types.SimpleNamespace(batch_size=batch, n_samples_per_prompt=n)


def test_run_identity_names_what_differs(tmp_path):
    a, b = tmp_path / "model_a", tmp_path / "model_b"
    for folder, layers in ((a, 2), (b, 3)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("{}\n")
    saved = resume.run_identity(_Args(str(a), str(prompts)))
    assert resume.identity_mismatch(saved, resume.run_identity(_Args(str(a), str(prompts)))) == []
    moved = tmp_path / "moved"
    shutil.copytree(a, moved)  # the same model at another path: the same run
    assert resume.identity_mismatch(saved, resume.run_identity(_Args(str(moved), str(prompts)))) == []
    differ = resume.identity_mismatch(saved, resume.run_identity(_Args(str(b), str(prompts), batch=16)))
    assert [d[0] for d in differ] == ["--actor.model_name_or_path", "--rollout.batch_size"]
    assert differ[0][1:] == (str(a), str(b)) and differ[1][1:] == (8, 16)


def test_prune_keeps_the_new_checkpoint_and_evicts_as_upstream_does(tmp_path):
    """After the new step was written: the oldest step folders beyond --ckpt.max_num go (no-metric ones first,
    then the oldest), best* ones and the new one never."""
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy

    from openrlhf_ess.trainer import saving

    strategy = object.__new__(DeepspeedStrategy)  # its real metric reader; no distributed state needed
    strategy.print = lambda *a: None
    for i, name in enumerate(["global_step1", "global_step2", "best_step1", "global_step3"]):
        os.makedirs(tmp_path / name)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    deleted = saving.prune_checkpoints(strategy, str(tmp_path), max_num=1, keep="global_step3")
    assert sorted(os.path.basename(d) for d in deleted) == ["global_step1", "global_step2"]
    assert sorted(os.listdir(tmp_path)) == ["best_step1", "global_step3"]
    assert saving.prune_checkpoints(strategy, str(tmp_path), max_num=1, keep="global_step3") == []
