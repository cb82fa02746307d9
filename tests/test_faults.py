"""Nothing fails silently: injected faults and edge inputs, on the real CPU stack (docs/faults.md).

Real-stack tests run the CLI in a subprocess with a time limit; every process the run starts (driver, its
private Ray instance, Ray workers, vLLM's engine processes) is tracked by PID and start time, and whatever
is still alive after the run is reported as a leftover, then ended by that PID (tests/helpers/faults.py).
"""

import contextlib
import math
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from openrlhf_ess.runtime import cpu_compat

cpu_compat.apply()  # upstream's model modules import flash_attn

from tests.helpers.e2e import read_tensorboard, tiny_args  # noqa: E402
from tests.helpers.faults import (  # noqa: E402
    assert_stopped_by_signal,
    run_cli_tracked,
    signal_at,
    write_kill_engine_reward,
)

# ---------------------------------------------------------------- 1. a vLLM engine dies mid-rollout


def _engine_killed_run(tiny_world, tmp_path, kill_at, flags=(), steps_prompts=8):
    """Run the CLI with a reward function that SIGKILLs the vLLM engine it runs in on its ``kill_at``-th call."""
    run_dir = str(tmp_path)
    marker = os.path.join(run_dir, "killed_engine_pid")
    reward = write_kill_engine_reward(os.path.join(run_dir, "reward.py"), marker, kill_at=kill_at)
    args = tiny_args(tiny_world, run_dir, steps_prompts=steps_prompts)
    args[args.index("--reward.remote_url") + 1] = reward
    run = run_cli_tracked(args + list(flags), run_dir, timeout=600)
    return run, marker


def _check_fail_fast(run, marker):
    assert not run.timed_out, run.log[-6000:]
    assert os.path.exists(marker), "the fault was never injected: " + run.log[-3000:]
    killed_pid = open(marker).read().strip()
    assert run.rc == 1, run.log[-6000:]
    # our message, naming the engine process that died and the way forward, after Ray's own report
    ours = [line for line in run.log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1, run.log[-6000:]
    assert ours[0].startswith("openrlhf-ess: error: the vLLM engine (RolloutRayActorImpl, pid " + killed_pid), ours
    assert "died during the run" in ours[0] and "--ckpt.load_enable" in ours[0], ours
    assert run.log.rindex("ActorDiedError") < run.log.rindex("openrlhf-ess: error:")
    # fail fast: the driver exits seconds after the engine died, not after a timeout
    assert run.ended_at - os.stat(marker).st_mtime < 60
    # the dead engine's vLLM processes (EngineCore, its worker) went with it: nothing of the run is left
    assert not run.leftovers, run.leftovers
    # nor their shared memory: the killed engine's psm_*/sem.mp-* files, removed by the CLI
    assert not run.shm_left, f"/dev/shm files of the run left behind: {run.shm_left}"


@pytest.mark.real_stack
@pytest.mark.slow
def test_engine_killed_mid_rollout_fails_fast(tiny_world, tmp_path):
    """Sync training (upstream's controller): the engine is SIGKILLed (as by the OOM killer) while the
    first rollout's requests are in flight. (The default suite's dead engine is the one past the replacement budget,
    tests/test_engine_replacement.py: the same classification and message, through our controllers.)"""
    run, marker = _engine_killed_run(tiny_world, tmp_path, kill_at=3)
    _check_fail_fast(run, marker)
    assert "Global step" not in run.log  # died in the first rollout: no training step happened


@pytest.mark.real_stack
@pytest.mark.slow
def test_engine_killed_during_async_partial_training_fails_fast(tiny_world, tmp_path):
    """Async + partial rollouts (our controllers): the engine dies in the second rollout (40th reward), which
    the generator runs while the trainer works on the first batch."""
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.ess_lr_enable"]
    run, marker = _engine_killed_run(tiny_world, tmp_path, kill_at=40, flags=flags, steps_prompts=24)
    _check_fail_fast(run, marker)


def test_actor_died_message_from_nested_ray_errors():
    """The CLI finds the dead actor under Ray's wrapping (one RayTaskError per caller) and names it."""
    from ray.exceptions import ActorDiedError, RayTaskError

    from openrlhf_ess.cli.train_ppo_ray import actor_died_message, dead_actor

    died = ActorDiedError()
    died.error_msg = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutRayActorImpl\n\t"
        "actor_id: abc\n\tpid: 4242\nThe actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits. Some common causes include: (1) OOM"
    )
    inner = RayTaskError("GenerateSamplesActor.fit", "tb", died).as_instanceof_cause()
    outer = RayTaskError("PPOTrainerAsync.fit", "tb", inner).as_instanceof_cause()
    assert dead_actor(outer) is died
    assert dead_actor(ValueError("x")) is None
    args = SimpleNamespace(
        ray=SimpleNamespace(temp_dir="/tmp/ray_x", address=None), vllm=SimpleNamespace(max_restarts=0)
    )
    msg = actor_died_message(died, args)
    assert msg.startswith("the vLLM engine (RolloutRayActorImpl, pid 4242,")
    assert "its worker process has died" in msg and "Some common causes" not in msg
    assert "/tmp/ray_x/session_latest/logs" in msg and "--ckpt.load_enable" in msg
    assert "replaced in place only with --vllm.max_restarts N" in msg  # the flag that would have gone on
    args.vllm.max_restarts = 2
    assert "this run's --vllm.max_restarts 2 replacement(s) are used" in actor_died_message(died, args)


