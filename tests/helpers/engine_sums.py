"""``python -m tests.helpers.engine_sums MODEL OUT [DTYPE]``: a real vLLM CPU engine (DTYPE, default float32, in this
process) loads MODEL and writes, under "plain", {name: [Σx, Σx², n]} of every parameter that holds its data (vLLM CPU
repacks dense linears into 0-element placeholders; the runs take those sums at load, trainer/ray/vllm_worker_wrap.py),
computed by the engine's own ``WorkerWrap.weight_checksums``, called on the model; under "start", the same method with
the engine's model config as the worker has it and no weights received since the start (an engine that replaced
another before the first sync): the repacked weights reported from the checkpoint vLLM loaded; under "emptied", the
names of those weights. One engine per process."""

import json
import sys


def main(model: str, out: str, dtype: str = "float32") -> None:
    from types import SimpleNamespace

    import torch

    from openrlhf_ess.tiny.engine import tiny_engine
    from openrlhf_ess.trainer.ray.vllm_worker_wrap import WorkerWrap
    from openrlhf_ess.trainer.sync_check import emptied_names

    llm = tiny_engine(model, dtype)
    config = SimpleNamespace(model=model, revision=None, dtype=getattr(torch, dtype))

    def sums(m):  # the worker's own method, on this engine's model (no Ray worker here, nothing loaded by a sync)
        _, plain = WorkerWrap.weight_checksums(SimpleNamespace(model_runner=SimpleNamespace(model=m)))
        worker = WorkerWrap.__new__(WorkerWrap)  # a worker that has received no weights since its start
        worker.model_runner = SimpleNamespace(model=m, model_config=config)
        _, start = worker.weight_checksums()
        return {
            "plain": {n: list(c) for n, c in plain.items()},
            "start": {n: list(c) for n, c in start.items()},
            "emptied": emptied_names(m),
        }

    with open(out, "w") as f:
        json.dump(llm.apply_model(sums)[0], f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
