"""Bad flag combinations are rejected by parse_args, before Ray starts or any model loads, with a
message naming the flags. Each row: extra flags, a regex the message must match."""

import os
import shlex

import pytest

from openrlhf_ess import config
from openrlhf_ess.cli import train_ppo_ray as cli

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "bad_inputs.md")


def _doc_rows(preflight: bool = False):
    """(flags, error name, message) for each row of a bad-input table in docs/bad_inputs.md: the rows rejected by
    parse_args, or (``preflight``) those rejected by ``checks.preflight.check`` (tests/test_preflight.py)."""
    rows = []
    for line in open(DOC):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`--") and ("pre-flight" in cells[1]) == preflight:
            flags = shlex.split(cells[0].strip("`"))
            rows.append((flags, cells[1].split()[0], cells[2].strip("`")))
    return rows


BAD = _doc_rows()


def _base(world, attn="sdpa"):
    return [
        "--actor.model_name_or_path",
        world["model"],
        "--data.prompt_dataset",
        world["prompts"],
        "--reward.remote_url",
        world["reward"],
        "--vllm.num_engines",
        "1",
        "--ds.attn_implementation",
        attn,
        "--algo.advantage.estimator",
        "reinforce",
    ]


def test_the_table_is_whole():
    assert len(BAD) >= 30


