"""--algo.prox_ewma_decay auto: β = age/(1+age) from the observed version lag, by hand numbers."""

import types

import pytest
import torch

from openrlhf_ess import config
from openrlhf_ess.models.corrections import ewma_decay_for_age
from openrlhf_ess.trainer import prox
from openrlhf_ess.trainer.prox_sources import ProxSources
from tests.test_config import _base  # the minimal valid command (tiny world, one engine)


def test_decay_for_age_by_hand():
    assert ewma_decay_for_age(0) == 0.0  # the live weights
    assert ewma_decay_for_age(1) == 0.5
    assert ewma_decay_for_age(3) == 0.75
    assert ewma_decay_for_age(9) == pytest.approx(0.9)  # the fixed default is a mean age of 9 steps
    # the mean age Σ_k k (1−β) βᵏ of the EWMA's weights is the age asked for
    beta = ewma_decay_for_age(4)
    assert sum(k * (1 - beta) * beta**k for k in range(2000)) == pytest.approx(4.0)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="age"):
            ewma_decay_for_age(bad)


def _scalar_module(value: float) -> torch.nn.Module:
    m = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(value)
    return m


def _set(m, value):
    with torch.no_grad():
        m.weight.fill_(value)


def test_ewma_weights_with_a_decay_per_update_by_hand():
    m = _scalar_module(1.0)
    ewma = prox.EwmaWeights("auto")
    ewma.update(m, 0.5)  # avg = 0.5·0 + 0.5·1 = 0.5; kept 0.5 → 0.5 / (1 − 0.5) = 1
    assert ewma.state()["weight"].item() == pytest.approx(1.0)
    _set(m, 2.0)
    ewma.update(m, 0.0)  # β = 0: avg = 2, kept 0 → the live weights, 2
    assert ewma.state()["weight"].item() == pytest.approx(2.0)
    _set(m, 3.0)
    ewma.update(m, 0.75)  # avg = 0.75·2 + 0.25·3 = 2.25, kept 0 → 2.25
    assert ewma.state()["weight"].item() == pytest.approx(2.25)
    with pytest.raises(ValueError, match="decay"):
        ewma.update(m)  # auto needs the step's β
    # checkpoint round trip keeps the product of the decays
    again = prox.EwmaWeights("auto")
    again.load_state_dict(ewma.state_dict())
    assert again.state()["weight"].item() == pytest.approx(2.25) and again.kept == 0.0


def test_fixed_decay_is_unchanged():
    m = _scalar_module(1.0)
    ewma = prox.EwmaWeights(0.9)
    ewma.update(m)
    _set(m, 2.0)
    ewma.update(m)
    # avg = 0.9·0.1 + 0.1·2 = 0.29; 1 − 0.9² = 0.19
    assert ewma.state()["weight"].item() == pytest.approx(0.29 / 0.19)
    legacy = {"decay": 0.9, "n": 2, "avg": {"weight": torch.tensor([[0.29]])}}  # saved before "kept" existed
    old = prox.EwmaWeights(0.9)
    old.load_state_dict(legacy)
    assert old.state()["weight"].item() == pytest.approx(0.29 / 0.19)


def _independent(thetas, betas):
    """Closed form of the bias-corrected EWMA with per-step decays: θ̂ = Σ_k θ_k (1−β_k) Π_{j>k} β_j / (1 − Π_j β_j)."""
    total, kept = 0.0, 1.0
    for k, (theta, beta) in enumerate(zip(thetas, betas)):
        later = 1.0
        for b in betas[k + 1 :]:
            later *= b
        total += theta * (1 - beta) * later
        kept *= beta
    return total / (1 - kept)


