"""Per-step overhead of ESS-LR, TIS and k2, measured inside one process on the real DeepSpeed actor.

    python -m benchmarks.step_overhead [--reps 40] [--samples 32] [--zero_stage 2] [--out docs/step_overhead.md]

The end-to-end benchmark (benchmarks/overhead.py) compares whole runs, whose per-step times vary by ±25% on
a shared 2-core machine, too much to check a 2% target. Here one DeepSpeed actor (the tiny model, the CLI's
own strategy) trains on the same fixed rollout with each configuration in turn, interleaved (off, ESS-LR,
TIS, ... , off, ESS-LR, ...), so machine drift hits every configuration alike; the median of ``--reps``
timed ``ppo_train`` calls per configuration gives the ratio. Each configuration is our ActorPPOTrainer built
from its own flags over the same model (the ESS hook of the ESS-LR trainer stays registered on the shared
optimizer while the others run; inactive, it returns at once).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("TQDM_DISABLE", "1")  # ppo_train's progress bar, once per timed call

CONFIGS = {
    "off": {},
    "ESS-LR": {"ess_lr_enable": True},
    "TIS token": {"tis_cap": 2.0},
    "TIS seq": {"tis_cap": 2.0, "tis_level": "seq"},
}
KL_CONFIGS = {"KL loss (k3), off": {}, "KL loss + k2": {"off_policy_k2_enable": True}}


def _trainer(strategy, model, optim, scheduler, micro, algo_overrides, kl_loss: bool):
    from openrlhf_ess import config
    from openrlhf_ess.trainer.ray.ppo_actor import ActorPPOTrainer

    args = copy.deepcopy(strategy.args)
    for key, value in algo_overrides.items():
        if key == "off_policy_k2_enable":
            args.algo.kl.off_policy_k2_enable = value
        else:
            setattr(args.algo, key, value)
    if kl_loss:
        args.algo.kl.use_loss, args.algo.kl.init_coef, args.algo.kl.estimator = True, 0.01, "k3"
    config.validate(args)  # the CLI's own post-parse step (maps the TIS cap onto upstream's IS options)
    ours = copy.copy(strategy)
    ours.args = args
    return ActorPPOTrainer(
        ours, model, None, optim, scheduler, micro_train_batch_size=micro, dataloader_pin_memory=False
    )


def measure(a) -> dict:
    import torch

    from benchmarks.common import build_actor, make_rollout, single_process_env
    from openrlhf_ess.tiny.world import build_world

    single_process_env()
    world = build_world(os.path.join(tempfile.mkdtemp(prefix="ess_step_"), "world"), seed=0, n_prompts=8)
    micro = 8
    strategy, model, optim, scheduler = build_actor(
        world["model"], world["prompts"], a.zero_stage, a.dtype, a.samples, micro, extra=["--vllm.num_engines", "1"]
    )
    rollout = make_rollout(0, a.samples)
    rollout.base_action_log_probs = rollout.action_log_probs - 0.05  # for the KL-loss group
    groups = {"features": (CONFIGS, False), "KL loss": (KL_CONFIGS, True)}
    times = {}
    for group, (configs, kl_loss) in groups.items():
        trainers = {
            name: _trainer(strategy, model, optim, scheduler, micro, o, kl_loss) for name, o in configs.items()
        }
        samples = {name: [] for name in trainers}
        for rep in range(a.reps + 2):  # the first two rounds warm up
            for name, trainer in trainers.items():
                trainer.replay_buffer.append(copy.deepcopy(rollout))
                t0 = time.perf_counter()
                trainer.ppo_train(0.0)
                elapsed = time.perf_counter() - t0
                trainer.replay_buffer.clear()
                if rep >= 2:
                    samples[name].append(elapsed)
        times[group] = {name: statistics.median(v) for name, v in samples.items()}
        times[group + " (spread)"] = {name: _iqr(v) for name, v in samples.items()}
    torch.distributed.destroy_process_group()
    return times


def _iqr(values):
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def write_report(times: dict, a, path: str) -> None:
    lines = [
        "# Per-step overhead inside the actor (interleaved, one process)",
        "",
        f"Measured with `python -m benchmarks.step_overhead --reps {a.reps} --samples {a.samples} "
        f"--zero_stage {a.zero_stage} --dtype {a.dtype}` on a 2-core CPU machine: the real DeepSpeed actor (tiny "
        f"Qwen2, {a.dtype}, "
        f"ZeRO-{a.zero_stage}), one rollout of {a.samples} samples per `ppo_train` call (micro-batch 8), each "
        f"configuration timed {a.reps} times, interleaved with the others. Median seconds per `ppo_train`, its "
        "ratio to the group's baseline, and the interquartile range of the timings (the noise).",
        "",
    ]
    for group in ("features", "KL loss"):
        med, spread = times[group], times[group + " (spread)"]
        base = next(iter(med.values()))
        lines += [f"## {group}", "", "| config | s / ppo_train | ratio | IQR s |", "|---|---|---|---|"]
        for name, t in med.items():
            lines.append(f"| {name} | {t:.4f} | {t / base:.3f} | {spread[name]:.4f} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "step_overhead.md"))
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="the actor's dtype (default: bf16 where this CPU computes it natively, else fp32: "
        "openrlhf_ess/runtime/cpu_dtype.py)",
    )
    a = parser.parse_args()
    if a.dtype is None:
        from benchmarks.common import cpu_dtype

        a.dtype = cpu_dtype()
    times = measure(a)
    write_report(times, a, a.out)
    print(open(a.out).read())


if __name__ == "__main__":
    main()