SYS_EXIT_REWARD = """
import sys

import torch

_calls = 0


def reward_func(queries, prompts, labels):
    global _calls
    _calls += 1
    if _calls >= 3:
        sys.exit(3)
    rewards = torch.tensor([0.5] * len(queries))
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
"""


@pytest.mark.real_stack
@pytest.mark.slow
def test_reward_sys_exit_stops_the_run_with_the_file_named(tiny_world, tmp_path):
    """A reward function that calls sys.exit() from its 3rd call on. Upstream's executor lets
    SystemExit out of the engine actor's event loop and the run hangs forever with no line; ours catches it in
    the reward's thread, and the run stops (--reward.failure_policy off) with our last line naming the file."""
    run_dir = str(tmp_path)
    reward = os.path.join(run_dir, "reward.py")
    with open(reward, "w") as f:
        f.write(SYS_EXIT_REWARD)
    args = tiny_args(tiny_world, run_dir, steps_prompts=8)
    args[args.index("--reward.remote_url") + 1] = reward
    run = run_cli_tracked(args, run_dir, timeout=600)
    assert not run.timed_out and run.rc == 1, run.log[-6000:]
    ours = [line for line in run.log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1, run.log[-6000:]
    assert ours[0].startswith(f"openrlhf-ess: error: reward_func of --reward.remote_url {reward} line 13 "), ours
    assert "raised SystemExit: 3" in ours[0] and "--reward.failure_policy drop" in ours[0], ours
    assert "Global step" not in run.log  # it failed in the first rollout
    assert not run.leftovers, run.leftovers


def _ray_is_starting(run_dir, tree):
    """Ray's GCS server has been spawned under the CLI: ray.init() is running (or has just returned)."""
    return any("gcs_server" in cmd for _, cmd in list(tree.seen.values()))


_PSM_FIRST_SEEN: dict = {}  # run folder -> when the test first saw the run's psm_* queue


def _engine_is_up(run_dir, tree):
    """The vLLM engine's processes map their psm_* message queues, and have for 3 of the CLI's 2-s looks at its
    run's files (shm_cleanup.INTERVAL_S): a queue created and abandoned between two looks is the documented limit
    of what a run can remove (docs/faults.md §9); signalled the moment the file appeared, whether the run had seen
    it was a race this test lost under load."""
    from openrlhf_ess.runtime.shm_cleanup import INTERVAL_S

    if not any(name.startswith("psm_") for name in list(tree.shm_names)):
        return False
    first = _PSM_FIRST_SEEN.setdefault(run_dir, time.time())
    return time.time() - first >= 3 * INTERVAL_S


# (signal, to the whole process group?, progress point). The group cases are what Slurm's scancel and Kubernetes do:
# SIGTERM to every process of the job (the driver, Ray's daemons and workers, vLLM's processes). SIGTERM mid-step (to
# the CLI) and mid-save (to the group) are kill-and-resume cases of tests/test_resume.py: these assertions on the
# signalled run, then the resume.
SIGNAL_POINTS = {
    "SIGHUP-while-ray-starts": (signal.SIGHUP, False, _ray_is_starting),
    "SIGTERM-group-engine-up": (signal.SIGTERM, True, _engine_is_up),
    "SIGINT-engine-up": (signal.SIGINT, False, _engine_is_up),
}


@pytest.mark.real_stack
@pytest.mark.parametrize(
    "case", [c if not c.startswith("SIGINT") else pytest.param(c, marks=pytest.mark.slow) for c in SIGNAL_POINTS]
)
def test_a_signalled_run_cleans_up_at_any_point(tiny_world, tmp_path, capsys, case):
    """A run signalled at a point of its own progress (while Ray starts, as its vLLM
    engine comes up; to the CLI alone or to its whole process group; mid-step and mid-save: tests/test_resume.py)
    says it is stopping, exits with 128 + the signal's number, removes the /dev/shm files its processes used and
    leaves no process (:func:`tests.helpers.faults.assert_stopped_by_signal`). Before our handler, a SIGTERM after
    ray.init() reached Abseil's handler (Ray's core worker), which aborts the driver 3 s later (exit 134) with the
    clean-up unfinished, depending on timing. Files are attributed to the run by the processes seen using them, so
    other runs on the machine (which change the global count, printed) are not counted. A CPU-burning process runs
    beside the run from the moment it is signalled to its end (tests/helpers/burner.py): the clean-up must hold under
    load. (Started then, not with the run: its start-up is not what is tested, and a core burned all through it cost
    the gate a minute or two of CPU.)"""
    from tests.helpers.burner import cpu_burner

    sig, group, reached = SIGNAL_POINTS[case]
    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir)
    with contextlib.ExitStack() as burning:
        burners = []  # a second job on the cores, as on a shared node, started right before the signal

        def load():
            burners.append(burning.enter_context(cpu_burner(limit_s=660)))

        at_the_point = signal_at(
            lambda tree: reached(run_dir, tree), sig, group, case, run_dir, limit_s=480, before=load
        )
        run = run_cli_tracked(args, run_dir, timeout=600, during=at_the_point, new_session=group)
        assert burners, "the run was never signalled"
        assert burners[0].poll() is None, "the CPU burner ended before the run: the clean-up was not under load"
    with capsys.disabled():
        counts = f"/dev/shm entries before / after: {run.shm_counts} (machine-wide)"
        print(f"\n{case} at {at_the_point.points}: {counts}, rc {run.rc}")
    assert_stopped_by_signal(run, sig, group)


