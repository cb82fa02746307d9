"""The dtype of our CPU runs (openrlhf_ess/runtime/cpu_dtype.py): bf16 where the CPU's flags name a native bf16
(x86 avx512_bf16 / amx_bf16, Arm bf16) and oneDNN is not held below it, else fp32; OPENRLHF_ESS_CPU_DTYPE forces
either; the one line; the demo scripts' flags and their pass-through override; the tests' tiny runs. Every expected
value is written by hand."""

import os
import subprocess
import sys

import pytest

from openrlhf_ess.runtime import cpu_dtype

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32 = ["--ds.param_dtype", "fp32", "--vllm.dtype", "float32"]
BF16 = ["--ds.param_dtype", "bf16", "--vllm.dtype", "bfloat16"]
AVX2 = "fpu sse2 avx avx2 fma f16c"  # an AVX2 server's flags (no bf16 of any kind)
AVX512 = AVX2 + " avx512f avx512bw avx512vl avx512_vnni"  # AVX-512 without BF16 (Skylake/Cascade Lake)


@pytest.mark.parametrize(
    "flags, native",
    [
        (AVX2, False),
        (AVX512, False),
        (AVX512 + " avx512_bf16", True),  # Cooper Lake, Zen 4
        (AVX512 + " amx_tile amx_bf16 amx_int8", True),  # Sapphire Rapids
        ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm", True),  # Arm Features (Neoverse V1)
        ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics", False),
        ("avx2 xavx512_bf16 avx512_bf16x", False),  # whole words only
        ("", False),
        (None, None),  # unknown: nothing read
    ],
)
def test_native_bf16_from_the_flags(flags, native):
    assert cpu_dtype.native_bf16(flags) is native
    if flags is not None:
        assert cpu_dtype.native_bf16(flags.split()) is native  # the words, as a list


