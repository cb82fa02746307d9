"""Run a real vLLM engine on a model folder and print sampled tokens with their log-probs as JSON.

Used by tests in a subprocess (vLLM keeps process-wide state). Usage:
    python -m tests.helpers.vllm_sample MODEL OUT.json --temperature 0.8 --max_tokens 24
"""

import argparse
import json
import os


def fp32_engine(model: str, max_model_len: int, max_logprobs: int):
    """An in-process fp32 vLLM engine (``openrlhf_ess.tiny.engine``) whose log-probs are those of the
    distribution sampled from (``processed_logprobs``: temperature and any top-k/top-p cut applied)."""
    from openrlhf_ess.tiny.engine import tiny_engine

    return tiny_engine(model, "float32", max_model_len=max_model_len, max_logprobs=max_logprobs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max_tokens", type=int, default=24)
    parser.add_argument("--prompts", nargs="+", default=["ab12 =", "hello =", "x ="])
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(args.model)
    llm = fp32_engine(args.model, max_model_len=128, max_logprobs=1)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, logprobs=1, seed=0)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in args.prompts]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    rows = []
    for prompt_ids, out in zip(prompts, outputs):
        sample = out.outputs[0]
        rows.append(
            {
                "prompt_ids": prompt_ids,
                "token_ids": list(sample.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)],
            }
        )
    with open(args.out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
