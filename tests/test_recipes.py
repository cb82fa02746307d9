"""Example scripts cannot rot: each parses as bash and uses only flags our parser accepts."""

import glob
import os
import re
import subprocess

import pytest

from openrlhf_ess.cli.train_ppo_ray import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "examples", "scripts", "*.sh")))


def _flags(path):
    text = open(path).read()
    # flags inside the bash arrays (args=( ... ), and the blocks a recipe takes from a file it sources), one per
    # line, upstream's layout
    for sourced in re.findall(r'source "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/([\w.]+)"', text):
        text += open(os.path.join(os.path.dirname(path), sourced)).read()
    for sourced in re.findall(r"source (examples/scripts/[\w.]+)", text):  # a tiny script, after its cd to the repo
        text += open(os.path.join(REPO, sourced)).read()
    bodies = re.findall(r"\w*args=\((.*?)\n\)", text, re.S)
    assert bodies, f"{path}: no args=( ... ) array"
    lines = [ln.split("#")[0] for body in bodies for ln in body.splitlines()]
    return re.findall(r"(?<![\w-])(--[a-z_][\w.]*)", "\n".join(lines))


def test_there_are_recipes():
    assert any("cpu" in os.path.basename(s) for s in SCRIPTS)
    assert len(SCRIPTS) >= 2


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_is_valid_bash(script):
    run = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# scripts that run a benchmark, not the CLI: their arguments are the benchmark's (checked by its own parser)
BENCHMARK_SCRIPTS = {"compare_tiny_cpu.sh": "benchmarks.rlvr_grid"}


@pytest.mark.parametrize(
    "script", [s for s in SCRIPTS if os.path.basename(s) not in BENCHMARK_SCRIPTS], ids=os.path.basename
)
def test_script_flags_are_accepted(script):
    known = {opt for a in build_parser()._actions for opt in a.option_strings}
    flags = _flags(script)
    assert flags, script
    unknown = sorted(set(flags) - known)
    assert not unknown, f"{os.path.basename(script)} uses flags our parser rejects: {unknown}"


def _argv(path, tmp_path):
    """The CLI's arguments as the script passes them: the script run under bash with ``python3`` and ``ray`` replaced
    by stubs on PATH that print their arguments (nothing runs), its variables set to a placeholder."""
    for name in ("python3", "ray"):
        stub = tmp_path / name
        stub.write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(dict.fromkeys(("MODEL", "DATA", "REWARD", "SAVE", "EVAL", "HEAD"), "PLACEHOLDER"))
    run = subprocess.run(["bash", path], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = run.stdout.splitlines()
    entry = next(i for i, arg in enumerate(out) if arg.endswith(".train_ppo_ray"))  # after "-m"
    return out[entry + 1 :]


# the GPU recipes; a file whose name starts with "_" holds blocks the recipes source, not a command
GPU_RECIPES = [s for s in SCRIPTS if "cpu" not in os.path.basename(s) and not os.path.basename(s).startswith("_")]


@pytest.mark.parametrize("script", GPU_RECIPES, ids=os.path.basename)
def test_gpu_recipe_passes_validation(script, monkeypatch, tmp_path):
    # Upstream's and our cross-flag checks, as on a GPU machine (CUDA faked: nothing is loaded).
    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.cli.train_ppo_ray import parse_args
    from openrlhf_ess.runtime import cpu_compat

    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    # a multi-node recipe joins its cluster, whose GPU nodes answer the probe (test_accelerator_decision.py)
    monkeypatch.setattr(cli, "_probe_gpu_nodes", lambda address: {"gpu node": True})
    args, notices = parse_args(_argv(script, tmp_path))
    cli.check_with_cluster(args, notices)  # parsing does no I/O: the cluster is joined after it
    assert args.ray.accelerator == "cuda"
    assert args.actor.model_name_or_path == "PLACEHOLDER"


def _benchmark_configs():
    from benchmarks import overhead, sampling_mask, staleness

    for group, configs in overhead.GROUPS.items():
        for name, flags in configs.items():
            yield f"overhead/{group}/{name}", flags
    for level, name in staleness.grid(list(staleness.STALENESS), list(staleness.ALL_CORRECTIONS)):
        yield f"staleness/{level}/{name}", staleness.config_flags(level, name)
    for name, flags in sampling_mask.RUNS.items():
        yield f"sampling_mask/{name}", sampling_mask.ASYNC + flags


@pytest.mark.parametrize("name, flags", list(_benchmark_configs()), ids=lambda x: x if isinstance(x, str) else "")
def test_benchmark_configs_pass_validation(tiny_world, tmp_path, name, flags):
    """Every configuration the benchmark and the staleness experiment run is a valid command (they would
    otherwise fail an hour into a measurement)."""
    from openrlhf_ess.cli.train_ppo_ray import parse_args
    from tests.helpers.e2e import tiny_args

    parse_args(tiny_args(tiny_world, str(tmp_path)) + flags)


@pytest.mark.parametrize("name", sorted(BENCHMARK_SCRIPTS))
def test_benchmark_script_names_real_configurations(name):
    from benchmarks import rlvr_grid

    text = open(os.path.join(REPO, "examples", "scripts", name)).read()
    assert f"python -m {BENCHMARK_SCRIPTS[name]} " in text
    default = re.search(r"CORRECTED=\$\{CORRECTED:-([^}]+)\}", text).group(1)
    configs = re.findall(r'"((?:sync|async q\d+ \+ partial) \| [^"$]+)"', text)
    assert len(configs) == 2, configs
    for key in configs + [f"async q8 + partial | {default}"]:
        rlvr_grid.parse_config(key)  # raises on a name the grid does not know
