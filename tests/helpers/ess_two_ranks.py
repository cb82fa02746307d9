"""Run under torchrun (2 ranks, gloo on 127.0.0.1): each rank computes the ESS LR scale on its shard.

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P -m tests.helpers.ess_two_ranks OUT_DIR CASE
CASE: "split" (rank 0 gets samples 0-2, rank 1 samples 3-7) or "missing" (rank 1's μ is absent).
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def items_for(case: str, rank: int):
    from openrlhf.trainer.ppo_utils.experience import Experience, split_experience_batch

    g = torch.Generator().manual_seed(7)
    n, t = 8, 5
    prox = -torch.rand(n, t, generator=g) * 2
    mu = prox - torch.randn(n, 1, generator=g) * 0.7  # per-trajectory offsets: a spread of weights
    mask = torch.ones(n, t, dtype=torch.long)
    mask[2, 3:] = 0
    exp = Experience(
        sequences=torch.zeros(n, t + 1, dtype=torch.long),
        action_mask=mask,
        attention_mask=torch.ones(n, t + 1, dtype=torch.long),
        action_log_probs=prox,
        rollout_log_probs=mu,
    )
    items = split_experience_batch(exp)
    if rank < 0:
        return items
    shard = items[:3] if rank == 0 else items[3:]
    if case == "missing" and rank == 1:
        for it in shard:
            it.rollout_log_probs = None
    return shard


def main() -> None:
    out_dir, case = sys.argv[1], sys.argv[2]
    from openrlhf_ess.trainer import ess_lr

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        rank = -1  # single process, the whole batch
    scale, metrics = ess_lr.global_lr_scale(items_for(case, rank), "geo_mean", "sqrt", 0.1)
    with open(os.path.join(out_dir, f"{case}_rank{rank}.json"), "w") as f:
        json.dump({"scale": scale, **metrics}, f)
    if rank >= 0:
        from tests.helpers.rank_exit import finish_rank

        finish_rank()


if __name__ == "__main__":
    main()
