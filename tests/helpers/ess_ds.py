"""Train the real DeepSpeed actor with upstream's or our ActorPPOTrainer on fixed rollouts, for tests.

    python -m tests.helpers.ess_ds MODEL PROMPTS OUT.pt --zero_stage 2 --param_dtype bf16 --accum 2 \
        --variant ours_on|ours_off|upstream [--lr 1e-3] [--rollouts 2]
    python -m tests.helpers.ess_ds MODEL PROMPTS OUT_PREFIX ... --variants ours_on@1e-3,upstream@8e-4

``--variants``: several variants one after the other in this one process (each a fresh model, optimizer and
scheduler from the same checkpoint and seed; DeepSpeed's process group is set up once), each written to
``OUT_PREFIX.<variant>@<lr>.pt``: the imports (~8 s of a 2-core machine) paid once, not once per variant.

Every variant sees the same rollouts (fixed seed): sequences, advantages, π_prox (``action_log_probs``)
and μ (``rollout_log_probs``) chosen so the trajectory weights are exp(0) and exp(log 5) alternately,
i.e. Σw = 3n, Σw² = 13n and ρ = 9/13 ≈ 0.692, whatever the ZeRO stage. Writes the final parameters (gathered),
the scheduler's LR after each rollout, and the status dicts.
"""

import argparse

import torch

# make_rollout moved to benchmarks/common.py (benchmarks/step_overhead.py trains on it too)
from benchmarks.common import ACT, SEQ, build_actor, make_rollout, single_process_env  # noqa: F401

MICRO = 2
VARIANTS = ("ours_on", "ours_off", "upstream")


def train_variant(a, variant: str, lr: float, out: str) -> None:
    """One variant: build the actor (a fresh model from the checkpoint), train ``a.rollouts`` rollouts, save."""
    extra = ["--actor.lr_scheduler", a.scheduler, "--vllm.num_engines", "1", "--algo.kl.init_coef", "0"]
    if variant == "ours_on":
        extra.append("--algo.ess_lr_enable")
    train_batch = MICRO * a.accum
    strategy, model, optim, scheduler = build_actor(
        a.model, a.prompts, a.zero_stage, a.param_dtype, train_batch, MICRO, lr=lr, extra=extra
    )
    if variant == "upstream":
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    else:
        from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer
    trainer = ActorPPOTrainer(
        strategy, model, None, optim, scheduler, micro_train_batch_size=MICRO, dataloader_pin_memory=False
    )
    lrs, statuses = [], []
    for r in range(a.rollouts):
        trainer.replay_buffer.append(make_rollout(100 + r, 2 * train_batch))
        status = trainer.ppo_train(0.0)
        trainer.replay_buffer.clear()
        lrs.append(scheduler.get_last_lr()[0])
        statuses.append({k: float(v) for k, v in status.items() if isinstance(v, (int, float))})

    import deepspeed

    params = dict(model.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=a.zero_stage == 3):
        state = {k: v.detach().float().clone() for k, v in params.items()}
    torch.save({"params": state, "lrs": lrs, "statuses": statuses}, out)
    if hasattr(model.model, "destroy"):  # the DeepSpeed engine: its optimizer's ZeRO hooks, before the next variant
        model.model.destroy()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("prompts")
    p.add_argument("out")
    p.add_argument("--zero_stage", type=int, default=2)
    p.add_argument("--param_dtype", default="bf16")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--variants", help="VARIANT@LR,...: several, in this process, to OUT.<VARIANT@LR>.pt")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--scheduler", default="cosine_with_min_lr")
    a = p.parse_args()
    if (a.variant is None) == (a.variants is None):
        p.error("give --variant or --variants")
    single_process_env()
    if a.variant is not None:
        train_variant(a, a.variant, a.lr, a.out)
        return
    entries = []  # all checked before the first variant trains: the variant and its learning rate
    for entry in a.variants.split(","):
        variant, _, lr = entry.partition("@")
        if variant not in VARIANTS:
            p.error(f"--variants: {entry!r}: {variant!r} is none of {VARIANTS}")
        try:
            entries.append((entry, variant, float(lr)))
        except ValueError:
            p.error(f"--variants: {entry!r}: no number after '@' (VARIANT@LR, e.g. ours_on@1e-3)")
    for entry, variant, lr in entries:
        train_variant(a, variant, lr, f"{a.out}.{entry}.pt")


if __name__ == "__main__":
    main()
