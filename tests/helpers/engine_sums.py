"""``python -m tests.helpers.engine_sums MODEL OUT``: a real vLLM CPU engine (fp32, in this process) loads MODEL
and writes {name: [Σx, Σx², n]} of every parameter that holds its data (vLLM CPU repacks dense linears into
0-element placeholders; the runs take those sums at load, trainer/ray/vllm_worker_wrap.py), computed as the
engine's ``weight_checksums`` computes them. One engine per process."""

import json
import sys


def main(model: str, out: str) -> None:
    from openrlhf_ess.tiny.engine import tiny_engine
    from openrlhf_ess.trainer.sync_check import checksum

    llm = tiny_engine(model, "float32")

    def sums(m):
        return {n: list(checksum(p)) for n, p in m.named_parameters() if p.numel()}

    with open(out, "w") as f:
        json.dump(llm.apply_model(sums)[0], f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