@pytest.mark.parametrize("extra,error,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_table(tiny_world, extra, error, message):
    expected = {"ConfigError": config.ConfigError, "AssertionError": AssertionError}[error]
    argv = _base(tiny_world)
    if any(flag.startswith("--actor.model_name_or_path=") for flag in extra):  # a row that blanks the model
        i = argv.index("--actor.model_name_or_path")
        del argv[i : i + 2]
    with pytest.raises(expected) as info:
        cli.parse_args(argv + extra)
    assert message in str(info.value), str(info.value)


def test_cpu_rejects_flash_attention(tiny_world):
    with pytest.raises(config.ConfigError, match="--ds.attn_implementation sdpa"):
        cli.parse_args(_base(tiny_world, attn="flash_attention_2"))


@pytest.mark.parametrize(
    "drop,message",
    [
        ("--actor.model_name_or_path", "--actor.model_name_or_path is required"),
        ("--data.prompt_dataset", "--data.prompt_dataset is required"),
        ("--reward.remote_url", "no reward source"),
    ],
)
def test_missing_required(tiny_world, drop, message):
    argv = _base(tiny_world)
    i = argv.index(drop)
    del argv[i : i + 2]
    with pytest.raises(config.ConfigError, match=message):
        cli.parse_args(argv)


def test_ess_lr_turns_on_rollout_logprobs_and_says_so(tiny_world):
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs

    args, notices = cli.parse_args(_base(tiny_world) + ["--algo.ess_lr_enable"])
    assert any("log-probs" in n for n in notices)
    kw = engine_kwargs(args)
    assert kw["force_logprobs"] and kw["logprobs_mode"] == "processed_logprobs"
    off, _ = cli.parse_args(_base(tiny_world))
    assert "force_logprobs" not in engine_kwargs(off)  # default: upstream's engine arguments


@pytest.mark.parametrize("style", ["paper", "code"])
def test_m2po_turns_on_rollout_logprobs_and_our_controllers(tiny_world, style):
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs

    m2po = ["--algo.m2po_tau", "0.04", "--algo.m2po_style", style, "--rollout.batch_size", "8"]
    args, notices = cli.parse_args(_base(tiny_world) + m2po + ["--train.batch_size", "8"])
    assert (args.algo.m2po_tau, args.algo.m2po_style) == (0.04, style)
    assert config.m2po_on(args) and config.needs_our_controllers(args)
    assert engine_kwargs(args)["force_logprobs"]
    assert any("the policy loss is M2PO's" in n and "--actor.eps_clip_low_high is not used" in n for n in notices)
    off, _ = cli.parse_args(_base(tiny_world))
    assert off.algo.m2po_tau is None and not config.m2po_on(off)


def test_cpu_default_sync_backend_is_reload(tiny_world):
    args, notices = cli.parse_args(_base(tiny_world))
    assert args.vllm.sync_backend == "reload"
    assert any("nccl -> reload" in n for n in notices)


def test_token_tis_leaves_upstreams_is_correction_flags_alone(tiny_world):
    """Our loss applies the TIS weight at every level (models/loss.py): upstream's own IS correction stays off."""
    args, _ = cli.parse_args(_base(tiny_world) + ["--algo.tis_cap", "2"])
    assert (args.algo.tis_cap, args.algo.tis_level) == (2.0, "token")
    assert args.algo.advantage.is_correction_level == "off"


def test_snapshot_lag_bound_lowers_the_requirement(tiny_world):
    flags = ["--algo.prox_mode", "snapshot", "--algo.prox_snapshots", "2", "--train.async_enable"]
    flags += ["--train.async_queue_size", "4", "--algo.max_version_lag", "1"]
    args, _ = cli.parse_args(_base(tiny_world) + flags)  # lag <= 1 needs versions V and V-1 only
    assert args.algo.prox_snapshots == 2


def test_critic_only_steps_are_announced(tiny_world):
    argv = _base(tiny_world) + ["--algo.ess_lr_enable", "--critic.freezing_steps", "5"]
    argv[argv.index("--algo.advantage.estimator") + 1] = "gae"  # a critic exists
    _, notices = cli.parse_args(argv)
    assert any("--critic.freezing_steps 5" in n and "never scaled" in n for n in notices)


def test_reward_failure_policy_needs_rule_based_rewards(tiny_world):
    argv = _base(tiny_world) + ["--reward.failure_policy", "drop"]
    i = argv.index("--reward.remote_url")
    argv[i : i + 2] = ["--reward.model_name_or_path", tiny_world["model"]]
    with pytest.raises(config.ConfigError, match="--reward.failure_policy drop watches rule-based rewards"):
        cli.parse_args(argv)


def test_which_flags_bring_our_controllers(tiny_world):
    plain, _ = cli.parse_args(_base(tiny_world))
    assert not config.needs_our_controllers(plain)  # default: upstream's controllers, untouched
    for flags in (["--algo.tis_cap", "2"], ["--algo.max_version_lag", "2"], ["--reward.failure_policy", "drop"]):
        args, _ = cli.parse_args(_base(tiny_world) + flags)
        assert config.needs_our_controllers(args), flags


def test_score_at_sync_modes_accepted_and_dedicated_gets_a_device(tiny_world):
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs

    partial = ["--train.async_enable", "--train.partial_rollout_enable"]
    base, _ = cli.parse_args(_base(tiny_world) + partial)
    args, _ = cli.parse_args(_base(tiny_world) + partial + ["--algo.prox_mode", "interrupt"])
    assert engine_kwargs(args)["report_outgoing"] is True
    assert "report_outgoing" not in engine_kwargs(base)
    dedicated, _ = cli.parse_args(_base(tiny_world) + ["--train.async_enable", "--algo.prox_mode", "dedicated"])
    assert config.logical_gpus_needed(dedicated) == config.logical_gpus_needed(base) + 1
    assert config.logical_gpus_needed(args) == config.logical_gpus_needed(base)


def test_cpu_kv_cache_comes_from_the_flag_else_vllms_variable_else_1_gib(tiny_world, monkeypatch):
    """vLLM CPU lets VLLM_CPU_KVCACHE_SPACE replace the engine's kv_cache_memory_bytes, so the flag did nothing
    wherever the variable was set (scripts/env_cpu.sh set it). Now: the flag, else the variable, else 1 GiB; the
    engine kwargs carry the bytes, and the engine actor drops the variable (the real engine: test_e2e_cli.py)."""
    from openrlhf_ess.trainer.ray.vllm_engine import engine_kwargs

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args, notices = cli.parse_args(_base(tiny_world))
    assert args.vllm.cpu_kv_cache_gb == 1.0 and engine_kwargs(args)["kv_cache_memory_bytes"] == 1 << 30
    assert not any("KVCACHE" in n for n in notices)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    args, notices = cli.parse_args(_base(tiny_world))
    assert args.vllm.cpu_kv_cache_gb == 3.0 and engine_kwargs(args)["kv_cache_memory_bytes"] == 3 << 30
    args, notices = cli.parse_args(_base(tiny_world) + ["--vllm.cpu_kv_cache_gb", "0.25"])
    assert engine_kwargs(args)["kv_cache_memory_bytes"] == 1 << 28
    assert any("--vllm.cpu_kv_cache_gb 0.25 sizes" in n and "VLLM_CPU_KVCACHE_SPACE=3" in n for n in notices)
    _, notices = cli.parse_args(_base(tiny_world) + ["--vllm.cpu_kv_cache_gb", "0.25", "--ray.accelerator", "cuda"])
    assert not any("cpu_kv_cache_gb" in n for n in notices)  # with CUDA the flag sizes nothing: no notice
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(config.ConfigError, match="VLLM_CPU_KVCACHE_SPACE='lots' is not a number of GiB"):
        cli.parse_args(_base(tiny_world))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    with pytest.raises(config.ConfigError, match=r"--vllm.cpu_kv_cache_gb \(or VLLM_CPU_KVCACHE_SPACE\) must be > 0"):
        cli.parse_args(_base(tiny_world))
