"""Shared fixtures: the offline tiny world, built once per test session under pytest's temp dir; the
session-wide check that every process the tests start ends with them (tests/helpers/leak_check.py); and the
one-at-a-time group of the tests that start a Ray instance or the CLI, declared with ``@pytest.mark.real_stack``
(:func:`pytest_collection_modifyitems`)."""

import ast
import atexit
import inspect
import os
import re
import shutil
import tempfile

import pytest

# The session-wide check that no process a test started outlives the session: pytest hooks. It needs psutil, which
# the full stack has and the GPU checks' device image (torch, transformers and pytest only: docs/gpu_check.md) does
# not: there the check is off, and the session says so (a warning and a header line), never silently.
try:
    from tests.helpers.leak_check import (  # noqa: F401
        pytest_runtest_logfinish,
        pytest_runtest_logstart,
        pytest_sessionfinish,
        pytest_sessionstart,
        pytest_testnodedown,
    )
except ImportError as _err:
    LEAK_CHECK_OFF = (
        f"the session-wide leak check (tests/helpers/leak_check.py) is OFF: {type(_err).__name__}: {_err} "
        "(it needs psutil; processes a test leaves running are not reported)"
    )
else:
    LEAK_CHECK_OFF = None

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM CPU lets this variable replace any engine's own KV-cache size: the tests' engines size theirs (64 MiB
# in-process, --vllm.cpu_kv_cache_gb in CLI runs), whatever the developer's shell exports.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
# The runs' /dev/shm ledgers (openrlhf_ess/runtime/shm_cleanup.py) in the suite's own folder, not the user's state
# folder.
if "OPENRLHF_ESS_STATE_DIR" not in os.environ:
    os.environ["OPENRLHF_ESS_STATE_DIR"] = tempfile.mkdtemp(prefix="ess_state_")
    atexit.register(shutil.rmtree, os.environ["OPENRLHF_ESS_STATE_DIR"], ignore_errors=True)


def pytest_configure(config):
    if LEAK_CHECK_OFF:
        config.issue_config_time_warning(pytest.PytestConfigWarning(LEAK_CHECK_OFF), stacklevel=2)


def pytest_report_header(config):
    return ([f"WARNING: {LEAK_CHECK_OFF}"] if LEAK_CHECK_OFF else []) + [cpu_dtype_line()]


def cpu_dtype_line() -> str:
    """The session's one line on the dtype its CPU runs compute in (``tests/helpers/e2e.py::tiny_args``, the
    in-process actors and engines that take this CPU's choice): fp32 where bf16 is emulated, and how to force bf16.
    The tests marked ``bf16`` keep bf16 on every CPU."""
    from openrlhf_ess.runtime.cpu_dtype import choose, notice

    return notice(choose(), "this session's tiny CPU runs (tests marked bf16 keep bf16)")


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory):
    from openrlhf_ess.tiny.world import build_world

    return build_world(str(tmp_path_factory.mktemp("tiny_world")), seed=0, n_prompts=32)


@pytest.fixture(scope="session")
def tied_world(tmp_path_factory):
    """The tiny world with a tied-embedding Qwen2 (``tie_word_embeddings``), 48 prompts: 6 steps of 8."""
    from openrlhf_ess.tiny.families import build_family_world

    return build_family_world(str(tmp_path_factory.mktemp("tied_world")), "qwen2_tied", n_prompts=48)


