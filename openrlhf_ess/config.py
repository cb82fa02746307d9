"""Our command-line flags and the one function that validates flag combinations.

Flags follow upstream's dotted groups. Every check that involves more than one flag lives in
:func:`validate`, which runs after upstream's own validation and before Ray or any model starts, and
raises :class:`ConfigError` with a message naming the flags and the fix.
"""

from __future__ import annotations

import argparse
import math
import os
import types
from typing import List

from openrlhf_ess import upstream
from openrlhf_ess.runtime import cpu_compat

RELOAD_BACKEND = "reload"
# --reward.timeout_s default: upstream's own bound on an HTTP reward request (aiohttp total timeout, utils/agent.py)
REWARD_TIMEOUT_S = 180.0


class ConfigError(ValueError):
    """A bad flag or flag combination, found before any model is loaded."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add openrlhf-ess flags to upstream's parser, in their own ``--help`` group."""
    upstream.extend_choices(parser, "ds.param_dtype", "fp32")
    for action in parser._actions:
        if action.dest == "vllm.sync_backend":
            action.help = (
                "DeepSpeed -> vLLM weight sync backend: nccl (upstream, GPU), gloo (upstream; broken without "
                "NCCL: rejected on CPU), or reload (openrlhf-ess: ship weights as one safetensors blob through "
                "Ray and load them with vLLM's reload_weights; works on CPU and GPU, costs one host copy of the "
                "model per sync). On a machine without CUDA the default becomes reload."
            )

    add_ess_lr_arguments(parser)
    add_opob_arguments(parser)
    add_off_policy_arguments(parser)
    add_prox_arguments(parser)
    add_sampling_mask_arguments(parser)
    add_routing_replay_arguments(parser)
    group = parser.add_argument_group("openrlhf-ess: engine and machine")
    group.add_argument(
        "--vllm.dtype",
        type=str,
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the vLLM engines (upstream hard-codes bfloat16, the default). float32 makes rollout "
        "log-probs match the trainer's to ~1e-5 on CPU; it doubles engine memory.",
    )
    group.add_argument(
        "--vllm.fp32_lm_head",
        action="store_true",
        help="The engines compute the LM head (the final projection to the vocabulary) in fp32 and so the "
        "log-softmax of fp32 logits, through vLLM's own option (hf_overrides head_dtype=float32). Removes the "
        "bf16 rounding of the logits from the mismatch between mu and an fp32 trainer (docs/mismatch_sources.md). "
        "Cost on CUDA: the logits of each step in fp32 (2 bytes more per vocabulary entry and token in the step); "
        "elsewhere also an fp32 copy of the head's weight per step. Checked at start-up: every engine worker must "
        "report an fp32 head. Not with --vllm.dtype float32 (already fp32) or a quantized LM head.",
    )
    group.add_argument(
        "--vllm.cpu_kv_cache_gb",
        type=float,
        default=None,
        help="KV-cache size per vLLM engine on a machine without CUDA, in GiB (vLLM's CPU backend cannot size it "
        "from --vllm.gpu_memory_utilization). Default: VLLM_CPU_KVCACHE_SPACE if set (vLLM CPU's own variable, "
        "whole GiB), else 1. The engines are started without that variable, which vLLM CPU would let override "
        "this flag. Ignored where CUDA exists.",
    )
    group.add_argument(
        "--vllm.sync_check_tol",
        type=float,
        default=0.5,
        help="After every weight sync, compare per-tensor checksums (sum and sum of squares, fused names "
        "matched) between the trainer and each engine, and (see --vllm.sync_check_canary_every) the log-probs of "
        "a fixed 32-token canary; stop the run, naming the tensors, on a checksum mismatch or if the canary's "
        "mean |difference| exceeds this many nats (bf16 engines differ by ~0.01-0.1; an engine that did not load "
        "the weights by far more). 0 disables both. Cost: one pass over the weights per sync, one 32-token "
        "forward on each side per canary. Metrics: sync/checksum_tensors_compared, sync/checksum_seconds, "
        "sync/canary_mean_abs_diff, sync/canary_seconds.",
    )
    group.add_argument(
        "--vllm.sync_check_rel_tol",
        type=float,
        default=None,
        help="The canary's second bound (start-up and syncs): its mean |difference| divided by the spread of the "
        "trainer's own canary log-probs (mean |log p - mean|). Rounding stays a fixed small fraction of that spread "
        "on any model (0.007 with a bf16 side, 3e-7 with both sides fp32, measured on the tiny models), while "
        "another LM head moves the log-probs by 2-4 times it; the absolute bound alone misses that on a flat model "
        "(docs/canary_faults.md). Default: 0.1, or 1e-3 when --vllm.dtype float32 and --ds.param_dtype fp32. "
        "0 disables this bound; raise it for an engine quantised on purpose (fp8). Metric: sync/canary_rel_diff.",
    )
    group.add_argument(
        "--vllm.sync_check_min_coverage",
        type=float,
        default=0.95,
        help="The per-tensor sync check fails, naming the tensors left out, when the engines' tensor names cover "
        "less than this fraction of the trainer's weight elements (an unknown fused layout would otherwise leave "
        "most of the model unchecked). 0 accepts any coverage. Metric: sync/checksum_coverage.",
    )
    group.add_argument(
        "--vllm.sync_check_canary_every",
        type=int,
        default=50,
        help="Run the sync check's canary (a log-prob comparison through the engine, which checks its numerics "
        "end to end) at the first sync and then every N syncs; the per-tensor checksums run at every sync. "
        "1 = every sync (costs one engine request per sync).",
    )
    group.add_argument(
        "--reward.failure_policy",
        type=str,
        default="off",
        choices=["off", "drop", "stop"],
        help="When the reward function (--reward.remote_url / agent) fails for a sample (upstream swallows the "
        "exception and leaves the reward None) or returns NaN/inf: drop = mask the sample out of the loss with "
        "reward 0 and count it (metric reward_failed); stop = end the run with the prompt in the message; "
        "off = upstream behaviour (a None reward crashes later with an unrelated error; NaN trains on NaN).",
    )
    group.add_argument(
        "--reward.timeout_s",
        type=float,
        default=REWARD_TIMEOUT_S,
        help="Bound, in seconds, on each call of the reward function of a --reward.remote_url .py file (one call per "
        "sample, in the vLLM engine). A call still running after 30 s is logged with the file's name; one that "
        "exceeds the bound, or raises SystemExit / another BaseException (sys.exit() would otherwise hang the run), "
        "is a failed reward: the run stops naming the file, or with --reward.failure_policy drop the sample is "
        "dropped. Default 180, upstream's own bound on an HTTP reward request; inf = no bound. Cost: none (a "
        "timed-out call's thread cannot be stopped and finishes in the background).",
    )
    group.add_argument(
        "--algo.nonfinite_logprobs",
        type=str,
        default="drop",
        choices=["drop", "stop"],
        help="A sample whose log-probs are NaN/inf on a response token, from the engine (mu) or from the actor's "
        "forward (pi_prox): drop = mask the whole sample out of the loss and count it (metrics "
        "rollout_logprob_nonfinite, actor_logprob_nonfinite); stop = end the run. Applies when our controllers "
        "run (any of our off-policy flags). A version's missing pi_prox in the exact modes follows "
        "--algo.prox_missing instead.",
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
        help="Start-up self-checks, after the models are loaded and before the first rollout: placement (no two "
        "ranks on one GPU unless a --train.colocate_* flag asks), one all-reduce and all-gather on the actor's "
        "process group, each actor rank's free GPU memory against our features' stated peak; with "
        "--algo.sampling_mask keep each engine proves it reports kept counts. A failure stops the run naming the "
        "contract and the fix; the time taken is logged (docs/gpu_path.md#start-up-self-checks). off: skip them.",
    )
    group.add_argument(
        "--ray.accelerator",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="Whether the run's actors and engines use CUDA. auto (default) decides from the cluster, not from "
        "the driver: with --ray.address / RAY_ADDRESS, a probe on each Ray node that declares GPUs asks NVML "
        "(without initialising CUDA) whether it has an NVIDIA GPU; with a private Ray instance, this machine. "
        "A CPU-only head node or `ray job submit` (whose driver sees no GPU) thus still runs a GPU cluster in GPU "
        "mode. The decision and its reason are the first line of the log. cuda / cpu: skip the probe.",
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
        help="Scale the actor LR by the rollout's effective sample size. Off: upstream behaviour, bit-exact.",
    )
    group.add_argument(
        "--algo.ess_lr_floor",
        type=float,
        default=0.1,
        help="Lower bound of the LR scale, in (0, 1]. 1 disables the scaling in effect.",
    )
    group.add_argument(
        "--algo.ess_lr_weight",
        type=str,
        default="geo_mean",
        choices=list(ESS_WEIGHT_FORMS),
        help="Trajectory weight: geo_mean = exp(mean_t log ratio) (the paper's, length-independent) or "
        "seq_product = exp(sum_t log ratio) (the VCPO reference code's; collapses ESS for long responses).",
    )
    group.add_argument(
        "--algo.ess_lr_rule",
        type=str,
        default="sqrt",
        choices=list(ESS_RULES),
        help="LR multiplier from rho = ESS/B: sqrt (VCPO) or linear (more aggressive).",
    )


