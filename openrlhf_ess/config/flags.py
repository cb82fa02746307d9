"""Our flags as declared: the ``--help`` groups, each flag's type, choices, default and short help, and the named
values the rest of the package compares against (mode families, :data:`DEFAULTS`, :data:`VCPO_RECIPE`).

Flags follow upstream's dotted groups. Each help says what the flag does and its default, and points to the doc
page with the long explanation; what a flag changes in other flags is in :mod:`.resolve`, which combinations are
refused in :mod:`.validation`.
"""

from __future__ import annotations

import argparse
from typing import Optional

from openrlhf_ess import upstream

RELOAD_BACKEND = "reload"
# --reward.timeout_s default: upstream's own bound on an HTTP reward request (aiohttp total timeout, utils/agent.py)
REWARD_TIMEOUT_S = 180.0
# --vllm.cpu_kv_cache_gb: vLLM CPU's own variable, read when the flag is not given; else this many GiB
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_KV_CACHE_GB = 1.0

# --vllm.watchdog_s default: no legitimate silence of an engine with requests in flight (a weight sync pausing partial
# rollouts, a long prefill) comes near it on a GPU cluster; a hung engine costs at most this much of the allocation.
ENGINE_WATCHDOG_S = 600.0
# --vllm.restart_timeout_s default: 3x the slowest first start of the run's engines, at least 300 s
# (trainer/ray/engine_watchdog.py::restart_deadline)
RESTART_TIMEOUT_AUTO = "auto"

OPOB_WEIGHTS = ("tis", "seq_product", "seq_product_truncated")
OPOB_NORMS = ("head", "full")
PROX_MODES = ("recompute", "snapshot", "interrupt", "dedicated", "ewma", "loglinear", "bypass")
# π_prox = μ, the engine's log-prob of each sampled token: upstream's old-log-prob forward is skipped.
BYPASS_PROX_MODE = "bypass"
# Modes that score the outgoing version's tokens at each weight sync (the engines report their streams).
SCORE_AT_SYNC_MODES = ("interrupt", "dedicated")
# Modes whose π_prox is each token's own version's weights (a stale token without them is masked or stops).
EXACT_PROX_MODES = ("snapshot",) + SCORE_AT_SYNC_MODES
# Modes that score by swapping stored weights into the actor (ZeRO-3: each rank's partition).
WEIGHT_SWAP_MODES = ("snapshot", "ewma", "interrupt")
EWMA_DECAY_AUTO = "auto"
SAMPLING_MASK_MODES = ("off", "keep")

# The declared defaults that checks and predicates compare against (a flag "is set" when it differs from its
# default): the add_argument calls below read them from here, so a default is written once.
DEFAULTS = {
    "algo.ess_lr_floor": 0.1,
    "algo.ess_lr_weight": "geo_mean",
    "algo.ess_lr_rule": "sqrt",
    "algo.advantage.opob_weight": "tis",
    "algo.advantage.opob_norm": "head",
    "algo.advantage.opob_pass_tokens": 0,
    "algo.tis_level": "token",
    "algo.prox_mode": "recompute",
    "algo.prox_dedicated_num_gpus": 1.0,
    "algo.prox_snapshots": 4,
    "algo.prox_missing": "mask",
    "algo.prox_ewma_decay": 0.9,
    "algo.prox_ewma_style": "hilton",
    "algo.sampling_mask": "off",
    "algo.m2po_style": "paper",
    "rollout.top_k": -1,
    "reward.failure_policy": "off",
    "train.stale_k": 0,
}

