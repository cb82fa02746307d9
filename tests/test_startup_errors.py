"""Start-up errors are named as start-up errors; an engine process death gets our paragraph.

Unit tests build Ray's own error objects (``RayTaskError`` one per caller, ``ActorDiedError`` from a creation
task, vLLM's ``EngineDeadError``) as they reach the driver and check the message the CLI prints. One CLI run
loads a model whose weights file is cut in half (pre-flight sees a config.json and a weights file, so the
failure happens in the actors) and asserts the message says start-up, names the role and the flag.
"""

import os
import shutil
import threading
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from openrlhf_ess.cli import train_ppo_ray as cli

ARGS = SimpleNamespace(ray=SimpleNamespace(temp_dir="/tmp/ray_x", address=None), vllm=SimpleNamespace(max_restarts=0))


def _task_error(function, cause, pid, traceback_text):
    """What an actor method that raised ``cause`` sends back, as the driver's ``ray.get`` raises it."""
    return RayTaskError(
        function, traceback_text, cause, proctitle=f"ray::{function}", pid=pid, ip="127.0.0.1"
    ).as_instanceof_cause()


def _caller(function, inner, pid=100):
    """One more level of Ray wrapping: ``inner`` passed through an actor that called the failing one."""
    return _task_error(function, inner, pid, f'Traceback (most recent call last):\n  File "x.py", line 1\n{inner}')


SAFETENSORS_TB = (
    "Traceback (most recent call last):\n"
    '  File "/venv/openrlhf/trainer/ray/ppo_actor.py", line 40, in init_model_from_pretrained\n'
    "    actor = Actor(pretrain, ...)\n"
    '  File "/venv/transformers/modeling_utils.py", line 4900, in from_pretrained\n'
    "    with safe_open(resolved_archive_file, framework='pt') as f:\n"
    "safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata, file not fully covered\n"
)


def test_a_model_that_fails_to_load_in_a_policy_rank():
    """A method of an actor raised before training: the role, the first line of the cause and the flag."""

    class SafetensorError(Exception):
        pass

    cause = SafetensorError("Error while deserializing header: incomplete metadata, file not fully covered")
    exc = _task_error("PolicyModelActorImpl.init_model_from_pretrained", cause, 4242, SAFETENSORS_TB)
    err = cli.classify_failure(exc, ARGS, started=False)
    assert isinstance(err, cli.StartupFailed)
    msg = str(err)
    assert msg.startswith(
        "start-up failed, before training began: the DeepSpeed policy (actor) model rank (PolicyModelActorImpl, "
        "pid 4242) raised: SafetensorError: Error while deserializing header: incomplete metadata"
    ), msg
    assert "--actor.model_name_or_path" in msg and "run the same command again" in msg
    assert "--ckpt.load_enable" not in msg and "during the run" not in msg
    assert "/tmp/ray_x/session_latest/logs" in msg


PORT_TB = (
    "Traceback (most recent call last):\n"
    '  File "/venv/torch/distributed/rendezvous.py", line 189, in _create_c10d_store\n'
    "    return TCPStore(\n"
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
    "port: 35399, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"
)


def test_a_rendezvous_port_taken_is_not_blamed_on_the_model():
    """Measured when two runs started at once on one machine: the rank's rendezvous port was taken. The fix is to
    run again, not to check the model folder (the policy rank's generic advice)."""

    class DistNetworkError(Exception):
        pass

    cause = DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 35399, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use"
    )
    exc = _task_error("PolicyModelActorImpl.init_model_from_pretrained", cause, 17963, PORT_TB)
    msg = str(cli.classify_failure(exc, ARGS, started=False))
    assert "EADDRINUSE" in msg and "port the rank had picked" in msg and "run the same command again" in msg, msg
    assert "--actor.model_name_or_path" not in msg


def _creation_failure(cls, pid, traceback_text, cause):
    """An actor whose ``__init__`` raised: every call to it raises ActorDiedError with Ray's rendering of the
    creation task's error (text only: Ray does not keep the exception object)."""
    task = RayTaskError(
        f"{cls}.__init__", traceback_text, cause, proctitle=f"ray::{cls}.__init__", pid=pid, ip="127.0.0.1"
    )
    return ActorDiedError.from_task_error(task)


DATASET_TB = (
    "Traceback (most recent call last):\n"
    '  File "/venv/openrlhf/trainer/ppo_trainer.py", line 477, in __init__\n'
    "    self.prompts_dataloader, self.eval_dataloader, self.max_steps = prepare_datasets(strategy, tokenizer)\n"
    '  File "/venv/datasets/load.py", line 1500, in load_dataset\n'
    "    raise FileNotFoundError(msg)\n"
    "FileNotFoundError: Unable to find '/data/prompts.jsonl'\n"
    "It looks like the file was moved.\n"
)


