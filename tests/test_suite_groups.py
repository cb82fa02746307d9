"""The suite's "real-stack" xdist group (tests/conftest.py): a test marked ``real_stack`` (or ``stack``) runs one at a
time on one worker; the others do not join the group. A test that starts a Ray instance or the CLI, directly,
through a helper of its module, through a script it runs in a child or through a fixture
(:func:`starts_real_stack`), without the mark is refused at collection."""

import importlib.util
import textwrap
import types

import pytest

from tests.conftest import starts_real_stack, undeclared

MODULE = """
import pytest

SCRIPT = "import ray\\nray.init(num_cpus=1)\\n"


def _helper(args):
    from tests.helpers.e2e import run_cli

    return run_cli(args, "/tmp/x")


def _indirect(args):
    return _helper(args)


def test_direct(tmp_path):
    run_cli([], str(tmp_path))


def test_through_two_helpers():
    _indirect([])


def test_a_script_in_a_child():
    import subprocess, sys

    subprocess.run([sys.executable, "-c", SCRIPT])


def test_the_cli_as_a_module():
    cmd = ["python", "-m", "openrlhf_ess.cli.train_ppo_ray", "--help"]


def test_pure():
    from openrlhf_ess.cli.train_ppo_ray import parse_args  # parsing flags starts nothing

    assert parse_args


def test_with_a_fixture(cluster):
    pass


@pytest.fixture
def cluster():
    from tests.helpers.ray_local import local_ray

    with local_ray() as ray:
        yield ray
"""


def _module(tmp_path):
    path = tmp_path / "fake_tests.py"
    path.write_text(textwrap.dedent(MODULE))
    spec = importlib.util.spec_from_file_location("fake_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _item(function, fixtures=None, marked=True):
    """What starts_real_stack reads of a pytest item: the function, its marks (none if not ``marked``), the fixtures
    it requests and their definitions."""
    fixtures = fixtures or {}
    info = types.SimpleNamespace(name2fixturedefs={k: [types.SimpleNamespace(func=f)] for k, f in fixtures.items()})
    marks = {m.name: m for m in getattr(function, "pytestmark", [])} if marked else {}
    return types.SimpleNamespace(
        function=function, fixturenames=list(fixtures), _fixtureinfo=info, get_closest_marker=marks.get
    )


@pytest.mark.real_stack
def test_the_group_is_found_from_the_source(tmp_path):
    m = _module(tmp_path)
    assert starts_real_stack(_item(m.test_direct))
    assert starts_real_stack(_item(m.test_through_two_helpers))
    assert starts_real_stack(_item(m.test_a_script_in_a_child))
    assert starts_real_stack(_item(m.test_the_cli_as_a_module))
    assert not starts_real_stack(_item(m.test_pure))
    assert starts_real_stack(_item(m.test_with_a_fixture, {"cluster": m.cluster.__wrapped__}))
    assert not starts_real_stack(_item(m.test_pure, {"tmp_path": lambda: None}))


def test_the_fault_tests_are_in_the_group():
    """The runs that must never overlap another Ray instance, read from the suite itself."""
    from tests import test_e2e_scale, test_faults, test_outputs_e2e, test_resume, test_signals

    for function in (
        test_resume.test_killed_at_a_point_of_its_progress_resumes_without_losing_prompts,
        test_faults.test_a_signalled_run_cleans_up_at_any_point,
        test_faults.test_engine_killed_mid_rollout_fails_fast,
        test_outputs_e2e.test_a_failed_final_save_a_second_run_and_a_broken_checkpoint,
        test_e2e_scale.test_two_actor_ranks_zero3_with_ess_lr_tis_and_interrupt_prox,
        test_signals.test_bare_ray_init_aborts_a_slow_clean_up_after_sigterm,
    ):
        assert starts_real_stack(_item(function)), function.__name__
    assert not starts_real_stack(_item(test_resume.test_a_half_written_checkpoint_is_never_loaded))


@pytest.mark.real_stack  # its fake module's source names run_cli: the guard reads it so
def test_a_test_that_starts_ray_without_the_mark_is_refused(tmp_path):
    """The group is declared, and the source only guards it: an unmarked test that starts the CLI is named at
    collection; marked ``real_stack`` or ``stack``, or one that starts nothing, passes."""
    m = _module(tmp_path)

    def item(function, marks=()):
        got = _item(function, marked=False)
        got.get_closest_marker = {name: object() for name in marks}.get
        got.nodeid = function.__name__
        return got

    assert undeclared([item(m.test_direct), item(m.test_pure)]) == ["test_direct"]
    assert undeclared([item(m.test_direct, ["real_stack"]), item(m.test_through_two_helpers, ["stack"])]) == []


def test_a_cli_run_that_stops_before_ray_is_left_out_of_the_group():
    """Marked ``before_ray`` (the CLI stops before Ray starts, and the test asserts it): such a test need not wait
    for the real-stack group; unmarked, the same source would join it."""
    from tests import test_caches, test_preflight

    for function in (
        test_preflight.test_cli_stops_before_ray_starts,
        test_caches.test_the_cli_starts_with_an_unwritable_home,
    ):
        assert not starts_real_stack(_item(function)), function.__name__
        assert starts_real_stack(_item(function, marked=False)), function.__name__


GROUPED_TESTS = """
import os

import pytest


def run_cli(name):  # a stand-in named like the real helper: the group is read from the source
    with open(os.path.join(os.environ["WHERE"], name), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.real_stack
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    run_cli(f"grouped{i}")


@pytest.mark.parametrize("i", range(4))
def test_free(i):
    with open(os.path.join(os.environ["WHERE"], f"free{i}"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
"""


@pytest.mark.real_stack
def test_the_group_runs_on_one_worker_under_xdist(tmp_path):
    """pytest-xdist 3.8 under pytest 9.2 ignores the group unless the test's id carries it (tests/conftest.py): the
    grouped tests of a real two-worker run all ran on one worker."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (suite / "test_fake.py").write_text(GROUPED_TESTS)
    where = tmp_path / "where"
    where.mkdir()
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": root}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    run = subprocess.run(
        cmd + ["-c", os.devnull, "--rootdir", str(suite), str(suite)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers = {name: (where / name).read_text() for name in os.listdir(where)}
    assert len(workers) == 8, workers
    assert len({workers[f"grouped{i}"] for i in range(4)}) == 1, workers