def add_opob_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "openrlhf-ess: VCPO's off-policy optimal baseline (arXiv 2602.17616)",
        "Per prompt group: b* = sum w^2 |g|^2 R / sum w^2 |g|^2, with w_i the sequence IS weight "
        "exp(mean_t log pi_prox/mu) (truncated at --algo.tis_cap) and |g_i| the norm of the LM head's gradient of "
        "log pi(response i), exact by the ghost-norm identity from the make-experience forward (no backward). "
        "Cost: A^2 V multiply-adds per response of A tokens in that forward, A x A fp32 matrices; metrics opob/*.",
    )
    group.add_argument(
        "--algo.advantage.baseline",
        type=str,
        default="estimator",
        choices=["estimator", "opob"],
        help="estimator: the baseline of --algo.advantage.estimator (upstream, bit-exact). opob: VCPO's "
        "off-policy optimal baseline, for reinforce_baseline, rloo, group_norm and dr_grpo (docs/opob.md).",
    )
    group.add_argument(
        "--algo.advantage.opob_weight",
        type=str,
        default="tis",
        choices=list(OPOB_WEIGHTS),
        help="w_i in b*: tis = the sequence weight the loss applies (1 without --algo.tis_cap); seq_product = "
        "exp(sum_t log pi_prox/mu), untruncated (VCPO's); seq_product_truncated = the same, truncated at "
        "--algo.tis_cap.",
    )
    group.add_argument(
        "--algo.vcpo_enable",
        action="store_true",
        default=False,
        help="VCPO as its reference recipe trains, with every setting below unless passed explicitly: "
        + "; ".join(_shown(dest, value) for dest, value in VCPO_RECIPE)
        + "; --train.batch_size = --rollout.batch_size x n (one optimizer step per rollout batch). docs/opob.md.",
    )


