"""The engine's LM-head precision as a source of train–inference mismatch (--vllm.fp32_lm_head).

    python -m benchmarks.mismatch_sources [--families dense] [--peak 1 8] [--out docs/mismatch_sources]

For each tiny model (the dense tiny world; a tiny MoE world where ``openrlhf_ess.tiny.world_moe`` builds one) and
each LM-head scale (1 = the random initialisation, whose next-token distribution is nearly flat; 8 = the head's
weight multiplied by 8, so the distribution is peaked the way a trained model's is), a real vLLM CPU engine in
bf16 samples the same prompts twice: with its default bf16 LM head and with vLLM's fp32 head
(``hf_overrides={"head_dtype": "float32"}``, what --vllm.fp32_lm_head sets). Each sampled token's log-prob μ is
compared with the trainer's log-prob π of the same token from the HF model in fp32 (``--ds.param_dtype fp32``)
and in bf16 (a bf16 trainer, logits cast to fp32 as upstream's actor does):

- ``mismatch/k1`` = mean over tokens of log μ − log π (the metric the trainer logs);
- max |Δ log p| = max over tokens of |log μ − log π|;
- TIS clip fraction = share of tokens whose weight π/μ exceeds the cap 2 (``--algo.tis_cap 2``);
- generation time ratio = the engine's wall time for the same requests, fp32 head / bf16 head (fastest of 5
  timed calls each, after a warm-up).

Each engine runs in its own subprocess (vLLM keeps process-wide state). Writes ``results.json`` and
``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TIS_CAP = 2.0
PROMPTS = ["ab12 =", "hello =", "x =", "q9z =", "mn34 =", "kk =", "7b7 =", "zz0 ="]


def engine_sample(model: str, out: str, fp32_head: bool, max_tokens: int, repeats: int) -> None:
    """In this process: a bf16 vLLM CPU engine samples every prompt (4 samples each, temperature 1); write the
    tokens, their log-probs μ, the head dtype the engine reports and the timed generate calls."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from openrlhf_ess.tiny.engine import tiny_engine

    kwargs = {"hf_overrides": {"head_dtype": "float32"}} if fp32_head else {}
    llm = tiny_engine(model, "bfloat16", **kwargs)

    def heads(m):
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        return [str(x.head_dtype) for x in m.modules() if isinstance(x, LogitsProcessor)]

    head_dtypes = [d for worker in llm.apply_model(heads) for d in worker]  # one list per worker
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=0, n=4, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(requests, params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    rows = []
    for prompt_ids, out_ in zip(prompts, outputs):
        for sample in out_.outputs:
            rows.append(
                {
                    "prompt_ids": prompt_ids,
                    "token_ids": list(sample.token_ids),
                    "logprobs": [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)],
                }
            )
    with open(out, "w") as f:
        json.dump({"rows": rows, "head_dtypes": head_dtypes, "times": times}, f)


# The trainers π comes from: the HF model in fp32; in bf16 (logits cast to fp32 after the bf16 head, as upstream's
# actor does); and a bf16 body with an fp32 head (hidden states cast to fp32 before the projection), which
# separates the head's rounding from the body's.
TRAINERS = {"fp32": ("float32", False), "bf16": ("bfloat16", False), "bf16 + fp32 head": ("bfloat16", True)}