def test_a_controller_whose_init_raised():
    died = _creation_failure("PPOTrainer", 777, DATASET_TB, FileNotFoundError("Unable to find '/data/prompts.jsonl'"))
    assert died.actor_init_failed and "raised in its creation task" in str(died)
    assert cli.dead_actor(died) is died
    msg = str(cli.classify_failure(died, ARGS, started=False))
    assert "the PPO controller (PPOTrainer, pid 777) failed to start: FileNotFoundError: Unable to find" in msg, msg
    assert "It looks like" not in msg  # the first line of the cause only
    assert "--data.prompt_dataset" in msg and "--ckpt.load_enable" not in msg


REWARD_IMPORT_TB = (
    "Traceback (most recent call last):\n"
    '  File "/venv/openrlhf/trainer/ray/vllm_engine.py", line 59, in __init__\n'
    "    self.executor = SingleTurnAgentExecutor(remote_rm_url)\n"
    '  File "/tmp/reward.py", line 3, in <module>\n'
    "    raise RuntimeError('no GPU for the judge')\n"
    "RuntimeError: no GPU for the judge\n"
)


def test_an_engine_that_never_started_is_a_start_up_error_even_after_fit():
    """The engine's __init__ (vLLM load, reward file import) raised; the driver first hears of it at the first
    call to the engine, which upstream makes inside fit(): still a start-up error, not a resume case."""
    died = _creation_failure("RolloutRayActorImpl", 555, REWARD_IMPORT_TB, RuntimeError("no GPU for the judge"))
    exc = _caller("PPOTrainer.fit", died)
    err = cli.classify_failure(exc, ARGS, started=True)
    assert isinstance(err, cli.StartupFailed), err
    msg = str(err)
    assert "the vLLM engine (RolloutRayActorImpl, pid 555) failed to start: RuntimeError: no GPU for the judge" in msg
    assert "--reward.remote_url" in msg and "--ckpt.load_enable" not in msg


def test_a_process_death_after_training_began_keeps_the_resume_advice():
    died = ActorDiedError()
    died.error_msg = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutRayActorImpl\n\t"
        "actor_id: abc\n\tpid: 4242\nThe actor is dead because its worker process has died. Worker exit type: "
        "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits. Some common causes include: (1) OOM"
    )
    exc = _caller("PPOTrainer.fit", died)
    err = cli.classify_failure(exc, ARGS, started=True)
    assert isinstance(err, cli.ActorDied) and not isinstance(err, cli.StartupFailed)
    assert "died during the run" in str(err) and "--ckpt.load_enable" in str(err)
    # the same death before training began (e.g. the OOM killer while models load) is a start-up error
    early = str(cli.classify_failure(exc, ARGS, started=False))
    assert early.startswith("start-up failed, before training began: the vLLM engine (RolloutRayActorImpl, pid 4242)")
    assert "died: its worker process has died" in early and "--ckpt.load_enable" not in early


def test_other_errors_after_training_began_pass_through():
    exc = _caller("PPOTrainer.fit", ValueError("a bug"))
    assert cli.classify_failure(exc, ARGS, started=True) is None


def test_a_driver_side_error_before_training():
    err = cli.classify_failure(AssertionError("num_nodes and num_gpus_per_node must be the same"), ARGS, False)
    msg = str(err)
    assert "the driver (upstream's train() in this process) raised: AssertionError: num_nodes" in msg
    assert "the traceback above" in msg


ENGINE_DEAD_TB = (
    "Traceback (most recent call last):\n"
    '  File "/venv/vllm/v1/engine/core_client.py", line 1215, in get_output_async\n'
    "    raise self._format_exception(outputs) from None\n"
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for "
    "the root cause.\n"
)
# As measured (a real EngineCore SIGKILL, sync run): Ray flattens the levels; the controller's error holds vLLM's
# EngineDeadError itself, and the engine's process title appears only in its text.
FIT_TB = (
    "Traceback (most recent call last):\n"
    '  File "/venv/openrlhf/trainer/ppo_utils/samples_generator.py", line 165, in _generate_vllm\n'
    "    self._process_response_into_experience(response, **generate_kwargs) for response in ray.get(ref)\n"
    "ray.exceptions.RayTaskError(EngineDeadError): \x1b[36mray::RolloutRayActorImpl.generate_responses()\x1b[39m "
    "(pid=5611, ip=192.0.2.2, actor_id=cb77, repr=<RolloutRayActorImpl object at 0x7f07>)\n"
    + ENGINE_DEAD_TB.split("\n", 1)[1]
)


