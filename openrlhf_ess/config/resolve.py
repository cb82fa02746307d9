"""What our flags resolve to: the flags one flag sets in others (``--algo.vcpo_enable``'s recipe, token-level TIS as
upstream's IS-correction flags, the per-level TIS cap), where outputs go by default (under ``--ckpt.output_dir``),
values taken from the machine (the CPU sync backend, the CPU KV cache), and the predicates the rest of the package
asks of the parsed flags (which features are on, what they need). Refusals of flag combinations are in
:mod:`.validation`."""

from __future__ import annotations

import argparse
import math
import os
import types
from typing import List

from openrlhf_ess.config.flags import (
    CPU_KV_CACHE_GB,
    DEFAULTS,
    KV_CACHE_ENV,
    RELOAD_BACKEND,
    VCPO_RECIPE,
    shown,
)
from openrlhf_ess.errors import ConfigError
from openrlhf_ess.runtime import cpu_compat

VCPO_APPLIED = "algo.vcpo_applied"  # the recipe flags the recipe set (not the user), for messages
CKPT_PATH_DEFAULTED = "ckpt.path_defaulted"  # --ckpt.path not passed: ours, under --ckpt.output_dir
CKPT_SUBDIR = "checkpoints_ppo_ray"  # upstream's default --ckpt.path is ./ckpt/checkpoints_ppo_ray


# ---- flags that set other flags ---------------------------------------------------------------------------------