# --algo.vcpo_enable: VCPO as its reference code trains (recipe/fully_async_policy/shell/vcpo/math/vcpo_k=10.sh of
# mit-han-lab/vcpo); each setting applies only where the user did not pass the flag (docs/opob.md has the table).
# Applied by resolve.apply_vcpo_recipe; declared here because the flag's help lists it.
VCPO_RECIPE = (
    ("algo.ess_lr_enable", True),  # ess_scaling.enable
    ("algo.ess_lr_weight", "seq_product"),  # ess_scaling.use_clipped=False: the untruncated product
    ("algo.ess_lr_floor", 1e-3),  # no floor there; rho >= 1/B, so 1e-3 binds only past B = 10^6
    ("algo.advantage.baseline", "opob"),  # grad_baselining.enable
    ("algo.advantage.opob_weight", "seq_product"),  # grad_baselining.use_clipped_is_ratios=False
    ("algo.advantage.opob_norm", "full"),  # ‖g_i‖ over every parameter (one backward per trajectory there)
    ("algo.advantage.estimator", "group_norm"),  # adv_estimator=grpo, grad_baselining.norm_by_std
    ("algo.tis_level", "seq_product"),  # rollout_is=sequence
    ("algo.tis_cap", 8.0),  # rollout_is_threshold=8.0
    ("actor.eps_clip_low_high", [1.0, 1e9]),  # clip_ratio_low=1.0, clip_ratio_high=1e9 (clip_ratio_c: no dual clip)
    ("actor.loss_agg_mode", "seq-mean-token-mean"),  # loss_agg_mode
    ("rollout.n_samples_per_prompt", 16),  # rollout.n
    ("train.max_epochs", 1),  # one pass: num_minibatches_per_update=1, updates_per_param_sync=1
    # its optimizer: Megatron's Adam (verl/utils/megatron/optimizer.py passes no betas, so OptimizerConfig's
    # adam_beta2=0.999; decoupled decay, eps 1e-8 as upstream's), weight_decay=0.1, lr_decay_style=constant,
    # lr_warmup_steps=0, and no KL (kl_coef=0, use_kl_loss=False): upstream then places no reference model
    ("actor.adam.betas", [0.9, 0.999]),
    ("actor.adam.weight_decay", 0.1),
    ("actor.lr_scheduler", "constant"),
    ("actor.lr_warmup_ratio", 0.0),
    ("algo.kl.init_coef", 0.0),
)


def shown(dest: str, value) -> str:
    """A flag as a user would type it: ``--dest value`` (``--dest`` alone for a switch)."""
    if value is True:
        return f"--{dest}"
    if isinstance(value, (list, tuple)):
        return f"--{dest} " + " ".join(f"{v:g}" for v in value)
    return f"--{dest} {value:g}" if isinstance(value, float) else f"--{dest} {value}"


def ewma_decay_arg(text: str):
    """``--algo.prox_ewma_decay``: a number, or ``auto`` (argparse names the flag in its error)."""
    if text == EWMA_DECAY_AUTO:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a decay in (0, 1) or '{EWMA_DECAY_AUTO}', got {text!r}") from None


def restart_timeout(text: str) -> Optional[float]:
    """--vllm.restart_timeout_s: 'auto' (None: a few times the engines' measured first start) or seconds > 0."""
    if str(text).strip().lower() == RESTART_TIMEOUT_AUTO:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or '{RESTART_TIMEOUT_AUTO}', got {text!r}")
    return value


