"""Pre-flight, flag values: every float flag finite (NaN never: every comparison with NaN is false, so ``tol > 0``
silently turned a check off; +-inf only where it means "no bound", :data:`INF_MEANS_NO_BOUND`); the step and sampling
flags upstream divides by or vLLM rejects mid-run (``--rollout.temperature 0``; below vLLM's floor 0.01 the engine
samples at 0.01); the optimisation and batch flags."""

from __future__ import annotations

import argparse
import math
import types
from typing import Any, List, Optional

from openrlhf_ess import config, upstream
from openrlhf_ess.config import ConfigError

# Float flags where +-inf is a meaningful value ("no bound"); NaN is rejected everywhere.
INF_MEANS_NO_BOUND = {
    "ckpt.max_mem": "upstream's default: no size limit on kept checkpoints",
    "reward.clip_range": "-inf/inf: that side of the reward is not clipped",
    "algo.advantage.is_correction_threshold": "inf HIGH: no upper bound on the IS statistic",
    "algo.dynamic_filtering_range": "-inf/inf: that side of the kept reward range is open",
    "algo.tis_cap": "inf: untruncated importance weights",
    "reward.timeout_s": "inf: no bound on a reward function call",
}


_FLOAT_HINTS = {"vllm.sync_check_tol": "0 disables the weight-sync check"}


# vLLM raises a sampling temperature in (0, this) to it (vllm/sampling_params.py: _MAX_TEMP = 1e-2, "maxed it out");
# tests/test_preflight_flags.py checks it against the installed vLLM.
VLLM_MIN_TEMPERATURE = 0.01


def float_flags() -> List[argparse.Action]:
    """Every float-typed flag of the CLI (upstream's and ours), in --help order."""
    parser = upstream.build_parser()
    config.add_arguments(parser)
    return [a for a in parser._actions if a.type is float and a.option_strings]


def flag_value(args: types.SimpleNamespace, dest: str, default: Any = None) -> Any:
    """The value of the flag whose argparse dest is ``dest`` (dotted: ``vllm.sync_check_tol``), or ``default``."""
    obj = args
    for part in dest.split("."):
        if not hasattr(obj, part):
            return default
        obj = getattr(obj, part)
    return obj


def _check_floats(args: types.SimpleNamespace) -> None:
    for action in float_flags():
        value = flag_value(args, action.dest)
        values = value if isinstance(value, (list, tuple)) else [value]
        for x in values:
            if not isinstance(x, float) or math.isfinite(x) or (math.isinf(x) and action.dest in INF_MEANS_NO_BOUND):
                continue
            flag = action.option_strings[0]
            shown = " ".join(str(v) for v in values)
            hint = _FLOAT_HINTS.get(action.dest)
            fix = f"pass a finite number (default: {action.default}{'; ' + hint if hint else ''})"
            if math.isnan(x):
                raise ConfigError(
                    f"{flag} {shown}: NaN is not a usable value (every comparison with NaN is false, so a check such "
                    f"as `value > 0` silently turns off): {fix}."
                )
            allowed = ", ".join("--" + k for k in INF_MEANS_NO_BOUND)
            raise ConfigError(
                f"{flag} {shown}: must be finite; {fix}. inf is accepted only where it means 'no bound' ({allowed})."
            )


def _check_steps(args: types.SimpleNamespace) -> None:
    if args.logger.logging_steps < 1:
        raise ConfigError(
            f"--logger.logging_steps {args.logger.logging_steps}: must be >= 1 (upstream logs when global_step % "
            "logging_steps == 0: 0 divides by zero at the first step)."
        )
    for flag, value, what in (
        ("--ckpt.save_steps", args.ckpt.save_steps, "no intermediate checkpoints"),
        ("--eval.steps", args.eval.steps, "no evaluation"),
    ):
        if value == 0 or value < -1:
            raise ConfigError(
                f"{flag} {value}: must be >= 1, or -1 for {what} (upstream tests global_step % {flag[2:]} == 0: 0 "
                "divides by zero at the first step, a negative value fires at unexpected steps)."
            )
    if args.data.max_samples < 1:
        raise ConfigError(f"--data.max_samples {args.data.max_samples}: must be >= 1 (the number of prompts used).")
    if args.eval.dataset and args.eval.n_samples_per_prompt < 1:
        raise ConfigError(f"--eval.n_samples_per_prompt {args.eval.n_samples_per_prompt}: must be >= 1.")
    if args.data.prompt_probs is not None:
        n_sets = len(args.data.prompt_dataset.split(","))
        try:
            probs = [float(p) for p in args.data.prompt_probs.split(",")]
        except ValueError:
            probs = None
        if probs is None or len(probs) != n_sets or not all(math.isfinite(p) and p >= 0 for p in probs):
            raise ConfigError(
                f"--data.prompt_probs {args.data.prompt_probs}: needs one finite probability >= 0 per dataset of "
                f"--data.prompt_dataset ({n_sets} given), comma-separated, e.g. {','.join(['0.5'] * max(n_sets, 2))}."
            )
        if sum(probs) <= 0:
            raise ConfigError(f"--data.prompt_probs {args.data.prompt_probs}: at least one must be > 0.")


