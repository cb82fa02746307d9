"""Which combinations of flags are refused: every check that involves more than one flag, raising
:class:`ConfigError` with a message that names the flags and the fix.

:func:`validate_before_upstream` runs on the parsed flags before upstream's post-parse code, :func:`validate` after
upstream's own validation and before Ray or any model starts. :func:`validate` also applies, at their place in the
checks, the few resolutions in :mod:`.resolve` whose result the later checks read (the CPU sync backend, the CPU KV
cache, the TIS cap and upstream's IS-correction flags), and returns the notices that say what changed.
"""

from __future__ import annotations

import argparse
import os
import types
from typing import List

from openrlhf_ess.config import resolve
from openrlhf_ess.config.flags import (
    BYPASS_PROX_MODE,
    DEFAULTS,
    EWMA_DECAY_AUTO,
    KV_CACHE_ENV,
    RELOAD_BACKEND,
    SCORE_AT_SYNC_MODES,
    WEIGHT_SWAP_MODES,
)
from openrlhf_ess.errors import ConfigError

ESS_LR_SETTINGS = ("ess_lr_floor", "ess_lr_weight", "ess_lr_rule")  # --algo.<name>: need --algo.ess_lr_enable


def validate_before_upstream(flat: argparse.Namespace) -> None:
    """Checks that must run before upstream's post-parse code, which crashes unclearly on them."""
    get = vars(flat).get
    if get("actor.model_name_or_path") is None:
        raise ConfigError("--actor.model_name_or_path is required (a local HF model folder or hub name).")
    if get("data.prompt_dataset") is None:
        raise ConfigError("--data.prompt_dataset is required (a JSON/JSONL file, folder or HF dataset name).")
    if not (get("reward.remote_url") or get("reward.model_name_or_path") or get("train.agent_func_path")):
        raise ConfigError(
            "no reward source: pass --reward.remote_url (an HTTP reward server or a .py file with "
            "reward_func), --reward.model_name_or_path (a reward model) or --train.agent_func_path."
        )
    # Upstream divides by both: its post-parse check by --rollout.micro_batch_size, DeepSpeed's gradient
    # accumulation (train_batch_size // micro_batch_size // world_size) by --train.micro_batch_size; 0 was a
    # ZeroDivisionError.
    for flag, what in (
        ("rollout.micro_batch_size", "samples per forward of the experience maker, per GPU"),
        ("train.micro_batch_size", "samples per forward/backward of a training step, per GPU"),
    ):
        value = get(flag)
        if value is not None and value < 1:
            raise ConfigError(
                f"--{flag} {value}: must be >= 1 ({what}; upstream divides by it). The default is 1; raise it for "
                "throughput, as memory allows."
            )
    _validate_group_baseline_before_upstream(flat)


def _validate_group_baseline_before_upstream(flat: argparse.Namespace) -> None:
    """--algo.vcpo_enable / --algo.advantage.baseline opob: what upstream's post-parse code would refuse with a bare
    assertion about a value the recipe set (GRPO on one sample per prompt), or let pass as a silent no-op (a KL
    loss or controller at the recipe's coefficient 0)."""
    from openrlhf_ess.models.opob import OPOB_ESTIMATORS

    get = vars(flat).get
    applied = get(resolve.VCPO_APPLIED) or ()
    vcpo = bool(get("algo.vcpo_enable"))
    flag = "--algo.vcpo_enable" if vcpo else "--algo.advantage.baseline opob"
    n = get("rollout.n_samples_per_prompt")
    # a group estimator on one sample: upstream asserts "<estimator> requires n_samples_per_prompt > 1"; an estimator
    # the baseline cannot take is named by _validate_opob instead
    estimator, opob = get("algo.advantage.estimator"), get("algo.advantage.baseline") == "opob"
    if n < 2 and estimator in OPOB_ESTIMATORS and (vcpo or opob):
        why = f"the {estimator} advantage and the optimal baseline are" if opob else f"the {estimator} advantage is"
        raise ConfigError(
            f"{flag} with --rollout.n_samples_per_prompt {n}: {why} taken over each prompt's samples, so one sample "
            "per prompt leaves every advantage at 0. Set --rollout.n_samples_per_prompt >= 2"
            + (" (the recipe's 16 when the flag is not passed)." if vcpo else ".")
        )
    if "algo.kl.init_coef" in applied:
        kl_users = [f for f in ("algo.kl.use_loss", "algo.kl.target") if get(f) not in (None, False)]
        if kl_users:
            listed = " and ".join(f"--{f}" for f in kl_users)
            raise ConfigError(
                f"{listed} with --algo.vcpo_enable, which sets --algo.kl.init_coef 0 (no KL and no reference model, "
                "as its reference trains): the KL would stay 0. Pass --algo.kl.init_coef C > 0 for a KL (a reference "
                f"model is then placed), or drop {listed}."
            )


