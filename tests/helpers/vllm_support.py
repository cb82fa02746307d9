"""Run a real vLLM engine with top-p / top-k and report, per sampled token, the kept-support size k_t.

Used by tests/test_sampling_mask.py in a subprocess (vLLM keeps process-wide state) and, with
``--bench``, as the probe behind docs/sampling_mask.md. Two ways of reading k_t are recorded:

* ``k_topn``: with ``logprobs_mode="processed_logprobs"`` the engine's log-probs are
  ``log_softmax`` of the top-k/top-p-masked, temperature-scaled logits, so every token outside the
  kept support S_t has log-prob ``-inf``. Requesting the top-N log-probs and counting the finite ones
  gives k_t = |S_t| exactly when k_t < N (``saturated`` marks k_t >= N). No engine change.
* ``k_rank`` (``--rank_patch``): a sampler-side patch (what a ``worker_extension_cls`` would
  install) that writes ``#finite(processed log-probs)`` into the sampled token's ``rank`` field, so
  ``logprobs=0`` suffices: zero extra bytes per token.

Usage:
    python -m tests.helpers.vllm_support MODEL OUT.json --temperature 0.7 --top_p 0.8 --num_logprobs -1
"""

import argparse
import json
import os
import pickle
import time

from tests.helpers.vllm_sample import fp32_engine


def install_rank_patch() -> None:
    """Make the sampled token's ``rank`` carry k_t = number of finite processed log-probs in its row."""
    import torch
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.sampler import Sampler

    original = Sampler.gather_logprobs

    def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
        out = original(logprobs, num_logprobs, token_ids)
        kept = torch.isfinite(logprobs).sum(dim=-1)
        return LogprobsTensors(out.logprob_token_ids, out.logprobs, kept.to(out.selected_token_ranks.dtype))

    Sampler.gather_logprobs = staticmethod(gather_logprobs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=-1)
    parser.add_argument("--num_logprobs", type=int, default=-1, help="top-N processed log-probs; -1 = whole vocab")
    parser.add_argument("--max_tokens", type=int, default=24)
    parser.add_argument("--prompts", nargs="+", default=["ab12 =", "hello =", "x =", "7+8 ="])
    parser.add_argument("--rank_patch", action="store_true")
    parser.add_argument("--bench", action="store_true", help="time several num_logprobs settings instead")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.rank_patch:
        install_rank_patch()
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(args.model)
    llm = fp32_engine(args.model, max_model_len=256, max_logprobs=-1)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in args.prompts]
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def params(num_logprobs: int, seed=0, max_tokens=None) -> SamplingParams:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=max_tokens or args.max_tokens,
            logprobs=num_logprobs,
            seed=seed,
        )

    if args.bench:
        # 16 requests x 64 tokens, warm, each setting timed 3 times (median); pickled logprob bytes per token.
        batch = (token_prompts * 4)[:16]
        results = {"vocab": vocab}
        settings = [("none", None), ("0", 0), ("1", 1), ("8", 8), ("32", 32), ("-1", -1)]
        for name, n in settings:
            times = []
            for rep in range(4):
                sp = [params(n, seed=100 * rep + i, max_tokens=64) for i in range(len(batch))]
                for s in sp:
                    s.ignore_eos = True
                t0 = time.perf_counter()
                outs = llm.generate(batch, sp, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
            lp_bytes = sum(len(pickle.dumps(o.outputs[0].logprobs)) for o in outs) if n is not None else 0
            results[name] = {
                "s_per_batch": sorted(times[1:])[1],
                "tokens": n_tok,
                "pickled_logprob_bytes_per_token": lp_bytes / n_tok,
            }
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        return

    outputs = llm.generate(token_prompts, [params(args.num_logprobs, seed=i) for i in range(len(prompts))])
    rows = []
    n_cap = vocab if args.num_logprobs == -1 else args.num_logprobs
    for prompt_ids, out in zip(prompts, outputs):
        sample = out.outputs[0]
        row = {"prompt_ids": prompt_ids, "token_ids": list(sample.token_ids), "logprobs": [], "k_topn": []}
        row["saturated"], row["k_rank"] = [], []
        for t, lp in zip(sample.token_ids, sample.logprobs):
            row["logprobs"].append(lp[t].logprob)
            finite = sum(1 for v in lp.values() if v.logprob != float("-inf"))
            row["k_topn"].append(finite)
            row["saturated"].append(finite >= n_cap)
            row["k_rank"].append(lp[t].rank)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"vocab": vocab, "rows": rows}, f)


if __name__ == "__main__":
    main()
