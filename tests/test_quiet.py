"""openrlhf_ess.runtime.quiet: the third-party messages the demo printed are dropped, each by its exact text, and
nothing else is: a library's other messages, the same text from another logger or module, an openrlhf_ess warning.

The messages below are typed out as the libraries print them (not taken from quiet.py's tables), so a filter that
drifts from the real text fails here; ``test_each_text_is_still_in_its_library`` fails when an upgrade changes a
library's text (and the filter would silently stop matching)."""

import ast
import importlib.util
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest

from openrlhf_ess.runtime import quiet

# (logger, msg, args, function that logs it): as the demo's console showed them
LOGGED = [
    (
        "DeepSpeed",
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
        (),
        "get_accelerator",
    ),
    (
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install "
        "kernels` and the kernels >= 0.11.1",
        (ModuleNotFoundError("No module named 'kernels'"),),
        "<module>",
    ),
    (
        "vllm.triton_utils.importing",
        "Triton is installed, but `triton.backends` could not be imported. Disabling Triton.",
        (),
        "<module>",
    ),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs.", (), "check_and_update"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead.", (), "x"),
    (
        "vllm.config.vllm",
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is equivalent to setting "
        "-cc.mode=none -cc.cudagraph_mode=none and --kernel_config.enable_jit_warmup=False",
        (),
        "__post_init__",
    ),
    (
        "vllm.config.vllm",
        "Inductor compilation was disabled by user settings, optimizations settings that are only active during "
        "inductor compilation will be ignored.",
        (),
        "__post_init__",
    ),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.", ("none",), "x"),
    (
        "vllm.model_executor.layers.indexer_topk",
        "Failed to import the DeepSelect extension (vllm._deepselect_C): %s",
        (ModuleNotFoundError("No module named 'vllm._deepselect_C'"),),
        "<module>",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        "%s is not found in LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD` in "
        "https://docs.vllm.ai/en/latest/getting_started/installation/cpu/ to setup required pre-loaded libraries.",
        ("libtcmalloc",),
        "check_preloaded_libs",
    ),
    (
        "vllm.v1.serial_utils",
        "Allowing insecure serialization using pickle due to VLLM_ALLOW_INSECURE_SERIALIZATION=1",
        (),
        "_log_insecure_serialization_warning",
    ),
    (
        "vllm.v1.engine.input_processor",
        "Passing raw prompts to InputProcessor is deprecated and will be removed in the future. You should instead "
        "pass the outputs of Renderer.render_cmpl() or Renderer.render_chat().",
        (),
        "process_inputs",
    ),
    (
        "vllm.distributed.device_communicators.shm_broadcast",
        "No available shared memory broadcast block found in %d seconds. This typically happens when some processes "
        "are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache quantization).",
        (60,),
        "acquire_read",
    ),
    ("transformers.modeling_utils", "`torch_dtype` is deprecated! Use `dtype` instead!", (), "from_pretrained"),
    ("transformers.configuration_utils", "`torch_dtype` is deprecated! Use `dtype` instead!", (), "torch_dtype"),
]
CPU_ONLY_LOGGED = {"DeepSpeed", "bitsandbytes.backends.cpu.ops", "vllm.triton_utils.importing", "vllm.platforms.cpu"}

# What must pass: a library's other records, the same text elsewhere, and ours.
KEPT_LOGGED = [
    ("vllm.config.vllm", "Some other vLLM warning.", (), "x"),
    ("vllm.v1.worker.cpu_worker", "Model Runner V2 requires Triton; using the V1 model runner instead.", (), "x"),
    (  # kernels installed but broken: bitsandbytes' hint is about that
        "bitsandbytes.backends.cpu.ops",
        "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install "
        "kernels` and the kernels >= 0.11.1",
        (RuntimeError("version mismatch"),),
        "<module>",
    ),
    (  # a model with state-space layers: the reset is about the user's model
        "vllm.platforms.cpu",
        "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.",
        ("qwen3_next",),
        "x",
    ),
    (  # the writer waiting: a worker does not read (a hang)
        "vllm.distributed.device_communicators.shm_broadcast",
        "No available shared memory broadcast block found in %d seconds. This typically happens when some processes "
        "are hanging or doing some time-consuming work (e.g. compilation, weight/kv cache quantization).",
        (60,),
        "acquire_write",
    ),
    (
        "openrlhf_ess.trainer.sync_check",
        "Model Runner V2 requires Triton; using the V1 model runner instead.",
        (),
        "x",
    ),
    ("openrlhf_ess.cli.train_ppo_ray", "a warning of ours", (), "x"),
    ("DeepSpeed", "Setting accelerator to CPU.", (), "get_accelerator"),  # not the whole text
]

