"""--algo.vcpo_enable resolves to VCPO's reference recipe (mit-han-lab/vcpo,
recipe/fully_async_policy/shell/vcpo/math/vcpo_k=10.sh), each setting overridable, and its refusals name the flag
the user passed. The expected values are written out here from the reference script, not read from our table."""

import pytest

from openrlhf_ess import config

# The reference script's settings, in our flags (docs/opob.md has the table with its lines).
REFERENCE = {
    "ess_lr_enable": True,  # ess_scaling=True
    "ess_lr_weight": "seq_product",  # ess_scaling_use_clipped=False: the untruncated trajectory ratio
    "ess_lr_rule": "sqrt",  # ess_scaling_scaling_rule="sqrt"
    "tis_level": "seq_product",  # rollout_is="sequence"
    "tis_cap": 8.0,  # rollout_is_threshold="8.0"
}


def _argv(world, *extra):
    """The config tests' base flags without their estimator (the recipe sets GRPO), on 4 prompts per step."""
    from tests.test_config import _base

    argv = _base(world)
    at = argv.index("--algo.advantage.estimator")
    del argv[at : at + 2]
    return argv + [
        "--rollout.batch_size",
        "4",
        "--rollout.micro_batch_size",
        "1",
        "--actor.num_gpus_per_node",
        "1",
        *extra,
    ]


def test_vcpo_enable_is_the_reference_recipe(tiny_world):
    from openrlhf_ess.cli import train_ppo_ray as cli

    args, notices = cli.parse_args(_argv(tiny_world, "--algo.vcpo_enable"))
    for name, value in REFERENCE.items():
        assert getattr(args.algo, name) == value, name
    assert args.algo.advantage.baseline == "opob"  # grad_baselining=True
    assert args.algo.advantage.opob_weight == "seq_product"  # grad_baselining_use_clipped_is_ratios=False
    assert args.algo.advantage.opob_norm == "full"  # ‖g_i‖ of every parameter (update_policy_per_traj)
    assert args.algo.advantage.estimator == "group_norm"  # adv_estimator=grpo, grad_baselining_norm_by_std=True
    assert tuple(args.actor.eps_clip_low_high) == (1.0, 1e9)  # clip_ratio_low=1.0, clip_ratio_high=1e9
    assert args.actor.dual_clip is None  # clip_ratio_c=1e9: no dual clip
    assert args.actor.loss_agg_mode == "seq-mean-token-mean"  # loss_agg_mode
    assert args.rollout.n_samples_per_prompt == 16  # n_resp_per_prompt=16
    assert args.algo.prox_mode == "recompute"  # π_old = the policy at the step's start, as the reference's sg(π_θ)
    # one optimizer step per rollout batch (num_minibatches_per_update=1, updates_per_param_sync=1): 4 prompts x 16
    assert args.train.max_epochs == 1 and args.train.batch_size == 4 * 16
    assert args.algo.ess_lr_floor <= 1 / (64**0.5)  # no floor in the reference: ours never binds at this B
    (recipe,) = [n for n in notices if n.startswith("--algo.vcpo_enable")]
    assert "--algo.tis_cap 8" in recipe and "--rollout.n_samples_per_prompt 16" in recipe


def test_every_recipe_setting_is_overridable(tiny_world):
    from openrlhf_ess.cli import train_ppo_ray as cli

    extra = ["--algo.vcpo_enable", "--algo.tis_cap", "2", "--algo.tis_level", "seq"]
    extra += [
        "--rollout.n_samples_per_prompt",
        "4",
        "--train.batch_size",
        "8",
        "--actor.eps_clip_low_high",
        "0.2",
        "0.3",
    ]
    extra += ["--algo.advantage.estimator", "rloo", "--algo.ess_lr_weight", "geo_mean"]
    args, notices = cli.parse_args(_argv(tiny_world, *extra))
    assert (args.algo.tis_cap, args.algo.tis_level) == (2.0, "seq")
    assert args.rollout.n_samples_per_prompt == 4 and args.train.batch_size == 8
    assert tuple(args.actor.eps_clip_low_high) == (0.2, 0.3)
    assert args.algo.advantage.estimator == "rloo" and args.algo.ess_lr_weight == "geo_mean"
    assert args.algo.advantage.opob_weight == "seq_product"  # not passed: the recipe's
    (recipe,) = [n for n in notices if n.startswith("--algo.vcpo_enable")]
    assert "kept as passed: " in recipe and "--algo.tis_cap" in recipe.split("kept as passed: ")[1]


def test_without_the_flag_nothing_changes(tiny_world):
    """Default off: the recipe touches no flag (the parsed namespaces are equal with and without our recipe code)."""
    from openrlhf_ess.cli import train_ppo_ray as cli

    parser = cli.build_parser()
    argv = _argv(tiny_world)
    plain = vars(parser.parse_args(argv))
    flat = parser.parse_args(argv)
    assert config.apply_vcpo_recipe(flat, config.given_dests(parser, argv)) == []
    assert {k: v for k, v in vars(flat).items() if k != config.VCPO_APPLIED} == plain
    args, _ = cli.parse_args(argv)
    assert args.algo.tis_cap is None and args.algo.tis_level == "token" and args.train.batch_size == 128


