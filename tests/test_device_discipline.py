"""Device discipline: every collective of ours takes tensors on the collective
device, as NCCL requires, checked on CPU with the virtual accelerator of ``tests/helpers/strict_device.py``."""

import ast
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.ports import free_port
from tests.helpers.strict_device import COLLECTIVES

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "openrlhf_ess")


def test_every_collective_of_ours_runs_on_the_collective_device(tmp_path):
    """Two gloo ranks under the virtual NCCL: ESS moments, π_prox version agreement and interrupt's forward count.

    Before the fix, the ESS moments were all-gathered as host tensors (``.cpu()``, ``torch.tensor(...)``): on GPU
    that is NCCL's "No backend type associated with device type cpu" at the first update of every recipe with
    ESS-LR and two or more actor ranks; here it is the same error from the virtual NCCL."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "-m", "tests.helpers.device_discipline_ranks", str(tmp_path)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        # the check can fail: a host tensor is refused with NCCL's message, a moved one accepted
        assert r["host_refused"] is True
        # each of ours really issued its collective (none skipped as single-rank)
        assert r["collectives"] == ["all_reduce", "all_gather", "all_reduce", "all_reduce"], r["collectives"]
        assert r["agree"] == [3, 4, 5]  # the union of what the ranks need, on both ranks
        assert r["score_forwards"] == 2  # ceil(20 / 16) forwards on both ranks, the idle one included
    assert r0["scored"] == 20 and r1["scored"] == 0
    # the start-up self-check's probe: both collectives on the collective device, values right on both ranks
    from openrlhf_ess.checks.selfcheck import check_collectives

    assert r0["selfcheck_collectives"] == r1["selfcheck_collectives"] == ["all_reduce", "all_gather"]
    assert "2 actor rank(s)" in check_collectives([r0["selfcheck"], r1["selfcheck"]])
    # the ESS result is the two-rank one (same as tests/test_ess_lr_two_ranks.py): identical on both ranks
    assert r0["ess"] == r1["ess"] and 0.1 < r0["ess"]["scale"] < 0.999


COLLECTIVE_NAMES = set(COLLECTIVES) | {"all_gather_object", "broadcast_object_list"}


def _collective_calls(path):
    """(line, call) of ``dist.X(...)`` / ``torch.distributed.X(...)`` collectives in one source file."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVE_NAMES:
            receiver = ast.unparse(node.func.value)
            if receiver in ("dist", "torch.distributed"):
                yield node.lineno, ast.unparse(node.func)


def test_collectives_go_through_the_distributed_module():
    """Only openrlhf_ess/distributed.py calls torch.distributed collectives, so the test above sees all of ours."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                calls = list(_collective_calls(path))
                if calls:
                    found[os.path.relpath(path, REPO)] = calls
    assert set(found) == {"openrlhf_ess/distributed.py"}, found
