"""Bad flag combinations are rejected by parse_args, before Ray starts or any model loads, with a
message naming the flags. Each row: extra flags, a regex the message must match."""

import pytest

from openrlhf_ess import config
from openrlhf_ess.cli import train_ppo_ray as cli

BAD = [
    (["--algo.ess_lr_enable", "--algo.ess_lr_floor", "0"], r"--algo.ess_lr_floor must be in \(0, 1\]"),
    (["--algo.ess_lr_enable", "--algo.ess_lr_floor", "1.5"], r"--algo.ess_lr_floor must be in \(0, 1\]"),
    (["--algo.ess_lr_enable", "--vllm.num_engines", "0"], r"--algo.ess_lr_enable needs .* --vllm.num_engines"),
    (["--algo.ess_lr_enable", "--actor.optim", "muon"], r"--actor.optim muon.*Use --actor.optim adam"),
    (["--algo.ess_lr_floor", "0.2"], r"--algo.ess_lr_enable is not"),
    (["--algo.ess_lr_rule", "linear"], r"--algo.ess_lr_enable is not"),
    (["--vllm.sync_backend", "gloo"], r"--vllm.sync_backend gloo does not work without CUDA"),
    (["--vllm.sync_backend", "shm"], r"--vllm.sync_backend 'shm' is unknown"),
    (["--vllm.sync_backend", "reload", "--vllm.sync_with_ray"], r"--vllm.sync_with_ray applies to nccl/gloo"),
    (["--vllm.cpu_kv_cache_gb", "0"], r"--vllm.cpu_kv_cache_gb must be > 0"),
    (["--algo.tis_cap", "0"], r"--algo.tis_cap must be > 0"),
    (["--algo.tis_cap", "2", "--algo.advantage.is_correction_level", "token"], r"not both"),
    (["--algo.tis_cap", "2", "--actor.policy_loss_type", "gspo"], r"use --actor.policy_loss_type ppo"),
    (["--algo.tis_level", "seq"], r"--algo.tis_cap is not"),
    (["--algo.max_version_lag", "-1"], r"--algo.max_version_lag must be >= 0"),
    (["--algo.kl.off_policy_k2_enable"], r"add --algo.kl.use_loss"),
    (
        ["--algo.kl.off_policy_k2_enable", "--algo.kl.use_loss", "--algo.kl.unbiased_gradient"],
        r"keep one",
    ),
    (["--algo.tis_cap", "2", "--vllm.num_engines", "0"], r"--vllm.num_engines >= 1"),
    (["--algo.prox_mode", "snapshot", "--ds.zero_stage", "3"], r"ZeRO-3 shards"),
    (
        [
            "--algo.prox_mode",
            "snapshot",
            "--algo.prox_snapshots",
            "2",
            "--train.async_enable",
            "--train.async_queue_size",
            "2",
            "--train.partial_rollout_enable",
        ],
        r"--algo.prox_snapshots 2 is smaller than the 4 versions",
    ),
    (["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "1"], r"--algo.prox_ewma_decay must be in \(0, 1\)"),
    (["--algo.prox_snapshots", "8"], r"--algo.prox_mode is recompute"),
]


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


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_combination_rejected(tiny_world, extra, message):
    with pytest.raises(config.ConfigError, match=message):
        cli.parse_args(_base(tiny_world) + extra)


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


def test_cpu_default_sync_backend_is_reload(tiny_world):
    args, notices = cli.parse_args(_base(tiny_world))
    assert args.vllm.sync_backend == "reload"
    assert any("nccl -> reload" in n for n in notices)


def test_token_tis_configures_upstream_flags(tiny_world):
    args, _ = cli.parse_args(_base(tiny_world) + ["--algo.tis_cap", "2"])
    adv = args.algo.advantage
    assert (adv.is_correction_level, adv.is_correction_mode, adv.is_correction_gating) == ("token", "clip", "ratio")
    assert adv.is_correction_threshold == [0.0, 2.0]


def test_snapshot_lag_bound_lowers_the_requirement(tiny_world):
    flags = ["--algo.prox_mode", "snapshot", "--algo.prox_snapshots", "2", "--train.async_enable"]
    flags += ["--train.async_queue_size", "4", "--algo.max_version_lag", "1"]
    args, _ = cli.parse_args(_base(tiny_world) + flags)  # lag <= 1 needs versions V and V-1 only
    assert args.algo.prox_snapshots == 2