def given_dests(parser: argparse.ArgumentParser, argv) -> set:
    """The dests of the flags ``argv`` passes explicitly (argparse fills the others from their defaults)."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        given, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved:
            action.default = default
    return set(vars(given))


def apply_vcpo_recipe(flat: argparse.Namespace, given: set) -> List[str]:
    """--algo.vcpo_enable: set every :data:`VCPO_RECIPE` flag the user did not pass, and the training batch to one
    optimizer step per rollout batch. Runs on the parsed flags before upstream's post-parse code (which derives
    the clip range and the step counts from them). Returns the notice that says what was set."""
    flags = vars(flat)
    flags[VCPO_APPLIED] = ()
    if not flags.get("algo.vcpo_enable"):
        return []
    applied = []
    for dest, value in VCPO_RECIPE:
        if dest not in given:
            flags[dest] = list(value) if isinstance(value, list) else value
            applied.append(dest)
    if "train.batch_size" not in given:
        flags["train.batch_size"] = flags["rollout.batch_size"] * flags["rollout.n_samples_per_prompt"]
        applied.append("train.batch_size")
    flags[VCPO_APPLIED] = tuple(applied)
    listed = ", ".join(shown(d, flags[d]) for d in applied)
    kept = [f"--{d}" for d, _ in VCPO_RECIPE if d in given]
    return [
        f"--algo.vcpo_enable: VCPO's reference recipe: {listed or 'nothing (every flag passed)'}"
        + (f"; kept as passed: {', '.join(kept)}" if kept else "")
        + "."
    ]


def default_tis_cap(args: types.SimpleNamespace, notices: List[str]) -> None:
    """A TIS level with its own cap (``TIS_DEFAULT_CAP``, e.g. seq_product: 8) and no --algo.tis_cap: that cap."""
    from openrlhf_ess.models.corrections import TIS_DEFAULT_CAP

    algo = args.algo
    if algo.tis_cap is None and algo.tis_level in TIS_DEFAULT_CAP:
        algo.tis_cap = TIS_DEFAULT_CAP[algo.tis_level]
        notices.append(f"--algo.tis_level {algo.tis_level}: weights truncated at --algo.tis_cap {algo.tis_cap:g}.")


# ---- where outputs go -------------------------------------------------------------------------------------------


def default_output_paths(flat: argparse.Namespace, given: set) -> None:
    """Outputs upstream puts in the working directory by default go under ``--ckpt.output_dir`` instead.

    Upstream's ``--ckpt.path`` default, ``./ckpt/checkpoints_ppo_ray``, is relative to the working directory, not to
    ``--ckpt.output_dir``: every run started in one folder shared it, and the rotation of best checkpoints (and of
    old ones, ``--ckpt.max_num``) deleted another run's there. Not passed, it is ``<--ckpt.output_dir>/`` +
    :data:`CKPT_SUBDIR` (the same folder under upstream's default ``--ckpt.output_dir ./ckpt``). Runs on the parsed
    flags, before upstream's post-parse code; the start-up notice says where each output goes
    (``checks/preflight/outputs.py``). wandb's run files keep wandb's own default (``./wandb``, or ``WANDB_DIR``):
    wandb only adds a new run folder there, it deletes nothing."""
    flags = vars(flat)
    flags[CKPT_PATH_DEFAULTED] = "ckpt.path" not in given
    if flags[CKPT_PATH_DEFAULTED]:
        flags["ckpt.path"] = os.path.join(flags["ckpt.output_dir"], CKPT_SUBDIR)


# ---- values taken from the machine ------------------------------------------------------------------------------


def cpu_sync_backend(args: types.SimpleNamespace, notices: List[str]) -> None:
    """No CUDA: upstream's default --vllm.sync_backend nccl becomes reload (NCCL needs GPUs)."""
    if args.vllm.sync_backend == "nccl":
        args.vllm.sync_backend = RELOAD_BACKEND
        notices.append("no CUDA here: --vllm.sync_backend nccl -> reload (NCCL needs GPUs).")


def cpu_kv_cache(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--vllm.cpu_kv_cache_gb: the flag, else vLLM CPU's own VLLM_CPU_KVCACHE_SPACE, else :data:`CPU_KV_CACHE_GB`.

    vLLM CPU reads that variable in ``CpuPlatform.check_and_update_config`` and lets it replace the engine's
    ``kv_cache_memory_bytes`` (a "legacy setting"), so with the variable set anywhere in the engine's environment
    the flag did nothing. The engine actor now starts vLLM without it (``trainer/ray/vllm_engine.py``). The value
    must then be > 0 (``validation``)."""
    env = os.environ.get(KV_CACHE_ENV, "")
    if args.vllm.cpu_kv_cache_gb is None:
        if env:
            try:
                args.vllm.cpu_kv_cache_gb = float(env)
            except ValueError:
                raise ConfigError(
                    f"{KV_CACHE_ENV}={env!r} is not a number of GiB: set it to a whole number (vLLM CPU reads it "
                    "with int()), or unset it and use --vllm.cpu_kv_cache_gb."
                ) from None
        else:
            args.vllm.cpu_kv_cache_gb = CPU_KV_CACHE_GB
    elif env and env != "0":
        notices.append(
            f"--vllm.cpu_kv_cache_gb {args.vllm.cpu_kv_cache_gb:g} sizes the engines' KV cache; {KV_CACHE_ENV}={env} "
            "(which vLLM CPU would let override it) is not passed to the engines."
        )


def on_cuda(args) -> bool:
    """Whether the run uses CUDA: ``--ray.accelerator`` as resolved by the CLI (``resolve_accelerator``: from the
    Ray cluster, not the driver), else this process's answer (:func:`cpu_compat.cuda_available`)."""
    decided = getattr(getattr(args, "ray", None), "accelerator", "auto")
    if decided in ("cuda", "cpu"):
        return decided == "cuda"
    return cpu_compat.cuda_available()


# ---- which features are on, and what they need -----------------------------------------------------------------


def opob_on(args: types.SimpleNamespace) -> bool:
    return args.algo.advantage.baseline == "opob"


def m2po_on(args: types.SimpleNamespace) -> bool:
    return getattr(args.algo, "m2po_tau", None) is not None


def sampling_mask_on(args: types.SimpleNamespace) -> bool:
    return getattr(args.algo, "sampling_mask", DEFAULTS["algo.sampling_mask"]) == "keep"


def routing_replay_on(args: types.SimpleNamespace) -> bool:
    return bool(getattr(args.algo, "routing_replay", False))


def truncates_sampling(args: types.SimpleNamespace) -> bool:
    """Whether the engines sample from a truncated distribution (top-p < 1 or top-k on)."""
    return 0 < args.rollout.top_p < 1 or getattr(args.rollout, "top_k", DEFAULTS["rollout.top_k"]) > 0


def resume_applies(args) -> bool:
    """Whether an async run saves or loads checkpoints (our sidecar and resume checks, trainer/resume.py); off:
    upstream's."""
    ckpt = args.ckpt  # save_steps: -1 on the driver, inf in the actors (upstream's controller sets it) = never
    return bool(args.train.async_enable) and (bool(ckpt.load_enable) or 0 < ckpt.save_steps < float("inf"))


def eval_on(args) -> bool:
    """Whether the run evaluates (``--eval.dataset`` with ``--eval.steps`` N >= 1; -1, upstream's default, is no
    eval: upstream's controllers turn it into inf in the actors)."""
    return bool(args.eval.dataset) and 0 < args.eval.steps < float("inf")


def mu_consumers(args: types.SimpleNamespace) -> List[str]:
    """The flags of the enabled features that consume mu, the engine's sampled-token log-probs."""
    algo = args.algo
    out = []
    if algo.ess_lr_enable:
        out.append("--algo.ess_lr_enable")
    if opob_on(args):
        out.append("--algo.advantage.baseline opob")
    if algo.tis_cap is not None:
        out.append(f"--algo.tis_cap {algo.tis_cap}")
    elif algo.advantage.is_correction_level != "off":
        out.append(f"--algo.advantage.is_correction_level {algo.advantage.is_correction_level}")
    if algo.kl.off_policy_k2_enable:
        out.append("--algo.kl.off_policy_k2_enable")
    if m2po_on(args):
        out.append(f"--algo.m2po_tau {algo.m2po_tau}")
    if algo.prox_mode != DEFAULTS["algo.prox_mode"]:
        out.append(f"--algo.prox_mode {algo.prox_mode}")
    if sampling_mask_on(args):
        out.append("--algo.sampling_mask keep")
    if stale_k(args):  # its mismatch/* metrics: KL(mu || pi_prox) at the lag set
        out.append(f"--train.stale_k {stale_k(args)}")
    return out


def stale_k(args: types.SimpleNamespace) -> int:
    """--train.stale_k: the version lag set exactly (0: off)."""
    return int(getattr(getattr(args, "train", None), "stale_k", 0) or 0)


def reward_file(args: types.SimpleNamespace):
    """The reward .py file upstream's single-turn executor imports (--reward.remote_url, no agent), or None."""
    urls = args.reward.remote_url
    if not urls or args.train.agent_func_path or not urls[0].endswith(".py"):
        return None
    return urls[0]


def needs_rollout_logprobs(args: types.SimpleNamespace) -> bool:
    """Whether any enabled feature consumes mu, the engine's sampled-token log-probs."""
    return bool(mu_consumers(args))


def dedicated_gpus(args: types.SimpleNamespace) -> int:
    """GPU slots the dedicated old-log-prob model takes (0 unless --algo.prox_mode dedicated)."""
    return math.ceil(args.algo.prox_dedicated_num_gpus) if args.algo.prox_mode == "dedicated" else 0


def needs_versions(args: types.SimpleNamespace) -> bool:
    """Whether rollout tokens must be tagged with the weight version that sampled them."""
    return (
        needs_rollout_logprobs(args) or args.algo.max_version_lag is not None or args.algo.prox_audit_dir is not None
    )


def needs_our_controllers(args: types.SimpleNamespace) -> bool:
    """Whether the controller must run our generator and experience maker (else upstream's run untouched).

    Async runs that checkpoint need ours for a resume without lost prompts (trainer/resume.py)."""
    return (
        needs_versions(args)
        or args.reward.failure_policy != DEFAULTS["reward.failure_policy"]
        or args.rollout.top_k > 0  # upstream has no top-k flag: our generator passes it
        or routing_replay_on(args)  # the engine's routes ride on our generator's samples
        or resume_applies(args)
        or args.vllm.max_restarts > 0  # a replaced engine is checked before its samples are trained
    )


def logical_gpus_needed(args: types.SimpleNamespace) -> int:
    """An upper bound on the GPU slots upstream's placement asks for (colocation only needs fewer)."""
    total = args.actor.num_nodes * args.actor.num_gpus_per_node
    total += (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
    if args.algo.kl.init_coef > 0:
        total += args.ref.num_nodes * args.ref.num_gpus_per_node
    if args.critic.model_name_or_path:
        total += args.critic.num_nodes * args.critic.num_gpus_per_node
    if not args.reward.remote_url:
        total += args.reward.num_nodes * args.reward.num_gpus_per_node
    return total + dedicated_gpus(args)


def max_lag_possible(args: types.SimpleNamespace) -> int:
    """The deepest version lag a token can have when consumed, given the queue (and partial rollouts)."""
    if not args.train.async_enable:
        return stale_k(args)
    return args.train.async_queue_size + (1 if args.train.partial_rollout_enable else 0)
