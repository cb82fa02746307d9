"""Every collective of ours on the virtual accelerator, with 2 gloo ranks (see strict_device.py).

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P -m tests.helpers.device_discipline_ranks OUT

Runs, under ``strict_collectives``: the ESS LR scale (its moments all-gather), ``ProxSources.agree`` (which
stale versions any rank needs) and ``ProxSources.score_streams`` (how many forwards every rank runs), each with
different inputs per rank; plus two controls: a host tensor in a collective is refused, the same tensor moved to
``distributed.device()`` is accepted. Writes one JSON per rank.
"""

import json
import os
import sys
import types

import torch
import torch.distributed as dist

from tests.helpers.ess_two_ranks import items_for
from tests.helpers.strict_device import NCCL_ERROR, strict_collectives


class TinyLM(torch.nn.Module):
    """Just enough of a causal LM for ``prox.stream_log_probs``: embedding -> logits."""

    def __init__(self, vocab=16, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.calls += 1
        return types.SimpleNamespace(logits=self.head(self.embed(input_ids)))


def prox_sources(model):
    from openrlhf_ess.trainer.prox_sources import ProxSources

    args = types.SimpleNamespace(
        algo=types.SimpleNamespace(prox_mode="interrupt", prox_snapshots=1),
        rollout=types.SimpleNamespace(temperature=1.0),
    )
    engine = types.SimpleNamespace(
        module=model, global_steps=0, optimizer=types.SimpleNamespace(empty_partition_cache=lambda: None)
    )
    # partitioned=True: the ZeRO-3 code path (the swap of a plain module needs no DeepSpeed)
    return ProxSources(args, engine, weight_version=0, partitioned=True)


def host_collective():
    dist.all_reduce(torch.ones(2))  # the bug class: a host tensor in the default group's collective


def device_collective():
    from openrlhf_ess import distributed

    dist.all_reduce(torch.ones(2).to(distributed.device()))


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {}
    from openrlhf_ess.trainer import ess_lr

    with strict_collectives(("openrlhf_ess", __name__)) as calls:
        try:
            host_collective()
            result["host_refused"] = False
        except RuntimeError as e:
            result["host_refused"] = NCCL_ERROR in str(e)
        device_collective()
        scale, metrics = ess_lr.global_lr_scale(items_for("split", rank), "geo_mean", "sqrt", 0.1)
        result["ess"] = {"scale": scale, **metrics}
        model = TinyLM()
        sources = prox_sources(model)
        # rank 0 needs versions 3 and 5, rank 1 only 4: every rank must run all three
        result["agree"] = sources.agree([3, 5] if rank == 0 else [4], [3, 4, 5, 6])
        streams = [[1, 2, 3, 4]] * (20 if rank == 0 else 0)  # rank 0: two forwards of 16; rank 1: none of its own
        scored = sources.score_streams(0, streams)
        result["score_forwards"] = model.calls
        result["scored"] = len(scored)
        result["collectives"] = [name for name, _ in calls]
    with strict_collectives(("openrlhf_ess", __name__)) as calls:  # the start-up self-check's collective probe
        from openrlhf_ess.checks.selfcheck import collective_probe

        result["selfcheck"] = collective_probe()
        result["selfcheck_collectives"] = [name for name, _ in calls]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    from tests.helpers.rank_exit import finish_rank

    finish_rank()


if __name__ == "__main__":
    main()