# ---------------------------------------------------------------- 2. edge inputs through the CLI


@pytest.mark.real_stack
@pytest.mark.slow
def test_edge_inputs_train_to_the_end(tiny_world, tmp_path):
    """One run: prompts longer than --data.max_len, responses that reach --rollout.max_new_tokens and
    responses with no text (a model that answers ``<pad></s>`` a third of the time), through our
    controllers (TIS, ESS LR, versions). Upstream truncates long prompts (keeps their end, warns); the
    run completes and no logged metric is NaN/inf."""
    from tests.helpers.edge_world import build_eos_model, write_edge_reward, write_prompts

    run_dir = str(tmp_path)
    world = {
        "model": build_eos_model(tiny_world["model"], os.path.join(run_dir, "eos_model")),
        "prompts": write_prompts(os.path.join(run_dir, "prompts.jsonl"), n_short=12, n_long=4, long_chars=100),
        "reward": write_edge_reward(os.path.join(run_dir, "reward.py")),
    }
    args = tiny_args(world, run_dir, steps_prompts=16)
    args[args.index("--rollout.max_new_tokens") + 1] = "4"  # --data.max_len stays 64 < 100-char prompts
    run = run_cli_tracked(args + ["--algo.tis_cap", "2", "--algo.ess_lr_enable"], run_dir, timeout=600)
    assert run.rc == 0 and not run.timed_out, run.log[-6000:]
    assert not run.leftovers, run.leftovers
    assert "exceeds max_prompt_length (60)" in run.log  # upstream's warning: 64 - 4 tokens kept
    scalars = read_tensorboard(run_dir)
    assert len(scalars["train/policy_loss"]) == 2
    bad = {tag: v for tag, values in scalars.items() for _, v in values if not math.isfinite(v)}
    assert not bad, bad
    mean = {tag: sum(v for _, v in values) / len(values) for tag, values in scalars.items()}
    # every long prompt, and only those, reached the engine truncated (4 of 16 prompts, 32 samples per step)
    assert mean["train/edge_prompt_truncated"] == pytest.approx(4 / 16)
    assert mean["train/edge_empty_response"] > 0  # responses with no text were trained on
    assert 0 < mean["train/truncated"] < 1  # some responses hit --rollout.max_new_tokens, some ended
    assert mean["train/response_length"] <= 4


