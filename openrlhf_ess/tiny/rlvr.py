"""A verifiable task for the tiny world (RLVR): two-digit addition, exact-match reward, warm-started model.

The digit reward of ``reward.py`` is a dense, learnable signal, but it is not what RLVR trains on: a right/wrong
answer to a problem, judged on held-out problems. This module gives the tiny world such a task:

- **Task**: ``"47+38="`` -> ``"85"``: both operands in 10..99, so every prompt is 6 characters and an answer 2 or
  3 digits (20..198). A 2-layer, 64-wide model learns it from worked examples (to 100 % in ~2,000 steps of 64),
  with a steep middle where it is partly right: the warm start stops there.
- **Split**: the 4,095 unordered pairs {a, b} are shuffled once with a fixed data seed; the first ``n_eval`` go
  to the held-out eval set (both orders a+b and b+a, so commutation cannot leak an eval problem), the rest are
  the training pool. RL prompts and the warm start's examples come from the pool only. The files are the same
  for every model seed, so runs on different seeds are judged on the same problems.
- **Reward** (:func:`reward_func`, ``--reward.remote_url <this file>``): 1 if the response is exactly the
  answer's digits followed by the EOS token, 0 otherwise (a wrong number, leading zeros, any other character,
  or no EOS, i.e. a truncated response).
- **Warm start** (:func:`warm_start`): the random model of ``world.py`` fine-tuned on prompt + answer + EOS with
  plain torch on CPU (AdamW, loss on the answer tokens only) until its greedy accuracy on a dev split of the
  training pool reaches ``target_acc``, so RL starts partly skilled (docs/rlvr_task.md has the measured
  accuracies). Built once under ``root`` and reused, like the world: the stamp's name hashes the task, seed,
  model spec and warm-start settings.

Top-level imports stay light (no torch): OpenRLHF loads this file for ``reward_func`` in every rollout worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from openrlhf_ess.tiny.world import TinyModelSpec

TASK = "add2"  # two-digit addition, answer most significant digit first
LOW, HIGH = 10, 99  # operand range (inclusive): fixed-width prompts
DATA_SEED = 0  # the train/eval split and the prompt order: the same for every model seed
# held-out unordered pairs, both orders asked: 1,589 problems (100 pairs, 197 problems, before: ``n_eval=100``)
N_EVAL = 800
EOS = "</s>"
_PROMPT = re.compile(r"^(\d+)\+(\d+)=$")
_ANSWER = re.compile(r"^(0|[1-9]\d*)$")


# ----------------------------------------------------------------------------------------------- the task


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def solve(prompt: str) -> str:
    """The correct answer to ``prompt`` (``"47+38="`` -> ``"85"``)."""
    m = _PROMPT.match(prompt)
    if not m:
        raise ValueError(f"not a task prompt: {prompt!r}")
    return str(int(m.group(1)) + int(m.group(2)))


def split_pairs(
    n_eval: int = N_EVAL, data_seed: int = DATA_SEED
) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """(train pool, eval problems) as ordered pairs (a, b). The unordered pairs are split, so a+b and b+a are
    always on the same side; both orders of each of the first ``n_eval`` unordered pairs are eval problems."""
    unordered = [(a, b) for a in range(LOW, HIGH + 1) for b in range(a, HIGH + 1)]
    random.Random(data_seed).shuffle(unordered)

    def both(pairs):
        return [p for a, b in pairs for p in ([(a, b)] if a == b else [(a, b), (b, a)])]

    return both(unordered[n_eval:]), both(unordered[:n_eval])


def _write_jsonl(path: str, pairs: Sequence[Tuple[int, int]]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"input": prompt_of(a, b), "label": str(a + b)}) + "\n")
    return path


def build_prompts(
    train_path: str, eval_path: str, n_train: int = 1024, n_eval: int = N_EVAL, data_seed: int = DATA_SEED
) -> Tuple[str, str]:
    """Write the RL prompts (``n_train`` problems of the training pool, in a fixed shuffled order) and the
    held-out eval set (both orders of ``n_eval`` unordered pairs) as JSON lines ``{"input", "label"}``."""
    pool, held_out = split_pairs(n_eval, data_seed)
    rng = random.Random(data_seed + 1)
    rng.shuffle(pool)
    if n_train > len(pool):
        raise ValueError(f"n_train={n_train} > {len(pool)} problems in the training pool")
    held_out = sorted(held_out)
    return _write_jsonl(train_path, pool[:n_train]), _write_jsonl(eval_path, held_out)


# ----------------------------------------------------------------------------------------------- the reward


def response_of(query: str, prompt: str) -> str:
    """The response part of a decoded ``prompt + response`` (special tokens kept)."""
    return query[len(prompt) :] if query.startswith(prompt) else query


def is_correct(response: str, answer: str) -> bool:
    """Strict exact match: the answer's digits, then EOS, then nothing."""
    if not response.endswith(EOS):
        return False  # no EOS: truncated or still going
    body = response[: -len(EOS)]
    return bool(_ANSWER.match(body)) and body == answer


