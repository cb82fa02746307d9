"""What the benchmark scripts share: the run's flags on the tiny CPU world or on a user's model (GPU)."""

from __future__ import annotations

import argparse
import os
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("GPU variant (default: the offline tiny world on CPU)")
    group.add_argument("--gpu", action="store_true", help="run on GPUs: flash attention instead of sdpa")
    group.add_argument("--model", default=None, help="HF model path or name (default: the offline tiny model)")
    group.add_argument("--prompts-file", default=None, help="prompt dataset with an 'input' key (with --model)")
    group.add_argument("--reward", default=None, help="reward function .py file (with --model)")
    group.add_argument(
        "--extra", default="", help="more CLI flags for every run, e.g. '--vllm.num_engines 2 --rollout.batch_size 64'"
    )


def check_model_arguments(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.model and not (a.prompts_file and a.reward):
        parser.error("--model needs --prompts-file and --reward")


def world_for(a: argparse.Namespace, root: str, n_prompts: int) -> dict:
    """The user's model, prompts and reward, or the tiny world built under ``root``."""
    if a.model:
        return {"model": a.model, "prompts": a.prompts_file, "reward": a.reward}
    from openrlhf_ess.tiny.world import build_world

    return build_world(os.path.join(root, "world"), seed=0, n_prompts=n_prompts)


def run_flags(a: argparse.Namespace, world: dict, run_dir: str, prompts: int) -> List[str]:
    """The tests' tiny-run flags (8 prompts x 4 samples per step, ZeRO-2), adapted to the GPU variant."""
    from tests.helpers.e2e import tiny_args

    flags = tiny_args(world, run_dir, steps_prompts=prompts)
    if a.gpu:
        flags[flags.index("sdpa")] = "flash_attention_2"
    return flags + a.extra.split()


def peak_allocated_bytes(fn) -> int:
    """The largest sum of live CPU allocations while ``fn`` runs: every allocation and free torch makes, from
    torch.profiler's memory events in time order (what was allocated before the call, e.g. weights, is not
    counted). The one memory measurement of the benchmarks and the memory tests."""
    import itertools

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    return max(itertools.accumulate(n for _, n in events), default=0)


def write_table(module: str, setting: str, lines: List[str], out) -> None:
    """Print the tables under the command that reproduces them (``python -m benchmarks.<module>`` and this run's
    arguments) and ``setting`` (threads, dtype, repetitions), and write the same to ``out`` when given."""
    import sys

    cmd = f"python -m benchmarks.{module} " + " ".join(sys.argv[1:])
    text = f"Command: `{cmd}` ({setting})\n\n" + "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text)