def validate(args: types.SimpleNamespace) -> List[str]:
    """Check flag combinations; fix the few that have one right answer and say so.

    Returns notices for the user (what was changed and why). Raises :class:`ConfigError` for a
    combination that would fail later or, worse, train on garbage.
    """
    notices: List[str] = []
    on_cpu = not resolve.on_cuda(args)

    if args.reward.failure_policy != DEFAULTS["reward.failure_policy"] and not args.reward.remote_url:
        raise ConfigError(
            f"--reward.failure_policy {args.reward.failure_policy} watches rule-based rewards (--reward.remote_url "
            "or --train.agent_func_path); a reward model has no per-sample failures to catch. Drop the flag."
        )
    if not args.reward.timeout_s > 0:  # NaN fails too
        raise ConfigError(
            f"--reward.timeout_s must be > 0 seconds (inf = no bound), got {args.reward.timeout_s}: it bounds each "
            "call of the reward function."
        )
    if args.vllm.sync_check_rel_tol is not None and not args.vllm.sync_check_rel_tol >= 0:  # NaN fails too
        raise ConfigError(
            f"--vllm.sync_check_rel_tol must be >= 0 (0 disables the canary's relative bound), got "
            f"{args.vllm.sync_check_rel_tol}."
        )
    if not 0 <= args.vllm.sync_check_min_coverage <= 1:  # NaN fails too
        raise ConfigError(
            f"--vllm.sync_check_min_coverage must be in [0, 1] (a fraction of the trainer's weight elements; 0 "
            f"accepts any coverage), got {args.vllm.sync_check_min_coverage}."
        )
    if args.vllm.sync_check_tol < 0:
        raise ConfigError(
            f"--vllm.sync_check_tol must be >= 0 (0 disables the check), got {args.vllm.sync_check_tol}."
        )
    if args.rollout.max_new_tokens is not None and args.rollout.max_new_tokens >= args.data.max_len:
        raise ConfigError(
            f"--rollout.max_new_tokens {args.rollout.max_new_tokens} leaves no room for the prompt within "
            f"--data.max_len {args.data.max_len} (upstream keeps the last max_len - max_new_tokens prompt tokens): "
            "raise --data.max_len or lower --rollout.max_new_tokens."
        )
    if args.vllm.sync_check_canary_every < 1:
        raise ConfigError(
            f"--vllm.sync_check_canary_every must be >= 1, got {args.vllm.sync_check_canary_every} "
            "(--vllm.sync_check_tol 0 disables the whole check)."
        )
    resolve.cpu_kv_cache(args, notices if on_cpu else [])  # with CUDA the flag is ignored: no notice
    _check_cpu_kv_cache(args)
    if args.vllm.fp32_lm_head and not args.vllm.num_engines:
        raise ConfigError("--vllm.fp32_lm_head sets the vLLM engines' LM head: it needs --vllm.num_engines >= 1.")
    if args.vllm.fp32_lm_head and args.vllm.dtype == "float32":
        raise ConfigError(
            "--vllm.fp32_lm_head with --vllm.dtype float32: the whole engine, its LM head included, is already "
            "fp32, so the flag would change nothing. Drop it (or use --vllm.dtype bfloat16 with it)."
        )

    _validate_routing_replay(args)
    _validate_opob(args, notices)
    if on_cpu:
        resolve.cpu_sync_backend(args, notices)
        if args.vllm.sync_backend == "gloo" and args.vllm.num_engines:
            raise ConfigError(
                "--vllm.sync_backend gloo does not work without CUDA: vLLM's receiving side is a NCCL "
                "communicator that disables itself and returns without data, so the engine would keep "
                "generating from uninitialised weights. Use --vllm.sync_backend reload."
            )
        if args.ds.packing_samples or args.ds.ring_attn_size > 1:
            raise ConfigError(
                "--ds.packing_samples and --ds.ring_attn_size > 1 need flash-attn, which needs CUDA. Drop them on CPU."
            )
        if "flash_attention" in args.ds.attn_implementation:
            raise ConfigError(
                f"--ds.attn_implementation {args.ds.attn_implementation} needs flash-attn and CUDA. "
                "On CPU use --ds.attn_implementation sdpa (or eager)."
            )
        if args.vllm.enable_sleep:
            raise ConfigError("--vllm.enable_sleep is not supported by vLLM's CPU backend. Drop it on CPU.")
        if args.ds.adam_offload:
            raise ConfigError("--ds.adam_offload offloads to CPU from a GPU; on a CPU-only machine drop it.")
    if args.vllm.sync_backend not in ("nccl", "gloo", RELOAD_BACKEND):
        raise ConfigError(
            f"--vllm.sync_backend {args.vllm.sync_backend!r} is unknown: use nccl, gloo or {RELOAD_BACKEND}."
        )
    if args.vllm.sync_backend == RELOAD_BACKEND and args.vllm.sync_with_ray:
        raise ConfigError("--vllm.sync_with_ray applies to nccl/gloo only; drop it with --vllm.sync_backend reload.")
    _validate_replacement(args)
    if args.algo.ess_lr_enable:
        if not 0 < args.algo.ess_lr_floor <= 1:
            raise ConfigError(
                f"--algo.ess_lr_floor must be in (0, 1], got {args.algo.ess_lr_floor}: it is the smallest LR "
                "multiplier (0.1 = at most 10x smaller LR)."
            )
        if not args.vllm.num_engines:
            raise ConfigError(
                "--algo.ess_lr_enable needs rollout log-probs from vLLM engines: set --vllm.num_engines >= 1."
            )
        if args.critic.freezing_steps > 0:
            notices.append(
                f"--algo.ess_lr_enable with --critic.freezing_steps {args.critic.freezing_steps}: the first steps "
                "train only the critic, which is never scaled; ESS LR scaling starts with the actor's first step."
            )
        if args.actor.optim != "adam":
            raise ConfigError(
                f"--algo.ess_lr_enable with --actor.optim {args.actor.optim}: DeepSpeed's Muon reads per-group "
                "muon_lr/adam_lr overrides, so scaling the param-group lr would silently do nothing. "
                "Use --actor.optim adam."
            )
    elif any(getattr(args.algo, name) != DEFAULTS[f"algo.{name}"] for name in ESS_LR_SETTINGS):
        raise ConfigError(
            "--algo.ess_lr_floor/--algo.ess_lr_weight/--algo.ess_lr_rule are set but --algo.ess_lr_enable is not: "
            "add --algo.ess_lr_enable, or drop them."
        )
    _validate_stale(args)
    _validate_off_policy(args, notices)
    _validate_sampling_mask(args, notices)
    _validate_auto_resume(args)
    if not on_cpu:
        _validate_gpu_path(args)
    return notices


