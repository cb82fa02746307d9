"""A quick search for settings under which RL climbs on the verifiable task, in plain torch (no Ray, vLLM or
DeepSpeed), so one setting costs seconds instead of minutes.

    python -m benchmarks.rlvr_search --seed 0 --target 0.27 --lr 1e-4 --prompts 32 --samples 8 --steps 200

The update is the CLI's synchronous GRPO step on this task (docs/rlvr_task.md): ``--prompts`` training-pool
problems, ``--samples`` samples each at temperature 1 (up to 6 new tokens, cut after EOS), reward 1 for the exact
answer then EOS, advantage (r − mean) / (std + 1e-9) within each prompt's group, loss −A · log π(token) averaged
over the batch's response tokens, one Adam step per batch (on-policy: the ratio is 1, so PPO's clip never acts).
What it leaves out against the CLI: bf16, ZeRO, the vLLM sampler, gradient clipping. Every ``--eval-every`` steps
it prints the held-out accuracy, greedy and at temperature 1 (mean of 4 passes over the 197 eval problems). The
table this search produced is in docs/rlvr_task.md; the CLI runs there confirm its pick.
"""

from __future__ import annotations

import argparse
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


def run(seed, target, lr, prompts, samples, steps, eval_every, root, normalize=True, lag=0, tis_cap=None):
    import collections
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openrlhf_ess.tiny import rlvr

    built = rlvr.build_rlvr(root, seed=seed, warm=rlvr.WarmStart(target_acc=target))
    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    model = AutoModelForCausalLM.from_pretrained(built["model"], dtype="float32")
    pool, held_out = rlvr.split_pairs()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed + 7)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    eos = tokenizer.eos_token_id
    curve = []
    # the sampler: the policy ``lag`` optimizer steps old (every sample exactly that stale; lag 0 = on-policy)
    sampler = copy.deepcopy(model) if lag else model
    history = collections.deque([copy.deepcopy(model.state_dict())], maxlen=lag + 1)
    ratios = {"+": [], "-": []}

    def evaluate(step):
        greedy = rlvr.accuracy(model, tokenizer, held_out)
        sampled = statistics.mean(rlvr.accuracy(model, tokenizer, held_out, temperature=1.0, seed=k) for k in range(4))
        curve.append((step, greedy, sampled))
        seen = " ".join(
            f"π/μ on A{sign} tokens {statistics.mean(ratios[sign][-eval_every:]):.3f}" for sign in "+-" if ratios[sign]
        )
        print(f"step {step:4d}: held-out greedy {greedy:.3f}, T=1 {sampled:.3f}  {seen}", flush=True)

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
                probs = torch.softmax(sampler(x).logits[:, -1].float(), -1)
                x = torch.cat([x, torch.multinomial(probs, 1)], 1)
            mu = torch.log_softmax(sampler(x).logits[:, n_prompt - 1 : -1].float(), -1)
            mu = mu.gather(-1, x[:, n_prompt:, None])[..., 0]
        mask = torch.zeros(x.shape[0], x.shape[1] - n_prompt)
        rewards = []
        for i, row in enumerate(x[:, n_prompt:].tolist()):
            a, b = pairs[i // samples]
            length = row.index(eos) + 1 if eos in row else len(row)
            mask[i, :length] = 1
            rewards.append(float(row[:length] == rlvr._encode(tokenizer, str(a + b)) + [eos]))
        adv = grpo_advantages(torch.tensor(rewards).view(prompts, samples), normalize).view(-1, 1)
        logp = torch.log_softmax(model(x).logits[:, n_prompt - 1 : -1].float(), -1)
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
        opt.step()
        if lag:
            history.append(copy.deepcopy(model.state_dict()))
        if step % eval_every == 0:
            evaluate(step)
    return curve


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
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "ess_rlvr_search"))
    a = parser.parse_args()
    run(a.seed, a.target, a.lr, a.prompts, a.samples, a.steps, a.eval_every, a.root, not a.no_std, a.lag, a.tis_cap)


if __name__ == "__main__":
    main()
