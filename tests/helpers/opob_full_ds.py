"""The whole model's per-trajectory gradient norms through a real DeepSpeed actor (upstream's Actor + strategy) in
one process, then one optimizer step, for tests:

    python -m tests.helpers.opob_full_ds MODEL PROMPTS OUT.json --zero_stage 3 [--no_norms]
    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P -m tests.helpers.opob_full_ds MODEL PROMPTS OUT

Writes the norms (unless ``--no_norms``), the step's loss and a checksum of the parameters after it, so a test
can compare the norms with autograd on the plain model and the step with one taken without the norm pass. Under
torchrun (2 ranks, gloo) rank 0 takes rows 0-1 of the batch and rank 1 row 2 (micro-batches of unequal size, as
a split prompt group gives), and each writes OUT.rank<r>.json.
"""

import argparse
import json
import os

from tests.helpers.ds_actor import build_actor, param_checksum, single_process_env


def batch():
    import torch

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(4, 60, (3, 14), generator=g)
    attention_mask = torch.ones_like(seq)
    attention_mask[1, :4] = 0  # left padding
    seq[1, :4] = 0
    action_mask = torch.ones(3, 6, dtype=torch.bool)
    action_mask[2, -2:] = False
    return seq, action_mask, attention_mask


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--no_norms", action="store_true")
    a = parser.parse_args()
    ranks = "RANK" in os.environ  # under torchrun: its rank, world size and rendezvous
    if not ranks:
        single_process_env()
    import torch

    from openrlhf_ess.trainer import opob

    strategy, model, optim, scheduler = build_actor(
        a.model,
        a.prompts,
        a.zero_stage,
        "fp32",
        train_batch=2 if ranks else 3,  # DeepSpeed's check: micro x ranks (the rows fed may differ per rank)
        micro_batch=1 if ranks else 3,
        extra=["--actor.gradient_checkpointing_enable"],
    )
    seq, action_mask, attention_mask = batch()
    out = a.out
    if ranks:
        rank = int(os.environ["RANK"])
        rows = slice(0, 2) if rank == 0 else slice(2, 3)
        seq, action_mask, attention_mask = seq[rows], action_mask[rows], attention_mask[rows]
        out = f"{a.out}.rank{rank}.json"
    # two ranks: one row of 14 tokens per pass, so rank 0 needs two passes and rank 1 one; the ranks agree on two
    # (ZeRO-3), and rank 1 makes a filler pass after its one row
    from openrlhf_ess.trainer import prox

    chunks = (
        dict(max_tokens=seq.shape[1], agree=opob.passes_on_every_rank(prox.causal_lm(model.model))) if ranks else {}
    )
    norms = pass_log_probs = upstream_log_probs = None
    if not a.no_norms:
        pass_log_probs, norms = opob.full_norms(model, seq, action_mask, attention_mask, **chunks)
        norms, pass_log_probs = norms.tolist(), pass_log_probs.tolist()
        model.eval()  # upstream's make-experience forward: the engine, evaluation mode, no gradient
        with torch.no_grad():
            upstream_log_probs = model(seq, action_mask, attention_mask=attention_mask).tolist()
        model.train()
    log_probs = model(seq, action_mask, attention_mask=attention_mask)
    loss = -(log_probs * action_mask).sum() / action_mask.sum()
    strategy.backward(loss, model, optim)
    strategy.optimizer_step(optim, model, scheduler, name="actor")
    with open(out, "w") as f:
        result = {"norms": norms, "loss": loss.item(), "after": param_checksum(model, strategy)}
        json.dump(dict(result, pass_log_probs=pass_log_probs, upstream_log_probs=upstream_log_probs), f)


if __name__ == "__main__":
    main()