# (message, category, module it is attributed to)
WARNED = [
    (
        "Tip: In future versions of Ray, Ray will no longer override accelerator visible devices env var if "
        "num_gpus=0 or num_gpus=None (default). To enable this behavior and turn off this error message, set "
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0",
        FutureWarning,
        "ray._private.worker",
    ),
    (
        "The given NumPy array is not writable, and PyTorch does not support non-writable tensors. This means writing "
        "to this tensor will result in undefined behavior. You may want to copy the array to protect its data or make "
        "it writable before converting it to a tensor. This type of warning will be suppressed for the rest of this "
        "program. (Triggered internally at /__w/pytorch/pytorch/torch/csrc/utils/tensor_numpy.cpp:213.)",
        UserWarning,
        "ray._private.tensor_serialization_utils",
    ),
    (
        "'set_vital' is deprecated, please do not call",
        UserWarning,
        "torchdata.stateful_dataloader.stateful_dataloader",
    ),
    (
        "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.",
        UserWarning,
        "torchdata.stateful_dataloader.stateful_dataloader",
    ),
    (
        "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
        FutureWarning,
        "vllm.triton_utils.dispatcher",
    ),
    (
        "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.",
        UserWarning,
        "torch.utils.data.dataloader",
    ),
]
ZERO_COPY = (
    "Zero-copy tensor serialization is enabled, but it only works safely for read-only tensors (detached, no "
    "gradients, contiguous). Modifiable or non-contiguous tensors may cause data corruption."
)
KEPT_WARNED = [
    ("'set_vital' is deprecated, please do not call", UserWarning, "openrlhf_ess.trainer.ppo_actor"),  # ours
    ("some other torchdata warning", UserWarning, "torchdata.stateful_dataloader.stateful_dataloader"),
    ("'set_vital' is deprecated, please do not call", UserWarning, "some_user_module"),
    (
        "'set_vital' is deprecated, please do not call. And more",
        UserWarning,
        "torchdata.stateful_dataloader.stateful_dataloader",
    ),
    (
        "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead",
        DeprecationWarning,  # not the category it is raised with
        "vllm.triton_utils.dispatcher",
    ),
]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _log(entries) -> list:
    """Log each (logger, msg, args, function) on its logger, as from that function; the messages that got through."""
    seen = _Records()
    for name, msg, args, func in entries:
        logger = logging.getLogger(name)
        logger.addHandler(seen)
        old_level, logger.level = logger.level, logging.DEBUG
        try:
            record = logger.makeRecord(name, logging.WARNING, "lib.py", 1, msg, args, None, func=func)
            logger.handle(record)  # the logger's filters, then its handlers: as logger.warning() does
        finally:
            logger.removeHandler(seen)
            logger.setLevel(old_level)
    return seen.messages


