"""``python -m tests.helpers.engine_sums MODEL OUT``: a real vLLM CPU engine (fp32, in this process) loads MODEL
and writes {name: [Σx, Σx², n]} of every parameter that holds its data (vLLM CPU repacks dense linears into
0-element placeholders; the runs take those sums at load, trainer/ray/vllm_worker_wrap.py), computed
by the engine's own ``WorkerWrap.weight_checksums``, called on the model. One engine per process."""

import json
import sys


def main(model: str, out: str) -> None:
    from types import SimpleNamespace

    from openrlhf_ess.tiny.engine import tiny_engine
    from openrlhf_ess.trainer.ray.vllm_worker_wrap import WorkerWrap

    llm = tiny_engine(model, "float32")

    def sums(m):  # the worker's own method, on this engine's model (no Ray worker here, nothing loaded by a sync)
        _, named = WorkerWrap.weight_checksums(SimpleNamespace(model_runner=SimpleNamespace(model=m)))
        return {n: list(c) for n, c in named.items()}

    with open(out, "w") as f:
        json.dump(llm.apply_model(sums)[0], f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
