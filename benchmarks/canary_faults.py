"""What the start-up engine contract can tell from bf16 noise: each fault the canary claims to
catch, made real in a vLLM CPU engine, against the noise of a correct engine, in bf16 and fp32.

    python -m benchmarks.canary_faults [--out docs/canary_faults]     # ~4 min on 2 cores

The start-up self-check (``trainer/weight_sync.py``) makes two comparisons before the first rollout:

1. **the canary** (temperature 1): the engine's prompt log-probs of a fixed 32-token sequence against the trainer's
   forward of the same tokens, which catches an engine that computes another function than the trainer;
2. **the sampled contract** (the run's temperature T): μ of 32 tokens the engine samples against the trainer's
   log softmax(z/T) of them, which catches an engine that returns the log-probs of another distribution.

Faults, each real in the engine (not simulated on the trainer side): ``raw-logprobs`` (vLLM's
``logprobs_mode=raw_logprobs``: μ of the untempered distribution while it samples at T); ``tied-head`` (the
engine's LM head is the input embedding, as a checkpoint wrongly tied or untied gives it: another head); ``rope``
(the engine's ``rope_theta`` × 100: another positional kernel); ``stale-layer`` (one decoder layer's weights from
before one Adam-sized update, lr 1e-3: a sync that missed a layer). Temperature applied twice is a third
hypothesis the trainer computes, log softmax(z/T²). Models: the tiny world's dense model as built (head scale 1:
near-uniform next-token distributions) and with its LM head × 8 (peaked, as a trained model's;
``benchmarks/mismatch_sources.py``).

Two statistics per comparison: mean |Δ log p| (nats, what ``--vllm.sync_check_tol`` bounds), and the same divided
by the trainer's own spread of log-probs, mean |log p − mean log p|: a relative error that does not shrink with
a flat model, as bf16 rounding (relative to the logits) does not either.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

CANARY_TOKENS = 32  # as trainer/weight_sync.py::SYNC_CANARY_TOKENS
TEMPERATURE = 0.6
FAULTS = ("none", "raw-logprobs", "tied-head", "rope", "stale-layer")
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def canary_ids(vocab: int) -> List[int]:
    """The canary and the sampled contract's prompt, drawn as weight_sync.py draws them."""
    import torch

    g = torch.Generator().manual_seed(1234)
    canary = torch.randint(min(4, vocab - 1), vocab, (1, CANARY_TOKENS), generator=g)[0].tolist()
    g = torch.Generator().manual_seed(4321)
    prompt = torch.randint(min(4, vocab - 1), vocab, (8,), generator=g).tolist()
    return canary, prompt


def engine_run(model: str, dtype: str, mode: str, out: str) -> None:
    """In this process: the engine's canary log-probs and one 32-token sample at TEMPERATURE (seed 1234, as the
    engine's ``contract_sample``), written to ``out``."""
    from transformers import AutoConfig
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from openrlhf_ess.tiny.engine import KV_CACHE_BYTES

    # tiny_engine's settings, with the logprobs mode as the (mis)configured engine has it
    llm = LLM(
        model=model, dtype=dtype, seed=0, max_model_len=128, kv_cache_memory_bytes=KV_CACHE_BYTES,
        logprobs_mode=mode, max_logprobs=1, enforce_eager=True,
    )  # fmt: skip
    vocab = AutoConfig.from_pretrained(model).vocab_size
    canary, prompt = canary_ids(vocab)
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    out_c = llm.generate([TokensPrompt(prompt_token_ids=canary)], params, use_tqdm=False)[0]
    canary_lp = [step[t].logprob for step, t in zip(out_c.prompt_logprobs[1:], canary[1:])]
    params = SamplingParams(max_tokens=CANARY_TOKENS, temperature=TEMPERATURE, logprobs=0, seed=1234, ignore_eos=True)
    out_s = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
    sample_lp = [step[t].logprob for step, t in zip(out_s.logprobs, out_s.token_ids)]
    with open(out, "w") as f:
        json.dump({"canary": canary_lp, "tokens": list(out_s.token_ids), "sample": sample_lp}, f)
    llm.llm_engine.engine_core.shutdown()  # the next engine of this process starts on a clean slate
    del llm
    gc.collect()