def watchdog_seconds(text: str) -> float:
    """--vllm.watchdog_s: seconds >= 0 (0 = off)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0 = off), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add openrlhf-ess flags to upstream's parser, in their own ``--help`` groups."""
    upstream.extend_choices(parser, "ds.param_dtype", "fp32")
    for action in parser._actions:
        if action.dest == "vllm.sync_backend":
            action.help = (
                "DeepSpeed -> vLLM weight sync: nccl (upstream, GPU; default), gloo (upstream; rejected without "
                "CUDA) or reload (ours: one safetensors blob through Ray, loaded with vLLM's reload_weights; CPU and "
                "GPU, one host copy of the model per sync). Without CUDA nccl becomes reload. docs/flags.md."
            )
        elif action.dest == "ckpt.path":
            action.help = (
                "Step and best checkpoints. Not passed: <--ckpt.output_dir>/checkpoints_ppo_ray (ours; upstream's "
                "./ckpt/checkpoints_ppo_ray is relative to the working directory). A folder holding an earlier run's "
                "checkpoints is refused unless --ckpt.load_enable continues it. docs/running.md#where-outputs-go."
            )
        elif action.dest == "eval.steps":
            action.help = (
                "Evaluate --eval.dataset every N steps and after the final step (-1: never). An async eval is "
                "logged at the step whose weights it ran on. Each eval costs one generation pass over the eval set. "
                "docs/running.md#held-out-eval."
            )

    add_ess_lr_arguments(parser)
    add_opob_arguments(parser)
    add_off_policy_arguments(parser)
    add_prox_arguments(parser)
    add_sampling_mask_arguments(parser)
    add_routing_replay_arguments(parser)
    add_engine_arguments(parser)
    add_auto_resume_arguments(parser)
    add_stale_arguments(parser)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("openrlhf-ess: engine and machine")
    group.add_argument(
        "--vllm.dtype",
        type=str,
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the vLLM engines; default %(default)s, the one upstream hard-codes. float32 makes rollout "
        "log-probs match the trainer's to ~1e-5 on CPU, at twice the engine memory. docs/flags.md.",
    )
    group.add_argument(
        "--vllm.fp32_lm_head",
        action="store_true",
        help="The engines compute the LM head and its log-softmax in fp32 (vLLM's hf_overrides head_dtype=float32), "
        "taking the logits' bf16 rounding out of the mu/trainer mismatch; each engine worker must report it at "
        "start-up. Off by default; not with --vllm.dtype float32. Cost: docs/mismatch_sources.md.",
    )
    group.add_argument(
        "--vllm.cpu_kv_cache_gb",
        type=float,
        default=None,
        help=f"KV cache per vLLM engine without CUDA, in GiB. Default: {KV_CACHE_ENV} if set, else "
        f"{CPU_KV_CACHE_GB:g}; the engines start without that variable, which vLLM CPU would let override this flag. "
        "Ignored where CUDA exists. docs/flags.md.",
    )
    group.add_argument(
        "--vllm.sync_check_tol",
        type=float,
        default=0.5,
        help="After every weight sync, compare per-tensor checksums of trainer and engines, and a fixed 32-token "
        "canary's log-probs (see --vllm.sync_check_canary_every); stop the run on a checksum mismatch or a canary "
        "mean |difference| above this many nats. Default %(default)s; 0 disables both. docs/flags.md.",
    )
    group.add_argument(
        "--vllm.sync_check_rel_tol",
        type=float,
        default=None,
        help="The canary's second bound: its mean |difference| over the spread of the trainer's own canary log-probs "
        "(catches another LM head on a flat model, which the absolute bound misses). Default 0.1, or 1e-3 with "
        "--vllm.dtype float32 and --ds.param_dtype fp32; 0 disables it. docs/canary_faults.md.",
    )
    group.add_argument(
        "--vllm.sync_check_min_coverage",
        type=float,
        default=0.95,
        help="The per-tensor sync check fails, naming the tensors left out, when the engines' tensor names cover "
        "less than this fraction of the trainer's weight elements. Default %(default)s; 0 accepts any coverage. "
        "docs/flags.md.",
    )
    group.add_argument(
        "--vllm.sync_check_canary_every",
        type=int,
        default=50,
        help="Run the sync check's canary (a log-prob comparison through the engine) at the first sync and then "
        "every N syncs; the checksums run at every sync. Default %(default)s; 1 = every sync (one engine request "
        "each). docs/flags.md.",
    )
    group.add_argument(
        "--vllm.watchdog_s",
        type=watchdog_seconds,
        default=ENGINE_WATCHDOG_S,
        help="An engine with requests in flight that streams no token and finishes no request for this many seconds "
        "is hung: the run stops naming it (engine, pid, what it was doing). Default %(default)g, above a large "
        "model's weight sync (it pauses partial rollouts); 0 = off, a hung engine is then waited for forever. "
        "docs/faults.md.",
    )
    group.add_argument(
        "--vllm.max_restarts",
        type=int,
        default=0,
        help="Replace a dead or hung vLLM engine up to N times in the run (all engines together): Ray restarts it on "
        "its placement, it loads the last weight sync's weights and version and checks its canary against the "
        "trainer's before serving, its in-flight prompts are generated again from the start, and its samples are "
        "trained only after the sync check passed on it. Default 0 = upstream's fail fast. Sync and async "
        "training, any sync backend (with nccl/gloo the group is formed again at the next sync; a death during a "
        "broadcast stops the run); not the interrupt/dedicated π_prox modes nor --train.colocate_all; keeps up to two "
        "host copies of the model in Ray's object store (one between syncs). docs/faults.md.",
    )
    group.add_argument(
        "--vllm.restart_timeout_s",
        type=restart_timeout,
        default=RESTART_TIMEOUT_AUTO,
        help="With --vllm.max_restarts: the longest an engine may take from its death or kill to serving again; "
        "past it the run stops naming the engine, the cause and what it waited for (a lost node, a start that never "
        "ends). Default %(default)s: 3x the slowest first start of the run's engines, at least 300 s. docs/faults.md.",
    )
    group.add_argument(
        "--reward.failure_policy",
        type=str,
        default=DEFAULTS["reward.failure_policy"],
        choices=["off", "drop", "stop"],
        help="When the reward function fails for a sample (upstream leaves the reward None) or returns NaN/inf: "
        "drop = mask the sample out with reward 0 (metric reward_failed); stop = end the run naming the prompt; "
        "off = upstream's behaviour. Default %(default)s. docs/faults.md.",
    )
    group.add_argument(
        "--reward.timeout_s",
        type=float,
        default=REWARD_TIMEOUT_S,
        help="Bound in seconds on each call of a --reward.remote_url .py file's reward function; a call past it, or "
        "one raising SystemExit or another BaseException, is a failed reward (see --reward.failure_policy). "
        "Default %(default)g, upstream's HTTP bound; inf = no bound. docs/faults.md.",
    )
    group.add_argument(
        "--algo.nonfinite_logprobs",
        type=str,
        default="drop",
        choices=["drop", "stop"],
        help="A sample with NaN/inf log-probs on a response token, from the engine (mu) or the actor (pi_prox): "
        "drop = mask it out of the loss and count it; stop = end the run. Default %(default)s. Applies when our "
        "controllers run (any of our off-policy flags). docs/faults.md.",
    )
    group.add_argument(
        "--ray.address",
        type=str,
        default=None,
        help="Ray cluster to join (e.g. 'auto' under `ray job submit`). Default: the RAY_ADDRESS environment "
        "variable if set, else a private local Ray instance bound to 127.0.0.1.",
    )
    group.add_argument(
        "--ray.temp_dir",
        type=str,
        default=None,
        help="Temp/session folder of the local Ray instance this command starts (default: a fresh folder "
        "under /tmp, removed at exit).",
    )
    group.add_argument(
        "--ray.num_gpus",
        type=int,
        default=None,
        help="Logical GPUs the local Ray instance declares on a machine without CUDA, so upstream's GPU "
        "placement groups can be scheduled (default: what the flags ask for). Ignored with --ray.address.",
    )
    group.add_argument(
        "--selfcheck",
        choices=["on", "off"],
        default="on",
        help="Start-up self-checks after the models load, before the first rollout: placement, collectives, free GPU "
        "memory against our features' peak; a failure stops the run naming the fix. Default %(default)s; off skips "
        "them. docs/gpu_path.md#start-up-self-checks.",
    )
    group.add_argument(
        "--ray.accelerator",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="Whether actors and engines use CUDA. auto (default) asks the Ray cluster (an NVML probe on each GPU "
        "node), not the driver, so a CPU-only head node or `ray job submit` still runs a GPU cluster in GPU mode; "
        "cuda / cpu: skip the probe. The log's first line says why. docs/gpu_path.md.",
    )