@pytest.mark.parametrize(
    "extra,named,fix",
    [
        (["--algo.advantage.estimator", "gae"], "--algo.vcpo_enable", "--algo.advantage.baseline estimator"),
        (["--ds.packing_samples"], "--algo.vcpo_enable", "Drop those flags"),
        (
            ["--algo.advantage.baseline", "opob", "--algo.advantage.estimator", "gae"],
            "--algo.advantage.baseline opob",
            "drop it",
        ),
    ],
)
def test_refusals_name_the_flag_the_user_passed(tiny_world, extra, named, fix):
    from openrlhf_ess.cli import train_ppo_ray as cli

    flags = ["--algo.vcpo_enable"] if named == "--algo.vcpo_enable" else []
    with pytest.raises(config.ConfigError) as err:
        cli.parse_args(_argv(tiny_world, *flags, *extra))
    message = str(err.value)
    assert message.startswith(named) and fix in message
    if named == "--algo.vcpo_enable":
        assert "or drop it" not in message  # the user never passed --algo.advantage.baseline opob


def test_seq_product_level_alone_defaults_its_cap_to_8(tiny_world):
    from openrlhf_ess.cli import train_ppo_ray as cli

    args, notices = cli.parse_args(_argv(tiny_world, "--algo.tis_level", "seq_product"))
    assert args.algo.tis_cap == 8.0
    assert any("truncated at --algo.tis_cap 8" in n for n in notices)
    with pytest.raises(config.ConfigError, match="--algo.tis_level is set but --algo.tis_cap is not"):
        cli.parse_args(_argv(tiny_world, "--algo.tis_level", "seq"))


def test_help_lists_what_the_recipe_sets():
    from openrlhf_ess.cli import train_ppo_ray as cli

    text = cli.build_parser().format_help()
    start = text.rindex("--algo.vcpo_enable")  # its entry, after the usage line
    block = " ".join(text[start : start + 1500].split())
    for shown in ("--algo.tis_level seq_product", "--algo.tis_cap 8", "--actor.eps_clip_low_high 1 1e+09"):
        assert shown in block, shown


@pytest.mark.stack
def test_the_recipe_trains_through_the_cli(tiny_world, tmp_path):
    """The tiny CPU variant of the recipe, end to end (vLLM CPU engine, DeepSpeed, async with partial rollouts): the
    recipe's GRPO estimator, a group of 4 instead of 16 and 8 prompts a step (both passed, so kept). Every step
    logs the trajectory-ratio TIS weights (at most 8), ρ from product weights and its LR scale by the sqrt rule
    without a binding floor, and a baseline inside the rewards' range."""
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir, steps_prompts=16)
    at = args.index("--algo.advantage.estimator")
    del args[at : at + 2]  # the recipe's group_norm
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.vcpo_enable"]
    rc, log = run_cli(args + flags, run_dir)
    assert rc == 0, log[-5000:]
    assert "--algo.vcpo_enable: VCPO's reference recipe: --algo.ess_lr_enable" in log
    tb = read_tensorboard(run_dir)
    steps = len(tb["train/rho_ess"])
    assert steps == 2
    for (_, rho), (_, scale) in zip(tb["train/rho_ess"], tb["train/lr_scale"]):
        assert 0 < rho <= 1 + 1e-6
        assert scale == pytest.approx(max(1e-3, min(1.0, rho**0.5)), rel=1e-5)
    assert all(0 < v <= 8 + 1e-5 for _, v in tb["train/tis/max_weight"])
    assert all(0 <= v <= 1 for _, v in tb["train/opob/baseline"])  # digit-fraction rewards are in [0, 1]
    assert all(v > 0 for _, v in tb["train/opob/grad_norm_mean"])
    assert len(tb["train/policy_loss"]) == steps and all(abs(v) < 1e3 for _, v in tb["train/policy_loss"])


@pytest.mark.stack
def test_the_baseline_under_bypass_with_whole_model_norms_trains_through_the_cli(tiny_world, tmp_path):
    """π_prox = μ (--algo.prox_mode bypass) with the optimal baseline over every parameter's norm, async with
    partial rollouts: the actor's make-experience forward runs for the norms alone (π_prox stays μ: no recompute
    forward counted), and every step logs a baseline inside the rewards' range from positive, unequal norms."""
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir, steps_prompts=16)
    at = args.index("--algo.advantage.estimator")
    args[at + 1] = "group_norm"
    flags = [
        "--train.async_enable",
        "--train.partial_rollout_enable",
        "--algo.prox_mode",
        "bypass",
        "--algo.advantage.baseline",
        "opob",
        "--algo.advantage.opob_norm",
        "full",
    ]
    rc, log = run_cli(args + flags, run_dir)
    assert rc == 0, log[-5000:]
    tb = read_tensorboard(run_dir)
    assert len(tb["train/opob/baseline"]) == 2
    assert all(0 <= v <= 1 for _, v in tb["train/opob/baseline"])  # digit-fraction rewards are in [0, 1]
    assert all(v > 0 for _, v in tb["train/opob/grad_norm_mean"])
    assert all(v > 0 for _, v in tb["train/opob/grad_norm_rel_spread"])
    assert all(v == 0 for _, v in tb["train/prox/recompute_forwards"])