def trainer_logprobs(model_dir: str, rows: List[dict], trainer: str) -> List[List[float]]:
    """log π of every sampled token from the HF model as ``trainer`` (a key of TRAINERS) computes it."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype, fp32_head = TRAINERS[trainer]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    head = model.get_output_embeddings().weight.float()
    out = []
    with torch.no_grad():
        for row in rows:
            seq = torch.tensor([row["prompt_ids"] + row["token_ids"]])
            if fp32_head:
                hidden = model.model(seq).last_hidden_state[0, len(row["prompt_ids"]) - 1 : -1]
                logits = torch.nn.functional.linear(hidden.float(), head)
            else:
                logits = model(seq).logits[0, len(row["prompt_ids"]) - 1 : -1].float()
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(row["token_ids"])[:, None])[:, 0]
            out.append(lp.tolist())
    return out


def mismatch(rows: List[dict], pi: List[List[float]]) -> Dict[str, float]:
    """k1 = mean(log μ − log π), max |log μ − log π|, share of tokens with π/μ > TIS_CAP (over all tokens)."""
    import math

    diffs = [m - p for row, lps in zip(rows, pi) for m, p in zip(row["logprobs"], lps)]
    return {
        "k1": statistics.mean(diffs),
        "max_abs": max(abs(d) for d in diffs),
        "tis_clip_frac": sum(math.exp(-d) > TIS_CAP for d in diffs) / len(diffs),
        "tokens": len(diffs),
    }


def scaled_copy(model_dir: str, dest: str, peak: float) -> str:
    """A copy of the model whose LM-head weight is multiplied by ``peak`` (1: the model itself)."""
    if peak == 1:
        return model_dir
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    path = os.path.join(dest, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = (tensors["lm_head.weight"].float() * peak).to(tensors["lm_head.weight"].dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return dest


def build(family: str, root: str) -> str:
    if family == "dense":
        from openrlhf_ess.tiny.world import build_world

        return build_world(os.path.join(root, "dense"), seed=0, n_prompts=8)["model"]
    from openrlhf_ess.tiny.world_moe import build_moe_world

    return build_moe_world(os.path.join(root, family), seed=0, n_prompts=8, family=family)["model"]


def write_table(results: List[dict], path: str, command: str) -> None:
    lines = [
        "# LM-head precision: mismatch between the engine's μ and the trainer's π",
        "",
        f"Command: `{command}`. bf16 vLLM CPU engine, 8 prompts × 4 samples, temperature 1; π from the HF",
        "model in fp32, in bf16, or in bf16 with an fp32 head, on the engine's own tokens. k1 = mean(log μ − log π);",
        f"TIS clip = share of tokens with π/μ > {TIS_CAP}; time ratio = engine generate time with the fp32 head /",
        "with the bf16 head (fastest of 5 calls each).",
        "",
        "| model | head scale | engine head | trainer | k1 | max \\|Δ log p\\| | TIS clip frac | tokens "
        "| generate time ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for trainer in TRAINERS:
            m = r[f"vs_{trainer}"]
            ratio = f"{r['time_ratio']:.2f}" if r["head"] == "fp32" else "1"
            lines.append(
                f"| {r['family']} | {r['peak']:g} | {r['head']} ({', '.join(sorted(set(r['head_dtypes'])))}) "
                f"| {trainer} | {m['k1']:+.2e} | {m['max_abs']:.2e} | {m['tis_clip_frac']:.4f} | {m['tokens']} "
                f"| {ratio} |"
            )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=["dense"], help="dense, qwen2_moe, qwen3_moe")
    parser.add_argument("--peak", nargs="*", type=float, default=[1.0, 8.0], help="LM-head weight scales")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "mismatch_sources"))
    parser.add_argument("--engine-worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--fp32-head", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.engine_worker:
        engine_sample(a.engine_worker[0], a.engine_worker[1], a.fp32_head, a.max_tokens, repeats=5)
        return
    root = tempfile.mkdtemp(prefix="ess_mismatch_")
    results = []
    for family in a.families:
        base = build(family, root)
        for peak in a.peak:
            model = scaled_copy(base, os.path.join(root, f"{family}_x{peak:g}"), peak)
            runs = {}
            for head in ("bf16", "fp32"):
                out = os.path.join(root, f"{family}_x{peak:g}_{head}.json")
                cmd = [sys.executable, "-m", "benchmarks.mismatch_sources", "--engine-worker", model, out]
                cmd += ["--max-tokens", str(a.max_tokens)] + (["--fp32-head"] if head == "fp32" else [])
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
                if run.returncode != 0:
                    raise RuntimeError(f"engine run failed:\n{run.stderr[-3000:]}")
                with open(out) as f:
                    runs[head] = json.load(f)
            for head, data in runs.items():
                row = {"family": family, "peak": peak, "head": head, "head_dtypes": data["head_dtypes"]}
                for trainer in TRAINERS:
                    row[f"vs_{trainer}"] = mismatch(data["rows"], trainer_logprobs(model, data["rows"], trainer))
                # fastest of 5: the least disturbed by other work on the machine
                row["time_ratio"] = min(data["times"]) / min(runs["bf16"]["times"])
                row["times"] = data["times"]
                results.append(row)
                print(f"[mismatch] {family} x{peak:g} head {head}: {row['vs_fp32']} ratio {row['time_ratio']:.2f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    command = "python -m benchmarks.mismatch_sources " + " ".join(sys.argv[1:])
    write_table(results, os.path.join(a.out, "results.md"), command.strip())
    print(f"[mismatch] wrote {a.out}/results.md")


if __name__ == "__main__":
    main()