OPOB_WEIGHTS = ("tis", "seq_product", "seq_product_truncated")
# --algo.vcpo_enable: VCPO as its reference code trains (recipe/fully_async_policy/shell/vcpo/math/vcpo_k=10.sh of
# mit-han-lab/vcpo); each setting applies only where the user did not pass the flag (docs/opob.md has the table).
VCPO_RECIPE = (
    ("algo.ess_lr_enable", True),  # ess_scaling.enable
    ("algo.ess_lr_weight", "seq_product"),  # ess_scaling.use_clipped=False: the untruncated product
    ("algo.ess_lr_floor", 1e-3),  # no floor there; rho >= 1/B, so 1e-3 binds only past B = 10^6
    ("algo.advantage.baseline", "opob"),  # grad_baselining.enable
    ("algo.advantage.opob_weight", "seq_product"),  # grad_baselining.use_clipped_is_ratios=False
    ("algo.advantage.estimator", "group_norm"),  # adv_estimator=grpo, grad_baselining.norm_by_std
    ("algo.tis_level", "seq_product"),  # rollout_is=sequence
    ("algo.tis_cap", 8.0),  # rollout_is_threshold=8.0
    ("actor.eps_clip_low_high", [1.0, 1e9]),  # clip_ratio_low=1.0, clip_ratio_high=1e9 (clip_ratio_c: no dual clip)
    ("actor.loss_agg_mode", "seq-mean-token-mean"),  # loss_agg_mode
    ("rollout.n_samples_per_prompt", 16),  # rollout.n
    ("train.max_epochs", 1),  # one pass: num_minibatches_per_update=1, updates_per_param_sync=1
)
VCPO_APPLIED = "algo.vcpo_applied"  # the recipe flags the recipe set (not the user), for messages


def _shown(dest: str, value) -> str:
    """A flag as a user would type it: ``--dest value`` (``--dest`` alone for a switch)."""
    if value is True:
        return f"--{dest}"
    if isinstance(value, (list, tuple)):
        return f"--{dest} " + " ".join(f"{v:g}" for v in value)
    return f"--{dest} {value:g}" if isinstance(value, float) else f"--{dest} {value}"


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
    shown = ", ".join(_shown(d, flags[d]) for d in applied)
    kept = [f"--{d}" for d, _ in VCPO_RECIPE if d in given]
    return [
        f"--algo.vcpo_enable: VCPO's reference recipe: {shown or 'nothing (every flag passed)'}"
        + (f"; kept as passed: {', '.join(kept)}" if kept else "")
        + "."
    ]


def opob_on(args: types.SimpleNamespace) -> bool:
    return args.algo.advantage.baseline == "opob"