def test_a_rollout_with_every_sample_dropped_stops_the_run():
    """Each sample can be dropped (failed reward under --reward.failure_policy drop, non-finite mu); if a
    whole rollout batch is dropped the update would be 0/0 = NaN (shown with upstream's loss), so our
    generator stops the run and says why; one surviving sample is enough to train."""
    from openrlhf.models.loss import PolicyLoss
    from openrlhf.trainer.ppo_utils.experience import Experience

    from openrlhf_ess.trainer.ppo_utils.samples_generator import check_not_all_dropped

    theta = torch.ones(4, requires_grad=True)
    log_probs = torch.tensor([[-1.0, -1.1, -0.9, -1.0]]) * theta
    loss, *_ = PolicyLoss()(log_probs, log_probs.detach(), torch.zeros(1, 4), action_mask=torch.zeros(1, 4))
    assert torch.isnan(torch.autograd.grad(loss, theta)[0]).all()

    def sample(kept, reward_failed, mu_bad):
        info = {"reward_failed": torch.tensor([reward_failed]), "rollout_logprob_nonfinite": torch.tensor([mu_bad])}
        return Experience(action_mask=torch.full((1, 3), kept, dtype=torch.bool), info=info)

    dropped = [sample(False, 1.0, 0.0), sample(False, 1.0, 0.0), sample(False, 0.0, 1.0)]
    with pytest.raises(RuntimeError, match=r"every one of the 3 samples .* \(2 failed rewards .* 1 with non-finite"):
        check_not_all_dropped(dropped)
    check_not_all_dropped(dropped + [sample(True, 0.0, 0.0)])
    check_not_all_dropped([])


# ---------------------------------------------------------------- 3. NaN/inf in the actor's own log-probs


def _maker(prox_mode="recompute", tis_cap=2.0, nonfinite="drop"):
    """Our experience maker's post-processing on real tensors: upstream's make_experience (the Ray forward
    dispatch) is replaced by one that returns the experiences as the actor's forward would have filled them."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as Upstream

    from openrlhf_ess.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    class ForwardDone(Upstream):
        def make_experience(self, samples_list):
            return samples_list

    class Maker(RemoteExperienceMaker, ForwardDone):  # super() in ours -> ForwardDone
        pass

    upstream = Upstream.__new__(Upstream)
    algo = dict(max_version_lag=None, prox_mode=prox_mode, prox_missing="mask", prox_snapshots=4)
    algo["nonfinite_logprobs"] = nonfinite
    upstream.args = SimpleNamespace(
        algo=SimpleNamespace(tis_cap=tis_cap, tis_level="token", prox_audit_dir=None, **algo)
    )
    return Maker.from_upstream(upstream)


def _experience(prox):
    from openrlhf.trainer.ppo_utils.experience import Experience

    exp = Experience(
        sequences=torch.zeros(1, 6, dtype=torch.long),
        attention_mask=torch.ones(1, 6, dtype=torch.long),
        action_mask=torch.ones(1, 4, dtype=torch.bool),
        action_log_probs=torch.tensor([prox]),  # pi_prox: the actor's forward (recompute)
        rollout_log_probs=torch.tensor([[-1.0, -1.2, -0.8, -1.1]]),  # mu from the engine
        kl=torch.zeros(1, 4),
    )
    exp.rollout_versions = torch.zeros(1, 4, dtype=torch.long)
    return exp


def _loss_and_grad(exp, advantage):
    """Upstream's PolicyLoss (token TIS, cap 2, as --algo.tis_cap 2 configures it) on the experience."""
    from openrlhf.models.loss import PolicyLoss

    loss_fn = PolicyLoss(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0.0, 2.0])
    log_probs = torch.tensor([[-1.0, -1.1, -0.9, -1.0]], requires_grad=True)  # pi_theta in the training step
    adv = torch.full((1, 4), advantage)
    loss, _, ppo_kl, vllm_kl, _ = loss_fn(
        log_probs,
        exp.action_log_probs,
        adv,
        action_mask=exp.action_mask.float(),
        rollout_log_probs=exp.rollout_log_probs,
    )
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss, grad, ppo_kl, vllm_kl


GOOD = [-1.0, -1.1, -0.9, -1.0]


