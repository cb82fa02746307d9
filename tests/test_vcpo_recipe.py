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


# The reference's optimizer, each with the reference's source and upstream's default it replaces:
# (dest, the parsed args' path, the reference's value, upstream's default, how the notice shows it).
REFERENCE_OPTIMIZER = [
    # Megatron's Adam: verl/utils/megatron/optimizer.py passes no betas, so OptimizerConfig's adam_beta1=0.9,
    # adam_beta2=0.999 (upstream: 0.95, a second moment averaged over ~1/(1-0.95) = 20 steps instead of ~1,000)
    ("actor.adam.betas", ("actor", "adam", "betas"), (0.9, 0.999), (0.9, 0.95), "--actor.adam.betas 0.9 0.999"),
    ("actor.adam.weight_decay", ("actor", "adam", "weight_decay"), 0.1, 0.0, "--actor.adam.weight_decay 0.1"),
    (
        "actor.lr_scheduler",
        ("actor", "lr_scheduler"),
        "constant",
        "cosine_with_min_lr",
        "--actor.lr_scheduler constant",
    ),
    ("actor.lr_warmup_ratio", ("actor", "lr_warmup_ratio"), 0.0, 0.03, "--actor.lr_warmup_ratio 0"),
    ("algo.kl.init_coef", ("algo", "kl", "init_coef"), 0.0, 0.01, "--algo.kl.init_coef 0"),
]
# a value of each that is neither the reference's nor upstream's, for the user-wins test
USER_VALUE = {
    "actor.adam.betas": (["0.8", "0.99"], (0.8, 0.99)),
    "actor.adam.weight_decay": (["0.05"], 0.05),
    "actor.lr_scheduler": (["linear"], "linear"),
    "actor.lr_warmup_ratio": (["0.1"], 0.1),
    "algo.kl.init_coef": (["0.002"], 0.002),
}


def _at(args, path):
    for name in path:
        args = getattr(args, name)
    return tuple(args) if isinstance(args, list) else args


@pytest.mark.parametrize(
    "dest,path,reference,upstream,shown", REFERENCE_OPTIMIZER, ids=[r[0] for r in REFERENCE_OPTIMIZER]
)
def test_the_recipe_sets_the_reference_optimizer(tiny_world, dest, path, reference, upstream, shown):
    """Each optimizer setting of the reference, set by the flag alone and listed in the start-up notice; without the
    flag upstream's default stands (so the recipe, not the default, gives the reference's value)."""
    from openrlhf_ess.cli import train_ppo_ray as cli

    args, notices = cli.parse_args(_argv(tiny_world, "--algo.vcpo_enable"))
    assert _at(args, path) == reference
    (recipe,) = [n for n in notices if n.startswith("--algo.vcpo_enable")]
    assert shown in recipe.split("; kept as passed")[0]
    plain, _ = cli.parse_args(_argv(tiny_world, "--algo.advantage.estimator", "reinforce"))
    assert _at(plain, path) == upstream


@pytest.mark.parametrize("dest", list(USER_VALUE))
def test_a_passed_optimizer_setting_wins(tiny_world, dest):
    """The user's value stands, the notice names it as kept, and the other settings are still the recipe's."""
    from openrlhf_ess.cli import train_ppo_ray as cli

    typed, value = USER_VALUE[dest]
    extra = ["--algo.vcpo_enable", f"--{dest}", *typed]
    if dest == "algo.kl.init_coef":  # a reference model is placed: the recipe's colocation rules do not apply here
        extra += ["--ref.num_gpus_per_node", "1"]
    args, notices = cli.parse_args(_argv(tiny_world, *extra))
    for other, path, reference, _, shown in REFERENCE_OPTIMIZER:
        (recipe,) = [n for n in notices if n.startswith("--algo.vcpo_enable")]
        set_part, _, kept_part = recipe.partition("; kept as passed: ")
        if other == dest:
            assert _at(args, path) == value
            assert f"--{dest}" in kept_part and f"--{dest}" not in set_part
        else:
            assert _at(args, path) == reference and shown in set_part, other