def add_off_policy_arguments(parser: argparse.ArgumentParser) -> None:
    from openrlhf_ess.models.corrections import TIS_LEVELS

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
        help="Truncated importance sampling cap C: weight each token by min(pi_prox/mu, C). Token level runs "
        "through upstream's PolicyLoss (is_correction clip mode). Typical C: 2. Off by default. Cost: none "
        "beyond vLLM returning log-probs. Replaces --algo.advantage.is_correction_* (do not set both).",
    )
    group.add_argument(
        "--algo.tis_level",
        type=str,
        default="token",
        choices=list(TIS_LEVELS),
        help="token: per-token ratio; seq: the sequence's geometric-mean ratio exp(mean_t log pi_prox/mu), capped, "
        "applied to all its tokens; seq_product: the trajectory's ratio exp(sum_t log pi_prox/mu) (VCPO's), capped "
        "(--algo.tis_cap, default 8 at this level).",
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
        help="With --algo.kl.use_loss: backprop the unbiased reverse-KL gradient under off-policy sampling, "
        "from the k2 surrogate 0.5*(log pi_theta - log pi_ref)^2 weighted by the detached decoupled weight "
        "min((pi_theta/pi_prox)*d, 10), d = min(pi_prox/mu, C) per token, or per sequence with --algo.tis_level seq "
        "(C = --algo.tis_cap, else 10; 10 is upstream's KL IS-weight bound); the logged value stays "
        "--algo.kl.estimator's (straight-through). Upstream's --algo.kl.unbiased_gradient weights by "
        "pi_theta/pi_old only, ignoring the train/inference discrepancy.",
    )


PROX_MODES = ("recompute", "snapshot", "interrupt", "dedicated", "ewma", "loglinear", "bypass")
# π_prox = μ, the engine's log-prob of each sampled token: upstream's old-log-prob forward is skipped.
BYPASS_PROX_MODE = "bypass"
# Modes that score the outgoing version's tokens at each weight sync (the engines report their streams).
SCORE_AT_SYNC_MODES = ("interrupt", "dedicated")
# Modes whose π_prox is each token's own version's weights (a stale token without them is masked or stops).
EXACT_PROX_MODES = ("snapshot",) + SCORE_AT_SYNC_MODES
# Modes that score by swapping stored weights into the actor (ZeRO-3: each rank's partition).
WEIGHT_SWAP_MODES = ("snapshot", "ewma", "interrupt")


