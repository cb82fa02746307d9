"""The GRPO recipes of examples/scripts/ give the command lines in tests/data/recipe_commands.json: each script run
under bash with ``python3`` and ``ray`` replaced by stubs on PATH that print their arguments, one a line (nothing is
trained, nothing is started). The 7B recipes take their shared blocks from ``_grpo_7b_base.sh``; an edit there or in
a recipe that changes a command line fails here until the JSON says so."""

import json
import os
import shutil
import stat
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "examples", "scripts")
EXPECTED = json.load(open(os.path.join(REPO, "tests", "data", "recipe_commands.json")))
# the recipes' own defaults, not the caller's: the variables each script reads from the environment
RECIPE_VARIABLES = ("MODEL", "DATA", "REWARD", "SAVE", "EVAL", "HEAD")


@pytest.fixture
def stub_path(tmp_path):
    for name in ("python3", "ray"):
        stub = tmp_path / name
        stub.write_text(f"#!/usr/bin/env bash\nprintf '%s\\n' {name} \"$@\"\n")
        stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return str(tmp_path)


def test_every_grpo_recipe_is_listed():
    on_disk = sorted(n for n in os.listdir(SCRIPTS) if n.startswith("train_grpo_") and n.endswith(".sh"))
    assert on_disk == sorted(EXPECTED)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_recipe_command_line(script, stub_path):
    env = {k: v for k, v in os.environ.items() if k not in RECIPE_VARIABLES}
    env["PATH"] = stub_path + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(
        ["bash", os.path.join("examples", "scripts", script), "--extra", "x"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    expected = [arg.replace("$PWD", REPO) for arg in EXPECTED[script]]
    assert proc.stdout.splitlines() == expected