def _engine_dead_chain(shape):
    from vllm.v1.engine.exceptions import EngineDeadError

    if shape == "measured":
        return _task_error("PPOTrainer.fit", EngineDeadError(), 4541, FIT_TB)
    engine = _task_error("RolloutRayActorImpl.generate_responses", EngineDeadError(), 5611, ENGINE_DEAD_TB)
    return _caller("PPOTrainer.fit", engine)


@pytest.mark.parametrize("shape", ["measured", "nested"])
@pytest.mark.parametrize("started", [True, False])
def test_an_engine_process_death_gets_our_paragraph(started, shape):
    exc = _engine_dead_chain(shape)
    assert cli.engine_dead(exc) and not cli.engine_dead(ValueError("x"))
    err = cli.classify_failure(exc, ARGS, started=started)
    assert isinstance(err, cli.EngineDied)
    msg = str(err)
    assert msg.startswith("a vLLM engine's own processes died")
    assert "EngineCore or a worker process" in msg and "RolloutRayActorImpl, pid 5611" in msg, msg
    assert "The run stops here" in msg and "/tmp/ray_x/session_latest/logs" in msg and "dmesg" in msg
    assert ("--ckpt.load_enable" in msg) == started
    assert ("during the run" in msg) == started


def test_exception_line_reads_rays_renderings():
    text = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::X.__init__()\x1b[39m "
        "(pid=1, ip=1.2.3.4)\n  File \"a.py\", line 1, in f\n    g()\nKeyError: 'input'\n"
        "During handling of the above exception, another exception occurred:\n\n"
        '\x1b[36mray::X.__init__()\x1b[39m (pid=1, ip=1.2.3.4)\n  File "a.py", line 3, in f\n    raise\n'
        "datasets.exceptions.DatasetGenerationError: An error occurred while generating the dataset\nmore\n"
    )
    assert cli.exception_line(text) == "DatasetGenerationError: An error occurred while generating the dataset"
    assert cli.exception_line("no traceback here") is None


def test_fit_watch_marks_the_start_of_training():
    """The driver-side signal: upstream's train() calling fit.remote() on the controller, ours or upstream's."""
    calls = []

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *a, **k):
            calls.append(self.name)
            return self.name

    class Handle:
        def __getattr__(self, name):
            return Method(name)

    class Remote:
        def remote(self, *a, **k):
            return Handle()

        def options(self, **k):
            return self

    started = threading.Event()
    controller = cli._FitWatch(Remote(), started).options(num_cpus=0).remote("pretrain", strategy=None)
    assert controller.get_max_steps.remote() == "get_max_steps" and not started.is_set()
    assert controller.fit.remote() == "fit" and started.is_set()
    assert calls == ["get_max_steps", "fit"]


def test_main_prints_our_line_last_and_exits_1(monkeypatch, capsys):
    exc = _caller("PPOTrainer.__init__", ValueError("bad"))
    monkeypatch.setattr(cli, "parse_args", lambda argv: (ARGS, []))
    monkeypatch.setattr(cli.preflight, "check", lambda args: [])
    monkeypatch.setattr(cli.run_lock, "acquire_all", lambda args, **kwargs: [])  # ARGS has no output folders
    monkeypatch.setattr(cli.preflight.outputs, "saves_best", lambda args: False)  # nor an eval or a ckpt group
    monkeypatch.setattr(ARGS.ray, "accelerator", "cpu", raising=False)  # main() exports it for the workers
    monkeypatch.setattr(ARGS, "train", SimpleNamespace(auto_resume=0), raising=False)  # no supervisor
    monkeypatch.setattr(cli, "train", lambda args: (_ for _ in ()).throw(cli.StartupFailed("start-up failed: x")))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "openrlhf-ess: error: start-up failed: x"
    from openrlhf_ess.checks import resources

    monkeypatch.setattr(cli, "train", lambda args: (_ for _ in ()).throw(resources.ResourceError("too big")))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2 and "Traceback" not in capsys.readouterr().err
    assert exc  # the wrapping helpers build on Ray's real classes


# ---------------------------------------------------------------------------------- the real CLI


