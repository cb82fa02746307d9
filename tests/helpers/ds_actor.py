"""A real DeepSpeed actor (upstream's Actor + DeepspeedStrategy) in one process, for tests.

    python -m tests.helpers.ds_actor MODEL OUT.json --zero_stage 2 --param_dtype bf16 --steps 2

Builds the strategy from our CLI parser (so every upstream default applies), prepares the actor
exactly as PolicyModelActor does, takes ``--steps`` optimizer steps on a fixed batch and writes the
loss per step and a checksum of the parameters before and after.
"""

import argparse
import json
import os

from tests.helpers.ports import free_port


def single_process_env() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def build_actor(
    model_path, prompts, zero_stage, param_dtype, train_batch, micro_batch, lr=1e-3, extra=(), zero_overrides=None
):
    """``zero_overrides``: entries replacing upstream's ``zero_optimization`` config (e.g. a persistence
    threshold), in both the model's ZeRO-3 init and ``deepspeed.initialize``."""
    from openrlhf_ess.runtime import cpu_compat

    cpu_compat.apply()
    from openrlhf.models import Actor
    from openrlhf.utils import get_strategy

    from openrlhf_ess.cli.train_ppo_ray import parse_args

    argv = [
        "--actor.model_name_or_path",
        model_path,
        "--data.prompt_dataset",
        prompts,
        "--reward.remote_url",
        "unused.py",
        "--ds.attn_implementation",
        "sdpa",
        "--ds.zero_stage",
        str(zero_stage),
        "--ds.param_dtype",
        param_dtype,
        "--train.batch_size",
        str(train_batch),
        "--train.micro_batch_size",
        str(micro_batch),
        "--actor.num_gpus_per_node",
        "1",
        "--actor.adam.lr",
        str(lr),
        "--actor.lr_warmup_ratio",
        "0",
        "--actor.lr_scheduler",
        "constant",
        "--algo.advantage.estimator",
        "reinforce",
    ] + list(extra)
    args, _ = parse_args(argv)
    strategy = get_strategy(args)
    if zero_overrides:
        upstream_config = strategy.get_ds_train_config

        def with_overrides(*a, **k):
            config = upstream_config(*a, **k)
            config["zero_optimization"].update(zero_overrides)
            return config

        strategy.get_ds_train_config = with_overrides
    strategy.setup_distributed()
    actor = Actor(
        model_path,
        attn_implementation="sdpa",
        param_dtype=param_dtype,
        ds_config=strategy.get_ds_train_config(),
        temperature=1.0,
    )
    cfg = dict(
        optim="adam",
        muon=vars(args.actor.muon),
        adam=vars(args.actor.adam),
        lr_scheduler=args.actor.lr_scheduler,
        lr_warmup_ratio=args.actor.lr_warmup_ratio,
        min_lr_ratio=args.actor.min_lr_ratio,
        max_norm=args.actor.max_norm,
        scheduler_steps=100,
    )
    model, optim, scheduler = strategy.prepare((actor, cfg))
    return strategy, model, optim, scheduler


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