def test_kl_off_places_no_reference_model(tiny_world):
    """Upstream's own train() (cli/train_ppo_ray.py), run with Ray, DeepSpeed and the engines replaced by recorders:
    under the recipe it builds the policy's actor group and no reference model group, and hands the controller no
    reference model; the same command with a KL coefficient passed builds one (the recorder can see it). The
    resource count our pre-flight asks Ray for leaves the reference's GPUs out likewise."""
    import types

    from openrlhf_ess import upstream
    from openrlhf_ess.cli import train_ppo_ray as cli
    from openrlhf_ess.config import resolve

    def placed(argv):
        args, _ = cli.parse_args(argv)
        groups, handed = [], {}

        class Group:  # upstream's RayActorGroup(num_nodes, num_gpus_per_node, actor_class, ...)
            def __init__(self, nodes, gpus, actor_class, **kwargs):
                groups.append(actor_class)

            def async_init_model_from_pretrained(self, *a, **k):
                return []

            def async_save_model(self):
                return []

        class Trainer:  # the controller: records the reference model it is given
            @classmethod
            def remote(cls, pretrain, strategy, actor, critic, reward, reference, *a, **k):
                handed["reference"] = reference
                remote = types.SimpleNamespace(remote=lambda: None)
                return types.SimpleNamespace(get_max_steps=remote, fit=remote)

        fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get=lambda refs: refs)
        module = upstream.upstream_cli_module()
        run = upstream.rebind(
            module.train,
            {
                "ray": fake_ray,
                "RayActorGroup": Group,
                "get_strategy": lambda a: types.SimpleNamespace(print=lambda *x: None),
                "create_vllm_engines": lambda *a, **k: [],
                "placement_group": lambda *a, **k: types.SimpleNamespace(ready=lambda: None),
            },
            {
                "openrlhf.trainer.ppo_trainer": {"PPOTrainer": Trainer},
                "openrlhf.trainer.ppo_trainer_async": {"PPOTrainerAsync": Trainer},
            },
        )
        run(args)
        names = {id(module.PolicyModelActor): "policy", id(module.ReferenceModelActor): "reference"}
        return [names.get(id(g), g) for g in groups], handed["reference"], resolve.logical_gpus_needed(args)

    argv = _argv(tiny_world, "--algo.vcpo_enable")
    groups, reference, gpus = placed(argv)
    assert groups == ["policy"] and reference is None
    assert gpus == 1 + 1  # the actor's GPU and the engine's
    groups, reference, gpus = placed(argv + ["--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "1"])
    assert groups == ["policy", "reference"] and reference is not None
    assert gpus == 1 + 1 + 1


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--algo.vcpo_enable", "--rollout.n_samples_per_prompt", "1"], "--algo.vcpo_enable"),
        (  # the user's own baseline choice with the recipe's estimator: upstream would assert on group_norm
            ["--algo.vcpo_enable", "--algo.advantage.baseline", "estimator", "--rollout.n_samples_per_prompt", "1"],
            "--algo.vcpo_enable",
        ),
        (
            ["--algo.advantage.baseline", "opob", "--algo.advantage.estimator", "rloo"],
            "--algo.advantage.baseline opob",
        ),
    ],
)
def test_one_sample_per_prompt_is_refused_by_our_message(tiny_world, extra, named):
    """One sample per prompt with the recipe (or the baseline alone): our message, naming the flag the user passed
    and --rollout.n_samples_per_prompt, comes before upstream's bare "group_norm requires n_samples_per_prompt > 1"
    (an AssertionError, which the raises() below would not catch)."""
    from openrlhf_ess.cli import train_ppo_ray as cli

    argv = _argv(tiny_world, *extra)
    if "--algo.advantage.estimator" not in extra and "--algo.vcpo_enable" not in extra:
        argv += ["--algo.advantage.estimator", "group_norm"]
    with pytest.raises(config.ConfigError) as err:
        cli.parse_args(argv)
    message = str(err.value)
    assert message.startswith(f"{named} with --rollout.n_samples_per_prompt 1")
    assert "Set --rollout.n_samples_per_prompt >= 2" in message