# ---- two workers, one real stack at a time (scripts/test.sh runs the suite with pytest-xdist -n 2 --dist loadgroup)
#
# A test that starts a Ray instance, the CLI or a Ray cluster is marked ``real_stack`` (a ``stack``-tier test is one
# too) and joins the xdist group "real-stack": the group's tests run one after the other on one worker while the other
# worker takes the rest. Two private Ray instances of one session at once would slow each other on 2 cores as much as
# they overlap (docs/tests.md); a test of the rest (pure Python, an in-process vLLM engine, DeepSpeed ranks over gloo)
# uses about one core, and a real-stack run leaves part of the second idle. scripts/test.sh runs the stack tier, a
# session of its own, beside the default suite: a second Ray instance on the node then goes without the dashboard
# agent's HTTP port (52365, job submission only), which the first holds. The group is declared; the source is read
# only to refuse a test that starts one without the mark (:func:`starts_real_stack`: the test function, the module's
# functions and scripts (strings) it names (two levels), and the fixtures it requests).
REAL_STACK = re.compile(
    r"\brun_cli|[\"']openrlhf_ess\.cli\.train_ppo_ray[\"']|\blocal_ray\b|\bray_cluster\b|\bray\.init\(|\binit_ray\("
)
REAL_STACK_GROUP = "real-stack"


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _names(source: str) -> set:
    try:
        tree = ast.parse(inspect.cleandoc(source) if source.startswith((" ", "\t")) else source)
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def starts_real_stack(item) -> bool:
    """Whether ``item`` (a collected test) starts a Ray instance or the CLI, read from its source (see above); a test
    marked ``before_ray`` runs the CLI only to a point before Ray starts (and asserts it), so it does not."""
    function = getattr(item, "function", None)
    if function is None or item.get_closest_marker("before_ray"):
        return False
    namespace = function.__globals__  # the test module's
    texts, seen, frontier = [], set(), [function]
    for _ in range(3):  # the test, then what it names in its module, twice
        following = []
        for obj in frontier:
            text = _source(obj)
            texts.append(text)
            for name in _names(text) - seen:
                seen.add(name)
                member = namespace.get(name)
                if inspect.isfunction(member) and member.__module__ == function.__module__:
                    following.append(member)
                elif isinstance(member, str):  # a script the test runs in a child process
                    texts.append(member)
        frontier = following
    for name in getattr(item, "fixturenames", ()):
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            texts.append(_source(fixturedef.func))
    return any(REAL_STACK.search(text) for text in texts)


def in_real_stack_group(item) -> bool:
    """Declared: marked ``real_stack``, or ``stack`` (every stack-tier test runs the CLI)."""
    return item.get_closest_marker("real_stack") is not None or item.get_closest_marker("stack") is not None


def undeclared(items) -> list:
    """The ids of the tests that start a Ray instance or the CLI (read from their source) without the mark."""
    return [item.nodeid for item in items if not in_real_stack_group(item) and starts_real_stack(item)]


# Module-scoped fixtures whose tests must share one worker: tests/gpu's `shared` (a module's entries hand results to
# the next: split, test_placement_distinct found nothing from test_placement); test_prox_modes' `zero3_two_ranks` (one
# two-rank launch for three tests: split, each worker would launch it)
ONE_WORKER_FIXTURES = ("shared", "zero3_two_ranks")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own
def pytest_collection_modifyitems(config, items):
    missing = undeclared(items)
    if missing:
        raise pytest.UsageError(
            "these tests start a Ray instance or the CLI but are not marked @pytest.mark.real_stack (two at once on "
            "two workers contend for Ray's fixed ports; tests/conftest.py): " + ", ".join(missing[:10])
        )
    grouping = getattr(config.option, "loadgroup", False)  # an xdist worker under --dist loadgroup
    if not config.pluginmanager.hasplugin("xdist"):  # -p no:xdist (the stack tier): one process, no groups
        return
    for item in items:
        group = None
        if in_real_stack_group(item):
            group = REAL_STACK_GROUP
        elif set(ONE_WORKER_FIXTURES) & set(getattr(item, "fixturenames", ())):
            group = "module-" + item.path.stem
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if grouping:
                # xdist's scheduler reads the group from the suffix "@<group>" of the test's id, which xdist 3.8 sets
                # as `item._nodeid`; pytest 9.2 derives the id from `item._id`, so that has no effect (both workers
                # got real-stack tests, seen in a run): set here the way pytest 9.2 keeps it.
                from _pytest.nodeid import NodeId

                item._id = NodeId.parse(f"{item.nodeid}@{group}")