def well_formed(response: str) -> bool:
    """Digits (no leading zero) then EOS: a number was given, right or wrong."""
    return response.endswith(EOS) and bool(_ANSWER.match(response[: -len(EOS)]))


def _answer_for(prompt: str, label) -> str:
    if isinstance(label, str) and label:
        return label
    return solve(prompt)


def reward_func(queries, prompts, labels):
    """OpenRLHF's custom reward hook: 1.0 for an exactly right answer followed by EOS, else 0.0."""
    import torch

    responses = [response_of(q, p) for q, p in zip(queries, prompts)]
    answers = [_answer_for(p, lab) for p, lab in zip(prompts, labels)]
    rewards = torch.tensor([float(is_correct(r, a)) for r, a in zip(responses, answers)])
    formed = torch.tensor([float(well_formed(r)) for r in responses])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"correct": rewards, "well_formed": formed}}


# ----------------------------------------------------------------------------------------------- warm start


class WarmStart(NamedTuple):
    """Supervised fine-tuning on worked examples, stopped at a target greedy accuracy. (A NamedTuple, not a
    dataclass: upstream loads this file without registering it in ``sys.modules``, where a dataclass fails.)"""

    target_acc: float = 0.6  # stop once greedy accuracy on the dev split reaches this (0.27 before)
    max_steps: int = 3000  # give up (and keep the model) after this many steps
    batch_size: int = 128
    lr: float = 1e-3  # AdamW, betas (0.9, 0.98), linear warm-up, gradients clipped to norm 1
    warmup_steps: int = 100
    check_every: int = 5  # steps between dev accuracy checks (25 before)
    n_dev: int = 256  # dev problems (from the training pool, not the RL prompts' order)