@pytest.mark.parametrize("kl_flag", [["--algo.kl.use_loss"], ["--algo.kl.target", "0.1"]])
def test_a_kl_flag_without_a_coefficient_is_refused(tiny_world, kl_flag):
    """A KL loss or KL controller passed with the recipe's coefficient 0 would train without KL and say nothing:
    refused, naming the coefficient to pass; with the coefficient passed it trains with KL (a reference model)."""
    from openrlhf_ess.cli import train_ppo_ray as cli

    with pytest.raises(config.ConfigError, match=f"{kl_flag[0]} with --algo.vcpo_enable.*--algo.kl.init_coef C > 0"):
        cli.parse_args(_argv(tiny_world, "--algo.vcpo_enable", *kl_flag))
    extra = ["--algo.vcpo_enable", *kl_flag, "--algo.kl.init_coef", "1e-3", "--ref.num_gpus_per_node", "1"]
    args, _ = cli.parse_args(_argv(tiny_world, *extra))
    assert args.algo.kl.init_coef == 1e-3


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
    block = " ".join(text[start : start + 2500].split())
    for shown in (
        "--algo.tis_level seq_product",
        "--algo.tis_cap 8",
        "--actor.eps_clip_low_high 1 1e+09",
        "--actor.adam.betas 0.9 0.999",
        "--actor.adam.weight_decay 0.1",
        "--actor.lr_scheduler constant",
        "--actor.lr_warmup_ratio 0",
        "--algo.kl.init_coef 0",
    ):
        assert shown in block, shown


@pytest.mark.stack
def test_the_recipe_trains_through_the_cli(tiny_world, tmp_path):
    """The tiny CPU variant of the recipe, end to end (vLLM CPU engine, DeepSpeed, async with partial rollouts): the
    recipe's GRPO estimator and optimizer, a group of 4 instead of 16 and 8 prompts a step (both passed, so kept).
    Every step logs the trajectory-ratio TIS weights (at most 8), ρ from product weights and its LR scale by the sqrt
    rule without a binding floor, a baseline inside the rewards' range, and the scheduler's LR at the one passed
    (constant: upstream's cosine would have halved it by the second step)."""
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir, steps_prompts=16)
    for flag in ("--algo.advantage.estimator", "--algo.kl.init_coef", "--actor.lr_warmup_ratio"):
        at = args.index(flag)
        del args[at : at + 2]  # the recipe's: group_norm, no KL (no reference model), no warm-up
    flags = ["--train.async_enable", "--train.partial_rollout_enable", "--algo.vcpo_enable"]
    rc, log = run_cli(args + flags, run_dir)
    assert rc == 0, log[-5000:]
    assert "--algo.vcpo_enable: VCPO's reference recipe: --algo.ess_lr_enable" in log
    for shown in ("--actor.adam.betas 0.9 0.999", "--actor.lr_scheduler constant", "--algo.kl.init_coef 0"):
        assert shown in log, shown
    tb = read_tensorboard(run_dir)
    steps = len(tb["train/rho_ess"])
    assert steps == 2
    lr = float(args[args.index("--actor.adam.lr") + 1])
    assert [v for _, v in tb["train/actor_lr"]] == pytest.approx([lr] * steps, rel=1e-6)
    for (_, rho), (_, scale) in zip(tb["train/rho_ess"], tb["train/lr_scale"]):
        assert 0 < rho <= 1 + 1e-6
        assert scale == pytest.approx(max(1e-3, min(1.0, rho**0.5)), rel=1e-5)
    assert all(0 < v <= 8 + 1e-5 for _, v in tb["train/tis/max_weight"])
    assert all(0 <= v <= 1 for _, v in tb["train/opob/baseline"])  # digit-fraction rewards are in [0, 1]
    assert all(v > 0 for _, v in tb["train/opob/grad_norm_mean"])
    assert len(tb["train/policy_loss"]) == steps and all(abs(v) < 1e3 for _, v in tb["train/policy_loss"])
