"""benchmarks/common.py::run_cli, the tests' and benchmarks' way to run the CLI: what it leaves behind.

The CLI is replaced here by a stand-in script (the ``launcher``) that makes the run's ``--ray.temp_dir`` folder as
Ray would and then exits or hangs: no Ray, no engine, so the test runs in a second."""

import os
import subprocess
import sys

import pytest

from benchmarks.common import run_cli

# argv: [-c, openrlhf_ess.cli.train_ppo_ray, *args]; Ray makes the folder at start and fills it with sockets and logs
STAND_IN = """
import os, sys, time
folder = sys.argv[sys.argv.index("--ray.temp_dir") + 1]
os.makedirs(os.path.join(folder, "session_latest", "logs"))
open(os.path.join(folder, "session_latest", "logs", "raylet.out"), "w").write("log")
print("stand-in run", flush=True)
time.sleep(float(os.environ.get("STAND_IN_SLEEP", "0")))
sys.exit(int(os.environ.get("STAND_IN_RC", "0")))
"""


@pytest.mark.before_ray  # the stand-in never starts Ray or the CLI
@pytest.mark.parametrize("rc", [0, 3])
def test_the_runs_ray_folder_is_removed_whatever_the_exit(tmp_path, rc):
    folder = f"/tmp/ray_ess_test_common_{os.getpid()}_{rc}"  # where ray_temp_dir puts it: short, under /tmp
    got, log = run_cli(
        ["--ray.temp_dir", folder],
        str(tmp_path),
        launcher=[sys.executable, "-c", STAND_IN],
        env={"STAND_IN_RC": str(rc)},
    )
    assert got == rc and "stand-in run" in log
    assert not os.path.exists(folder)


@pytest.mark.before_ray  # the stand-in never starts Ray or the CLI
def test_the_runs_ray_folder_is_removed_after_a_timeout(tmp_path):
    folder = f"/tmp/ray_ess_test_common_{os.getpid()}_timeout"
    env = {"STAND_IN_SLEEP": "60"}
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(
            ["--ray.temp_dir", folder], str(tmp_path), timeout=3, launcher=[sys.executable, "-c", STAND_IN], env=env
        )
    assert not os.path.exists(folder)
