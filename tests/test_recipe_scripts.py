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


def test_the_vcpo_recipe_resolves_to_the_reference_optimizer_and_validation():
    """The VCPO GPU recipe's recorded command, parsed with our flags and --algo.vcpo_enable's recipe applied: the
    reference's optimizer (vcpo_k=10.sh: Megatron's Adam, betas 0.9 0.999; weight_decay=0.1; constant LR, no
    warm-up; lr=1e-6; clip 1.0; no KL) and its validation (test_freq=10; val_kwargs n=3, temperature 0.8). The script
    passes none of the recipe's optimizer flags, so the start-up notice lists them as set by the recipe. Top-p stays
    the rollout's 1.0 (the reference validates at 0.7): upstream's evaluation has no top-p of its own."""
    from openrlhf_ess import config
    from openrlhf_ess.cli import train_ppo_ray as cli

    argv = EXPECTED["train_grpo_qwen2.5_7b_math_vcpo.sh"][3:-2]  # after python3 -m <module>, before --extra x
    parser = cli.build_parser()
    flat = parser.parse_args(argv)
    (notice,) = config.apply_vcpo_recipe(flat, config.given_dests(parser, argv))
    get = vars(flat).get
    assert tuple(get("actor.adam.betas")) == (0.9, 0.999)
    assert get("actor.adam.weight_decay") == 0.1
    assert get("actor.lr_scheduler") == "constant" and get("actor.lr_warmup_ratio") == 0
    assert get("actor.adam.lr") == 1e-6 and get("actor.max_norm") == 1.0
    assert get("algo.kl.init_coef") == 0 and not get("algo.kl.use_loss")
    set_part = notice.partition("; kept as passed")[0]
    for shown in ("--actor.adam.betas 0.9 0.999", "--actor.adam.weight_decay 0.1", "--actor.lr_scheduler constant"):
        assert shown in set_part, shown
    assert "--actor.lr_warmup_ratio 0" in set_part and "--algo.kl.init_coef 0" in set_part
    assert get("eval.steps") == 10 and get("eval.n_samples_per_prompt") == 3 and get("eval.temperature") == 0.8
    assert get("rollout.temperature") == 1.0 and get("rollout.top_p") == 1.0