def add_ess_lr_arguments(parser: argparse.ArgumentParser) -> None:
    from openrlhf_ess.models.corrections import ESS_RULES, ESS_WEIGHT_FORMS

    group = parser.add_argument_group(
        "openrlhf-ess: ESS-guided LR scaling (VCPO, arXiv 2602.17616)",
        "Once per rollout batch, over all actor ranks: w_i = exp(mean_t(log pi_prox - log mu)), "
        "rho = ESS/B = (sum w)^2 / (B sum w^2), and the actor LR of that rollout's optimizer steps is "
        "multiplied by clamp(sqrt(rho), floor, 1). The critic is never scaled. Needs rollout log-probs from "
        "vLLM (enabled automatically). Cost: one all-gather of 4 numbers per rollout.",
    )
    group.add_argument(
        "--algo.ess_lr_enable",
        action="store_true",
        default=False,
        help="Scale the actor LR by the rollout's effective sample size. Off by default: upstream behaviour, "
        "bit-exact. docs/ess_lr.md.",
    )
    group.add_argument(
        "--algo.ess_lr_floor",
        type=float,
        default=DEFAULTS["algo.ess_lr_floor"],
        help="Lower bound of the LR scale, in (0, 1]; default %(default)s. 1 disables the scaling in effect.",
    )
    group.add_argument(
        "--algo.ess_lr_weight",
        type=str,
        default=DEFAULTS["algo.ess_lr_weight"],
        choices=list(ESS_WEIGHT_FORMS),
        help="Trajectory weight: geo_mean (default) = exp(mean_t log ratio), the paper's, length-independent; "
        "seq_product = exp(sum_t log ratio), the VCPO reference code's (collapses ESS for long responses).",
    )
    group.add_argument(
        "--algo.ess_lr_rule",
        type=str,
        default=DEFAULTS["algo.ess_lr_rule"],
        choices=list(ESS_RULES),
        help="LR multiplier from rho = ESS/B: sqrt (VCPO; default) or linear (more aggressive).",
    )