def trainer_logprobs(model: str, dtype: str, canary: List[int], prompt: List[int], tokens: List[int]):
    """The trainer's side, as weight_sync.py computes it (HF forward in ``dtype``, logits cast to fp32): the canary's
    log softmax(z), and the sampled tokens' log softmax(z/t) for t = T (correct), 1 (raw) and T² (twice)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        z = m(torch.tensor([canary])).logits[0, :-1].float()
        canary_lp = z.log_softmax(-1).gather(-1, torch.tensor(canary[1:])[:, None])[:, 0]
        seq = torch.tensor([prompt + tokens])
        z = m(seq).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].float()
        idx = torch.tensor(tokens)[:, None]
        hyp = {name: (z / t).log_softmax(-1).gather(-1, idx)[:, 0] for name, t in HYPOTHESES.items()}
    return canary_lp, hyp


HYPOTHESES = {"at T": TEMPERATURE, "raw (T = 1)": 1.0, "T twice": TEMPERATURE**2}


def mean_abs(a, b) -> float:
    import torch

    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().mean().item()


def spread(lp) -> float:
    """mean |log p − mean log p|: the scale a relative error is measured against."""
    import torch

    x = torch.as_tensor(lp, dtype=torch.float64)
    return (x - x.mean()).abs().mean().item()


def faulty_copy(model: str, dest: str, fault: str, head_scale: float) -> str:
    """The model the engine loads: the trainer's (``head_scale`` applied to both), or with ``fault`` in it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest, dirs_exist_ok=True)
    path = os.path.join(dest, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * head_scale
    if fault == "tied-head":  # the engine's head is the input embedding, as a wrongly tied checkpoint gives it
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone() * head_scale
    if fault == "stale-layer":  # layer 1 one Adam step (lr 1e-3, sign of a random gradient) behind the trainer
        g = torch.Generator().manual_seed(7)
        for name in [n for n in tensors if n.startswith("model.layers.1.")]:
            t = tensors[name]
            tensors[name] = t - 1e-3 * torch.randn(t.shape, generator=g).sign().to(t.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg_path = os.path.join(dest, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if fault == "rope":
        cfg["rope_theta"] = float(cfg.get("rope_theta", 10000.0)) * 100
        if isinstance(cfg.get("rope_parameters"), dict):
            cfg["rope_parameters"]["rope_theta"] = cfg["rope_theta"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return dest


def engine_logprobs(engine_model: str, dtype: str, mode: str, out: str) -> Dict:
    """:func:`engine_run` in a child process, its output read back."""
    return engine_logprobs_many([(engine_model, dtype, mode, out)])[0]


def engine_logprobs_many(cases: List[tuple]) -> List[Dict]:
    """:func:`engine_run` for each (model, dtype, mode, out) of ``cases``, one engine after the other in one child
    process (vLLM's import paid once: ~8 s of CPU per engine on 2 cores), the outputs read back. Each engine is
    shut down before the next starts. Checked 2026-12-03 for the five cases of tests/test_canary.py: the outputs
    equal one process per engine bit for bit, in 30 s instead of 84 s here."""
    cmd = [sys.executable, "-m", "benchmarks.canary_faults"]
    for case in cases:
        cmd += ["--engine-run", *case]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"engine runs failed ({cases}):\n{run.stderr[-3000:]}")
    outputs = []
    for *_, out in cases:
        with open(out) as f:
            outputs.append(json.load(f))
    return outputs


def measure(root: str, head_scales: List[float]) -> List[Dict]:
    from openrlhf_ess.tiny.world import build_world

    base = build_world(os.path.join(root, "world"), seed=0, n_prompts=8)["model"]
    results = []
    for scale in head_scales:
        trainer_model = faulty_copy(base, os.path.join(root, f"trainer_x{scale:g}"), "none", scale)
        for fault in FAULTS:
            engine_model = trainer_model
            if fault in ("tied-head", "rope", "stale-layer"):
                engine_model = faulty_copy(base, os.path.join(root, f"{fault}_x{scale:g}"), fault, scale)
            mode = "raw_logprobs" if fault == "raw-logprobs" else "processed_logprobs"
            for engine_dtype in DTYPES:
                out = os.path.join(root, f"{fault}_x{scale:g}_{engine_dtype}.json")
                eng = engine_logprobs(engine_model, DTYPES[engine_dtype], mode, out)
                from transformers import AutoConfig

                canary, prompt = canary_ids(AutoConfig.from_pretrained(trainer_model).vocab_size)
                for trainer_dtype in DTYPES:
                    c_lp, hyp = trainer_logprobs(trainer_model, DTYPES[trainer_dtype], canary, prompt, eng["tokens"])
                    row = {
                        "head_scale": scale,
                        "fault": fault,
                        "engine": engine_dtype,
                        "trainer": trainer_dtype,
                        "canary_abs": mean_abs(eng["canary"], c_lp),
                        "canary_rel": mean_abs(eng["canary"], c_lp) / spread(c_lp),
                        "sample_spread": spread(hyp["at T"]),
                    }
                    for name, h in hyp.items():
                        row[f"sample_abs[{name}]"] = mean_abs(eng["sample"], h)
                    row["sample_rel"] = row["sample_abs[at T]"] / row["sample_spread"]
                    results.append(row)
                    print(
                        f"[canary] x{scale:g} {fault:>12} engine {engine_dtype} trainer {trainer_dtype}: canary "
                        f"{row['canary_abs']:.2e} ({row['canary_rel']:.3f} rel), sample at T "
                        f"{row['sample_abs[at T]']:.2e} raw {row['sample_abs[raw (T = 1)]']:.2e} twice "
                        f"{row['sample_abs[T twice]']:.2e}",
                        flush=True,
                    )
    return results


def write_table(results: List[Dict], path: str, command: str) -> None:
    lines = [
        "# Canary statistics per fault (benchmarks/canary_faults.py)",
        "",
        f"`{command}`; T = {TEMPERATURE}; mean |Δ log p| in nats over 31 canary / 32 sampled tokens; rel = divided",
        "by the trainer's spread of log-probs (mean |log p − mean|). The sampled columns: μ against the trainer's",
        "log softmax(z/t) for t = T (the correct one), 1 (raw log-probs) and T² (temperature twice).",
        "",
        "| head × | fault | engine | trainer | canary abs | canary rel | μ vs at T | μ vs raw | μ vs T² | sample rel"
        " |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['head_scale']:g} | {r['fault']} | {r['engine']} | {r['trainer']} | {r['canary_abs']:.2e} | "
            f"{r['canary_rel']:.4f} | {r['sample_abs[at T]']:.2e} | {r['sample_abs[raw (T = 1)]']:.2e} | "
            f"{r['sample_abs[T twice]']:.2e} | {r['sample_rel']:.4f} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-scales", nargs="*", type=float, default=[1.0, 8.0])
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "canary_faults"))
    parser.add_argument(
        "--engine-run", nargs=4, action="append", metavar=("MODEL", "DTYPE", "MODE", "OUT"), help=argparse.SUPPRESS
    )
    a = parser.parse_args()
    if a.engine_run:
        for case in a.engine_run:
            engine_run(*case)
        return
    root = tempfile.mkdtemp(prefix="ess_canary_")
    results = measure(root, a.head_scales)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    command = ("python -m benchmarks.canary_faults " + " ".join(sys.argv[1:])).strip()
    write_table(results, os.path.join(a.out, "results.md"), command)
    print(f"[canary] wrote {a.out}/results.md")


if __name__ == "__main__":
    main()
