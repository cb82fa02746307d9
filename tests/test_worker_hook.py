"""Ray's worker set-up hook never initialises CUDA, and the run's accelerator is the
cluster's, not the driver's.

Why it matters: the hook runs in every Ray worker before Ray sets the actor's ``CUDA_VISIBLE_DEVICES``. One
``cuInit`` there (``torch.cuda.is_available()``, or importing DeepSpeed, whose accelerator probe calls
``device_count()`` and ``is_available()``) fixes the device list to the node's full set, and upstream's
``set_device(0)`` then puts every actor of the node on physical GPU 0. No CPU machine can show the wrong GPU,
so the tests below instrument every CUDA entry point of torch in a fresh process and fail on any call.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# A fresh interpreter: the CUDA entry points of torch replaced by recorders *before* our code is imported, the
# node made to look like a GPU node (a CUDA build of torch whose NVML sees 2 GPUs), then the hook as Ray runs it.
_HOOK_RUN = textwrap.dedent(
    """
    import importlib, json, sys
    import torch

    calls = []

    def recorder(name, result):
        def call(*args, **kwargs):
            calls.append(name)
            return result
        return call

    for name, result in [("is_available", True), ("device_count", 2), ("init", None), ("_lazy_init", None),
                         ("current_device", 0), ("set_device", None), ("synchronize", None),
                         ("get_device_name", "GPU"), ("get_device_properties", None), ("mem_get_info", (0, 0))]:
        setattr(torch.cuda, name, recorder("torch.cuda." + name, result))
    torch._C._cuda_getDeviceCount = recorder("torch._C._cuda_getDeviceCount (cuInit)", 2)  # also: a CUDA build
    torch._C._cuda_init = recorder("torch._C._cuda_init", None)
    nvml = []
    torch.cuda._raw_device_count_nvml = lambda: nvml.append(1) or 2  # NVML: no CUDA context, no device list

    module, _, attr = sys.argv[1].rpartition(".")
    getattr(importlib.import_module(module), attr)()
    print("RESULT " + json.dumps({"calls": calls, "nvml": len(nvml),
                                  "deepspeed": "deepspeed" in sys.modules, "openrlhf": "openrlhf" in sys.modules}))
    """
)


def _result(argv, env=None, stderr=None) -> dict:
    """Run ``python argv`` in a fresh process; the JSON of its last ``RESULT `` line (its stderr appended to the
    list ``stderr`` if given)."""
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if stderr is not None:
        stderr.append(out.stderr)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _run_hook(hook: str, device_env=None):
    env = {k: v for k, v in os.environ.items() if k != "OPENRLHF_ESS_DEVICE"}
    if device_env is not None:
        env["OPENRLHF_ESS_DEVICE"] = device_env
    return _result(["-c", _HOOK_RUN, hook], env)


@pytest.mark.parametrize("device_env", [None, "cuda"], ids=["undecided-gpu-node", "decided-cuda"])
def test_worker_hook_makes_no_cuda_call_on_a_gpu_node(device_env):
    from openrlhf_ess.cli import train_ppo_ray

    result = _run_hook(train_ppo_ray.WORKER_SETUP_HOOK, device_env)
    assert result["calls"] == [], f"the worker hook called CUDA before Ray set CUDA_VISIBLE_DEVICES: {result}"
    # and it loaded nothing that would on the actor's first import before placement
    assert not result["deepspeed"] and not result["openrlhf"], result
    if device_env is None:
        assert result["nvml"] >= 1  # the GPU node was recognised through NVML, not the CUDA runtime


@pytest.mark.engine
def test_worker_hook_applies_the_cpu_patches_on_a_cpu_run():
    """The same hook on a CPU run: it imports nothing heavy (Ray's queue and lock actors never import torch), and each
    patch is in place once its module is imported, for the importer too (``from ... import`` of a patched name)."""
    code = textwrap.dedent(
        """
        import json, os, sys
        os.environ["OPENRLHF_ESS_DEVICE"] = "cpu"
        from openrlhf_ess.runtime import cpu_compat, worker_hook
        worker_hook.setup_worker()
        heavy = sorted(m for m in ("torch", "deepspeed", "openrlhf", "transformers", "vllm") if m in sys.modules)
        import torch
        from openrlhf.utils.utils import convert_to_torch_dtype
        from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
        from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy
        from deepspeed.runtime.zero import partition_parameters
        print("RESULT " + json.dumps({
            "heavy": heavy,
            "current_device": torch.cuda.current_device(),
            "set_device": getattr(torch.cuda.set_device, "__openrlhf_ess_patch__", False),
            "synchronize": getattr(torch.cuda.synchronize, "__openrlhf_ess_patch__", False),
            "fp32": str(convert_to_torch_dtype("fp32")),
            "replay_buffer": str(NaiveReplayBuffer(4).target_device),
            "torch_adam": getattr(DeepspeedStrategy.get_ds_train_config, "__openrlhf_ess_patch__", False),
            "zero3": getattr(partition_parameters.dist, "__openrlhf_ess_patch__", False),
            # wandb, Ray's tensor serialization and vLLM's logger (quiet.py): the hook waits until a run imports them
            "pending": sorted(cpu_compat._HOOK.pending),
        }))
        """
    )
    assert _result(["-c", code]) == {
        "heavy": [],
        "current_device": "cpu",
        "set_device": True,
        "synchronize": True,
        "fp32": "torch.float32",
        "replay_buffer": "cpu",
        "torch_adam": True,
        "zero3": True,
        "pending": ["ray._private.tensor_serialization_utils", "vllm.logger", "wandb"],
    }


def test_cuda_available_reads_the_decision_first(monkeypatch):
    from openrlhf_ess.runtime import cpu_compat

    monkeypatch.setattr(cpu_compat, "node_has_cuda", lambda: pytest.fail("the decision was not read"))
    monkeypatch.setenv(cpu_compat.DEVICE_ENV, "cuda")
    assert cpu_compat.cuda_available() is True
    monkeypatch.setenv(cpu_compat.DEVICE_ENV, "cpu")
    assert cpu_compat.cuda_available() is False


_WANDB_RUN = textwrap.dedent(
    """
    import json, os, signal, sys
    if sys.argv[1] == "hook":
        os.environ["OPENRLHF_ESS_DEVICE"] = "cpu"
        from openrlhf_ess.runtime import worker_hook
        worker_hook.setup_worker()
    import wandb
    wandb.init(mode="offline", dir=sys.argv[2], project="p")
    wandb.log({"x": 1.0})
    wandb.finish()  # as upstream's WandbLogger.close() at the end of fit()
    me = os.getpid()
    children = [int(p) for p in open(f"/proc/{me}/task/{me}/children").read().split()]
    # What Ray's core worker does when an actor ends: SIGKILL the actor's children, then let Python exit.
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    print("RESULT " + json.dumps({"children_after_finish": len(children)}), flush=True)
    """
)


def _wandb_env(tmp_path) -> dict:
    """wandb offline, quiet, and every folder of its own under ``tmp_path``."""
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env[name] = str(tmp_path / name)
    return env


def test_wandb_service_ends_with_the_run_not_at_exit(tmp_path):
    """A Ray actor that logged to wandb ends without wandb's "Exception ignored in atexit callback ...
    ConnectionResetError" (seen in CI). Ray SIGKILLs an ending actor's children before its atexit hooks run, and
    wandb's service is one. Without the hook the service outlives ``finish()`` (the control: so the check below can
    fail); with it, ``finish()`` has ended it and nothing is left for the atexit hook or for Ray to kill."""
    env = _wandb_env(tmp_path)
    found = {}
    for mode in ("bare", "hook"):
        run_dir = tmp_path / mode
        run_dir.mkdir()
        stderr = []
        found[mode] = _result(["-c", _WANDB_RUN, mode, str(run_dir)], env, stderr)["children_after_finish"]
        if mode == "hook":
            assert "Traceback" not in stderr[0] and "Exception ignored" not in stderr[0], stderr[0][-3000:]
        assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb")), f"{mode}: the run's file is missing"
    assert found == {"bare": 1, "hook": 0}, found


def test_wandb_service_stays_while_another_run_of_the_process_logs(tmp_path):
    """Ending the service is for the last run only: with two runs (``reinit="create_new"``), finishing the newest
    (the global ``wandb.run``) leaves the older one logging, and its file is complete once it finishes too. A check of
    ``wandb.run`` alone would have ended the service under it."""
    code = textwrap.dedent(
        """
        import json, os, sys
        os.environ["OPENRLHF_ESS_DEVICE"] = "cpu"
        from openrlhf_ess.runtime import worker_hook
        worker_hook.setup_worker()
        import wandb
        a = wandb.init(mode="offline", dir=sys.argv[1], project="p", reinit="create_new")
        b = wandb.init(mode="offline", dir=sys.argv[1], project="p", reinit="create_new")
        b.log({"x": 1.0})
        b.finish()  # the newest run, wandb.run: after it wandb.run is None, yet run a is still active
        me = os.getpid()
        children = lambda: len(open(f"/proc/{me}/task/{me}/children").read().split())
        alive = children()
        a.log({"x": 2.0})  # raises if the service had been ended
        a.finish()
        print("RESULT " + json.dumps({"service_after_first": alive, "service_after_last": children()}))
        """
    )
    env = _wandb_env(tmp_path)
    assert _result(["-c", code, str(tmp_path)], env) == {"service_after_first": 1, "service_after_last": 0}
    assert len(list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))) == 2
