"""The dtype our CPU runs compute in (the tiny demos, the test tiers, the CPU benchmarks): bf16 where this CPU
computes it natively, else fp32. The CLI's own defaults (bf16 trainer and engine) never change: GPU users, and
anyone who runs the CLI by hand, get upstream's bf16.

Why: torch's bf16 matrix products are native only where the CPU has bf16 instructions (x86: AVX512-BF16 or
AMX-BF16; Arm: BF16); elsewhere oneDNN, which torch calls for them, emulates them. Measured (512x512 matmul, one
thread, torch 2.13): an AVX2 machine 1.3 GFLOP/s in bf16 against 93 in fp32; on an AVX512-BF16 machine 204 against
78, and the same machine with oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) 2.2 against 91, or to AVX-512
without BF16 (``AVX512_CORE``) 33 against 78. So fp32 is the faster choice wherever bf16 is not native, by 2x to
70x on the matrix products, and bf16 (half the bytes, twice the rate) where it is. docs/tests.md has whole runs.

How it is read: the CPU's flags in ``/proc/cpuinfo`` (x86 ``flags``: ``avx512_bf16``, ``amx_bf16``; Arm
``Features``: ``bf16``), and oneDNN's own ISA cap (``ONEDNN_MAX_CPU_ISA``, older ``DNNL_MAX_CPU_ISA``) when it is set
below the bf16 ISAs. Not ``torch.backends.cpu.get_cpu_capability()``: it answers ``AVX512`` both on a CPU with
AVX512-BF16 and on one without (measured: the AVX512-BF16 machine above reads ``AVX512``), and it needs torch's
import (seconds) in the shell scripts that ask. Not torch's private ``torch.cpu._is_avx512_bf16_supported()``:
private, and the same import. The flags are what the kernel enabled (it clears a feature whose register state the
OS does not save), read as text, so the decision is a pure function of a string (:func:`native_bf16`). Where
nothing can be read (no ``/proc/cpuinfo``: macOS) the CLI's default, bf16, stays.

``OPENRLHF_ESS_CPU_DTYPE`` (``bf16``, ``fp32``, or ``auto``, the default) forces the choice. ``python -m
openrlhf_ess.runtime.cpu_dtype`` prints the CLI flags for the chosen dtype on stdout and the one line that says
why on stderr (the demo scripts call it). Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Union

ENV = "OPENRLHF_ESS_CPU_DTYPE"
CPUINFO = "/proc/cpuinfo"
NATIVE_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 "flags" (AVX512-BF16, AMX-BF16); Arm "Features" (BF16)
# oneDNN's ISA cap names below its first bf16 ISA (avx512_core_bf16): with one of them set, bf16 is emulated
ONEDNN_ISA_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
# our name -> (--ds.param_dtype, --vllm.dtype)
CLI_DTYPES = {"bf16": ("bf16", "bfloat16"), "fp32": ("fp32", "float32")}


def cpu_flags(cpuinfo: str = CPUINFO) -> Optional[str]:
    """The first ``flags`` (x86) or ``Features`` (Arm) line of ``cpuinfo``, its value; None where it cannot be
    read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return value.strip()
    except OSError:
        return None
    return None


def onednn_cap(env: Mapping[str, str]) -> Optional[str]:
    """oneDNN's ISA cap from ``env`` when it holds bf16 below native (a name of :data:`ONEDNN_BELOW_BF16`), else
    None."""
    for name in ONEDNN_ISA_ENVS:
        value = env.get(name, "").strip().upper()
        if value in ONEDNN_BELOW_BF16:
            return f"{name}={value}"
    return None


def native_bf16(flags: Union[str, Iterable[str], None], env: Mapping[str, str] = None) -> Optional[bool]:
    """Whether this CPU computes bf16 natively: one of :data:`NATIVE_FLAGS` among ``flags`` (the text of the
    cpuinfo line, or its words) and oneDNN not capped below it in ``env``. None: ``flags`` unknown (None)."""
    if flags is None:
        return None
    words = set(flags.split() if isinstance(flags, str) else flags)
    return bool(words & set(NATIVE_FLAGS)) and onednn_cap(env or {}) is None


