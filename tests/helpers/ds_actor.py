"""A real DeepSpeed actor (upstream's Actor + DeepspeedStrategy) in one process, for tests.

    python -m tests.helpers.ds_actor MODEL OUT.json --zero_stage 2 --param_dtype bf16 --steps 2

Builds the strategy from our CLI parser (so every upstream default applies), prepares the actor
exactly as PolicyModelActor does, takes ``--steps`` optimizer steps on a fixed batch and writes the
loss per step and a checksum of the parameters before and after.
"""

import argparse
import json

# moved to benchmarks/common.py (benchmarks/step_overhead.py builds the actor too)
from benchmarks.common import build_actor, single_process_env  # noqa: F401


def param_checksum(model, strategy) -> float:
    import deepspeed

    total = 0.0
    params = list(model.model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=strategy.args.ds.zero_stage == 3):
        for p in params:
            total += p.detach().float().double().abs().sum().item()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--param_dtype", default="bf16")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--accum", type=int, default=1)
    a = parser.parse_args()
    single_process_env()
    import torch

    micro = 2
    strategy, model, optim, scheduler = build_actor(
        a.model, a.prompts, a.zero_stage, a.param_dtype, train_batch=micro * a.accum, micro_batch=micro
    )
    torch.manual_seed(0)
    seq = torch.randint(4, 60, (micro, 12))
    action_mask = torch.ones(micro, 6, dtype=torch.long)
    attention_mask = torch.ones_like(seq)
    before = param_checksum(model, strategy)
    losses = []
    for _ in range(a.steps * a.accum):
        log_probs = model(seq, action_mask, attention_mask=attention_mask)
        loss = -log_probs.float().mean()
        strategy.backward(loss, model, optim)
        strategy.optimizer_step(optim, model, scheduler, name="actor")
        losses.append(loss.item())
    after = param_checksum(model, strategy)
    with open(a.out, "w") as f:
        json.dump({"losses": losses, "before": before, "after": after, "lr": scheduler.get_last_lr()[0]}, f)


if __name__ == "__main__":
    main()
