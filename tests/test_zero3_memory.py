"""Memory discipline under ZeRO-3: the sync check, the weights a sync sends and
the π_prox weight swaps never hold more gathered than one parameter beyond what a normal forward holds.

Before the fix the sync check and ``_synced_state`` opened ``GatheredParameters`` over every parameter: each rank
materialised the whole model on its device at every sync (64 GB per GPU for a 32B model, check on by default)."""

import json
import subprocess
import sys

import pytest

from tests.helpers.ports import free_port
from tests.test_device_discipline import REPO

pytestmark = pytest.mark.engine  # an engine, DeepSpeed ranks or child processes: not in --fast


def test_zero3_passes_gather_one_parameter_at_a_time(tiny_world, tmp_path):
    out = tmp_path / "memory.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), "-m", "tests.helpers.zero3_memory"]
    cmd += [tiny_world["model"], tiny_world["prompts"], str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    for rank in (0, 1):
        res = json.loads(open(f"{out}.rank{rank}").read())
        peaks, numels = res["peaks"], res["numels"]
        partitioned = sorted(set(numels) - set(res["persistent"]))  # sizes of the gathered-on-demand ones
        largest, whole = max(numels), sum(numels) - sum(res["persistent"])
        assert len(numels) - len(res["persistent"]) >= 10 and whole > 3 * largest, (numels, res["persistent"])
        assert partitioned  # the instrument sees something: a forward gathers, and more than one parameter
        assert largest < peaks["forward"] <= whole, peaks
        for name in ("checksums", "synced_state"):
            assert 0 < peaks[name] <= largest, (name, peaks[name], largest, whole)
        for name in ("snapshot_swap", "score_streams"):  # a forward with other weights: no more than a forward
            assert 0 < peaks[name] <= peaks["forward"], (name, peaks)
        # nothing of ours left gathered (a plain eval forward may keep what ZeRO-3 expects to reuse: DeepSpeed's)
        assert all(res["left"][name] == 0 for name in peaks if name != "forward"), res["left"]