def cache_key(seed: int, spec: TinyModelSpec, warm: WarmStart, n_eval: int) -> str:
    """A short hash of everything the warm-started model depends on (the split: ``n_eval``; not ``n_train``,
    which only sets how many RL prompts are written)."""
    key = {
        "task": TASK,
        "range": [LOW, HIGH],
        "data_seed": DATA_SEED,
        "seed": seed,
        "spec": dataclasses.asdict(spec),
        "warm": warm._asdict(),
        "n_eval": n_eval,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _encode(tokenizer, text: str) -> List[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def accuracy(model, tokenizer, pairs: Sequence[Tuple[int, int]], temperature: float = 0.0, seed: int = 0) -> float:
    """Exact-match accuracy of ``model`` on ``pairs``: greedy (``temperature`` 0) or sampled, batched (every
    prompt has the same length), up to 4 new tokens (3 digits + EOS)."""
    import torch

    if not pairs:
        return 0.0
    x = torch.tensor([_encode(tokenizer, prompt_of(a, b)) for a, b in pairs])
    n = x.shape[1]
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(4):
            logits = model(x).logits[:, -1].float()
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            x = torch.cat([x, nxt[:, None]], 1)
    model.train(was_training)
    eos = tokenizer.eos_token_id
    right = 0
    for row, (a, b) in zip(x[:, n:].tolist(), pairs):
        want = _encode(tokenizer, str(a + b)) + [eos]
        right += row[: len(want)] == want
    return right / len(pairs)


def warm_start(model, tokenizer, pool: Sequence[Tuple[int, int]], seed: int, warm: WarmStart) -> Dict:
    """Fine-tune ``model`` in place on ``pool``'s worked examples until the dev accuracy reaches the target.
    One CPU thread (faster than two for a model this small, and deterministic). Returns what happened."""
    import torch

    rng = random.Random(seed)
    dev = rng.sample(list(pool), min(warm.n_dev, len(pool)))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    examples = []
    for a, b in pool:
        p, ans = _encode(tokenizer, prompt_of(a, b)), _encode(tokenizer, str(a + b)) + [eos]
        examples.append((p + ans, [-100] * len(p) + ans))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=warm.lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0 = time.time()
    step, dev_acc, curve = 0, accuracy(model, tokenizer, dev), []
    try:
        while dev_acc < warm.target_acc and step < warm.max_steps:
            batch = [examples[rng.randrange(len(examples))] for _ in range(warm.batch_size)]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
            labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
            loss = model(ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in opt.param_groups:
                group["lr"] = warm.lr * min(1.0, (step + 1) / warm.warmup_steps)
            opt.step()
            step += 1
            if step % warm.check_every == 0 or step == warm.max_steps:
                dev_acc = accuracy(model, tokenizer, dev)
                curve.append([step, round(loss.item(), 4), dev_acc])
    finally:
        torch.set_num_threads(threads)
    return {
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "dev_acc": dev_acc,
        "reached_target": dev_acc >= warm.target_acc,
        "curve": curve,
    }


def build_rlvr(
    root: str,
    seed: int = 0,
    n_train: int = 1024,
    n_eval: int = N_EVAL,
    spec: TinyModelSpec = TinyModelSpec(),
    warm: WarmStart = WarmStart(),
) -> Dict:
    """Build (once) the warm-started model, RL prompts and eval set under ``root``; return their paths and the
    warm start's record (``warm_start``: steps, seconds, dev accuracy, greedy and sampled eval accuracy).

    Reused when ``root`` holds a build with the same :func:`cache_key` (nothing is trained then)."""
    key = cache_key(seed, spec, warm, n_eval)
    model_dir = os.path.join(root, f"model-{key}")
    stamp = os.path.join(root, f".built-rlvr-{key}.json")
    paths = {
        "model": model_dir,
        "prompts": os.path.join(root, f"train-n{n_train}-e{n_eval}.jsonl"),
        "eval": os.path.join(root, f"eval-e{n_eval}.jsonl"),
        "reward": os.path.abspath(__file__),
    }
    if not (os.path.exists(paths["prompts"]) and os.path.exists(paths["eval"])):
        build_prompts(paths["prompts"], paths["eval"], n_train=n_train, n_eval=n_eval)
    if os.path.exists(stamp):
        with open(stamp) as f:
            record = json.load(f)
        return {**paths, "warm_start": record, "cached": True}

    from transformers import AutoModelForCausalLM

    from openrlhf_ess.tiny.world import build_model

    pool, held_out = split_pairs(n_eval)
    _, tokenizer = build_model(model_dir, seed=seed, spec=spec)  # the random tiny model, then fine-tuned
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    record = warm_start(model, tokenizer, pool, seed, warm)
    record["eval_greedy_acc"] = accuracy(model, tokenizer, held_out)
    record["eval_sampled_acc"] = accuracy(model, tokenizer, held_out, temperature=1.0, seed=seed)
    record["key"] = key
    model.save_pretrained(model_dir, safe_serialization=True)
    tmp = stamp + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, stamp)  # the stamp last: an interrupted build is redone
    return {**paths, "warm_start": record, "cached": False}


def main(argv: Optional[Sequence[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build the tiny RLVR task (two-digit addition): model, prompts.")
    parser.add_argument("root", help="output folder (a build is reused when its settings match)")
    parser.add_argument("--seed", type=int, default=0, help="model init and warm-start seed")
    parser.add_argument("--n_train", type=int, default=1024, help="RL prompts")
    parser.add_argument(
        "--n_eval", type=int, default=N_EVAL, help="held-out unordered pairs (both orders are asked; 100 before)"
    )
    parser.add_argument("--target_acc", type=float, default=WarmStart().target_acc)
    parser.add_argument("--max_steps", type=int, default=WarmStart().max_steps)
    parser.add_argument("--check_every", type=int, default=WarmStart().check_every, help="steps between dev checks")
    args = parser.parse_args(argv)
    warm = WarmStart(target_acc=args.target_acc, max_steps=args.max_steps, check_every=args.check_every)
    out = build_rlvr(args.root, seed=args.seed, n_train=args.n_train, n_eval=args.n_eval, warm=warm)
    out["warm_start"] = {k: v for k, v in out["warm_start"].items() if k != "curve"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