def _check_cpu_kv_cache(args: types.SimpleNamespace) -> None:
    """--vllm.cpu_kv_cache_gb as resolved (the flag, else vLLM CPU's variable, else the default) must be > 0."""
    env = os.environ.get(KV_CACHE_ENV, "")
    if args.vllm.cpu_kv_cache_gb <= 0:  # NaN: pre-flight names it (flags._check_floats)
        where = "--vllm.cpu_kv_cache_gb" if not env else f"--vllm.cpu_kv_cache_gb (or {KV_CACHE_ENV})"
        raise ConfigError(f"{where} must be > 0, got {args.vllm.cpu_kv_cache_gb:g}.")


TRAINER_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --ds.param_dtype -> torch's name


def _validate_gpu_path(args: types.SimpleNamespace) -> None:
    """Configurations that crash in the first minutes of a GPU run, refused before anything is placed. Each
    was read in upstream's and vLLM's GPU code; the CPU path takes other branches."""
    if args.ds.param_dtype == "fp32":
        # cpu_compat's fp32 patch returns before it on CUDA; upstream's convert_to_torch_dtype("fp32") raises
        # "Invalid param_dtype" in the actor, reference and critic ranks.
        raise ConfigError(
            "--ds.param_dtype fp32 on GPU: upstream's DeepSpeed strategy accepts only bf16 and fp16 there (fp32 is "
            "our CPU-only patch), so every model rank would fail to start. Use --ds.param_dtype bf16; for an fp32 "
            "view of the policy, --vllm.fp32_lm_head (the engine's LM head) or --vllm.dtype float32 with "
            "--vllm.sync_backend reload."
        )
    trainer = TRAINER_DTYPES.get(args.ds.param_dtype, args.ds.param_dtype)
    if args.vllm.num_engines and args.vllm.dtype != trainer and args.vllm.sync_backend != RELOAD_BACKEND:
        # upstream's broadcast sends dtype=param.dtype; vLLM's receiving worker asserts it equals the engine's.
        raise ConfigError(
            f"--vllm.dtype {args.vllm.dtype} with a {trainer} trainer (--ds.param_dtype {args.ds.param_dtype}) and "
            f"--vllm.sync_backend {args.vllm.sync_backend}: upstream's weight broadcast sends the trainer's "
            f"{trainer} tensors and vLLM's worker asserts they have the engine's dtype, so the first weight sync "
            "crashes. Use --vllm.sync_backend reload (it casts as the engine loads; host memory about 3x the model, "
            f"docs/gpu_path.md), or --vllm.dtype {trainer} (with --vllm.fp32_lm_head for an fp32 LM head)."
        )
    if args.ds.tensor_parallel_size > 1:
        # every trainer-side pass over the weights gathers ZeRO-3 partitions only; under DeepSpeed TP rank 0 would
        # checksum, snapshot or ship its own shard (upstream gathers with GatheredReplacedLayerParams).
        users = []
        if args.vllm.num_engines and args.vllm.sync_check_tol > 0:
            users.append(f"the weight sync check (--vllm.sync_check_tol {args.vllm.sync_check_tol})")
        if args.algo.prox_mode in ("snapshot", "dedicated"):
            users.append(f"--algo.prox_mode {args.algo.prox_mode}")
        if args.algo.prox_audit_dir:
            users.append("--algo.prox_audit_dir")
        if users:
            raise ConfigError(
                f"--ds.tensor_parallel_size {args.ds.tensor_parallel_size} with {', '.join(users)}: these read the "
                "whole weights on the trainer, which we gather under ZeRO-3 only; under DeepSpeed tensor "
                "parallelism each rank holds a shard, so the check would compare a shard with the engine's tensor "
                "and stop the run at the first sync (or store shards). Use --ds.tensor_parallel_size 1 (ZeRO-3 "
                "shards a 70B model without it), or drop them (--vllm.sync_check_tol 0, --algo.prox_mode "
                "recompute/interrupt)."
            )
    if args.ds.ring_attn_size > 1:
        # upstream swaps HF attention for ring flash-attention in the trainer's processes; its kernel reads state
        # only Actor.forward sets and asserts batch size 1. The canaries and interrupt scoring call the HF model.
        users = []
        if args.vllm.num_engines and args.selfcheck == "on":
            users.append("the start-up self-check's canary (--selfcheck on)")
        if args.vllm.num_engines and args.vllm.sync_check_tol > 0:
            users.append(f"the weight sync check's canary (--vllm.sync_check_tol {args.vllm.sync_check_tol})")
        if args.algo.prox_mode == "interrupt":
            users.append("--algo.prox_mode interrupt")
        if users:
            raise ConfigError(
                f"--ds.ring_attn_size {args.ds.ring_attn_size} with {', '.join(users)}: ring attention replaces the "
                "model's attention in the trainer's processes with a kernel that needs the packed batch upstream's "
                "Actor.forward prepares (batch size 1), and these score batches through the model directly, so they "
                "would fail. Drop them (--selfcheck off, --vllm.sync_check_tol 0, --algo.prox_mode snapshot) or "
                "use --ds.ring_attn_size 1."
            )


