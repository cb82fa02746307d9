"""TEST-ONLY: what the test launchers of our CLI share (``tests.helpers.gloo_broadcast``,
``tests.helpers.fault_injection``, ``tests.helpers.span_gate``).

Each launcher is ``python -m tests.helpers.<name> openrlhf_ess.cli.train_ppo_ray ARGS``: in the driver only,
:func:`run_cli` forwards the launcher's environment variables to every Ray worker, names the launcher's
``setup_ray_worker`` as the Ray worker set-up hook (:func:`setup_worker`: the CLI's own hook, then the launcher's
patches) and its worker extension class as the engines' ``worker_extension_cls``; that class is built on first use
(:func:`lazy_worker_extension`); the patches wrap product functions once their module is imported
(:func:`wrap_after_import`). Nothing here is imported by the package.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Iterable, Optional

CLI_MODULE = "openrlhf_ess.cli.train_ppo_ray"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launcher(module: str) -> list:
    """The command that runs the CLI module under the test launcher ``module`` (``run_cli(..., launcher=)``)."""
    return [sys.executable, "-m", module]


def replace(obj, name: str, value, launcher_module: str) -> None:
    """Set ``obj.name``, which must exist: if a refactor renames it, the launcher fails here instead of running the
    test on the CLI's own path (without its substitution or fault)."""
    if not hasattr(obj, name):
        where = launcher_module.replace(".", "/")
        raise AttributeError(f"{getattr(obj, '__name__', obj)}.{name} is gone: update {where}.py")
    setattr(obj, name, value)


def run_cli(
    argv,
    launcher_module: str,
    *,
    forward: Iterable[str],
    worker_extension: str,
    banner: Callable[[], str],
    prepare: Optional[Callable[[], None]] = None,
    ready: bool = True,
    usage_prefix: str = "",
) -> None:
    """``python -m LAUNCHER_MODULE openrlhf_ess.cli.train_ppo_ray ARGS``: our CLI whose Ray workers get the variables
    ``forward`` (those set, at the time the CLI builds its runtime env) and ``LAUNCHER_MODULE.setup_ray_worker`` as
    their set-up hook, and whose engines get ``worker_extension`` (a dotted class name).

    ``prepare``: called once the imports can reach this repository, before the replacements. ``ready`` false (a
    variable the launcher needs is missing) or other argv: the usage line (``usage_prefix`` before it).
    ``banner()``: printed once everything is in place, right before the CLI runs."""
    if not argv or argv[0] != CLI_MODULE or not ready:
        raise SystemExit(f"usage: {usage_prefix}python -m {launcher_module} {CLI_MODULE} ARGS")
    # Ray workers and vLLM's engine processes import the launcher by name (hook, worker extension)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    if prepare is not None:
        prepare()

    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.trainer.ray import vllm_engine

    names = tuple(forward)
    runtime_env = getattr(cli, "_runtime_env", None)

    def test_runtime_env():
        env = runtime_env()
        env["env_vars"].update({key: os.environ[key] for key in names if os.environ.get(key)})
        env["worker_process_setup_hook"] = f"{launcher_module}.setup_ray_worker"
        return env

    replace(cli, "_runtime_env", test_runtime_env, launcher_module)
    replace(vllm_engine, "WORKER_EXTENSION", worker_extension, launcher_module)
    print(banner(), flush=True)
    cli.main(argv[1:])


def setup_worker(*installs: Callable[[], None]) -> None:
    """A launcher's Ray ``worker_process_setup_hook``: the CLI's own hook, then the launcher's ``installs``."""
    from openrlhf_ess.runtime import worker_hook

    worker_hook.setup_worker()
    for install in installs:
        install()


def lazy_worker_extension(name: str, build: Callable[[type], type]):
    """A module ``__getattr__`` that answers ``name`` with ``build(WorkerWrap)`` (our vLLM worker extension as the
    base), built on first use: by vLLM, in the engine's worker. Importing the class with its module would import
    vLLM into every Ray worker that runs the set-up hook."""

    @functools.lru_cache(maxsize=None)
    def extension_class():
        from openrlhf_ess.trainer.ray.vllm_worker_wrap import WorkerWrap

        return build(WorkerWrap)

    def __getattr__(attribute: str):
        if attribute == name:
            return extension_class()
        raise AttributeError(attribute)

    return __getattr__


def wrap_after_import(module_name: str, attribute: str, wrap: Callable, marker: str) -> None:
    """Replace ``module.attribute`` (a dotted path inside the module, e.g. ``Class.method``) with
    ``wrap(current)``, now if the module is imported, else right after it is (a set-up hook runs before the
    trainer's modules are imported, and importing them there would load DeepSpeed into every Ray worker). The
    wrapped function carries ``marker`` (an attribute set to True): it is wrapped once however often this is armed."""
    from openrlhf_ess.runtime import cpu_compat

    *path, name = attribute.split(".")

    def apply():
        owner = sys.modules[module_name]
        for part in path:
            owner = getattr(owner, part)
        current = getattr(owner, name)  # a refactor that renames it fails here, not as a patch never applied
        if not getattr(current, marker, False):
            wrapped = wrap(current)
            setattr(wrapped, marker, True)
            setattr(owner, name, wrapped)

    cpu_compat.after_import(module_name, apply)
