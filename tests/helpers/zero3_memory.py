"""Memory discipline under ZeRO-3: how many weights each pass of ours holds gathered at once.

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P -m tests.helpers.zero3_memory \
        MODEL PROMPTS OUT.json

A real DeepSpeed ZeRO-3 actor on two gloo ranks (fp32, persistence threshold lowered so that most parameters are
partitioned). ZeRO-3's own parameter status is instrumented: a partitioned parameter holds its full value in
``param.data`` only while gathered (its ``data`` is empty otherwise). After every ``GatheredParameters`` enter
and in every module's forward pre-hook (DeepSpeed's own pre-hook has gathered that module by then), the elements
gathered beyond the persistent parameters are summed; the peak is kept per phase (each starts from an empty
partition cache: after an eval forward ZeRO-3 may keep parameters it expects to reuse):

- ``forward``: a normal forward (what training itself holds),
- ``checksums`` and ``synced_state``: the sync check and the weights a sync sends (reload blob, dedicated
  model, audit trail),
- ``snapshot_swap`` and ``score_streams``: π_prox forwards with swapped-in weights (snapshot, interrupt).

Writes {phase: peak elements}, what is left gathered after each phase, and the parameter sizes.
"""

import contextlib
import json
import os
import sys

import torch

from tests.helpers.ds_actor import build_actor
from tests.helpers.ess_ds import MICRO, make_rollout


def gathered_elements(module) -> int:
    """Elements of non-persistent ZeRO-3 parameters currently gathered (their ``data`` is their full value)."""
    return sum(p.data.numel() for p in module.parameters() if hasattr(p, "ds_tensor") and not p.ds_persist)


class Peak:
    def __init__(self, module):
        self.module, self.phase, self.peaks = module, None, {}

    def sample(self, *_args, **_kwargs):
        if self.phase is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), gathered_elements(self.module))

    @contextlib.contextmanager
    def sampling(self, forwards: bool = True):
        """Sample after every ``GatheredParameters`` enter (and, with ``forwards``, in every module's forward
        pre-hook) inside the block."""
        import deepspeed

        enter = deepspeed.zero.GatheredParameters.__enter__
        peak = self

        def sampling_enter(ctx):
            result = enter(ctx)
            peak.sample()
            return result

        hooks = [sub.register_forward_pre_hook(self.sample) for sub in self.module.modules()] if forwards else []
        deepspeed.zero.GatheredParameters.__enter__ = sampling_enter
        try:
            yield self
        finally:
            deepspeed.zero.GatheredParameters.__enter__ = enter
            for hook in hooks:
                hook.remove()


def main() -> None:
    model_path, prompts, out = sys.argv[1:4]
    strategy, model, optim, scheduler = build_actor(
        model_path,
        prompts,
        3,
        "fp32",
        MICRO * int(os.environ["WORLD_SIZE"]),
        MICRO,
        extra=["--vllm.num_engines", "1", "--algo.kl.init_coef", "0", "--algo.prox_mode", "snapshot"],
        zero_overrides={"stage3_param_persistence_threshold": 100},
    )
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    trainer = ActorPPOTrainer(
        strategy, model, None, optim, scheduler, micro_train_batch_size=MICRO, dataloader_pin_memory=False
    )
    module = model.model.module
    peak = Peak(module)
    sampling = peak.sampling()
    sampling.__enter__()  # for the rest of the run

    # one rollout and a version advance, so that version 0 is a stale, kept snapshot
    trainer.replay_buffer.append(make_rollout(11, 2 * MICRO))
    trainer.ppo_train(0.0)
    trainer.replay_buffer.clear()
    trainer.advance_version()
    batch = make_rollout(99, 2)

    def forward():
        with torch.no_grad():
            return model(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask).float()

    left = {}

    def phase(name, fn):
        model.model.empty_partition_cache()  # each phase starts with nothing gathered beyond the persistent ones
        peak.phase = name
        fn()
        peak.phase = None
        left[name] = gathered_elements(module)

    phase("forward", forward)
    phase("checksums", trainer.weight_sync.trainer_checksums)
    phase("synced_state", trainer.weight_sync.synced_state)
    versions = torch.zeros(2, batch.action_mask.shape[1], dtype=torch.long)  # every token of version 0
    phase("snapshot_swap", lambda: trainer.proximal_log_probs(forward(), versions, forward))
    phase("score_streams", lambda: trainer.score_streams(1, [batch.sequences[0].tolist()]))
    params = list(module.parameters())
    result = {
        "peaks": peak.peaks,
        "left": left,
        "numels": [p.ds_numel for p in params],
        "persistent": [p.ds_numel for p in params if p.ds_persist],
    }
    rank = torch.distributed.get_rank()
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