def test_upstream_loss_with_a_nan_old_logprob():
    """Upstream's loss with a NaN pi_prox on one token (upstream's controllers, none of our flags): the
    logged policy loss is NaN, the gradient is finite (the clamped ratio passes no gradient to that token)."""
    exp = _experience([-1.0, float("nan"), -0.9, -1.0])
    for adv in (1.0, -1.0):
        loss, grad, _, _ = _loss_and_grad(exp, adv)
        assert torch.isnan(loss) and torch.isfinite(grad).all() and grad[0, 1] == 0


@pytest.mark.parametrize("bad_value", [float("nan"), float("-inf")])
def test_upstream_loss_with_a_nonfinite_policy_logprob_has_nan_gradients(bad_value):
    """pi_theta side (the training forward, inside the actor's step): one non-finite log-prob makes the
    gradient NaN, and with -inf the loss still looks finite. Nothing checks this before the optimizer step
    today (docs/faults.md (3): the check recommended for ppo_actor.py)."""
    from openrlhf.models.loss import PolicyLoss

    theta = torch.ones(4, requires_grad=True)  # stands for the weights every token's log-prob depends on
    log_probs = torch.tensor([[-1.0, bad_value, -0.9, -1.0]]) * theta
    old, mu = torch.tensor([GOOD]), torch.tensor([[-1.0, -1.2, -0.8, -1.1]])
    loss_fn = PolicyLoss(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0.0, 2.0])
    loss, *_ = loss_fn(log_probs, old, torch.ones(1, 4), action_mask=torch.ones(1, 4), rollout_log_probs=mu)
    (grad,) = torch.autograd.grad(loss, theta)
    assert torch.isnan(grad[1]) and torch.isfinite(grad[[0, 2, 3]]).all()
    assert math.isfinite(loss.item()) == (bad_value == float("-inf"))


@pytest.mark.parametrize("bad_value", [float("nan"), float("-inf"), float("inf")])
def test_actor_nonfinite_logprob_drops_the_sample_and_counts_it(bad_value):
    """Wanted (the policy the engine side already has, shared by all prox modes): a sample whose pi_prox is
    non-finite on a response token is dropped from the loss as a whole and counted in
    ``actor_logprob_nonfinite``; the batch metrics stay those of the healthy samples."""
    maker = _maker()
    good, bad = maker.make_experience([_experience(GOOD), _experience([-1.0, bad_value, -0.9, -1.0])])
    assert good.action_mask.all() and not bad.action_mask.any()
    assert torch.isfinite(bad.action_log_probs).all()
    assert maker.last_metrics.get("actor_logprob_nonfinite") == 1
    # the healthy sample alone: pi_prox - mu is at most 0.1 in magnitude
    assert abs(maker.last_metrics["mismatch/k1"]) < 0.1 and maker.last_metrics["mismatch/max_abs_log_ratio"] < 0.11


def test_actor_nonfinite_logprob_stops_the_run_when_asked():
    maker = _maker(nonfinite="stop")
    with pytest.raises(RuntimeError, match="--algo.nonfinite_logprobs drop"):
        maker.make_experience([_experience(GOOD), _experience([-1.0, float("inf"), -0.9, -1.0])])


def test_stale_nan_in_exact_modes_is_a_missing_version_not_an_actor_fault():
    """snapshot mode marks a token whose version has no weights with NaN: masked and counted as missing
    (prox/masked_missing_tokens), the rest of the sample kept; a current-version NaN drops the sample."""
    maker = _maker(prox_mode="snapshot")
    stale = _experience([-1.0, float("nan"), -0.9, -1.0])
    stale.rollout_versions = torch.tensor([[1, 0, 1, 1]])  # token 1 is one version behind
    maker.weight_version = 1
    (out,) = maker.make_experience([stale])
    assert out.action_mask.tolist() == [[True, False, True, True]]
    assert maker.last_metrics["prox/masked_missing_tokens"] == 1 and maker.last_metrics["actor_logprob_nonfinite"] == 0
    current = _experience([-1.0, float("nan"), -0.9, -1.0])
    current.rollout_versions = torch.ones(1, 4, dtype=torch.long)
    healthy = _experience(GOOD)
    healthy.rollout_versions = torch.ones(1, 4, dtype=torch.long)
    out, _ = maker.make_experience([current, healthy])
    assert not out.action_mask.any() and maker.last_metrics["actor_logprob_nonfinite"] == 1


def test_a_batch_whose_every_sample_the_actor_scored_nonfinite_stops():
    maker = _maker()
    with pytest.raises(RuntimeError, match="every sample of this rollout batch"):
        maker.make_experience([_experience([float("nan"), -1.0, -0.9, -1.0])])