def add_opob_arguments(parser: argparse.ArgumentParser) -> None:
    """VCPO's off-policy optimal baseline and the recipe flag (trainer/opob.py, models/opob.py)."""
    group = parser.add_argument_group(
        "openrlhf-ess: VCPO's off-policy optimal baseline (arXiv 2602.17616)",
        "Per prompt group: b* = sum w^2 |g|^2 R / sum w^2 |g|^2, with w_i the sequence IS weight "
        "exp(mean_t log pi_prox/mu) (truncated at --algo.tis_cap) and |g_i| the norm of the gradient of "
        "log pi(response i) at the current weights (--algo.advantage.opob_norm); metrics opob/*.",
    )
    group.add_argument(
        "--algo.advantage.baseline",
        type=str,
        default="estimator",
        choices=["estimator", "opob"],
        help="estimator (default): the baseline of --algo.advantage.estimator (upstream, bit-exact). opob: VCPO's "
        "off-policy optimal baseline, for reinforce_baseline, rloo, group_norm and dr_grpo. docs/opob.md.",
    )
    group.add_argument(
        "--algo.advantage.opob_weight",
        type=str,
        default=DEFAULTS["algo.advantage.opob_weight"],
        choices=list(OPOB_WEIGHTS),
        help="w_i in b*: tis (default) = the sequence weight the loss applies (1 without --algo.tis_cap); "
        "seq_product = exp(sum_t log pi_prox/mu), untruncated (VCPO's); seq_product_truncated = the same, "
        "truncated at --algo.tis_cap. docs/opob.md.",
    )
    group.add_argument(
        "--algo.advantage.opob_norm",
        type=str,
        default=DEFAULTS["algo.advantage.opob_norm"],
        choices=list(OPOB_NORMS),
        help="|g_i| in b*: head (default) = the LM head's, exact, from the make-experience forward (no backward); "
        "full = every parameter's, exact (VCPO's): the make-experience forward runs with autograd and one backward "
        "that writes no gradient; dense models (MoE, LoRA refused). docs/opob.md.",
    )
    group.add_argument(
        "--algo.advantage.opob_pass_tokens",
        type=int,
        default=DEFAULTS["algo.advantage.opob_pass_tokens"],
        help="full: the most tokens (rows x padded length) one norm pass takes from a rollout micro-batch (at least "
        "one row); 0 (default) = --train.micro_batch_size x --data.max_len, what a training micro-batch may hold. "
        "Larger: fewer passes (ZeRO-3 gathers each layer once per pass), more activation memory. docs/opob.md.",
    )
    group.add_argument(
        "--algo.vcpo_enable",
        action="store_true",
        default=False,
        help="VCPO as its reference recipe trains, with every setting below unless passed explicitly: "
        + "; ".join(shown(dest, value) for dest, value in VCPO_RECIPE)
        + "; --train.batch_size = --rollout.batch_size x n (one optimizer step per rollout batch). docs/opob.md.",
    )


