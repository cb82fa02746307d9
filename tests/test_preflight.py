"""Pre-flight (openrlhf_ess/checks/preflight/): every input of a run checked in seconds, before Ray starts.

The "Rejected in pre-flight" table of docs/bad_inputs.md is walked row by row on the tiny run of
tests/helpers/e2e.py::tiny_args; FILES writes the files its rows name. Then: the tiny run passes (its time is
printed), NaN is refused on every float flag and inf only outside the "no bound" list, formats and folders that
must pass do, a 100k-line JSONL is read fast, the reward dry call is isolated, and the CLI stops before Ray starts.
"""

import os
import time

import pytest

from openrlhf_ess.checks import preflight
from openrlhf_ess.config import ConfigError
from tests.helpers.e2e import run_cli, tiny_args
from tests.helpers.preflight_inputs import (
    ROWS,
    _args,
    _expand_message,
    _materialize,
    _offline,  # noqa: F401  (autouse: the hub offline)
)


def test_the_table_is_whole():
    assert len(ROWS) >= 50
    assert all(error == "ConfigError" for _, error, _ in ROWS)


@pytest.mark.parametrize("extra,error,message", ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_preflight_table(tiny_world, tmp_path, extra, error, message):
    import ray

    files = str(tmp_path / "files")
    os.makedirs(files)
    args = _args(tiny_world, tmp_path, [_materialize(token, files, tiny_world) for token in extra])
    with pytest.raises(ConfigError) as info:
        preflight.check(args)
    assert _expand_message(message, files) in str(info.value), str(info.value)
    assert not ray.is_initialized()


def test_tiny_run_passes_quickly(tiny_world, tmp_path, capsys):
    args = _args(tiny_world, tmp_path)
    start = time.perf_counter()
    notices = preflight.check(args)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\npre-flight of the tiny run: {seconds:.2f} s ({notices[-1]})")
    assert len(notices) == 2, notices
    assert notices[0] == (  # where each output goes
        f"outputs: the trained model, at the end of the run -> {args.ckpt.output_dir} (--ckpt.output_dir); "
        f"TensorBoard events, from step 1 -> {args.logger.tensorboard_dir} (--logger.tensorboard_dir)."
    )
    assert notices[1].startswith("pre-flight checks passed") and "16 prompt records in 1 file(s)" in notices[1]
    assert "reward_func dry call returned 1 reward for 1 query" in notices[1]
    assert "2 output folder(s) writable" in notices[1]  # --ckpt.output_dir, --logger.tensorboard_dir
    assert os.listdir(args.ckpt.output_dir) == []  # created, and the probe file removed


@pytest.mark.engine
@pytest.mark.before_ray  # the CLI stops before Ray: no need to wait for the real-stack group
def test_cli_stops_before_ray_starts(tiny_world, tmp_path, capsys):
    """The real CLI with a bad prompt file: exit status 2 with our message, no Ray instance started."""
    run_dir = str(tmp_path)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"input": "ab ="}\n{"question": "cd ="}\n')
    args = tiny_args(tiny_world, run_dir)
    args[args.index("--data.prompt_dataset") + 1] = str(bad)
    ray_dir = f"/tmp/ray_ess_preflight_{os.getpid()}"  # Ray creates it at start; short: Ray's sockets live under it
    assert not os.path.exists(ray_dir)
    args[args.index("--ray.temp_dir") + 1] = ray_dir
    start = time.perf_counter()
    rc, log = run_cli(args, run_dir, timeout=300)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\nCLI with a bad prompt file exited {rc} after {seconds:.1f} s (mostly imports)")
    assert rc == 2, log[-3000:]
    assert f"openrlhf-ess: error: --data.prompt_dataset {bad} line 2: no key 'input' (--data.input_key)" in log
    assert not os.path.exists(ray_dir), "Ray's temp folder exists: Ray was started"
    assert "Started a local Ray instance" not in log and "ray.init" not in log