def test_prox_sources_sets_each_steps_decay_from_the_observed_lag():
    module = _scalar_module(1.0)
    engine = types.SimpleNamespace(module=module, global_steps=0)
    algo = types.SimpleNamespace(
        prox_mode="ewma", prox_ewma_decay="auto", prox_snapshots=4, prox_ewma_style="batch", prox_ewma_ref_batch=None
    )
    src = ProxSources(types.SimpleNamespace(algo=algo), engine, partitioned=False)

    def scored(versions, weight_version):
        current = torch.zeros(versions.shape)
        return src.log_probs(
            current, versions, lambda: torch.full(versions.shape, module.weight.item()), weight_version
        )

    # batch at version 2: tokens of versions 0, 0, 2 (lags 2, 2, 0; −1 is a prompt column) → mean lag 4/3
    out = scored(torch.tensor([[-1, 0, 0, 2]]), weight_version=2)
    assert torch.equal(out, torch.zeros(1, 4))  # no optimizer step yet: the live weights' log-probs
    engine.global_steps = 1
    src.after_optimizer_step()
    assert src.ewma_decay_used == pytest.approx((4 / 3) / (1 + 4 / 3))  # 4/7
    _set(module, 2.0)
    engine.global_steps = 2
    src.after_optimizer_step()  # no token scored since: the previous lag, 4/3
    assert src.ewma_decay_used == pytest.approx(4 / 7)
    src.after_sync(3)  # 2 optimizer steps in this version
    out = scored(torch.tensor([[2, 2, -1]]), weight_version=3)  # lag 1 version = 2 optimizer steps
    # the forward ran with the EWMA of θ = 1, 2 with decays 4/7, 4/7 swapped in
    assert out[0, 0].item() == pytest.approx(_independent([1.0, 2.0], [4 / 7, 4 / 7]), rel=1e-6)
    assert module.weight.item() == 2.0  # the live weights are back
    _set(module, 3.0)
    engine.global_steps = 3
    src.after_optimizer_step()
    assert src.ewma_decay_used == pytest.approx(2 / 3)  # age 1 × 2 = 2 steps
    expected = _independent([1.0, 2.0, 3.0], [4 / 7, 4 / 7, 2 / 3])
    assert src.ewma.state()["weight"].item() == pytest.approx(expected, rel=1e-6)
    assert src.metrics()["prox/ewma_decay"] == pytest.approx(2 / 3)


def test_flag_parses_auto_and_numbers_and_names_itself_when_wrong(tiny_world, capsys):
    from openrlhf_ess.cli import train_ppo_ray as cli

    args, _ = cli.parse_args(_base(tiny_world) + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "auto"])
    assert args.algo.prox_ewma_decay == "auto"
    args, _ = cli.parse_args(_base(tiny_world) + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "0.8"])
    assert args.algo.prox_ewma_decay == 0.8
    args, _ = cli.parse_args(_base(tiny_world))
    assert args.algo.prox_ewma_decay == 0.9  # default unchanged
    with pytest.raises(SystemExit):
        cli.parse_args(_base(tiny_world) + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "fast"])
    assert "--algo.prox_ewma_decay" in capsys.readouterr().err
    with pytest.raises(config.ConfigError, match="--algo.prox_ewma_decay .*recompute"):
        cli.parse_args(_base(tiny_world) + ["--algo.prox_ewma_decay", "auto"])


@pytest.mark.real_stack
@pytest.mark.slow
def test_auto_decay_through_the_cli(tiny_world, tmp_path):
    """Async queue 2 on the real stack: each step's logged β is lag/(1+lag) of the lag the step's batch had
    (one optimizer step per version here, so the age in steps is the lag in versions)."""
    from tests.helpers.e2e import read_tensorboard, run_cli, tiny_args

    run_dir = str(tmp_path)
    args = tiny_args(tiny_world, run_dir, steps_prompts=48)
    flags = ["--train.async_enable", "--train.async_queue_size", "2", "--algo.tis_cap", "2"]
    flags += ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "auto"]
    rc, log = run_cli(args + flags, run_dir)
    assert rc == 0, log[-5000:]
    tb = read_tensorboard(run_dir)
    decay = dict(tb["train/prox/ewma_decay"])
    lag = dict(tb["train/version_lag/mean"])
    print(f"[ewma auto] lag {lag} decay {decay}")
    assert len(decay) >= 3 and any(lag[s] > 0 for s in decay)  # 4 steps logged here (lags 0, 1, 2, 2)
    for step, beta in decay.items():
        assert beta == pytest.approx(lag[step] / (1 + lag[step]), abs=1e-6), (step, lag, decay)


def test_ewma_host_memory_is_one_fp32_copy_plus_one_parameter():
    """The EWMA once held three fp32 copies of the model on the host (the average, a full fp32 copy of
    the live weights at every update, a full bias-corrected copy at every swap). Now: the average, plus one
    parameter at a time. Measured with torch's allocator events (tests/test_prox_scoring_memory.py)."""
    from benchmarks.common import peak_allocated_bytes

    layers = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(8)]).to(torch.bfloat16)
    param = 256 * 256 * 4  # one parameter in fp32
    model = 8 * param
    ewma = prox.EwmaWeights(0.9)
    ewma.update(layers)  # allocates the average itself: 8 parameters in fp32
    assert ewma.nbytes() == model
    update_peak = peak_allocated_bytes(lambda: ewma.update(layers))
    assert update_peak <= 2 * param, update_peak  # one fp32 parameter (+ its temporary), never the whole model

    def swap_forward():
        with prox.swapped_weights(layers, ewma.state()):
            pass

    swap_peak = peak_allocated_bytes(swap_forward)
    assert swap_peak <= model // 2 + 2 * param, swap_peak  # the bf16 swapped-in weights + one fp32 parameter
    # the values: two updates with the same weights θ give θ̄ = 0.9·0.1θ + 0.1θ = 0.19θ, corrected by 1 − 0.9² = 0.19
    first = next(iter(layers.parameters())).detach().float()
    assert torch.allclose(ewma.state()["0.weight"], first, rtol=1e-6, atol=0)


