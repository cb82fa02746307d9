"""Snapshot-mode π_prox on a real DeepSpeed actor vs an independent HF recomputation per version.

    python -m tests.helpers.prox_snapshot MODEL PROMPTS OUT.pt --zero_stage 2 [--mode snapshot|ewma]

Trains two rollouts with a version advance after each (v0 -> v1 -> v2), keeping its own copy of the
weights at each version, then scores one batch whose tokens are tagged with versions 0, 1 and 2.
"""

import argparse

import torch

from tests.helpers.ds_actor import build_actor, single_process_env
from tests.helpers.ess_ds import MICRO, make_rollout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("prompts")
    p.add_argument("out")
    p.add_argument("--zero_stage", type=int, default=2)
    p.add_argument("--mode", default="snapshot")
    a = p.parse_args()
    single_process_env()
    extra = ["--vllm.num_engines", "1", "--algo.kl.init_coef", "0", "--algo.prox_mode", a.mode]
    strategy, model, optim, scheduler = build_actor(
        a.model, a.prompts, a.zero_stage, "fp32", MICRO, MICRO, extra=extra
    )
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    trainer = ActorPPOTrainer(
        strategy, model, None, optim, scheduler, micro_train_batch_size=MICRO, dataloader_pin_memory=False
    )
    module = model.model.module
    states = {0: {n: t.detach().clone() for n, t in module.state_dict().items()}}
    # ZeRO-0 fp32: the engine's optimizer updates the module's own parameters, so a post-step hook sees
    # the weights after every optimizer step (the test's independent EWMA is built from these).
    step_states = []
    if a.zero_stage == 0:
        model.model.optimizer.register_step_post_hook(
            lambda *_: step_states.append({n: t.detach().clone() for n, t in module.state_dict().items()})
        )
    for version in (1, 2):
        trainer.replay_buffer.append(make_rollout(10 + version, 2 * MICRO))
        trainer.ppo_train(0.0)
        trainer.replay_buffer.clear()
        trainer.advance_version()  # what broadcast_to_vllm does after the weights reached the engines
        states[version] = {n: t.detach().clone() for n, t in module.state_dict().items()}
    assert trainer.weight_version == 2

    batch = make_rollout(99, 3)
    versions = torch.tensor([[0] * 6, [1, 1, 1, 2, 2, 2], [2, 0, 1, -1, 2, 0]])

    def forward():
        with torch.no_grad():
            return model(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask).float()

    current = forward()
    prox = trainer.proximal_log_probs(current, versions, forward)
    ewma_state = trainer.ewma.state() if trainer.ewma is not None else None
    torch.save(
        {
            "prox": prox,
            "current": current,
            "versions": versions,
            "states": states,
            "sequences": batch.sequences,
            "n_actions": batch.action_mask.shape[1],
            "ewma": ewma_state,
            "metrics": trainer.prox_metrics(),
            "step_states": step_states,
        },
        a.out,
    )


if __name__ == "__main__":
    main()