@dataclass(frozen=True)
class Choice:
    """The dtype (``bf16`` or ``fp32``), whether ``OPENRLHF_ESS_CPU_DTYPE`` forced it, and why, in words."""

    dtype: str
    forced: bool
    reason: str

    @property
    def cli_flags(self) -> List[str]:
        return cli_flags(self.dtype)


def choose(flags: Union[str, Iterable[str], None] = "read", env: Mapping[str, str] = None) -> Choice:
    """The dtype of our CPU runs. ``flags``: the CPU's flags (default: read from ``/proc/cpuinfo``; None: unknown);
    ``env``: the environment (default ``os.environ``), for ``OPENRLHF_ESS_CPU_DTYPE`` and oneDNN's ISA cap. An
    unknown value of the variable raises ``ValueError`` naming it and the values it takes."""
    env = os.environ if env is None else env
    if isinstance(flags, str) and flags == "read":
        flags = cpu_flags(CPUINFO)
    native = native_bf16(flags, env)
    if native is None:
        how = "this CPU's flags could not be read (no /proc/cpuinfo): the CLI's default"
    elif native:
        found = sorted(set(flags.split() if isinstance(flags, str) else flags) & set(NATIVE_FLAGS))
        how = f"this CPU computes bf16 natively: {', '.join(found)}"
    else:
        cap = onednn_cap(env)
        how = "this CPU emulates bf16: " + (
            f"oneDNN held below its bf16 ISA by {cap}" if cap else "none of avx512_bf16, amx_bf16, bf16 in its flags"
        )
    forced = env.get(ENV, "").strip().lower()
    if forced not in ("", "auto", "bf16", "fp32"):
        raise ValueError(f"{ENV}={env.get(ENV)!r}: use bf16, fp32 or auto (the default: fp32 where bf16 is emulated).")
    if forced in ("bf16", "fp32"):
        return Choice(forced, True, f"{ENV}={forced} ({how})")
    return Choice("fp32" if native is False else "bf16", False, how)


def cli_flags(dtype: str) -> List[str]:
    """The CLI flags that make a run compute in ``dtype``, trainer and engine: ``--ds.param_dtype`` and
    ``--vllm.dtype`` (``fp32`` on the trainer is our CPU-only patch, ``runtime/cpu_compat.py``)."""
    trainer, engine = CLI_DTYPES[dtype]
    return ["--ds.param_dtype", trainer, "--vllm.dtype", engine]


def notice(choice: Choice, what: str, script: str = "") -> str:
    """The one line that says which dtype ``what`` (e.g. "train_ppo_tiny_cpu.sh") computes in, why, and how to force
    the other one: the variable, and for a ``script`` that passes extra flags to the CLI, those flags after its
    name."""
    other = "bf16" if choice.dtype == "fp32" else "fp32"
    how = f"{ENV}={other}"
    if script:
        how += f" (or: bash {script} {' '.join(cli_flags(other))})"
    flags = " ".join(choice.cli_flags)
    return f"openrlhf-ess: dtype of {what}: {choice.dtype} ({flags}), because {choice.reason}; {how} forces {other}."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m openrlhf_ess.runtime.cpu_dtype",
        description="Print the CLI flags of our CPU runs' dtype (stdout) and the line that says why (stderr).",
    )
    parser.add_argument("--what", default="this run", help="what computes in it, for the line (default: %(default)s)")
    parser.add_argument("--script", default="", help="the script that asks, if it passes extra flags to the CLI")
    a = parser.parse_args(argv)
    try:
        choice = choose()
    except ValueError as err:
        print(f"openrlhf-ess: error: {err}", file=sys.stderr)
        return 2
    print(notice(choice, a.what, a.script), file=sys.stderr)
    print(" ".join(choice.cli_flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
