"""ESS LR scale is global over data-parallel ranks: 2 real ranks (torchrun, gloo) agree with each
other and with one process holding the whole batch."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.ports import free_port

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(tmp_path, case):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "tests.helpers.ess_two_ranks",
        str(tmp_path),
        case,
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads((tmp_path / f"{case}_rank{r}.json").read_text()) for r in (0, 1)]


def _single(tmp_path, case):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run(
        [sys.executable, "-m", "tests.helpers.ess_two_ranks", str(tmp_path), case],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((tmp_path / f"{case}_rank-1.json").read_text())


def test_two_ranks_equal_single_process(tmp_path):
    r0, r1 = _torchrun(tmp_path, "split")
    single = _single(tmp_path, "split")
    assert r0 == r1  # identical on both ranks, bit for bit
    assert r0["scale"] == pytest.approx(single["scale"], rel=1e-12)
    assert r0["rho_ess"] == pytest.approx(single["rho_ess"], rel=1e-12)
    assert 0.1 < r0["scale"] < 0.999  # a real reduction, not the trivial 1


def test_missing_mu_on_one_rank_gives_scale_one_on_both(tmp_path):
    r0, r1 = _torchrun(tmp_path, "missing")
    assert r0 == r1
    assert r0["scale"] == 1.0 and r0["ess_lr_missing"] == 1.0