def add_prox_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "openrlhf-ess: proximal policy (old log-probs) under async training",
        "pi_prox, the 'old' policy of the PPO ratio, should be the training-side policy at the version that "
        "sampled each token. Upstream recomputes it with the current weights (recompute).",
    )
    group.add_argument(
        "--algo.prox_mode",
        type=str,
        default="recompute",
        choices=list(PROX_MODES),
        help="recompute: upstream (current weights; default, bit-exact). snapshot: exact; the actor keeps host "
        "copies of the last --algo.prox_snapshots versions and scores each token with its version's weights "
        "(one extra actor forward per distinct stale version, K x model host memory). ewma: PPO-EWMA, the "
        "bias-corrected EWMA of the actor weights (one extra forward, 1 x model host memory). loglinear: AReaL's "
        "interpolation log mu + L/(L+1) (log pi_V - log mu) by version lag L (no extra forward). interrupt: exact; "
        "at each weight sync generation is paused and every token of the outgoing version still outstanding "
        "(in-flight prefixes included) is scored by the actor with its one kept copy of that version (async + "
        "partial rollouts). dedicated: exact; the same scoring at each sync, done by an old-log-prob model that "
        "receives every weight sync with the engines (--algo.prox_dedicated_num_gpus). bypass: pi_prox = mu, the "
        "engine's log-prob of each sampled token; upstream's old-log-prob forward over the batch is skipped (saves "
        "one actor forward per rollout batch), the PPO ratio is pi_theta/mu and the TIS weight min(pi_prox/mu, C), "
        "ESS-LR's w_i and the mismatch metrics are 1, 1 and 0 by construction. Sound only when mu is the "
        "distribution the trainer models: an fp32 engine (--vllm.dtype float32; bf16 gets a notice) and no "
        "truncated sampling, or truncated sampling with --algo.sampling_mask keep (--rollout.top_p < 1 or "
        "--rollout.top_k without it is rejected); without the mask upstream's first response token, sampled "
        "with EOS banned (min_tokens=1), starts at ratio 1 - pi(EOS). Any ZeRO stage: under "
        "ZeRO-3 snapshot/ewma/interrupt keep each rank's partition (host memory / number of ranks).",
    )
    group.add_argument(
        "--algo.prox_dedicated_num_gpus",
        type=float,
        default=1.0,
        help="dedicated mode: GPUs of the old-log-prob model (a Ray actor holding an HF copy of the policy in "
        "--ds.param_dtype), in (0, 1]: the copy is not sharded, so it must fit one GPU (a fraction shares one). "
        "On CPU one more logical GPU is created for it.",
    )
    group.add_argument(
        "--algo.prox_snapshots",
        type=int,
        default=4,
        help="snapshot mode: versions kept. Must cover the deepest lag the queue allows "
        "(async_queue_size + 1, + 1 more with partial rollouts), or --algo.max_version_lag + 1.",
    )
    group.add_argument(
        "--algo.prox_missing",
        type=str,
        default="mask",
        choices=["mask", "error"],
        help="exact modes (snapshot, interrupt, dedicated): a stale token with no score from its version's "
        "weights (snapshot evicted, stream not reported at the sync) is masked out and counted (mask) or stops the "
        "run (error). It is never scored with other weights.",
    )
    group.add_argument(
        "--algo.prox_audit_dir",
        type=str,
        default=None,
        help="Audit trail: write, per training step, the tokens, their versions and the pi_prox the loss used "
        "(batch_v<V>.pt), and the actor weights at every version (weights_v<V>.safetensors), so pi_prox can be "
        "recomputed offline. Costly (one weight file per sync): for debugging and tests.",
    )
    group.add_argument(
        "--algo.prox_ewma_decay",
        type=ewma_decay_arg,
        default=0.9,
        help="ewma mode: decay beta of the weight EWMA, in (0, 1), updated after every optimizer step. auto: "
        "each step's beta = age/(1+age), so the EWMA's mean age beta/(1-beta) equals the mean version lag of the "
        "tokens scored since the previous step, in optimizer steps (Hilton et al. 2021 tie beta to the proximal "
        "policy's age); logged as prox/ewma_decay. Costs nothing beyond ewma mode.",
    )
    group.add_argument(
        "--algo.prox_ewma_style",
        type=str,
        default="hilton",
        choices=["hilton", "batch"],
        help="ewma mode: hilton (default) = PPO-EWMA as published (Hilton et al. 2021, openai/ppo-ewma): the "
        "average starts at the initial weights with weight 1 (no bias correction) and pi_prox is a forward of the "
        "average recomputed for every minibatch (one extra no-grad actor forward per minibatch). batch = the "
        "former default, measured behind hilton at the same beta on both test rewards: the average "
        "starts at 0 with bias correction 1/(1-beta^n), pi_prox computed once per rollout batch and kept for every "
        "PPO epoch; kept to reproduce the recorded beta sweep (docs/prox_modes.md).",
    )
    group.add_argument(
        "--algo.prox_ewma_ref_batch",
        type=int,
        default=None,
        help="ewma mode: Hilton's batch-size-invariance rule. --algo.prox_ewma_decay is the beta tuned at this "
        "many samples per optimizer step; the run uses beta^(B / this), B = --train.batch_size, so the average "
        "spans the same number of samples at any batch size. Default: beta as given.",
    )
    group.add_argument(
        "--algo.prox_score_memory_mb",
        type=int,
        default=2048,
        help="interrupt and dedicated modes: bound (MB, > 0) on the fp32 logits-derived working memory of scoring "
        "token streams at a sync. The LM head runs on the final hidden states a chunk of positions at a time "
        "(about MB / (V x 8 bytes) positions, V x 32 with --algo.sampling_mask keep), never on [streams, T, V] at "
        "once, and a forward takes at most 16 streams whose fp32 hidden states fit in MB. Smaller: less memory, "
        "more, smaller LM-head calls (same numbers). docs/prox_modes.md.",
    )


EWMA_DECAY_AUTO = "auto"


def ewma_decay_arg(text: str):
    """``--algo.prox_ewma_decay``: a number, or ``auto`` (argparse names the flag in its error)."""
    if text == EWMA_DECAY_AUTO:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a decay in (0, 1) or '{EWMA_DECAY_AUTO}', got {text!r}") from None


SAMPLING_MASK_MODES = ("off", "keep")


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
        default="off",
        choices=list(SAMPLING_MASK_MODES),
        help="off: upstream (full-vocabulary log-probs; default, bit-exact). keep: the engine reports per sampled "
        "token the size k_t of the support it kept (0 extra bytes: it rides in the log-prob's rank field), and "
        "the trainer computes log pi_theta, log pi_prox (every --algo.prox_mode) and log pi_ref over the same "
        "top-k_t tokens of its own logits, renormalised. TIS, ESS-LR, the mismatch metrics and the PPO ratio "
        "then compare distributions on the same support, and the gradient is the truncated policy's. Also "
        "removes the first response token's EOS ban (upstream's min_tokens=1) from the mismatch. Metric: "
        "sampling_mask/log_kept_mass (mean log Z_t of pi_theta). The engine runs vLLM's V1 model runner "
        "(VLLM_USE_V2_MODEL_RUNNER=0, set by the engine) and proves its kept counts at start-up. Cost: the "
        "actor's log-prob step, forward + backward, 0.7-1.2x upstream's at V = 151,936 on CPU; backward memory one "
        "logits-sized gradient, as upstream's (docs/sampling_mask.md).",
    )
    group.add_argument(
        "--rollout.top_k",
        type=int,
        default=-1,
        help="openrlhf-ess: top-k sampling in the rollout engines (-1: off, upstream's only setting). Like "
        "--rollout.top_p, pair it with --algo.sampling_mask keep for off-policy corrections that see only "
        "staleness and numerics.",
    )


