"""Snapshot/EWMA π_prox on a real DeepSpeed actor vs an independent HF recomputation per version.

    python -m tests.helpers.prox_snapshot MODEL PROMPTS OUT.pt --zero_stage 2 [--mode snapshot|ewma]
    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P -m tests.helpers.prox_snapshot \
        MODEL PROMPTS OUT.pt --zero_stage 3 --persistence_threshold 100      (writes OUT.pt.rank0, OUT.pt.rank1)
    ... --configs snapshot,ewma:batch,ewma:hilton   (one actor after the other in the same ranks: OUT.pt.<i>.rank<r>)

Trains two rollouts with a version advance after each (v0 -> v1 -> v2), keeping its own (gathered, full)
copy of the weights at each version, then scores one batch whose tokens are tagged with versions 0, 1
and 2. Under ZeRO-3 with two ranks, rank 1's batch has no stale token: it must still join the swapped
forwards that rank 0 needs (else the gathers would hang). ``--persistence_threshold`` lowers ZeRO-3's
so that the tiny model has both kinds of parameters: small ones kept gathered and partitioned ones.
"""

import argparse
import os

import torch

from tests.helpers.ds_actor import build_actor, single_process_env
from tests.helpers.ess_ds import MICRO, make_rollout


def full_state(module, zero_stage):
    """The module's full weights by state-dict name (gathered from every rank under ZeRO-3)."""
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero_stage == 3):
        return {n: t.detach().clone() for n, t in module.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("prompts")
    p.add_argument("out")
    p.add_argument("--zero_stage", type=int, default=2)
    p.add_argument("--mode", default="snapshot")
    p.add_argument("--persistence_threshold", type=int, default=None)
    p.add_argument("--ewma_style", default=None)
    # several scenarios in one launch (each a new actor; the ranks' start-up and imports paid once): mode[:style],...
    p.add_argument("--configs", default=None)
    a = p.parse_args()
    if "RANK" not in os.environ:
        single_process_env()
    if a.configs is None:
        scenario(a, a.mode, a.ewma_style, a.out)
        return
    for i, config in enumerate(a.configs.split(",")):
        mode, _, style = config.partition(":")
        scenario(a, mode, style or None, f"{a.out}.{i}")


def scenario(a, mode: str, ewma_style, out: str) -> None:
    """One actor with ``--algo.prox_mode mode``: two rollouts trained, then one batch of versions 0-2 scored."""
    extra = ["--vllm.num_engines", "1", "--algo.kl.init_coef", "0", "--algo.prox_mode", mode]
    if ewma_style:
        extra += ["--algo.prox_ewma_style", ewma_style]
    overrides = None
    if a.persistence_threshold is not None:
        overrides = {"stage3_param_persistence_threshold": a.persistence_threshold}
    strategy, model, optim, scheduler = build_actor(
        # every rank trains on the same rollouts: one optimizer step per micro-batch, as with one rank
        a.model,
        a.prompts,
        a.zero_stage,
        "fp32",
        MICRO * int(os.environ["WORLD_SIZE"]),
        MICRO,
        extra=extra,
        zero_overrides=overrides,
    )
    from openrlhf_ess.trainer import prox
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    rank = torch.distributed.get_rank()
    trainer = ActorPPOTrainer(
        strategy, model, None, optim, scheduler, micro_train_batch_size=MICRO, dataloader_pin_memory=False
    )
    module = model.model.module
    states = {0: full_state(module, a.zero_stage)}
    # The weights after every optimizer step, gathered (the test's independent EWMA is built from these):
    # training_step is where the trainer sees an optimizer step happen.
    step_states = []
    minibatch_prox = []  # (optimizer steps before it, π_prox its loss used, its sequences, its action count)
    inner_step = trainer.training_step

    def recording_step(*args, **kwargs):
        steps = model.model.global_steps
        status = inner_step(*args, **kwargs)
        exp = args[0]  # the minibatch: its action_log_probs are the π_prox the step's loss used
        minibatch_prox.append((len(step_states), exp.action_log_probs.clone(), exp.sequences.clone()))
        if model.model.global_steps > steps:
            step_states.append(full_state(module, a.zero_stage))
        return status

    trainer.training_step = recording_step
    for version in (1, 2):
        trainer.replay_buffer.append(make_rollout(10 + version, 2 * MICRO))
        trainer.ppo_train(0.0)
        trainer.replay_buffer.clear()
        trainer.advance_version()  # what broadcast_to_vllm does after the weights reached the engines
        states[version] = full_state(module, a.zero_stage)
    assert trainer.weight_version == 2

    batch = make_rollout(99, 3)
    versions = torch.tensor([[0] * 6, [1, 1, 1, 2, 2, 2], [2, 0, 1, -1, 2, 0]])
    if rank == 1:  # nothing stale on this rank
        versions = torch.tensor([[2] * 6, [2, 2, 2, -1, -1, -1], [2] * 6])

    def forward():
        with torch.no_grad():
            return model(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask).float()

    storages = {n: prox.storage(p) for n, p in module.named_parameters()}
    pointers = {n: t.data_ptr() for n, t in storages.items()}
    current = forward()
    prox_lp = trainer.proximal_log_probs(current, versions, forward)
    after = forward()  # the live weights again
    metrics = trainer.prox_metrics()

    # the same rows as two micro-batches, scored as the actor's execute_batch does: grouped by version
    def rows(sl):
        def forward_rows():
            with torch.no_grad():
                seqs, mask, attn = batch.sequences[sl], batch.action_mask[sl], batch.attention_mask[sl]
                return model(seqs, mask, attention_mask=attn).float()

        return forward_rows

    halves = [rows(slice(0, 2)), rows(slice(2, 3))]
    grouped = trainer.prox.grouped_forwards(
        lambda: [trainer.proximal_log_probs(f(), v, f) for f, v in zip(halves, (versions[:2], versions[2:]))],
        trainer.weight_version,
    )
    params = list(module.parameters())
    result = {
        "prox": prox_lp,
        "current": current,
        "after": after,
        "storage_moved": [n for n, t in storages.items() if t.data_ptr() != pointers[n]],
        "versions": versions,
        "states": states,
        "sequences": batch.sequences,
        "n_actions": batch.action_mask.shape[1],
        "ewma": dict(trainer.ewma.state().items()) if trainer.ewma is not None else None,  # materialised: a dict
        "metrics": metrics,
        "grouped": torch.cat(grouped),
        "grouped_metrics": trainer.prox_metrics(),
        "step_states": step_states,
        "minibatch_prox": minibatch_prox,
        "partitioned": sum(1 for p in params if hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel),
        "persistent": sum(1 for p in params if getattr(p, "ds_persist", False)),
        "numels": [getattr(p, "ds_numel", p.numel()) for p in params],
    }
    if torch.distributed.get_world_size() == 1:
        torch.save(result, out)
    else:
        torch.save(result, f"{out}.rank{rank}")
        torch.distributed.barrier()  # no rank goes on (or tears gloo down) while the other is mid-collective


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
