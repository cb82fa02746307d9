"""``python -m openrlhf_ess.tools.build_ops``: build DeepSpeed's CPU shared-memory comm op once, at install.

Without this the first run on a machine JIT-builds it (``deepspeed_shm_comm``, DeepSpeed's ``ShareMemCommBuilder``,
34-60 s on 2 cores) inside a DeepSpeed rank, under a lock file that a run killed meanwhile leaves behind
(``openrlhf_ess/runtime/build_locks.py``). ``scripts/bootstrap_cpu.sh`` runs this, into the folder torch builds
extensions under (``$TORCH_EXTENSIONS_DIR``; ``scripts/env_cpu.sh`` sets ``.cache/torch_extensions``), which every
run then loads the op from. Stale locks are cleared first. On a CUDA machine the op does not exist (DeepSpeed's
CUDA accelerator has no ShareMemCommBuilder): nothing is built.
"""

from __future__ import annotations

import time

from openrlhf_ess.runtime import build_locks

OP_BUILDER = "ShareMemCommBuilder"


def build() -> str:
    """Build (or load, if built) the op as DeepSpeed's ``comm/torch.py::build_shm_op`` does; a line saying what
    happened."""
    notices: list = []
    build_locks.clear_stale(notices)
    for notice in notices:
        print(f"[build_ops] {notice}", flush=True)
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(OP_BUILDER)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return f"DeepSpeed's {get_accelerator().device_name()} accelerator has no {OP_BUILDER}: nothing to build"
    start = time.perf_counter()
    builder.load(verbose=False)
    return (
        f"DeepSpeed op {builder.NAME} ready in {time.perf_counter() - start:.0f} s under "
        f"{build_locks.extensions_root()}"
    )


if __name__ == "__main__":
    print(f"[build_ops] {build()}", flush=True)