def _validate_opob(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--algo.vcpo_enable / --algo.advantage.baseline opob (trainer/opob.py): what the baseline needs."""
    from openrlhf_ess.models.opob import OPOB_ESTIMATORS

    algo = args.algo
    applied = getattr(algo, "vcpo_applied", ())
    if algo.advantage.opob_weight != DEFAULTS["algo.advantage.opob_weight"] and not resolve.opob_on(args):
        raise ConfigError(
            f"--algo.advantage.opob_weight {algo.advantage.opob_weight} chooses the weights of the optimal baseline: "
            "add --algo.advantage.baseline opob, or drop the flag."
        )
    if algo.advantage.opob_norm != DEFAULTS["algo.advantage.opob_norm"] and not resolve.opob_on(args):
        raise ConfigError(
            f"--algo.advantage.opob_norm {algo.advantage.opob_norm} chooses the gradient norm of the optimal "
            "baseline: add --algo.advantage.baseline opob, or drop the flag."
        )
    tokens = algo.advantage.opob_pass_tokens
    if tokens < 0:
        raise ConfigError(f"--algo.advantage.opob_pass_tokens must be >= 0 (0: the default), got {tokens}.")
    if tokens and not (resolve.opob_on(args) and algo.advantage.opob_norm == "full"):
        raise ConfigError(
            f"--algo.advantage.opob_pass_tokens {tokens} sizes the passes of the whole-model norm: add "
            "--algo.advantage.opob_norm full (with --algo.advantage.baseline opob), or drop the flag."
        )
    if not resolve.opob_on(args):
        return
    # the flag the user passed: --algo.vcpo_enable where its recipe turned the baseline on
    flag = "--algo.vcpo_enable" if "algo.advantage.baseline" in applied else "--algo.advantage.baseline opob"
    drop = "--algo.advantage.baseline estimator" if flag == "--algo.vcpo_enable" else "drop it"
    estimator = algo.advantage.estimator
    if estimator not in OPOB_ESTIMATORS:
        raise ConfigError(
            f"{flag} replaces the prompt group's baseline of a critic-free estimator, but "
            f"--algo.advantage.estimator is {estimator}: use one of {', '.join(OPOB_ESTIMATORS)}, or {drop}."
        )
    if estimator == "reinforce_baseline" and algo.advantage.gamma != 1.0:
        raise ConfigError(
            f"{flag} with reinforce_baseline needs --algo.advantage.gamma 1 (upstream forces 1 for this estimator), "
            f"got {algo.advantage.gamma}."
        )
    if algo.advantage.opob_weight != DEFAULTS["algo.advantage.opob_weight"] and not args.vllm.num_engines:
        raise ConfigError(
            f"--algo.advantage.opob_weight {algo.advantage.opob_weight} weighs by pi_prox/mu: it needs the rollout "
            "log-probs (mu) of vLLM engines, --vllm.num_engines >= 1."
        )
    if algo.advantage.opob_weight == "seq_product_truncated" and algo.tis_cap is None:
        raise ConfigError(
            "--algo.advantage.opob_weight seq_product_truncated truncates at --algo.tis_cap: add --algo.tis_cap C, "
            "or use seq_product (untruncated)."
        )
    if resolve.sampling_mask_on(args):
        raise ConfigError(
            f"{flag} with --algo.sampling_mask keep: the optimal baseline's norms are computed over the full "
            f"vocabulary, not the kept support. Drop --algo.sampling_mask keep, or {drop}."
        )
    if args.ds.packing_samples or args.ds.ring_attn_size > 1 or args.ds.tensor_parallel_size > 1:
        raise ConfigError(
            f"{flag}: the optimal baseline reads each sample's LM-head inputs and logits whole; "
            "--ds.packing_samples, --ds.ring_attn_size > 1 and --ds.tensor_parallel_size > 1 split or pack them. "
            "Drop those flags."
        )
    lora_rank = getattr(getattr(args.ds, "lora", None), "rank", 0) or 0
    if algo.advantage.opob_norm == "full" and lora_rank > 0:
        via = " (set by --algo.vcpo_enable)" if "algo.advantage.opob_norm" in applied else ""
        raise ConfigError(
            f"--algo.advantage.opob_norm full{via} with --ds.lora.rank {lora_rank}: the whole-model norm pass takes "
            "the gradient down to the input embedding's output, which LoRA freezes, and covers the base model's "
            "modules, not the adapters. Pass --algo.advantage.opob_norm head (the LM head's norm, from the forward "
            "alone), or drop --ds.lora.rank."
        )
    if args.reward.overlong_buffer_len is not None or args.reward.stop_properly_penalty_coef is not None:
        raise ConfigError(
            f"{flag} with a length penalty (--reward.overlong_buffer_len / --reward.stop_properly_penalty_coef): "
            f"the optimal baseline does not support one yet; drop the penalty, or {drop}."
        )


def _validate_off_policy(args: types.SimpleNamespace, notices: List[str]) -> None:
    """TIS, version lag and k2 KL rules; token-level TIS becomes upstream's IS-correction flags (resolve)."""
    algo = args.algo
    upstream_is = algo.advantage.is_correction_level != "off"
    resolve.default_tis_cap(args, notices)
    if algo.tis_cap is not None:
        if not algo.tis_cap > 0:
            raise ConfigError(f"--algo.tis_cap must be > 0 (typically 2), got {algo.tis_cap}.")
        if upstream_is:
            raise ConfigError(
                "--algo.tis_cap and --algo.advantage.is_correction_level both set an IS correction on the same "
                "ratio pi_prox/mu: use --algo.tis_cap (clamp) or upstream's --algo.advantage.is_correction_* "
                "(e.g. mask mode), not both."
            )
        if args.actor.policy_loss_type != "ppo":
            raise ConfigError(
                f"--algo.tis_cap with --actor.policy_loss_type {args.actor.policy_loss_type}: GSPO's ratio is "
                "already taken against mu; use --actor.policy_loss_type ppo."
            )
    elif algo.tis_level != DEFAULTS["algo.tis_level"]:
        raise ConfigError("--algo.tis_level is set but --algo.tis_cap is not: add --algo.tis_cap C (e.g. 2).")
    if algo.max_version_lag is not None and algo.max_version_lag < 0:
        raise ConfigError(f"--algo.max_version_lag must be >= 0, got {algo.max_version_lag}.")
    if algo.max_version_lag == 0 and args.train.async_enable:
        # Found only after step 1 otherwise: the batch of step 2 was generated while step 1 trained, so every
        # token is one sync old and the experience maker stops the run (an update over zero tokens).
        raise ConfigError(
            "--algo.max_version_lag 0 with --train.async_enable: the async generator samples each batch while the "
            "trainer still trains the one before, so from step 2 on every token is at least 1 weight sync old and "
            "all would be masked (the run would stop after step 1). Use --algo.max_version_lag 1 or more with "
            "async training, or drop --train.async_enable for fully on-policy steps."
        )
    if algo.kl.off_policy_k2_enable:
        if not algo.kl.use_loss or algo.kl.init_coef <= 0:
            raise ConfigError(
                "--algo.kl.off_policy_k2_enable shapes the gradient of the KL *loss*: add --algo.kl.use_loss and "
                "a positive --algo.kl.init_coef."
            )
        if algo.kl.unbiased_gradient:
            raise ConfigError(
                "--algo.kl.off_policy_k2_enable and --algo.kl.unbiased_gradient both replace the KL gradient: "
                "keep one (ours adds the min(pi_prox/mu, C) discrepancy term to upstream's pi_theta/pi_old weight)."
            )
    _validate_prox(args, notices)
    _validate_m2po(args, notices)
    if resolve.needs_rollout_logprobs(args) and not args.vllm.num_engines:
        raise ConfigError(
            f"rollout log-probs (mu) come from vLLM engines: {', '.join(resolve.mu_consumers(args))} need "
            "--vllm.num_engines >= 1."
        )
    if resolve.needs_rollout_logprobs(args) and not upstream_is and algo.tis_cap is None:
        notices.append("vLLM engines will return sampled-token log-probs (mu), as the enabled features need them.")


def _validate_m2po(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--algo.m2po_tau / --algo.m2po_style (trainer/m2po.py): the mask is computed by the experience maker from
    log pi_old - log mu, which is log pi_theta/mu at the step only when pi_old is the current weights' (recompute)
    and the batch takes one optimizer step; the loss replaces PPO's and the IS corrections on the same ratio."""
    algo = args.algo
    if not resolve.m2po_on(args):
        if algo.m2po_style != DEFAULTS["algo.m2po_style"]:
            raise ConfigError(
                f"--algo.m2po_style {algo.m2po_style} is set but --algo.m2po_tau is not: add --algo.m2po_tau 0.04 "
                "(the paper's budget), or drop the flag."
            )
        return
    tau = algo.m2po_tau
    if not tau > 0 or tau == float("inf"):  # NaN fails too
        raise ConfigError(
            f"--algo.m2po_tau must be a finite budget > 0 on the mean (log pi_theta/mu)^2 of the trust-region tokens "
            f"(the paper uses 0.04 in every run), got {tau}."
        )
    flag = f"--algo.m2po_tau {tau:g}"
    if algo.vcpo_enable:
        raise ConfigError(
            f"{flag} with --algo.vcpo_enable: VCPO's recipe weights the loss by its truncated trajectory ratio, M2PO "
            "replaces the loss with its own on pi_theta/mu. Use one of them."
        )
    if algo.tis_cap is not None or algo.advantage.is_correction_level != "off":
        raise ConfigError(
            f"{flag} with --algo.tis_cap / --algo.advantage.is_correction_level: M2PO's loss already takes the whole "
            "ratio to the behaviour policy pi_theta/mu, so an IS weight pi_prox/mu would apply twice. Drop the IS "
            "correction."
        )
    if args.actor.policy_loss_type != "ppo":
        raise ConfigError(
            f"{flag} with --actor.policy_loss_type {args.actor.policy_loss_type}: M2PO's loss is per token; use "
            "--actor.policy_loss_type ppo."
        )
    if args.actor.dual_clip is not None:
        raise ConfigError(
            f"{flag} with --actor.dual_clip: M2PO's loss replaces PPO's clip (the mask, or the code style's adaptive "
            "clip) and has no dual clip. Drop --actor.dual_clip."
        )
    if algo.prox_mode != DEFAULTS["algo.prox_mode"]:
        raise ConfigError(
            f"{flag} with --algo.prox_mode {algo.prox_mode}: the mask is computed from log pi_old - log mu, which is "
            "log pi_theta/mu at the optimizer step only when pi_old is recomputed with the current weights. Use "
            "--algo.prox_mode recompute."
        )
    samples = args.rollout.batch_size * args.rollout.n_samples_per_prompt
    if args.train.max_epochs != 1 or args.train.batch_size != samples:
        raise ConfigError(
            f"{flag} with --train.batch_size {args.train.batch_size} and --train.max_epochs {args.train.max_epochs}: "
            "the mask is taken over the whole optimizer batch, once, before its step, so it needs one optimizer step "
            f"per rollout batch. Set --train.batch_size {samples} (--rollout.batch_size x "
            "--rollout.n_samples_per_prompt) and --train.max_epochs 1."
        )
    notices.append(
        f"{flag} (--algo.m2po_style {algo.m2po_style}): the policy loss is M2PO's on the ratio pi_theta/mu "
        + (
            "with the batch's mask and no eps-clip"
            if algo.m2po_style == "paper"
            else "clipped to the batch's adaptive bound"
        )
        + "; --actor.eps_clip_low_high is not used."
    )


def _validate_prox(args: types.SimpleNamespace, notices: List[str]) -> None:
    algo = args.algo
    mode = algo.prox_mode
    if algo.prox_score_memory_mb <= 0:
        raise ConfigError(f"--algo.prox_score_memory_mb must be > 0 (MB), got {algo.prox_score_memory_mb}.")
    if mode != "ewma" and (
        algo.prox_ewma_style != DEFAULTS["algo.prox_ewma_style"] or algo.prox_ewma_ref_batch is not None
    ):
        raise ConfigError(
            f"--algo.prox_ewma_style/--algo.prox_ewma_ref_batch are set but --algo.prox_mode is {mode}: they only "
            "apply to --algo.prox_mode ewma; drop them."
        )
    if algo.prox_ewma_ref_batch is not None:
        if algo.prox_ewma_ref_batch < 1:
            raise ConfigError(f"--algo.prox_ewma_ref_batch must be >= 1 sample, got {algo.prox_ewma_ref_batch}.")
        if algo.prox_ewma_decay == EWMA_DECAY_AUTO:
            raise ConfigError(
                "--algo.prox_ewma_ref_batch rescales a fixed --algo.prox_ewma_decay; with auto the decay comes from "
                "the observed lag each step. Drop one of them."
            )
    if mode == DEFAULTS["algo.prox_mode"]:
        if any(
            getattr(algo, name) != DEFAULTS[f"algo.{name}"]
            for name in ("prox_snapshots", "prox_missing", "prox_ewma_decay")
        ):
            raise ConfigError(
                "--algo.prox_snapshots/--algo.prox_missing/--algo.prox_ewma_decay are set but --algo.prox_mode is "
                "recompute: choose --algo.prox_mode snapshot or ewma, or drop them."
            )
        return
    for name, owner in (
        ("prox_snapshots", "snapshot"),
        ("prox_ewma_decay", "ewma"),
        ("prox_dedicated_num_gpus", "dedicated"),
    ):
        if getattr(algo, name) != DEFAULTS[f"algo.{name}"] and mode != owner:
            raise ConfigError(
                f"--algo.{name} is set but --algo.prox_mode is {mode}: it only applies to {owner}; drop it."
            )
    if mode in SCORE_AT_SYNC_MODES:
        _validate_score_at_sync(args)
    if mode in WEIGHT_SWAP_MODES and args.ds.zero_stage == 3 and args.ds.zpg > 1:
        raise ConfigError(
            f"--algo.prox_mode {mode} under ZeRO-3 swaps each rank's weight partition, but ZeRO++ hpZ "
            f"(--ds.zpg {args.ds.zpg}) gathers from a second copy: drop --ds.zpg, or use --algo.prox_mode dedicated."
        )
    if mode in WEIGHT_SWAP_MODES and args.ds.tensor_parallel_size > 1:
        raise ConfigError(f"--algo.prox_mode {mode} needs full weights per rank: drop --ds.tensor_parallel_size.")
    if mode == BYPASS_PROX_MODE:
        _validate_bypass(args, notices)
    if mode == "snapshot":
        needed = resolve.max_lag_possible(args) + 1
        if algo.max_version_lag is not None:
            needed = min(needed, algo.max_version_lag + 1)
        if algo.prox_snapshots < needed:
            source = (
                f"--train.stale_k {resolve.stale_k(args)}"
                if not args.train.async_enable
                else f"--train.async_queue_size {args.train.async_queue_size}"
                f"{' and partial rollouts' if args.train.partial_rollout_enable else ''}"
            )
            raise ConfigError(
                f"--algo.prox_snapshots {algo.prox_snapshots} is smaller than the {needed} versions a token can lag "
                f"behind with {source}: tokens would lose their weights. Set --algo.prox_snapshots {needed} (or "
                "bound --algo.max_version_lag)."
            )
    if mode == "ewma" and algo.prox_ewma_decay != EWMA_DECAY_AUTO and not 0 < algo.prox_ewma_decay < 1:
        raise ConfigError(f"--algo.prox_ewma_decay must be in (0, 1) or auto, got {algo.prox_ewma_decay}.")


def _validate_score_at_sync(args: types.SimpleNamespace) -> None:
    mode = args.algo.prox_mode
    if not args.train.async_enable:
        raise ConfigError(
            f"--algo.prox_mode {mode} scores the outgoing version's tokens at each weight sync, which only matters "
            "when rollouts outlive a sync: add --train.async_enable (and --train.partial_rollout_enable), or keep "
            "--algo.prox_mode recompute (exact in synchronous training)."
        )
    if mode == "interrupt" and not args.train.partial_rollout_enable:
        raise ConfigError(
            "--algo.prox_mode interrupt pauses partial rollouts at each weight sync to score their prefixes: add "
            "--train.partial_rollout_enable, or use --algo.prox_mode snapshot or dedicated for async training "
            "without partial rollouts."
        )
    if args.train.agent_func_path:
        raise ConfigError(
            f"--algo.prox_mode {mode} matches engine token streams to samples for single-turn rollouts only; "
            "with --train.agent_func_path use --algo.prox_mode snapshot."
        )
    if mode == "dedicated" and args.algo.prox_dedicated_num_gpus <= 0:
        raise ConfigError(
            f"--algo.prox_dedicated_num_gpus must be > 0 (the old-log-prob model needs a device), "
            f"got {args.algo.prox_dedicated_num_gpus}."
        )
    if mode == "dedicated" and args.algo.prox_dedicated_num_gpus > 1:
        # The old-log-prob model is one HF copy on one device (trainer/ray/prox_scorer.py): a second GPU would
        # be reserved and sit idle while the copy still has to fit the first one.
        raise ConfigError(
            f"--algo.prox_dedicated_num_gpus {args.algo.prox_dedicated_num_gpus}: the dedicated old-log-prob model "
            "runs on one GPU (it is not sharded), so more would be reserved and never used. Use 1 (or a fraction "
            "to share a GPU); for a model that does not fit one GPU use --algo.prox_mode interrupt (scored by the "
            "training ranks, ZeRO-sharded) or snapshot."
        )


def _validate_bypass(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--algo.prox_mode bypass: π_prox = μ. Rejects what makes μ something other than the policy the trainer
    models (truncated sampling) or leaves nothing to bypass with; says which corrections become identities."""
    algo = args.algo
    if not args.vllm.num_engines:
        raise ConfigError(
            "--algo.prox_mode bypass uses the engines' sampled-token log-probs (mu) as pi_prox: it needs vLLM "
            "engines, set --vllm.num_engines >= 1 (or keep --algo.prox_mode recompute)."
        )
    if resolve.truncates_sampling(args) and not resolve.sampling_mask_on(args):
        # μ is then the truncated, renormalised distribution's log-prob (log π - log Z_t): in the PPO ratio
        # π_θ/μ that is a phantom ratio Z_t < 1 on every token, which the clip turns into lost gradient
        raise ConfigError(
            f"--algo.prox_mode bypass with --rollout.top_p {args.rollout.top_p} / --rollout.top_k "
            f"{args.rollout.top_k}: mu is then the log-prob of the truncated, renormalised distribution, not the "
            "policy the trainer models, and the PPO ratio pi_theta/mu would start at the kept mass (< 1) on every "
            "token. Add --algo.sampling_mask keep (the trainer then models the truncated policy), or use "
            "--rollout.top_p 1 --rollout.top_k -1, or --algo.prox_mode recompute."
        )
    if algo.prox_missing != DEFAULTS["algo.prox_missing"]:
        raise ConfigError(
            "--algo.prox_missing applies to the exact modes (snapshot, interrupt, dedicated); with "
            "--algo.prox_mode bypass every token's pi_prox is its own mu (a sample without a finite mu follows "
            "--algo.nonfinite_logprobs): drop it."
        )
    if args.vllm.dtype != "float32":
        notices.append(
            f"--algo.prox_mode bypass with --vllm.dtype {args.vllm.dtype}: mu differs from the trainer's log-probs "
            "by the engine's kernel error (~0.01-0.1 nats per token in bf16), which now sits inside the PPO ratio "
            "pi_theta/mu with no TIS weight to correct it. --vllm.dtype float32 makes mu match to ~1e-5."
        )
    if algo.tis_cap is not None or algo.advantage.is_correction_level != "off":
        notices.append(
            "--algo.prox_mode bypass: the TIS / IS-correction weight min(pi_prox/mu, C) is exactly 1 (pi_prox = mu), "
            "so --algo.tis_cap / --algo.advantage.is_correction_* change nothing (tis/* metrics report weight 1); "
            "the engine mismatch is inside the clipped ratio pi_theta/mu instead."
        )
    if algo.ess_lr_enable:
        notices.append(
            "--algo.prox_mode bypass with --algo.ess_lr_enable: every w_i = exp(mean(log pi_prox - log mu)) = 1, "
            "so rho_ess = 1 and the LR scale is 1 (the flag changes nothing in this mode)."
        )


def _validate_routing_replay(args: types.SimpleNamespace) -> None:
    """--algo.routing_replay (docs/routing_replay.md); the model family is checked in pre-flight."""
    if not resolve.routing_replay_on(args):
        return
    flag = "--algo.routing_replay"
    if not args.vllm.num_engines:
        raise ConfigError(f"{flag} replays the expert ids the vLLM engines chose: it needs --vllm.num_engines >= 1.")
    if args.ds.ring_attn_size > 1:
        raise ConfigError(
            f"{flag} with --ds.ring_attn_size {args.ds.ring_attn_size}: the routes are packed like the tokens "
            "(--ds.packing_samples works) but not sliced across ring-attention ranks yet. Use --ds.ring_attn_size 1, "
            "or drop --algo.routing_replay."
        )


def _validate_sampling_mask(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--rollout.top_k and --algo.sampling_mask keep (docs/sampling_mask.md)."""
    top_k = args.rollout.top_k
    if top_k == 0 or top_k < -1:
        raise ConfigError(f"--rollout.top_k must be -1 (off) or >= 1, got {top_k}.")
    if not resolve.sampling_mask_on(args):
        return
    if args.ds.ring_attn_size > 1:
        raise ConfigError(
            f"--algo.sampling_mask keep with --ds.ring_attn_size {args.ds.ring_attn_size}: the per-token kept "
            "counts are not sliced across ring-attention ranks yet. Use --ds.ring_attn_size 1, or drop the flag."
        )
    if not resolve.truncates_sampling(args):
        notices.append(
            "--algo.sampling_mask keep with --rollout.top_p 1 and --rollout.top_k -1: sampling is not truncated, so "
            "the mask only takes out the first response token's EOS ban (upstream samples it with min_tokens=1); "
            "every other token's support is the whole vocabulary."
        )


def _validate_replacement(args: types.SimpleNamespace) -> None:
    """--vllm.max_restarts (trainer/ray/engine_keeper.py): what engine replacement is built and tested for."""
    n = args.vllm.max_restarts
    if n < 0:
        raise ConfigError(f"--vllm.max_restarts must be >= 0 (0 = a dead engine stops the run), got {n}.")
    if n == 0:
        return
    if not args.vllm.num_engines:
        raise ConfigError("--vllm.max_restarts replaces vLLM engines: it needs --vllm.num_engines >= 1.")
    why = None
    if args.vllm.sync_backend != RELOAD_BACKEND and getattr(args.vllm, "sync_with_ray", False):
        why = (
            "--vllm.sync_with_ray makes the weight sync group a Ray collective group under upstream's one fixed "
            "name, which cannot be formed again with a restarted engine in it. Drop --vllm.sync_with_ray (the "
            "group is then formed again, on a new port, after a restart)"
        )
    elif args.algo.prox_mode in SCORE_AT_SYNC_MODES:
        why = (
            f"--algo.prox_mode {args.algo.prox_mode} scores the engines' in-flight streams at each sync, and a dead "
            "engine's streams die with it while their scores would wait for samples that never come back. Use "
            "--algo.prox_mode snapshot (exact as well, kept on the trainer)"
        )
    elif getattr(args.vllm, "enable_sleep", False):
        why = "a restarted engine starts awake, outside upstream's sleep/wake cycle. Drop --vllm.enable_sleep"
    elif getattr(getattr(args, "train", None), "colocate_all", False):
        why = (
            "--train.colocate_all puts the engines on the trainer's GPUs, and a restarted engine starts while the "
            "trainer's memory is still there: vLLM refuses to start below --vllm.gpu_memory_utilization of the "
            "GPU free. Drop --train.colocate_all (engines on GPUs of their own)"
        )
    elif args.vllm.sync_backend != RELOAD_BACKEND and not getattr(args.vllm, "watchdog_s", 1):
        why = (
            f"with --vllm.sync_backend {args.vllm.sync_backend} an engine that dies during a broadcast leaves the "
            "other members waiting in the collective, and --vllm.watchdog_s 0 turns off the bound that ends that "
            "wait (the run would hang). Give --vllm.watchdog_s seconds (default 600)"
        )
    elif resolve.stale_k(args) > 0:
        why = (
            f"--train.stale_k {resolve.stale_k(args)} sends the engines weights K versions older than the trainer's, "
            "and a replaced engine reloads the last sync's weights under the trainer's version, so its tokens would "
            "carry the wrong version. Drop --train.stale_k for a run with replacement"
        )
    elif args.vllm.sync_check_tol <= 0:
        why = (
            "a replaced engine's samples are trained only after the weight sync check (checksums and canary) passed "
            "on it, and --vllm.sync_check_tol 0 turns that check off. Leave --vllm.sync_check_tol at its default"
        )
    if why:
        raise ConfigError(f"--vllm.max_restarts {n}: {why}, or --vllm.max_restarts 0 (a dead engine stops the run).")


def _validate_stale(args: types.SimpleNamespace) -> None:
    """--train.stale_k K (trainer/stale_lag.py): synchronous training, the engines holding weights K versions back."""
    k = resolve.stale_k(args)
    if k < 0:
        raise ConfigError(f"--train.stale_k must be >= 0 (0 = off), got {k}.")
    if k == 0:
        return
    if args.train.async_enable:
        raise ConfigError(
            f"--train.stale_k {k} sets every token's lag exactly in synchronous training; --train.async_enable would "
            "add the queue's own lag on top. Drop --train.async_enable (or drop --train.stale_k to measure the "
            "queue's lag as it comes)."
        )
    if not args.vllm.num_engines:
        raise ConfigError(f"--train.stale_k {k} holds the vLLM engines' weights back: set --vllm.num_engines >= 1.")
    if args.algo.prox_mode in SCORE_AT_SYNC_MODES:
        raise ConfigError(
            f"--train.stale_k {k} with --algo.prox_mode {args.algo.prox_mode}: that mode scores the tokens of the "
            "version the trainer leaves at each sync, while here the engines hold one K versions older. Use "
            f"--algo.prox_mode snapshot with --algo.prox_snapshots {k + 1} (the same exact pi_prox, from the copies "
            "this lag keeps anyway)."
        )
    if args.ckpt.load_enable or args.train.auto_resume > 0:
        raise ConfigError(
            f"--train.stale_k {k} cannot resume from a checkpoint yet: the engines' K older versions are not saved "
            "with it, so a resumed run would sample from other weights than the lag says. Drop "
            "--ckpt.load_enable / --train.auto_resume, or run without --train.stale_k."
        )


def _validate_auto_resume(args: types.SimpleNamespace) -> None:
    """--train.auto_resume N (cli/auto_resume.py) restarts from the newest complete checkpoint: the run must write
    checkpoints, with DeepSpeed's files (what the resume loads)."""
    n = args.train.auto_resume
    if n < 0:
        raise ConfigError(
            f"--train.auto_resume must be >= 0 (0 = off: a death during training stops the run), got {n}."
        )
    if n == 0:
        return
    if not 0 < args.ckpt.save_steps < float("inf"):
        raise ConfigError(
            f"--train.auto_resume {n} restarts the run from its newest complete checkpoint, but --ckpt.save_steps "
            f"{args.ckpt.save_steps} writes none: add --ckpt.save_steps K (a checkpoint every K steps; a restart "
            "repeats at most the K steps since the last one), or drop --train.auto_resume."
        )
    if args.ckpt.disable_ds:
        raise ConfigError(
            f"--train.auto_resume {n} with --ckpt.disable_ds: the step checkpoints then hold no DeepSpeed state, so "
            "there is nothing to resume from. Drop --ckpt.disable_ds, or drop --train.auto_resume."
        )