# ---- PPO-EWMA as Hilton et al. published it (--algo.prox_ewma_style hilton) ---------------------------------


def test_hilton_average_starts_at_theta0_with_weight_one_by_hand():
    m = _scalar_module(1.0)  # θ0 = 1
    ewma = prox.EwmaWeights(0.5, "hilton")
    ewma.start(m)
    assert ewma.state()["weight"].item() == 1.0  # θ̄0 = θ0: no step yet, π_prox = the initial policy
    _set(m, 3.0)
    ewma.update(m)  # W1 = 0.5·1 + 1 = 1.5; θ̄1 = (0.5·1·1 + 3) / 1.5 = 7/3
    assert ewma.state()["weight"].item() == pytest.approx(7 / 3)
    _set(m, 5.0)
    ewma.update(m)  # weights β², β, 1 = 0.25, 0.5, 1 over 1, 3, 5: (0.25 + 1.5 + 5) / 1.75 = 27/7
    assert ewma.state()["weight"].item() == pytest.approx(27 / 7) and ewma.total == pytest.approx(1.75)
    again = prox.EwmaWeights(0.5, "hilton")
    again.load_state_dict(ewma.state_dict())
    assert again.state()["weight"].item() == pytest.approx(27 / 7) and again.total == pytest.approx(1.75)
    with pytest.raises(ValueError, match="--algo.prox_ewma_style hilton"):  # a batch-style run cannot take it
        prox.EwmaWeights(0.5, "batch").load_state_dict(ewma.state_dict())
    with pytest.raises(RuntimeError, match="start"):
        prox.EwmaWeights(0.5, "hilton").update(m)


def test_hilton_batch_size_rule_keeps_the_decay_per_sample():
    from openrlhf_ess.models.corrections import ewma_decay_for_batch

    assert ewma_decay_for_batch(0.9, 32, 32) == 0.9
    assert ewma_decay_for_batch(0.9, 64, 32) == pytest.approx(0.81)  # twice the batch: β² per step
    assert ewma_decay_for_batch(0.9, 16, 32) == pytest.approx(0.9**0.5)
    # the same decay per sample at every batch size: β_B^(1/B) = β_ref^(1/B_ref)
    for batch in (8, 48, 256):
        assert ewma_decay_for_batch(0.9, batch, 32) ** (1 / batch) == pytest.approx(0.9 ** (1 / 32))
    with pytest.raises(ValueError):
        ewma_decay_for_batch(1.0, 8, 8)


def test_hilton_flags_parse_and_prox_sources_start_from_the_initial_weights(tiny_world):
    from openrlhf_ess.cli import train_ppo_ray as cli

    args, _ = cli.parse_args(
        _base(tiny_world)
        + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "hilton", "--algo.prox_ewma_ref_batch", "64"]
        + ["--train.batch_size", "128", "--rollout.batch_size", "128"]
    )
    engine = types.SimpleNamespace(module=_scalar_module(2.0), global_steps=0)
    sources = ProxSources(args, engine, partitioned=False)
    assert sources.per_minibatch and sources.ewma.decay == pytest.approx(0.81)  # 0.9^(128/64)
    assert sources.ewma.state()["weight"].item() == 2.0
    for extra, message in (
        (["--algo.prox_ewma_style", "batch"], "only apply to --algo.prox_mode ewma"),  # hilton is the default
        (["--algo.prox_mode", "ewma", "--algo.prox_ewma_ref_batch", "0"], "must be >= 1 sample"),
        (
            ["--algo.prox_mode", "ewma", "--algo.prox_ewma_decay", "auto", "--algo.prox_ewma_ref_batch", "8"],
            "with auto the decay comes from the observed lag",
        ),
    ):
        with pytest.raises(config.ConfigError, match=message):
            cli.parse_args(_base(tiny_world) + extra)


def test_the_default_ewma_style_is_hilton_s(tiny_world):
    """At the same β, Hilton's published PPO-EWMA beat our batch style on both test rewards
    (docs/staleness_target.md Parts 5 and 6), so it is the default; batch stays selectable."""
    from openrlhf_ess.cli import train_ppo_ray as cli

    args, _ = cli.parse_args(_base(tiny_world) + ["--algo.prox_mode", "ewma"])
    assert args.algo.prox_ewma_style == "hilton"
    args, _ = cli.parse_args(_base(tiny_world) + ["--algo.prox_mode", "ewma", "--algo.prox_ewma_style", "batch"])
    assert args.algo.prox_ewma_style == "batch"