def _check_sampling(args: types.SimpleNamespace) -> None:
    rollout = args.rollout
    if rollout.temperature < 0:
        raise ConfigError(f"--rollout.temperature {rollout.temperature}: must be > 0 (1.0 samples the policy itself).")
    if rollout.temperature == 0:
        nan = (
            "the trainer scores every response with logits / temperature (openrlhf/models/actor.py, the temperature "
            "the engine sampled at), so 0 turns every log-prob into NaN"
        )
        consumers = config.mu_consumers(args)
        if consumers:
            raise ConfigError(
                f"--rollout.temperature 0 samples greedily, but {', '.join(consumers)} need(s) mu, the "
                "engine's probability of each sampled token: for a greedy sample mu is degenerate (the argmax token "
                "was chosen with certainty, whatever log-prob is reported), so every ratio pi/mu would be wrong; and "
                f"{nan}. Use a temperature > 0 (1.0 samples the policy itself)."
            )
        raise ConfigError(
            f"--rollout.temperature 0: {nan} and the first update into NaN. Use a temperature > 0 (1.0 samples the "
            "policy itself; below 1 sharpens it). Greedy decoding is for evaluation: --eval.temperature 0."
        )
    if rollout.temperature < VLLM_MIN_TEMPERATURE:
        # vLLM's SamplingParams raises 0 < T < 0.01 to 0.01 (_MAX_TEMP, a warning inside the engine actor's log) while
        # the trainer divides the logits by the flag's T: pi and mu would be different distributions (measured at
        # T = 0.001: mismatch/k1 2288, grad norm 5e5). Refused rather than raised to the floor for both: a run at
        # a temperature other than the one asked for would look right and not be.
        raise ConfigError(
            f"--rollout.temperature {rollout.temperature}: below vLLM's floor {VLLM_MIN_TEMPERATURE}. vLLM samples at "
            f"{VLLM_MIN_TEMPERATURE} instead (it raises any temperature in (0, {VLLM_MIN_TEMPERATURE}) to it) while "
            "the trainer scores with logits / --rollout.temperature, so the engine's and the trainer's distributions "
            f"would differ (mu and pi of different temperatures: huge importance ratios and gradients). Use "
            f"--rollout.temperature >= {VLLM_MIN_TEMPERATURE}."
        )
    if not 0 < rollout.top_p <= 1:
        raise ConfigError(f"--rollout.top_p {rollout.top_p}: must be in (0, 1] (vLLM rejects it; 1 = no nucleus cut).")
    if rollout.max_new_tokens is not None and rollout.max_new_tokens < 1:
        raise ConfigError(
            f"--rollout.max_new_tokens {rollout.max_new_tokens}: must be >= 1 (every response needs a token to "
            "train on), or left unset (up to --data.max_len minus the prompt)."
        )
    if args.eval.dataset and args.eval.temperature < 0:
        raise ConfigError(f"--eval.temperature {args.eval.temperature}: must be >= 0 (0 = greedy evaluation).")


