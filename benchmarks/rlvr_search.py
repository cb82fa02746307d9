"""A quick search for settings under which RL climbs on the verifiable task, in plain torch (no Ray, vLLM or
DeepSpeed), so one setting costs seconds instead of minutes.

    python -m benchmarks.rlvr_search --seed 0 --target 0.27 --lr 1e-4 --prompts 32 --samples 8 --steps 200
    python -m benchmarks.rlvr_search ... --out docs/rlvr_task/search.json   # keep the run in a results file
    python -m benchmarks.rlvr_search --render docs/rlvr_task/search.json    # its table, search.md beside it

The update is the CLI's synchronous GRPO step on this task (docs/rlvr_task.md): ``--prompts`` training-pool
problems, ``--samples`` samples each at ``--temperature`` (1 unless given; up to 6 new tokens, cut after EOS; the
loss's log-probs from the logits divided by it, as upstream's actor takes them), reward 1 for the exact answer
then EOS, advantage (r − mean) / (std + 1e-9) within each prompt's group, loss −A · log π(token) averaged over the
batch's response tokens, one Adam step per batch (on-policy: the ratio is 1, so PPO's clip never acts). Its
optimizer: the gradient clipped to ``--clip`` (the CLI's ``--actor.max_norm`` is 1; off unless given), Adam's β₂
``--beta2`` (the CLI's 0.95; 0.999 unless given) and ``--eps`` (the CLI's 1e-8), the learning rate warmed up
linearly over ``--warmup`` steps (none unless given, as the tiny scripts) and then constant. What it leaves out
against the CLI: bf16, ZeRO, the vLLM sampler. Every ``--eval-every`` steps it prints the held-out accuracy,
greedy and at the rollout temperature (mean of 4 passes over the 197 eval problems, or over both orders of the
first ``--n-eval`` unordered pairs of the split: 1,589 problems at 800). With ``--out`` the setting,
the warm start's record and that curve go into a JSON results file (one record per setting and seed; a rerun
replaces its record); ``--render`` writes the file's table (:func:`render`) to the ``.md`` beside it, and
``--render-grid`` counts each run of a ``benchmarks.rlvr_grid`` results file the same way
(:func:`render_grid_rises`, into its ``rises.md``). docs/rlvr_task.md quotes both; the CLI runs confirm the pick.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def grpo_advantages(rewards, normalize: bool = True):
    """(r − mean_group) / (std_group + 1e-9) per row of ``rewards`` [prompts, samples] (std with Bessel's
    correction, as torch's default and OpenRLHF's group_norm); without ``normalize`` the centred reward only."""
    centred = rewards - rewards.mean(1, keepdim=True)
    return centred / (rewards.std(1, keepdim=True) + 1e-9) if normalize else centred


EVAL_SAMPLES = 197 * 4  # the held-out eval at T = 1: 197 problems x 4 passes (the CLI's eval, the same count)
EVAL_PASSES = 4


def eval_samples(n_eval: int = 100, passes: int = EVAL_PASSES) -> int:
    """Samples of one held-out eval over ``n_eval`` unordered pairs (both orders of each, a + a once), ``passes``
    each: 788 for the first 100 pairs (197 problems)."""
    from openrlhf_ess.tiny.rlvr import split_pairs

    return passes * len(split_pairs(n_eval)[1])


def eval_se(acc: float, n: int = EVAL_SAMPLES) -> float:
    """Sampling standard error of one held-out eval at accuracy ``acc``: sqrt(acc (1 − acc) / n), the binomial
    error of ``n`` samples (for a fixed eval set an upper bound: problems differ in their own accuracy)."""
    return math.sqrt(acc * (1.0 - acc) / n)


def rise(curve, column: int = 2, last: int = 2, n: int = EVAL_SAMPLES) -> dict:
    """How far a run climbed: ``start`` = the step-0 eval, ``end`` = the mean of the last ``last`` evals (the grid's
    "final"), ``rise`` = end − start, and ``in_se`` = that rise in eval standard errors, taken at whichever of
    start and end has the larger one (closer to 0.5), so the count errs low. ``curve`` rows are
    [step, greedy, sampled]; ``column`` 2 reads the sampled (T = 1) accuracy, the task's eval metric."""
    start = curve[0][column]
    end = sum(row[column] for row in curve[-last:]) / len(curve[-last:])
    se = max(eval_se(start, n), eval_se(end, n))
    return {"start": start, "end": end, "rise": end - start, "in_se": (end - start) / se if se else math.inf}