def _warn(entries, cpu=True, after=None) -> list:
    """Warn each (message, category, module) as attributed to that module; the messages that got through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.filter_warnings(cpu)
        if after is not None:
            after()
        for message, category, module in entries:
            warnings.warn_explicit(message, category, "lib.py", 1, module=module, registry={})
    return [str(w.message) for w in caught]


def test_each_known_log_record_is_dropped_at_its_logger():
    quiet.filter_logs(cpu=True)
    assert _log(LOGGED) == []


def test_other_records_and_ours_pass():
    quiet.filter_logs(cpu=True)
    assert len(_log(KEPT_LOGGED)) == len(KEPT_LOGGED)


def test_cpu_only_records_pass_in_a_cuda_run():
    # A GPU machine where vLLM finds no Triton, or DeepSpeed no GPU: the same text points at a broken install.
    cuda = quiet.NoiseFilter(cpu=False)
    kept = [msg for name, msg, args, func in LOGGED if cuda.filter(_record(name, msg, args, func))]
    assert set(kept) >= {msg for name, msg, _, _ in LOGGED if name in CPU_ONLY_LOGGED}
    assert "Allowing insecure serialization using pickle due to VLLM_ALLOW_INSECURE_SERIALIZATION=1" not in kept


def _record(name, msg, args, func):
    return logging.getLogger(name).makeRecord(name, logging.WARNING, "lib.py", 1, msg, args, None, func=func)


def test_each_known_warning_is_dropped():
    assert _warn(WARNED) == []


def test_other_warnings_and_ours_pass():
    assert len(_warn(KEPT_WARNED)) == len(KEPT_WARNED)
    # on a CUDA run, no-accelerator pin_memory is news
    pin = [w for w in WARNED if w[0].startswith("'pin_memory'")]
    assert len(_warn(pin, cpu=False)) == len(pin) == 2


def test_ray_zero_copy_warning_is_dropped_after_ray_adds_its_own_filter():
    # Ray's module puts a "once" filter for its category in front of every other at import; install() puts ours
    # back in front once that module has been imported.
    from ray._private.tensor_serialization_utils import ZeroCopyTensorsWarning

    callbacks = {}
    quiet.install(True, lambda module, callback: callbacks.setdefault(module, []).append(callback))
    entry = [(ZERO_COPY, ZeroCopyTensorsWarning, "ray.cloudpickle.cloudpickle")]

    def ray_imported():
        warnings.filterwarnings("once", category=ZeroCopyTensorsWarning)  # what Ray's module does at import
        for callback in callbacks["ray._private.tensor_serialization_utils"]:
            callback()

    assert _warn(entry, after=ray_imported) == []
    assert "vllm.logger" in callbacks


def test_warn_options_reach_spawned_children():
    # multiprocessing hands a spawned child the parent's -W options: the child drops the same warnings.
    options = quiet.warn_options(cpu=True)
    assert options and all(o.startswith("ignore:") for o in options)
    code = (
        "import warnings\n"
        "for m, c, mod in [(%r, FutureWarning, 'vllm.triton_utils.dispatcher'),\n"
        "                  (%r, UserWarning, 'torchdata.stateful_dataloader.stateful_dataloader'),\n"
        "                  ('kept', UserWarning, 'torchdata.stateful_dataloader.stateful_dataloader')]:\n"
        "    warnings.warn_explicit(m, c, 'lib.py', 1, module=mod)\n"
    ) % (WARNED[4][0], WARNED[2][0])
    run = subprocess.run(
        [sys.executable, *[f"-W{o}" for o in options], "-c", code], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "Invalid -W option" not in run.stderr, run.stderr
    assert "reduce_op" not in run.stderr and "set_vital" not in run.stderr, run.stderr
    assert "UserWarning: kept" in run.stderr, run.stderr


def test_vllm_logging_config_filters_on_vllms_handler(tmp_path):
    # vLLM's own default config, standing in with a plain formatter (vLLM's needs vLLM), plus our filter: applied
    # in a fresh process as vLLM's engine core does, a child logger's noise is dropped and its other records kept.
    default = {
        "formatters": {"vllm": {"format": "(%(processName)s) %(levelname)s [%(filename)s] %(message)s"}},
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": "INFO",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
        "version": 1,
        "disable_existing_loggers": False,
    }
    config = quiet.vllm_logging_config(default, cpu=True)
    assert default["handlers"]["vllm"].get("filters") is None  # vLLM's dict is not changed
    assert config["formatters"] == default["formatters"] and config["loggers"] == default["loggers"]
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    code = (
        "import json, logging.config, sys\n"
        "logging.config.dictConfig(json.load(open(sys.argv[1])))\n"
        "log = logging.getLogger('vllm.v1.worker.cpu_worker')\n"
        f"log.warning({LOGGED[9][1]!r}, 'libiomp')\n"
        "log.warning('a worker warning that stays')\n"
        f"logging.getLogger('vllm.config.vllm').warning({LOGGED[4][1]!r})\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=repo, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["(MainProcess) WARNING [<string>] a worker warning that stays"], run.stdout


def test_configure_vllm_logging_leaves_a_users_config_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/users/own.json")
    assert quiet.configure_vllm_logging(True, folder=str(tmp_path)) is None
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert quiet.configure_vllm_logging(True, folder=str(tmp_path)) is None
    assert os.listdir(tmp_path) == []


def test_configure_vllm_logging_writes_vllms_config_with_the_filter(tmp_path, monkeypatch):
    vllm_logger = type(sys)("vllm.logger")  # stands in for vLLM's module: only its default config is read
    vllm_logger.DEFAULT_LOGGING_CONFIG = {"handlers": {"vllm": {"class": "logging.StreamHandler"}}, "version": 1}
    monkeypatch.setitem(sys.modules, "vllm.logger", vllm_logger)
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    path = quiet.configure_vllm_logging(True, folder=str(tmp_path))
    assert path and os.environ["VLLM_LOGGING_CONFIG_PATH"] == path and os.path.dirname(path) == str(tmp_path)
    written = json.load(open(path))
    assert written["handlers"]["vllm"]["filters"] == [quiet.FILTER_ID]
    assert written["filters"][quiet.FILTER_ID] == {"()": "openrlhf_ess.runtime.quiet.NoiseFilter", "cpu": True}
    # a process that inherits it (a Ray worker of the CLI's private instance) writes its own again: a file removed
    # meanwhile is back, and a process that decided otherwise gets its own filter
    os.remove(path)
    assert quiet.configure_vllm_logging(True, folder=str(tmp_path)) == path and os.path.exists(path)
    other = quiet.configure_vllm_logging(False, folder=str(tmp_path))
    assert other != path and json.load(open(other))["filters"][quiet.FILTER_ID]["cpu"] is False


def _module_source(module: str) -> str:
    """The source of ``module``, located without importing it (nor its packages)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    base = os.path.join(spec.submodule_search_locations[0], *rest)
    path = os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize(
    "entry", quiet.LOG_NOISE + quiet.WARNING_NOISE, ids=lambda e: getattr(e, "logger", getattr(e, "module", ""))
)
def test_each_text_is_still_in_its_library(entry):
    if isinstance(entry, quiet.LogNoise):
        module, text = entry.source or entry.logger, entry.msg
    elif entry.source is None:
        pytest.skip("raised in C++")
    else:
        module, text = entry.source or entry.module, entry.message
    strings = {n.value for n in ast.walk(ast.parse(_module_source(module))) if isinstance(n, ast.Constant)}
    assert text in strings, f"{module} no longer says {text!r}: update or remove the filter ({entry.why})"