def sampling_mask_on(args: types.SimpleNamespace) -> bool:
    return getattr(args.algo, "sampling_mask", "off") == "keep"


def add_routing_replay_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("openrlhf-ess: MoE routing replay (R3)")
    group.add_argument(
        "--algo.routing_replay",
        action="store_true",
        help="MoE models: the engine returns the expert ids it chose per token and MoE layer, and the trainer's "
        "forwards replay them: pi_theta (forward and backward of the training step), the pi_prox forwards (also "
        "the streams interrupt/dedicated score at a weight sync) and pi_ref use the engine's experts, with gate "
        "weights from the trainer's own router (its gradient kept). "
        "Removes the route flips (near-tied experts resolved differently by engine and trainer kernels) from the "
        "train/rollout mismatch. Metrics: routing/replayed_frac, routing/disagree_frac (share of response "
        "positions where the trainer's own top-k differs from the engine's). Cost: layers x top_k x (1 byte if "
        "<= 256 experts, else 2) per token carried from engine to actors (Qwen3-30B-A3B: 48 x 8 = 384 B/token). "
        "Needs vLLM >= 0.29 with enable_return_routed_experts (set by the engine; proved at start-up: not "
        "available on vLLM's CPU backend) and a qwen2_moe, qwen3_moe, olmoe or mixtral model "
        "(docs/routing_replay.md).",
    )


def routing_replay_on(args: types.SimpleNamespace) -> bool:
    return bool(getattr(args.algo, "routing_replay", False))