def add_off_policy_arguments(parser: argparse.ArgumentParser) -> None:
    from openrlhf_ess.models.corrections import TIS_DEFAULT_CAP, TIS_LEVELS

    group = parser.add_argument_group(
        "openrlhf-ess: decoupled PPO, truncated IS, version lag, k2 KL",
        "Decoupled objective per response token: r = pi_theta/pi_prox is PPO-clipped (staleness) and the "
        "loss is weighted by the detached TIS weight min(pi_prox/mu, C) (train/inference discrepancy). "
        "mu comes from vLLM (enabled automatically); every token is tagged with the weight version that "
        "sampled it.",
    )
    group.add_argument(
        "--algo.tis_cap",
        type=float,
        default=None,
        help="Truncated importance sampling cap C: weight the loss by min(pi_prox/mu, C) (per token, or per "
        "sequence: --algo.tis_level). Typical C: 2. Off by default. Not with upstream's "
        "--algo.advantage.is_correction_* (one IS correction at a time). docs/off_policy.md.",
    )
    default_caps = " or ".join(f"{cap:g} at {level}" for level, cap in TIS_DEFAULT_CAP.items())
    group.add_argument(
        "--algo.tis_level",
        type=str,
        default=DEFAULTS["algo.tis_level"],
        choices=list(TIS_LEVELS),
        help="token (default): per-token ratio; seq: the sequence's geometric-mean ratio, applied to all its tokens; "
        f"seq_product: the trajectory's ratio exp(sum_t log pi_prox/mu), VCPO's. Capped at --algo.tis_cap (given, "
        f"or {default_caps}). docs/off_policy.md.",
    )
    group.add_argument(
        "--algo.m2po_tau",
        type=float,
        default=None,
        help="M2PO: over the batch's trust-region tokens, mask those with the largest (log pi_theta/mu)^2 until "
        "their mean is <= tau (0.04 in the paper); the loss is -M (pi_theta/mu) A, no eps-clip. Off by default. "
        "Needs one optimizer step per rollout batch. docs/off_policy.md#m2po.",
    )
    group.add_argument(
        "--algo.m2po_style",
        type=str,
        default=DEFAULTS["algo.m2po_style"],
        choices=["paper", "code"],
        help="With --algo.m2po_tau: paper (default) = Algorithm 1's mask; code = the released code's rule, PPO's "
        "clip on pi_theta/mu with the bound exp(+-b) from the same budget, nothing masked. docs/off_policy.md#m2po.",
    )
    group.add_argument(
        "--algo.max_version_lag",
        type=int,
        default=None,
        help="Mask out (and count) response tokens sampled more than this many weight syncs before the "
        "update that consumes them. Off by default. 0 keeps only tokens of the current version.",
    )
    group.add_argument(
        "--algo.kl.off_policy_k2_enable",
        action="store_true",
        default=False,
        help="With --algo.kl.use_loss: the unbiased reverse-KL gradient under off-policy sampling, from the k2 "
        "surrogate weighted by the detached min((pi_theta/pi_prox) d, 10), d the TIS weight; the logged KL stays "
        "--algo.kl.estimator's. Off by default. docs/off_policy.md.",
    )