@pytest.mark.parametrize(
    "env, native",
    [
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, False),  # oneDNN reads the name in either case
        ({"DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, False),  # oneDNN's older name of the variable
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
        ({}, True),
    ],
)
def test_onednn_held_below_bf16_emulates_it(env, native):
    assert cpu_dtype.native_bf16(AVX512 + " avx512_bf16", env) is native


def test_the_flags_line_is_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n")
    empty = tmp_path / "empty"
    empty.write_text("processor\t: 0\n")
    assert cpu_dtype.cpu_flags(str(x86)) == "fpu avx2 avx512_bf16"
    assert cpu_dtype.cpu_flags(str(arm)) == "fp asimd bf16"
    assert cpu_dtype.cpu_flags(str(empty)) is None
    assert cpu_dtype.cpu_flags(str(tmp_path / "absent")) is None


@pytest.mark.parametrize(
    "flags, env, dtype, forced",
    [
        (AVX2, {}, "fp32", False),
        (AVX512, {}, "fp32", False),
        (AVX512 + " avx512_bf16", {}, "bf16", False),
        (AVX512 + " avx512_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "fp32", False),
        (None, {}, "bf16", False),  # flags unknown: the CLI's default
        (AVX2, {"OPENRLHF_ESS_CPU_DTYPE": "auto"}, "fp32", False),
        (AVX2, {"OPENRLHF_ESS_CPU_DTYPE": "bf16"}, "bf16", True),
        (AVX2, {"OPENRLHF_ESS_CPU_DTYPE": " BF16 "}, "bf16", True),
        (AVX512 + " amx_bf16", {"OPENRLHF_ESS_CPU_DTYPE": "fp32"}, "fp32", True),
    ],
)
def test_the_choice(flags, env, dtype, forced):
    choice = cpu_dtype.choose(flags, env)
    assert (choice.dtype, choice.forced) == (dtype, forced)
    assert choice.cli_flags == (FP32 if dtype == "fp32" else BF16)


def test_an_unknown_value_of_the_variable_is_refused_with_its_values():
    with pytest.raises(ValueError, match=r"OPENRLHF_ESS_CPU_DTYPE='fp16': use bf16, fp32 or auto"):
        cpu_dtype.choose(AVX2, {"OPENRLHF_ESS_CPU_DTYPE": "fp16"})


def test_the_line_says_the_dtype_why_and_how_to_force_the_other():
    line = cpu_dtype.notice(cpu_dtype.choose(AVX2, {}), "train_ppo_tiny_cpu.sh", "examples/scripts/x.sh")
    assert line == (
        "openrlhf-ess: dtype of train_ppo_tiny_cpu.sh: fp32 (--ds.param_dtype fp32 --vllm.dtype float32), because "
        "this CPU emulates bf16: none of avx512_bf16, amx_bf16, bf16 in its flags; OPENRLHF_ESS_CPU_DTYPE=bf16 (or: "
        "bash examples/scripts/x.sh --ds.param_dtype bf16 --vllm.dtype bfloat16) forces bf16."
    )
    native = cpu_dtype.notice(cpu_dtype.choose(AVX512 + " amx_bf16 avx512_bf16", {}), "the tests")
    assert native == (
        "openrlhf-ess: dtype of the tests: bf16 (--ds.param_dtype bf16 --vllm.dtype bfloat16), because this CPU "
        "computes bf16 natively: amx_bf16, avx512_bf16; OPENRLHF_ESS_CPU_DTYPE=fp32 forces fp32."
    )
    forced = cpu_dtype.notice(cpu_dtype.choose(AVX2, {"OPENRLHF_ESS_CPU_DTYPE": "bf16"}), "the tests")
    assert "bf16 (--ds.param_dtype bf16 --vllm.dtype bfloat16), because OPENRLHF_ESS_CPU_DTYPE=bf16 (this " in forced
    assert "\n" not in line + native + forced


def test_the_command_prints_the_flags_and_one_line(tmp_path, monkeypatch, capsys):
    info = tmp_path / "cpuinfo"
    info.write_text(f"flags\t: {AVX2}\n")
    monkeypatch.setattr(cpu_dtype, "CPUINFO", str(info))
    monkeypatch.delenv("OPENRLHF_ESS_CPU_DTYPE", raising=False)
    for name in cpu_dtype.ONEDNN_ISA_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert cpu_dtype.main(["--what", "the demo"]) == 0
    out, err = capsys.readouterr()
    assert out == "--ds.param_dtype fp32 --vllm.dtype float32\n"
    assert err.count("\n") == 1 and err.startswith("openrlhf-ess: dtype of the demo: fp32 ")
    monkeypatch.setenv("OPENRLHF_ESS_CPU_DTYPE", "half")
    assert cpu_dtype.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("openrlhf-ess: error: OPENRLHF_ESS_CPU_DTYPE='half'")


SOURCING = """#!/usr/bin/env bash
set -euo pipefail
RUN_DIR={run_dir}
source {repo}/examples/scripts/_tiny_cpu_base.sh
printf '%s\\n' "${{tiny_deepspeed_args[@]}}"
"""


@pytest.mark.parametrize("forced, expected", [("fp32", FP32), ("bf16", BF16)])
def test_the_demo_scripts_take_the_choice_and_say_it_once(tmp_path, forced, expected):
    """The demos' shared flags (_tiny_cpu_base.sh) under bash: the dtype flags among the DeepSpeed ones, one line on
    stderr naming the script, and a bad value stops the script before it starts anything."""
    script = tmp_path / "demo.sh"
    script.write_text(SOURCING.format(run_dir=tmp_path, repo=REPO))
    env = {**os.environ, "OPENRLHF_ESS_CPU_DTYPE": forced, "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin"}
    env["PYTHONPATH"] = REPO
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[-5:-1] == expected  # the last four of the DeepSpeed flags
    assert "--ds.param_dtype" not in run.stdout.split("\n")[:-5]  # once
    lines = [line for line in run.stderr.splitlines() if line.startswith("openrlhf-ess:")]
    assert len(lines) == 1 and lines[0].startswith(f"openrlhf-ess: dtype of demo.sh: {forced} "), run.stderr
    assert f"bash {script} --ds.param_dtype" in lines[0]  # the pass-through override, named
    env["OPENRLHF_ESS_CPU_DTYPE"] = "fp16"
    bad = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert bad.returncode != 0 and "--ds.param_dtype" not in bad.stdout, bad.stdout


def test_the_demos_pass_through_flags_override_the_choice():
    """The demo puts the user's extra flags after its own: the CLI's parser keeps the last value of each flag."""
    from openrlhf_ess.cli.train_ppo_ray import parse_args

    base = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p", "--reward.remote_url", "r.py"]
    args, _ = parse_args(base + ["--ds.attn_implementation", "sdpa"] + FP32 + BF16)
    assert (args.ds.param_dtype, args.vllm.dtype) == ("bf16", "bfloat16")
    args, _ = parse_args(base + ["--ds.attn_implementation", "sdpa"])
    assert (args.ds.param_dtype, args.vllm.dtype) == ("bf16", "bfloat16")  # the CLI's defaults stay bf16


@pytest.mark.parametrize(
    "forced, dtype, flags",
    [("fp32", None, FP32), ("bf16", None, []), ("fp32", "bf16", []), ("bf16", "fp32", FP32)],
)
def test_the_tests_tiny_runs_take_the_choice(monkeypatch, forced, dtype, flags):
    """tests/helpers/e2e.py::tiny_args: this CPU's choice unless the test names one; bf16 is the CLI's defaults
    (no flag)."""
    from tests.helpers.e2e import tiny_args

    monkeypatch.setenv("OPENRLHF_ESS_CPU_DTYPE", forced)
    args = tiny_args({"model": "M", "prompts": "P", "reward": "R"}, "/tmp/run", dtype=dtype)
    assert [a for a in args if a in ("--ds.param_dtype", "fp32", "--vllm.dtype", "float32", "bf16")] == flags