def test_ds_accelerator_is_set_where_the_run_decided_cpu():
    # A Ray worker of a CPU run (the driver's decision forwarded): DeepSpeed is told; the driver, undecided, is not
    # (it may decide CUDA for a cluster, and forwards the variable to every worker).
    code = (
        "import os\n"
        "from openrlhf_ess.runtime import cpu_compat\n"
        "cpu_compat.apply()\n"
        "print('DS_ACCELERATOR=' + os.environ.get('DS_ACCELERATOR', ''))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "OPENRLHF_ESS_DEVICE")}
    worker = subprocess.run(
        [sys.executable, "-c", code], env={**env, "OPENRLHF_ESS_DEVICE": "cpu"}, capture_output=True, text=True
    )
    driver = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert worker.returncode == 0 and driver.returncode == 0, worker.stderr + driver.stderr
    assert "DS_ACCELERATOR=cpu" in worker.stdout.splitlines(), worker.stdout
    assert "DS_ACCELERATOR=" in driver.stdout.splitlines(), driver.stdout


@pytest.mark.engine
def test_deepspeed_and_vllm_in_fresh_processes_print_none_of_it(tmp_path):
    """The real libraries: DeepSpeed imported after apply() in a worker of a CPU run and in the undecided driver
    prints no accelerator guess; vLLM's logging applied from the config apply() wrote (as vLLM's engine core does in
    its own process) drops the noise and keeps vLLM's format and its other records."""
    code = (
        "import logging, os, sys\n"
        "from openrlhf_ess.runtime import cpu_compat\n"
        "cpu_compat.apply()\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "print('ACCELERATOR', get_accelerator().device_name())\n"
        "import vllm.logger\n"
        "print('CONFIG', os.environ['VLLM_LOGGING_CONFIG_PATH'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "OPENRLHF_ESS_DEVICE")}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    for device in ("cpu", None):
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "OPENRLHF_ESS_DEVICE": device} if device else env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert "ACCELERATOR cpu" in run.stdout
        assert "Setting accelerator to CPU" not in run.stdout + run.stderr
    config = [ln.split(" ", 1)[1] for ln in run.stdout.splitlines() if ln.startswith("CONFIG ")][0]
    engine_core = (  # a process of vLLM's: nothing of ours imported before vLLM configures its logging
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging, init_logger\n"
        "configure_logging(LoggingConfig())\n"
        "log = init_logger('vllm.v1.serial_utils')\n"
        "log.warning_once('Allowing insecure serialization using pickle due to VLLM_ALLOW_INSECURE_SERIALIZATION=1')\n"
        "log.warning('a vLLM warning that stays')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", engine_core],
        env={**env, "VLLM_LOGGING_CONFIG_PATH": config},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if "WARNING" in ln]  # vLLM's format: "(MainProcess pid=..) WARNING"
    assert len(lines) == 1 and lines[0].startswith("(MainProcess pid="), run.stdout
    assert lines[0].endswith("a vLLM warning that stays"), run.stdout


def test_reload_filter_drops_a_tied_heads_warning_only_where_the_head_is_tied():
    """vLLM's layerwise reload logs "<class>: Failed to load weights" with the class name alone: a rotary embedding's
    is always harmless; a ParallelLMHead's is harmless only for a tied head (refreshed after the reload), and an
    untied head's failure must still be seen."""
    import logging

    from openrlhf_ess.runtime.quiet import RELOAD_MESSAGE, RotaryReloadFilter

    def record(layer):
        return logging.LogRecord("x", logging.WARNING, "f", 1, RELOAD_MESSAGE, (layer,), None)

    untied, tied = RotaryReloadFilter(), RotaryReloadFilter(tied_head=True)
    assert not untied.filter(record("Llama3RotaryEmbedding")) and not tied.filter(record("RotaryEmbedding"))
    assert untied.filter(record("ParallelLMHead"))  # an untied head that failed to load is reported
    assert not tied.filter(record("ParallelLMHead"))
    assert tied.filter(record("QKVParallelLinear")) and untied.filter(record("QKVParallelLinear"))
