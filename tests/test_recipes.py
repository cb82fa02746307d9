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
    # flags inside the args=( ... ) array, one per line, upstream's layout
    body = re.search(r"args=\((.*?)\n\)", text, re.S)
    assert body, f"{path}: no args=( ... ) array"
    lines = [ln.split("#")[0] for ln in body.group(1).splitlines()]
    return re.findall(r"(?<![\w-])(--[a-z_][\w.]*)", "\n".join(lines))


def test_there_are_recipes():
    assert any("cpu" in os.path.basename(s) for s in SCRIPTS)
    assert len(SCRIPTS) >= 2


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_is_valid_bash(script):
    run = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_flags_are_accepted(script):
    known = {opt for a in build_parser()._actions for opt in a.option_strings}
    flags = _flags(script)
    assert flags, script
    unknown = sorted(set(flags) - known)
    assert not unknown, f"{os.path.basename(script)} uses flags our parser rejects: {unknown}"


def _argv(path):
    """The args array as the shell would pass it, variables replaced by placeholders."""
    import shlex

    body = re.search(r"args=\((.*?)\n\)", open(path).read(), re.S).group(1)
    lines = [ln.split(" #")[0] for ln in body.splitlines() if not ln.strip().startswith("#")]
    text = re.sub(r'"?\$\{?\w+(:-[^}]*)?\}?"?', "PLACEHOLDER", "\n".join(lines))
    return shlex.split(text)


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "cpu" not in os.path.basename(s)], ids=os.path.basename)
def test_gpu_recipe_passes_validation(script, monkeypatch):
    # Upstream's and our cross-flag checks, as on a GPU machine (CUDA faked: nothing is loaded).
    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.cli.train_ppo_ray import parse_args
    from openrlhf_ess.runtime import cpu_compat

    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    # a multi-node recipe joins its cluster, whose GPU nodes answer the probe (test_accelerator_decision.py)
    monkeypatch.setattr(cli, "_probe_gpu_nodes", lambda address: {"gpu node": True})
    args, _ = parse_args(_argv(script))
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