def dp_size(args: types.SimpleNamespace, role: str) -> int:
    """Data-parallel ranks of ``role`` (actor or critic), as upstream's DeepspeedStrategy counts them: its GPUs
    over ring-attention and DeepSpeed-TP groups."""
    group = getattr(args, role)
    return max(1, group.num_nodes * group.num_gpus_per_node // args.ds.ring_attn_size // args.ds.tensor_parallel_size)


def _check_replacement_cluster(args: types.SimpleNamespace, notices: List[str], address: Optional[str]) -> None:
    """--vllm.max_restarts with tensor-parallel engines on a joined cluster (``address``): a dead engine's vLLM
    workers (Ray actors of its own) go only with its process group, which Ray's raylet ends only with
    ``RAY_process_group_cleanup_enabled`` set at ``ray start`` (our private instance sets it); without it the new
    engine's workers may wait for the GPUs the old ones hold, until --vllm.restart_timeout_s stops the run."""
    tp = int(getattr(args.vllm, "tensor_parallel_size", 1) or 1)
    if not address or getattr(args.vllm, "max_restarts", 0) <= 0 or tp <= 1:
        return
    notices.append(
        f"--vllm.max_restarts {args.vllm.max_restarts} with --vllm.tensor_parallel_size {tp} on the Ray cluster at "
        f"{address}: a dead engine's vLLM workers leave their GPUs only if every node's raylet was started with "
        "RAY_process_group_cleanup_enabled=true (RAY_process_group_cleanup_enabled=true ray start ...); without it "
        "a restarted engine can wait for GPUs its old workers still hold, until --vllm.restart_timeout_s stops the "
        "run. Our own Ray instance sets it; a joined cluster must (docs/faults.md)."
    )


def _check_training_flags(args: types.SimpleNamespace, notices: List[str]) -> None:
    """Flags that upstream accepts and that train nothing, or fail later blaming the model or the prompts."""
    for flag, value, what in (
        ("--train.max_epochs", args.train.max_epochs, "PPO epochs over each rollout batch"),
        ("--train.num_episodes", args.train.num_episodes, "passes over the prompts"),
    ):
        if value < 1:
            raise ConfigError(
                f"{flag} {value}: must be >= 1 ({what}); with {value} the run logs steps and saves the initial "
                "weights unchanged as the trained model. The default is 1."
            )
    roles = ["actor"] + (["critic"] if args.algo.advantage.estimator == "gae" else [])
    for role in roles:
        optim = getattr(getattr(args, role), "optim", "adam")
        lr = getattr(getattr(getattr(args, role), optim, None), "lr", None)
        if lr is not None and not lr > 0:
            raise ConfigError(
                f"--{role}.{optim}.lr {lr}: must be > 0 (a learning rate <= 0 does not train, or trains away from "
                f"the reward). The default is {1e-6 if role == 'actor' else 9e-6}."
            )
    if args.train.async_enable and args.train.async_queue_size < 1:
        raise ConfigError(
            f"--train.async_queue_size {args.train.async_queue_size}: must be >= 1 with --train.async_enable (the "
            "number of rollout batches the generator may run ahead of the trainer; 1 is the default and the least "
            "stale). For no queue at all, drop --train.async_enable."
        )
    if args.algo.kl.init_coef < 0:
        raise ConfigError(
            f"--algo.kl.init_coef {args.algo.kl.init_coef}: must be >= 0 (a negative KL coefficient rewards moving "
            "away from the reference model). 0 turns the KL term and the reference model off."
        )
    if args.algo.max_version_lag is not None and not args.train.async_enable:
        notices.append(
            f"--algo.max_version_lag {args.algo.max_version_lag} with synchronous training: every token is sampled "
            "by the current weights (lag 0), so nothing is masked; the flag only logs the lag (add "
            "--train.async_enable for a queue it applies to)."
        )
    if args.train.dynamic_batch_enable:
        return  # DeepSpeed steps by token budget, not by sample counts
    for role in roles:
        per_step = args.train.micro_batch_size * dp_size(args, role)
        if args.train.batch_size < 1 or args.train.batch_size % per_step:
            ranks = f"{getattr(args, role).num_nodes} x {getattr(args, role).num_gpus_per_node} {role} GPUs"
            if args.ds.ring_attn_size * args.ds.tensor_parallel_size > 1:
                ranks += f" / (ring {args.ds.ring_attn_size} x TP {args.ds.tensor_parallel_size})"
            raise ConfigError(
                f"--train.batch_size {args.train.batch_size}: must be a positive multiple of --train.micro_batch_size "
                f"{args.train.micro_batch_size} x {dp_size(args, role)} data-parallel {role} rank(s) ({ranks}) = "
                f"{per_step}: DeepSpeed accumulates gradients over batch_size / (micro_batch_size x ranks) "
                f"micro-batches per optimizer step and refuses a remainder. Use --train.batch_size "
                f"{max(per_step, args.train.batch_size // per_step * per_step)} (or change the micro-batch size)."
            )
    per_rollout = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    if not args.algo.dynamic_filtering_enable and per_rollout % args.train.batch_size:
        raise ConfigError(
            f"--rollout.batch_size {args.rollout.batch_size} x --rollout.n_samples_per_prompt "
            f"{args.rollout.n_samples_per_prompt} = {per_rollout} samples per rollout is not a multiple of "
            f"--train.batch_size {args.train.batch_size}: DeepSpeed steps only when a full training batch has "
            f"accumulated, so the last {per_rollout % args.train.batch_size} samples of every rollout would add "
            "their gradient to the next rollout's first step (a step over two policies' samples, logged with the "
            "wrong grad norm). Make the rollout a multiple of the training batch, e.g. --train.batch_size "
            f"{math.gcd(per_rollout, args.train.batch_size)}."
        )