def add_prox_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "openrlhf-ess: proximal policy (old log-probs) under async training",
        "pi_prox, the 'old' policy of the PPO ratio, should be the training-side policy at the version that "
        "sampled each token. Upstream recomputes it with the current weights (recompute).",
    )
    group.add_argument(
        "--algo.prox_mode",
        type=str,
        default=DEFAULTS["algo.prox_mode"],
        choices=list(PROX_MODES),
        help="recompute (default): upstream, current weights. Exact, each token's own version: snapshot (host "
        "copies), interrupt (scored at each sync), dedicated (an old-log-prob model). ewma: PPO-EWMA weights. "
        "loglinear: AReaL's interpolation. bypass: pi_prox = mu. Costs, constraints: docs/prox_modes.md.",
    )
    group.add_argument(
        "--algo.prox_dedicated_num_gpus",
        type=float,
        default=DEFAULTS["algo.prox_dedicated_num_gpus"],
        help="dedicated mode: GPUs of the old-log-prob model (an unsharded HF copy of the policy in "
        "--ds.param_dtype), in (0, 1]; a fraction shares one. Default %(default)s. On CPU one more logical GPU is "
        "created for it. docs/prox_modes.md.",
    )
    group.add_argument(
        "--algo.prox_snapshots",
        type=int,
        default=DEFAULTS["algo.prox_snapshots"],
        help="snapshot mode: versions kept; default %(default)s. Must cover the deepest lag the queue allows "
        "(async_queue_size + 1, + 1 more with partial rollouts), or --algo.max_version_lag + 1.",
    )
    group.add_argument(
        "--algo.prox_missing",
        type=str,
        default=DEFAULTS["algo.prox_missing"],
        choices=["mask", "error"],
        help="exact modes (snapshot, interrupt, dedicated): a stale token with no score from its version's "
        "weights is masked out and counted (mask, default) or stops the run (error); it is never scored with other "
        "weights. docs/prox_modes.md.",
    )
    group.add_argument(
        "--algo.prox_audit_dir",
        type=str,
        default=None,
        help="Audit trail: write, per training step, the tokens, their versions and the pi_prox the loss used, and "
        "the actor weights at every version, so pi_prox can be recomputed offline. Off by default; costly (one "
        "weight file per sync): for debugging and tests.",
    )
    group.add_argument(
        "--algo.prox_ewma_decay",
        type=ewma_decay_arg,
        default=DEFAULTS["algo.prox_ewma_decay"],
        help="ewma mode: decay beta of the weight EWMA, in (0, 1), default %(default)s, applied after every "
        "optimizer step. auto: each step's beta makes the EWMA's mean age equal the scored tokens' mean version lag "
        "(logged as prox/ewma_decay). docs/prox_modes.md.",
    )
    group.add_argument(
        "--algo.prox_ewma_style",
        type=str,
        default=DEFAULTS["algo.prox_ewma_style"],
        choices=["hilton", "batch"],
        help="ewma mode: hilton (default) = PPO-EWMA as published, pi_prox recomputed for every minibatch (one extra "
        "no-grad forward each); batch = the former rule, bias-corrected and once per rollout batch, kept to "
        "reproduce the recorded beta sweep. docs/prox_modes.md.",
    )
    group.add_argument(
        "--algo.prox_ewma_ref_batch",
        type=int,
        default=None,
        help="ewma mode: Hilton's batch-size-invariance rule. --algo.prox_ewma_decay is the beta tuned at this "
        "many samples per optimizer step; the run uses beta^(B / this), B = --train.batch_size. Default: beta as "
        "given. docs/prox_modes.md.",
    )
    group.add_argument(
        "--algo.prox_score_memory_mb",
        type=int,
        default=2048,
        help="interrupt and dedicated modes: bound in MB (> 0) on the fp32 logits-derived working memory of scoring "
        "token streams at a sync; the LM head runs a chunk of positions at a time. Smaller: less memory, more LM-head "
        "calls, same numbers. Default %(default)s. docs/prox_modes.md.",
    )


