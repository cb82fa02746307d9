"""Pre-flight, models and tokenizer: model folders (config.json, weights, the tokenizer upstream loads) or hub ids
(cache, HF_HUB_OFFLINE), with no network access attempted; ``--data.max_len`` within the context vLLM accepts for the
model; --algo.routing_replay's model family; --algo.advantage.opob_norm full's modules (the module tree built on the
meta device); ``--rollout.top_k`` below the vocabulary; every token id of the tokenizer within the model's vocabulary
(config.json's ``vocab_size`` and the embedding's rows)."""

from __future__ import annotations

import json
import os
import struct
import types
from typing import List, Optional, Tuple

from openrlhf_ess.checks.preflight.flags import flag_value
from openrlhf_ess.config import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


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


def hub_id_form(name: str) -> bool:
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


def first_line(exc: BaseException) -> str:
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
        _check_fed_actor_ids("--reward.model_name_or_path", reward, actor, tokenizer)
        checked.add(reward)
    critic = args.critic.model_name_or_path  # upstream set it (gae only) to the reward or actor model by default
    if critic and critic not in checked:
        _check_model("--critic.model_name_or_path", critic, args, notices, load_tokenizer=True)
        _check_fed_actor_ids("--critic.model_name_or_path", critic, actor, tokenizer)
    return tokenizer


def _check_fed_actor_ids(flag: str, path: str, actor: str, tokenizer) -> None:
    """The reward model and the critic score the policy's sequences, token ids of the actor's tokenizer: their
    vocabulary must cover those ids too."""
    folder = _model_folder(path) if tokenizer is not None else None
    if folder is None:
        return
    cfg = model_config(folder) or {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    n_ids = tokenizer_ids(tokenizer)[0]
    vocab_size = cfg.get("vocab_size") or text.get("vocab_size")
    fed_by = f"--actor.model_name_or_path {actor}"
    problem = vocab_problem(flag, path, vocab_size, embedding_rows(folder), n_ids, fed_by=fed_by)
    if problem:
        raise ConfigError(problem)


def _check_model(flag: str, path: str, args, notices: List[str], load_tokenizer: bool):
    if os.path.isdir(path):
        _check_model_dir(flag, path, path)
        return _checked_tokenizer(flag, path, path, args) if load_tokenizer else None
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
    if not hub_id_form(path):
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
    return _checked_tokenizer(flag, path, os.path.dirname(cached), args) if load_tokenizer else None


def _checked_tokenizer(flag: str, path: str, folder: str, args):
    """The model's tokenizer as upstream loads it, its ids checked against the model's vocabulary."""
    tokenizer = _load_tokenizer(flag, path, args)
    _check_vocab(flag, path, folder, tokenizer)
    return tokenizer


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
            f"{first_line(e)}. Add the tokenizer files (tokenizer.json, tokenizer_config.json) to the folder."
        ) from None
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    if len(inner) < 2:
        # transformers 5 builds an empty tokenizer from config.json alone when the tokenizer files are missing.
        raise ConfigError(
            f"{flag} {path}: its tokenizer has no vocabulary ({len(inner)} token): the folder lacks the tokenizer "
            "files (tokenizer.json, tokenizer_config.json, vocab files). Copy them from the base model."
        )
    return tokenizer


# Names of the input embedding / output head weights whose first dimension is the vocabulary (HF checkpoints).
_EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "lm_head.weight")


def tokenizer_ids(tokenizer) -> Tuple[int, Optional[str], Optional[int], Optional[str]]:
    """(the number of ids the tokenizer can produce: its largest id + 1, at least ``len(tokenizer)``; its pad token;
    the pad token's id; its eos token) as upstream loads it.

    Upstream (``openrlhf.utils.utils.get_tokenizer``) adds no token itself: a tokenizer without a pad token pads with
    its eos token. But transformers adds a pad token the vocabulary lacks at id ``len(vocabulary)``, one past what
    the model was built for: the one tokenizer_config.json names, or, when it names none, the default of the
    tokenizer class it picks for the model (Qwen2's: '<|endoftext|>')."""
    inner = getattr(tokenizer, "tokenizer", tokenizer)  # a VLM's processor wraps the tokenizer
    size = len(inner)
    try:
        size = max(size, max(inner.get_vocab().values()) + 1)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        pass
    pad_id = getattr(inner, "pad_token_id", None)
    pad_id = pad_id if isinstance(pad_id, int) else None
    return size, getattr(inner, "pad_token", None), pad_id, getattr(inner, "eos_token", None)