@pytest.mark.real_stack
def test_cli_names_a_corrupt_weights_file_as_a_start_up_error(tiny_world, tmp_path):
    """The model folder has config.json, a tokenizer and model.safetensors (pre-flight passes), but the weights
    file is cut in half: the first actor to load it fails; the CLI says start-up, the role and the flag."""
    from tests.helpers.e2e import GPU_ENGINE_LAYOUT, tiny_args
    from tests.helpers.faults import run_cli_tracked

    run_dir = str(tmp_path)
    model = os.path.join(run_dir, "model")
    shutil.copytree(tiny_world["model"], model)
    weights = os.path.join(model, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    world = {**tiny_world, "model": model}
    # The engine's process layout GPU users get (tests/helpers/e2e.py): nothing asserted here depends on vLLM CPU's own
    run = run_cli_tracked(tiny_args(world, run_dir), run_dir, timeout=300, env=GPU_ENGINE_LAYOUT)
    assert not run.timed_out and run.rc == 1, run.log[-6000:]
    ours = [line for line in run.log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1, run.log[-6000:]
    msg = ours[0]
    assert msg.startswith("openrlhf-ess: error: start-up failed, before training began: the "), msg
    assert any(role in msg for role in ("vLLM engine (", "DeepSpeed policy (actor) model rank (")), msg
    assert "Error while deserializing header" in msg and "--actor.model_name_or_path" in msg, msg
    assert "--ckpt.load_enable" not in msg and "during the run" not in msg
    assert len(msg) < 1200, len(msg)
    assert not run.leftovers, run.leftovers


# A reward file (run inside the vLLM engine actor by upstream) that SIGKILLs the engine's EngineCore process
# on its 3rd call, as the OOM killer would: the engine actor survives and vLLM raises EngineDeadError.
KILL_ENGINE_CORE_REWARD = """
import os
import signal

import psutil
import torch

_calls = 0


def reward_func(queries, prompts, labels):
    global _calls
    _calls += 1
    if _calls == 3:
        children = psutil.Process().children(recursive=True)
        core = [p for p in children if "EngineCore" in p.name() + " ".join(p.cmdline())] or children
        with open({marker!r}, "w") as f:
            f.write(" ".join(str(p.pid) for p in core))
        for p in core:
            os.kill(p.pid, signal.SIGKILL)
    rewards = torch.tensor([0.5] * len(queries))
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{}}}}
"""


@pytest.mark.real_stack
@pytest.mark.slow
def test_cli_engine_core_killed_mid_run_gets_our_paragraph(tiny_world, tmp_path):
    from tests.helpers.e2e import tiny_args
    from tests.helpers.faults import run_cli_tracked

    run_dir = str(tmp_path)
    marker = os.path.join(run_dir, "killed")
    reward = os.path.join(run_dir, "reward.py")
    with open(reward, "w") as f:
        f.write(KILL_ENGINE_CORE_REWARD.format(marker=marker))
    args = tiny_args(tiny_world, run_dir, steps_prompts=8)
    args[args.index("--reward.remote_url") + 1] = reward
    run = run_cli_tracked(args, run_dir, timeout=600)
    assert os.path.exists(marker), "the fault was never injected: " + run.log[-3000:]
    assert not run.timed_out and run.rc == 1, run.log[-6000:]
    ours = [line for line in run.log.splitlines() if line.startswith("openrlhf-ess: error:")]
    assert len(ours) == 1, run.log[-6000:]
    assert ours[0].startswith("openrlhf-ess: error: a vLLM engine's own processes died during the run"), ours
    assert "RolloutRayActorImpl, pid" in ours[0] and "--ckpt.load_enable" in ours[0]
    assert run.ended_at - os.stat(marker).st_mtime < 60
    assert not run.leftovers, run.leftovers


def test_a_checkpoint_of_another_model_names_the_keys_that_differ():
    """A checkpoint of a model of another depth and width (no identity file to refuse it in
    pre-flight) fails in PyTorch's load_state_dict; the start-up message keeps only the cause's first line, which
    cut the key lists off. The fix now counts them and names the first three of each kind, and names
    --actor.model_name_or_path. The error text is PyTorch's own, from a real mismatched load."""
    import types

    import torch

    from openrlhf_ess.cli.train_ppo_ray import checkpoint_load_fix, state_dict_detail

    saved = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    try:
        model.load_state_dict(saved.state_dict())
    except RuntimeError as e:
        text = str(e)
    assert state_dict_detail(text) == (
        "2 unexpected key(s), e.g. 2.weight, 2.bias; 3 tensor(s) of another shape, e.g. 0.weight, 0.bias, 1.weight"
    )
    deeper = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    )
    try:
        deeper.load_state_dict(saved.state_dict())
    except RuntimeError as e:
        text = str(e)
    assert state_dict_detail(text) == "2 missing key(s), e.g. 3.weight, 3.bias"
    assert state_dict_detail("CUDA error: an illegal memory access") == ""
    args = types.SimpleNamespace(
        ckpt=types.SimpleNamespace(path="/runs/a/ckpt"), actor=types.SimpleNamespace(model_name_or_path="/m/7b")
    )
    fix = checkpoint_load_fix(args, "DeepSpeed policy (actor) model rank", text)
    assert "written for another model (--actor.model_name_or_path /m/7b)" in fix
    assert "The checkpoint and the model differ: 2 missing key(s), e.g. 3.weight, 3.bias." in fix
    assert "drop --ckpt.load_enable to start fresh" in fix