def add_sampling_mask_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "openrlhf-ess: truncated sampling (top-p / top-k)",
        "With top-p or top-k the engine samples from the truncated, renormalised distribution, and mu is its "
        "log-prob; the trainer's log-probs are full-vocabulary, so every token carries a phantom mismatch of "
        "log Z_t (the kept mass). docs/sampling_mask.md.",
    )
    group.add_argument(
        "--algo.sampling_mask",
        type=str,
        default=DEFAULTS["algo.sampling_mask"],
        choices=list(SAMPLING_MASK_MODES),
        help="off (default): upstream's full-vocabulary log-probs. keep: the engine reports each sampled token's kept "
        "support size k_t, and the trainer computes pi_theta, pi_prox and pi_ref over the same top-k_t tokens, "
        "renormalised. Metric sampling_mask/log_kept_mass. Cost: docs/sampling_mask.md.",
    )
    group.add_argument(
        "--rollout.top_k",
        type=int,
        default=DEFAULTS["rollout.top_k"],
        help="openrlhf-ess: top-k sampling in the rollout engines (default %(default)s: off, upstream's only "
        "setting). Like --rollout.top_p, pair it with --algo.sampling_mask keep for off-policy corrections that see "
        "only staleness and numerics.",
    )


def add_routing_replay_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("openrlhf-ess: MoE routing replay (R3)")
    group.add_argument(
        "--algo.routing_replay",
        action="store_true",
        help="MoE models (qwen2_moe, qwen3_moe, olmoe, mixtral): the engines return the experts they chose per token "
        "and layer, and the trainer's forwards (pi_theta, pi_prox, pi_ref) replay them, removing route flips from "
        "the mismatch. Off by default; needs vLLM >= 0.29 on GPU. docs/routing_replay.md.",
    )


def add_auto_resume_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("openrlhf-ess: restarts after a death during training")
    group.add_argument(
        "--train.auto_resume",
        type=int,
        default=0,
        metavar="N",
        help="Run the job in a child process and, when it dies during training (a DeepSpeed rank killed, OOM, a CUDA "
        "error, a dead engine), start it again with --ckpt.load_enable from the newest complete checkpoint, up to N "
        "times; never after bad input, a start-up failure or a stop signal. Needs --ckpt.save_steps. Cost: the steps "
        "since the last checkpoint and a start-up per restart. Default 0 = off. docs/faults.md.",
    )


def add_stale_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("openrlhf-ess: a version lag set exactly")
    group.add_argument(
        "--train.stale_k",
        type=int,
        default=DEFAULTS["train.stale_k"],
        metavar="K",
        help="Synchronous training whose every rollout batch is generated by the weights K versions older than the "
        "ones that train it (the first K batches by the initial weights): the lag of an async fleet, reproduced "
        "exactly on any machine. Evals run on the trainer's own weights (two more syncs per eval). Cost: K + 1 host "
        "copies of the weights (ZeRO-3: a partition per rank). Not with --train.async_enable, resume or "
        "--vllm.max_restarts. Default 0 = off. docs/off_policy.md#a-lag-set-exactly---trainstale_k.",
    )