def run(
    seed,
    target,
    lr,
    prompts,
    samples,
    steps,
    eval_every,
    root,
    normalize=True,
    lag=0,
    tis_cap=None,
    clip=None,
    warm_check_every=None,
    warm_max_steps=None,
    beta2=0.999,
    warmup=0,
    temperature=1.0,
    eps=1e-8,
    n_eval=100,
):
    import collections
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_ess.tiny import rlvr

    warm = rlvr.WarmStart(target_acc=target)
    if warm_check_every:
        warm = warm._replace(check_every=warm_check_every)
    if warm_max_steps:
        warm = warm._replace(max_steps=warm_max_steps)
    built = rlvr.build_rlvr(root, seed=seed, n_eval=n_eval, warm=warm)
    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    model = AutoModelForCausalLM.from_pretrained(built["model"], dtype="float32")
    pool, held_out = rlvr.split_pairs(n_eval)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed + 7)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, beta2), eps=eps)
    eos = tokenizer.eos_token_id
    curve = []
    # the sampler: the policy ``lag`` optimizer steps old (every sample exactly that stale; lag 0 = on-policy)
    sampler = copy.deepcopy(model) if lag else model
    history = collections.deque([copy.deepcopy(model.state_dict())], maxlen=lag + 1)
    ratios = {"+": [], "-": []}

    def evaluate(step):
        greedy = rlvr.accuracy(model, tokenizer, held_out)
        sampled = statistics.mean(
            rlvr.accuracy(model, tokenizer, held_out, temperature=temperature, seed=k) for k in range(EVAL_PASSES)
        )
        curve.append((step, greedy, sampled))
        seen = " ".join(
            f"π/μ on A{sign} tokens {statistics.mean(ratios[sign][-eval_every:]):.3f}" for sign in "+-" if ratios[sign]
        )
        print(f"step {step:4d}: held-out greedy {greedy:.3f}, T={temperature:g} {sampled:.3f}  {seen}", flush=True)

    evaluate(0)
    for step in range(1, steps + 1):
        pairs = [pool[rng.randrange(len(pool))] for _ in range(prompts)]
        x = torch.tensor([rlvr._encode(tokenizer, rlvr.prompt_of(a, b)) for a, b in pairs]).repeat_interleave(
            samples, 0
        )
        n_prompt = x.shape[1]
        if lag:
            sampler.load_state_dict(history[0])  # the oldest kept: ``lag`` steps behind once the history is full
        with torch.no_grad():
            for _ in range(6):
                probs = torch.softmax(sampler(x).logits[:, -1].float() / temperature, -1)
                x = torch.cat([x, torch.multinomial(probs, 1)], 1)
            mu = torch.log_softmax(sampler(x).logits[:, n_prompt - 1 : -1].float() / temperature, -1)
            mu = mu.gather(-1, x[:, n_prompt:, None])[..., 0]
        mask = torch.zeros(x.shape[0], x.shape[1] - n_prompt)
        rewards = []
        for i, row in enumerate(x[:, n_prompt:].tolist()):
            a, b = pairs[i // samples]
            length = row.index(eos) + 1 if eos in row else len(row)
            mask[i, :length] = 1
            rewards.append(float(row[:length] == rlvr._encode(tokenizer, str(a + b)) + [eos]))
        adv = grpo_advantages(torch.tensor(rewards).view(prompts, samples), normalize).view(-1, 1)
        logp = torch.log_softmax(model(x).logits[:, n_prompt - 1 : -1].float() / temperature, -1)
        logp = logp.gather(-1, x[:, n_prompt:, None])[..., 0]
        # token TIS as the CLI applies it with one step per batch: min(π_old/μ, cap), π_old = the current policy
        ratio = (logp.detach() - mu).exp()  # π_θ/μ per token (1 on-policy)
        weight = ratio.clamp(max=tis_cap) if tis_cap else 1.0
        for sign, rows in (("+", adv[:, 0] > 0), ("-", adv[:, 0] < 0)):
            if rows.any():  # mean π_θ/μ over the tokens of samples with a positive / negative advantage
                ratios[sign].append(((ratio * mask)[rows].sum() / mask[rows].sum()).item())
        loss = -(weight * adv * logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for group in opt.param_groups:  # linear warm-up over ``warmup`` steps, then constant (the CLI's schedule)
            group["lr"] = lr * min(1.0, step / warmup) if warmup else lr
        opt.step()
        if lag:
            history.append(copy.deepcopy(model.state_dict()))
        if step % eval_every == 0:
            evaluate(step)
    record = {k: v for k, v in built["warm_start"].items() if k != "curve"}
    return curve, record


def setting_key(setting: dict) -> str:
    return json.dumps(setting, sort_keys=True)


def save(path: str, setting: dict, warm_start: dict, curve, seconds: float) -> None:
    """Put one run's record into the results file at ``path``, replacing a record of the same setting."""
    records = load(path)
    records = [r for r in records if setting_key(r["setting"]) != setting_key(setting)]
    records.append({"setting": setting, "warm_start": warm_start, "curve": curve, "seconds": round(seconds, 1)})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1)
    os.replace(tmp, path)


def load(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def _describe(setting: dict) -> str:
    parts = [f"warm {setting['target']}"]
    parts.append(f"checked every {setting.get('warm_check_every') or 25}")  # 25: the default before it was kept
    if setting.get("warm_max_steps"):
        parts.append(f"at most {setting['warm_max_steps']} steps")
    extra = []
    if setting.get("n_eval", 100) != 100:
        extra.append(f"eval {setting['n_eval']} pairs")
    if setting.get("clip"):
        extra.append(f"clip {setting['clip']:g}")
    if setting.get("eps", 1e-8) != 1e-8:
        extra.append(f"Adam eps {setting['eps']:g}")
    if setting.get("temperature", 1.0) != 1.0:
        extra.append(f"T = {setting['temperature']:g}")
    if setting.get("warmup"):
        extra.append(f"warm-up {setting['warmup']}")
    if setting.get("beta2", 0.999) != 0.999:
        extra.append(f"β₂ {setting['beta2']:g}")
    if not setting.get("normalize", True):
        extra.append("r − mean")
    if setting.get("lag"):
        extra.append(f"lag {setting['lag']}")
    if setting.get("tis_cap"):
        extra.append(f"TIS {setting['tis_cap']:g}")
    return ", ".join(parts), ", ".join(extra) or "–"


def render(records: list) -> str:
    """The search's table, one row per setting and seed, in the order the runs were recorded: the warm start, the
    update's settings, the held-out accuracy at the rollout temperature (T = 1 unless the row says) at the start, its
    peak and its end (mean of the last two evals), the rise and the rise in eval standard errors (:func:`rise`), the
    greedy accuracy start -> end, and the run's seconds."""
    lines = [
        "| seed | warm start (supervised steps) | lr | prompts × samples | steps | other "
        "| at the rollout T: start → end (peak) | rise | rise in eval SEs | greedy: start → end | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        st, curve = r["setting"], r["curve"]
        t1, greedy = rise(curve, n=eval_samples(st.get("n_eval", 100))), rise(curve, column=1)
        warm, extra = _describe(st)
        peak = max(row[2] for row in curve)
        lines.append(
            f"| {st['seed']} | {warm} ({r['warm_start'].get('steps', '?')}) | {st['lr']:g} | {st['prompts']} × "
            f"{st['samples']} | {st['steps']} | {extra} | {t1['start']:.3f} → {t1['end']:.3f} ({peak:.3f}) "
            f"| {t1['rise']:+.3f} | {t1['in_se']:.1f} | {greedy['start']:.3f} → {greedy['end']:.3f} "
            f"| {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def render_grid_rises(grid: dict, start_key: str = "_warm_start_accuracy") -> str:
    """The rise of each run of a ``benchmarks.rlvr_grid`` results file (its ``eval`` rows [step, s since launch, s
    since the first step, accuracy]), counted as :func:`rise` counts it, from the file's start value (the warm
    start's own eval): one row per configuration and seed."""
    start = grid[start_key]
    lines = ["| configuration | seed | start → end | rise | rise in eval SEs |", "|---|---|---|---|---|"]
    for key, runs in grid.items():
        if key.startswith("_"):
            continue
        for run in runs:
            n = eval_samples(int(run.get("task_env", {}).get("N_EVAL", 100)))
            r = rise([[0, None, start]] + [[e[0], None, e[3]] for e in run["eval"]], n=n)
            name = key.replace(" | ", ": ")
            lines.append(
                f"| {name} | {run['seed']} | {r['start']:.3f} → {r['end']:.3f} | {r['rise']:+.3f} | {r['in_se']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="model seed (its warm start) and sampling seed")
    parser.add_argument("--target", type=float, default=0.27, help="warm-start dev accuracy to stop at")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--no-std", action="store_true", help="advantage r − mean only (no division by the std)")
    parser.add_argument("--lag", type=int, default=0, help="sample with the policy this many steps old (0: on-policy)")
    parser.add_argument("--tis-cap", type=float, default=None, help="token TIS min(π/μ, cap) on the stale samples")
    parser.add_argument("--clip", type=float, default=None, help="clip the gradient's norm to this (the CLI's: 1)")
    parser.add_argument("--eps", type=float, default=1e-8, help="Adam's eps (the CLI's --actor.adam.eps: 1e-8)")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout and eval temperature")
    parser.add_argument("--warmup", type=int, default=0, help="linear LR warm-up steps (the tiny scripts': 0)")
    parser.add_argument("--beta2", type=float, default=0.999, help="Adam's beta2 (the CLI's: 0.95)")
    parser.add_argument("--warm-check-every", type=int, default=None, help="warm start: steps between dev checks")
    parser.add_argument("--warm-max-steps", type=int, default=None, help="warm start: at most this many steps")
    parser.add_argument(
        "--n-eval", type=int, default=100, help="held-out unordered pairs, asked in both orders (100: 197 problems)"
    )
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "ess_rlvr_search"))
    parser.add_argument("--out", default=None, help="results file (JSON) to keep this run's record in")
    parser.add_argument(
        "--render", default=None, help="write this results file's table to the .md beside it, and stop"
    )
    parser.add_argument(
        "--render-grid",
        default=None,
        help="a benchmarks.rlvr_grid results.json: each run's rise, to rises.md beside it",
    )
    a = parser.parse_args()
    if a.render_grid:
        with open(a.render_grid) as f:
            grid = json.load(f)
        md = os.path.join(os.path.dirname(a.render_grid), "rises.md")
        with open(md, "w") as f:
            f.write(render_grid_rises(grid))
        print(f"wrote {md}")
        return
    if a.render:
        md = os.path.splitext(a.render)[0] + ".md"
        with open(md, "w") as f:
            f.write(render(load(a.render)))
        print(f"wrote {md}")
        return
    import time

    t0 = time.time()
    curve, warm_start = run(
        a.seed,
        a.target,
        a.lr,
        a.prompts,
        a.samples,
        a.steps,
        a.eval_every,
        a.root,
        not a.no_std,
        a.lag,
        a.tis_cap,
        a.clip,
        a.warm_check_every,
        a.warm_max_steps,
        beta2=a.beta2,
        warmup=a.warmup,
        temperature=a.temperature,
        eps=a.eps,
        n_eval=a.n_eval,
    )
    if a.out:
        from openrlhf_ess.tiny.rlvr import WarmStart

        setting = {
            "seed": a.seed,
            "target": a.target,
            "lr": a.lr,
            "prompts": a.prompts,
            "samples": a.samples,
            "steps": a.steps,
            "eval_every": a.eval_every,
            "normalize": not a.no_std,
            "lag": a.lag,
            "tis_cap": a.tis_cap,
            "clip": a.clip,
            "warm_check_every": a.warm_check_every or WarmStart().check_every,  # the one used, default or not
            "warm_max_steps": a.warm_max_steps,
            "beta2": a.beta2,
            "warmup": a.warmup,
            "temperature": a.temperature,
            "eps": a.eps,
            "n_eval": a.n_eval,
        }
        save(a.out, setting, warm_start, curve, time.time() - t0)


if __name__ == "__main__":
    main()