def embedding_rows(folder: str) -> Optional[Tuple[int, str]]:
    """(the vocabulary rows of the model's embedding or output head, the weight's name) read from the safetensors
    headers in ``folder`` without loading any weight (the smallest if they differ); None if not found there
    (.bin weights, unknown names)."""
    files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    found = []
    for name in files:
        try:
            with open(os.path.join(folder, name), "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 * 2**20:  # not a safetensors header
                    continue
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            continue
        for key, meta in header.items():
            shape = meta.get("shape") if isinstance(meta, dict) else None
            if key.endswith(_EMBEDDING_NAMES) and isinstance(shape, list) and len(shape) == 2:
                found.append((int(shape[0]), key))
    return min(found) if found else None


def vocab_problem(
    flag: str,
    path: str,
    vocab_size,
    embedding,
    n_ids: int,
    pad: Optional[str] = None,
    pad_id: Optional[int] = None,
    eos: Optional[str] = None,
    fed_by: Optional[str] = None,
) -> Optional[str]:
    """The one-line error for a tokenizer whose ids reach past the model's vocabulary, or None.

    ``vocab_size``: config.json's (None if absent); ``embedding``: (rows, weight name) or None; ``n_ids``: the
    tokenizer's largest id + 1; ``pad``, ``pad_id``: its pad token (named when it is the one id too many); ``eos``:
    its eos token (the pad to suggest); ``fed_by``: the flag and path of the model whose tokenizer it is, when not
    the model's own (the reward model and the critic score the policy's token ids). Fewer tokens than the model's
    vocabulary is normal (vocabularies are padded to a multiple of 64 or 128)."""
    limits = []
    if isinstance(vocab_size, int) and vocab_size > 0:
        limits.append((vocab_size, "vocab_size in its config.json"))
    if embedding is not None:
        limits.append((embedding[0], f"rows of its weight {embedding[1]}"))
    if not limits:
        return None
    limit, where = min(limits, key=lambda limit: limit[0])  # config.json first on a tie
    if n_ids <= limit:
        return None
    whose = f"the policy's tokenizer ({fed_by}), whose ids it scores," if fed_by else "the tokenizer"
    head = f"{flag} {path}: {whose} has {n_ids} token ids but the model has {limit} ({where})"
    if fed_by is None and pad_id is not None and pad_id == limit == n_ids - 1:  # the pad token alone lies past
        return (
            f"{head}: its pad token {pad!r} is not in the vocabulary, so transformers added it at id {pad_id}, past "
            "the model's embedding (the first forward over a padded batch ends in IndexError; transformers adds the "
            "pad token tokenizer_config.json names, or, if it names none, its tokenizer class's default). Set "
            f'"pad_token" in the folder\'s tokenizer_config.json to a token of the vocabulary'
            f"{f', e.g. its eos token {eos!r}' if eos else ''}."
        )
    fix = (
        "Pass a model built on the policy's tokenizer"
        if fed_by
        else "Pass the tokenizer the model was trained with, or a model whose vocabulary covers "
        f"{n_ids} tokens (resize_token_embeddings, then save_pretrained)"
    )
    return (
        f"{head}, so ids from {limit} on reach past the model's embedding (vLLM and the forward end in "
        f"IndexError). {fix}."
    )


def _check_vocab(flag: str, path: str, folder: str, tokenizer) -> None:
    """Refuse a tokenizer whose ids reach past the model's vocabulary (``vocab_problem``), read from config.json
    and the safetensors headers, before any process starts."""
    cfg = model_config(folder) or {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    vocab_size = cfg.get("vocab_size") or text.get("vocab_size")
    n_ids, pad, pad_id, eos = tokenizer_ids(tokenizer)
    problem = vocab_problem(flag, path, vocab_size, embedding_rows(folder), n_ids, pad, pad_id, eos)
    if problem:
        raise ConfigError(problem)


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
    if not flag_value(args, "algo.routing_replay", False):
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
            f"({first_line(e)}); routing replay needs a supported MoE model."
        ) from None
    try:
        routing_replay.require_supported(model_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_opob_norm(args: types.SimpleNamespace, notices: List[str]) -> None:
    """--algo.advantage.opob_norm full (set by --algo.vcpo_enable): every module of the actor that holds trainable
    parameters is one the whole-model norm pass takes (``trainer/opob.py::norm_plan``, and each norm class's
    forward checked against its form), read from the module tree built on the meta device from config.json: no
    weight is loaded. A hub model not cached here is checked when the actor first scores a batch."""
    advantage = args.algo.advantage
    if advantage.baseline != "opob" or advantage.opob_norm != "full":
        return
    path = args.actor.model_name_or_path
    folder = _model_folder(path)
    if folder is None:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from openrlhf_ess.trainer import opob

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    except Exception as e:  # the model check reports an unreadable folder; a class not built here is run-time's
        notices.append(
            f"--algo.advantage.opob_norm full: {path}'s module tree could not be built on the meta device "
            f"({first_line(e)}); its modules are checked when the actor first scores a batch."
        )
        return
    try:
        opob.check_scale_forms(model)  # norm_plan's refusals, and each norm class's forward against its form
    except ValueError as e:
        raise ConfigError(f"--actor.model_name_or_path {path}: {e}") from None


def _model_folder(path: str) -> Optional[str]:
    """The local folder of a model flag: the folder itself, or a hub id's cached snapshot; None if neither."""
    if os.path.isdir(path):
        return path
    if not hub_id_form(path):
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
    vLLM refuses it at start-up with only "1 validation error for ModelConfig"."""
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
