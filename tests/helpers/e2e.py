"""Run the real CLI (Ray + vLLM CPU + DeepSpeed) on the tiny world in a subprocess, for tests."""

import os
import sys

# moved to benchmarks/common.py (the benchmarks run the CLI too); the tests keep importing them from here
from benchmarks.common import (  # noqa: F401
    CPU_ENGINE_LAYOUT,
    GPU_ENGINE_LAYOUT,
    LAST_RUN,
    REPO,
    TEST_KV_GB,
    ray_temp_dir,
    run_cli,
    tiny_args,
)


def read_tensorboard(run_dir: str) -> dict:
    """{tag: [(step, value), ...]} from the run's tensorboard folder."""
    from openrlhf_ess.tools.summary import read_scalars

    return read_scalars(os.path.join(run_dir, "tb"))


if __name__ == "__main__":
    print(" ".join(tiny_args({"model": "M", "prompts": "P", "reward": "R"}, sys.argv[1])))