def truncates_sampling(args: types.SimpleNamespace) -> bool:
    """Whether the engines sample from a truncated distribution (top-p < 1 or top-k on)."""
    return 0 < args.rollout.top_p < 1 or getattr(args.rollout, "top_k", -1) > 0


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
    if algo.prox_mode != "recompute":
        out.append(f"--algo.prox_mode {algo.prox_mode}")
    if sampling_mask_on(args):
        out.append("--algo.sampling_mask keep")
    return out


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
    from openrlhf_ess.trainer import resume

    return (
        needs_versions(args)
        or args.reward.failure_policy != "off"
        or args.rollout.top_k > 0  # upstream has no top-k flag: our generator passes it
        or routing_replay_on(args)  # the engine's routes ride on our generator's samples
        or resume.applies(args)
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


def on_cuda(args) -> bool:
    """Whether the run uses CUDA: ``--ray.accelerator`` as resolved by the CLI (``resolve_accelerator``: from the
    Ray cluster, not the driver), else this process's answer (:func:`cpu_compat.cuda_available`)."""
    decided = getattr(getattr(args, "ray", None), "accelerator", "auto")
    if decided in ("cuda", "cpu"):
        return decided == "cuda"
    return cpu_compat.cuda_available()


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


def validate(args: types.SimpleNamespace) -> List[str]:
    """Check flag combinations; fix the few that have one right answer and say so.

    Returns notices for the user (what was changed and why). Raises :class:`ConfigError` for a
    combination that would fail later or, worse, train on garbage.
    """
    notices: List[str] = []
    on_cpu = not on_cuda(args)

    if args.reward.failure_policy != "off" and not args.reward.remote_url:
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
    _resolve_cpu_kv_cache(args, notices if on_cpu else [])  # with CUDA the flag is ignored: no notice
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
        if args.vllm.sync_backend == "nccl":
            args.vllm.sync_backend = RELOAD_BACKEND
            notices.append("no CUDA here: --vllm.sync_backend nccl -> reload (NCCL needs GPUs).")
        elif args.vllm.sync_backend == "gloo" and args.vllm.num_engines:
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
    elif any(
        getattr(args.algo, name) != default
        for name, default in (("ess_lr_floor", 0.1), ("ess_lr_weight", "geo_mean"), ("ess_lr_rule", "sqrt"))
    ):
        raise ConfigError(
            "--algo.ess_lr_floor/--algo.ess_lr_weight/--algo.ess_lr_rule are set but --algo.ess_lr_enable is not: "
            "add --algo.ess_lr_enable, or drop them."
        )
    _validate_off_policy(args, notices)
    _validate_sampling_mask(args, notices)
    if not on_cpu:
        _validate_gpu_path(args)
    return notices


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


KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def _resolve_cpu_kv_cache(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--vllm.cpu_kv_cache_gb: the flag, else vLLM CPU's own VLLM_CPU_KVCACHE_SPACE, else 1 GiB.

    vLLM CPU reads that variable in ``CpuPlatform.check_and_update_config`` and lets it replace the engine's
    ``kv_cache_memory_bytes`` (a "legacy setting"), so with the variable set anywhere in the engine's environment
    the flag did nothing. The engine actor now starts vLLM without it (``trainer/ray/vllm_engine.py``)."""
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
            args.vllm.cpu_kv_cache_gb = 1.0
    elif env and env != "0":
        notices.append(
            f"--vllm.cpu_kv_cache_gb {args.vllm.cpu_kv_cache_gb:g} sizes the engines' KV cache; {KV_CACHE_ENV}={env} "
            "(which vLLM CPU would let override it) is not passed to the engines."
        )
    if args.vllm.cpu_kv_cache_gb <= 0:  # NaN: pre-flight names it (flags._check_floats)
        where = "--vllm.cpu_kv_cache_gb" if not env else f"--vllm.cpu_kv_cache_gb (or {KV_CACHE_ENV})"
        raise ConfigError(f"{where} must be > 0, got {args.vllm.cpu_kv_cache_gb:g}.")


def _validate_opob(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--algo.vcpo_enable / --algo.advantage.baseline opob (trainer/opob.py): what the baseline needs."""
    from openrlhf_ess.models.opob import OPOB_ESTIMATORS

    algo = args.algo
    applied = getattr(algo, "vcpo_applied", ())
    if algo.advantage.opob_weight != "tis" and not opob_on(args):
        raise ConfigError(
            f"--algo.advantage.opob_weight {algo.advantage.opob_weight} chooses the weights of the optimal baseline: "
            "add --algo.advantage.baseline opob, or drop the flag."
        )
    if not opob_on(args):
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
    if args.rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"{flag}: the optimal baseline is a baseline over each prompt's samples: set "
            f"--rollout.n_samples_per_prompt >= 2 (got {args.rollout.n_samples_per_prompt})."
        )
    if estimator == "reinforce_baseline" and algo.advantage.gamma != 1.0:
        raise ConfigError(
            f"{flag} with reinforce_baseline needs --algo.advantage.gamma 1 (upstream forces 1 for this estimator), "
            f"got {algo.advantage.gamma}."
        )
    if algo.prox_mode == BYPASS_PROX_MODE:
        raise ConfigError(
            f"{flag}: the optimal baseline takes its gradient norms from the actor's make-experience forward, which "
            "--algo.prox_mode bypass skips: use --algo.prox_mode recompute (VCPO's own pi_old at one step per "
            f"batch), snapshot, interrupt or dedicated, or {drop}."
        )
    if algo.advantage.opob_weight != "tis" and not args.vllm.num_engines:
        raise ConfigError(
            f"--algo.advantage.opob_weight {algo.advantage.opob_weight} weighs by pi_prox/mu: it needs the rollout "
            "log-probs (mu) of vLLM engines, --vllm.num_engines >= 1."
        )
    if algo.advantage.opob_weight == "seq_product_truncated" and algo.tis_cap is None:
        raise ConfigError(
            "--algo.advantage.opob_weight seq_product_truncated truncates at --algo.tis_cap: add --algo.tis_cap C, "
            "or use seq_product (untruncated)."
        )
    if sampling_mask_on(args):
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
    if args.reward.overlong_buffer_len is not None or args.reward.stop_properly_penalty_coef is not None:
        raise ConfigError(
            f"{flag} with a length penalty (--reward.overlong_buffer_len / --reward.stop_properly_penalty_coef): "
            f"the optimal baseline does not support one yet; drop the penalty, or {drop}."
        )


def _validate_off_policy(args: types.SimpleNamespace, notices: List[str]) -> None:
    """TIS, version lag and k2 KL rules; maps token-level TIS onto upstream's IS-correction flags."""
    from openrlhf_ess.models.corrections import TIS_DEFAULT_CAP

    algo = args.algo
    upstream_is = algo.advantage.is_correction_level != "off"
    if algo.tis_cap is None and algo.tis_level in TIS_DEFAULT_CAP:
        algo.tis_cap = TIS_DEFAULT_CAP[algo.tis_level]
        notices.append(f"--algo.tis_level {algo.tis_level}: weights truncated at --algo.tis_cap {algo.tis_cap:g}.")
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
        if algo.tis_level == "token":
            # One source of truth: upstream's PolicyLoss implements exactly min(pi_prox/mu, C) this way.
            algo.advantage.is_correction_level = "token"
            algo.advantage.is_correction_mode = "clip"
            algo.advantage.is_correction_gating = "ratio"
            algo.advantage.is_correction_threshold = [0.0, algo.tis_cap]
    elif algo.tis_level != "token":
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
    if needs_rollout_logprobs(args) and not args.vllm.num_engines:
        raise ConfigError(
            f"rollout log-probs (mu) come from vLLM engines: {', '.join(mu_consumers(args))} need "
            "--vllm.num_engines >= 1."
        )
    if needs_rollout_logprobs(args) and not upstream_is and algo.tis_cap is None:
        notices.append("vLLM engines will return sampled-token log-probs (mu), as the enabled features need them.")


def max_lag_possible(args: types.SimpleNamespace) -> int:
    """The deepest version lag a token can have when consumed, given the queue (and partial rollouts)."""
    if not args.train.async_enable:
        return 0
    return args.train.async_queue_size + (1 if args.train.partial_rollout_enable else 0)


def _validate_prox(args: types.SimpleNamespace, notices: List[str]) -> None:
    algo = args.algo
    mode = algo.prox_mode
    if algo.prox_score_memory_mb <= 0:
        raise ConfigError(f"--algo.prox_score_memory_mb must be > 0 (MB), got {algo.prox_score_memory_mb}.")
    if mode != "ewma" and (algo.prox_ewma_style != "hilton" or algo.prox_ewma_ref_batch is not None):
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
    if mode == "recompute":
        changed = algo.prox_snapshots != 4 or algo.prox_missing != "mask" or algo.prox_ewma_decay != 0.9
        if changed:
            raise ConfigError(
                "--algo.prox_snapshots/--algo.prox_missing/--algo.prox_ewma_decay are set but --algo.prox_mode is "
                "recompute: choose --algo.prox_mode snapshot or ewma, or drop them."
            )
        return
    for flag, value, default, owner in (
        ("--algo.prox_snapshots", algo.prox_snapshots, 4, ("snapshot",)),
        ("--algo.prox_ewma_decay", algo.prox_ewma_decay, 0.9, ("ewma",)),
        ("--algo.prox_dedicated_num_gpus", algo.prox_dedicated_num_gpus, 1.0, ("dedicated",)),
    ):
        if value != default and mode not in owner:
            raise ConfigError(f"{flag} is set but --algo.prox_mode is {mode}: it only applies to {owner[0]}; drop it.")
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
        needed = max_lag_possible(args) + 1
        if algo.max_version_lag is not None:
            needed = min(needed, algo.max_version_lag + 1)
        if algo.prox_snapshots < needed:
            raise ConfigError(
                f"--algo.prox_snapshots {algo.prox_snapshots} is smaller than the {needed} versions a token can lag "
                f"behind with --train.async_queue_size {args.train.async_queue_size}"
                f"{' and partial rollouts' if args.train.partial_rollout_enable else ''}: tokens would lose their "
                f"weights. Set --algo.prox_snapshots {needed} (or bound --algo.max_version_lag)."
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
    if truncates_sampling(args) and not sampling_mask_on(args):
        # μ is then the truncated, renormalised distribution's log-prob (log π - log Z_t): in the PPO ratio
        # π_θ/μ that is a phantom ratio Z_t < 1 on every token, which the clip turns into lost gradient
        raise ConfigError(
            f"--algo.prox_mode bypass with --rollout.top_p {args.rollout.top_p} / --rollout.top_k "
            f"{args.rollout.top_k}: mu is then the log-prob of the truncated, renormalised distribution, not the "
            "policy the trainer models, and the PPO ratio pi_theta/mu would start at the kept mass (< 1) on every "
            "token. Add --algo.sampling_mask keep (the trainer then models the truncated policy), or use "
            "--rollout.top_p 1 --rollout.top_k -1, or --algo.prox_mode recompute."
        )
    if algo.prox_missing != "mask":
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
    if not routing_replay_on(args):
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
    if not sampling_mask_on(args):
        return
    if args.ds.ring_attn_size > 1:
        raise ConfigError(
            f"--algo.sampling_mask keep with --ds.ring_attn_size {args.ds.ring_attn_size}: the per-token kept "
            "counts are not sliced across ring-attention ranks yet. Use --ds.ring_attn_size 1, or drop the flag."
        )
    if not truncates_sampling(args):
        notices.append(
            "--algo.sampling_mask keep with --rollout.top_p 1 and --rollout.top_k -1: sampling is not truncated, so "
            "the mask only takes out the first response token's EOS ban (upstream samples it with min_tokens=1); "
            "every other token's support is the whole vocabulary."
        )
