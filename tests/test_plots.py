"""openrlhf_ess.tools.plots: a synthetic tensorboard log with every plotted tag gives all five PNGs (through the
function and through ``python -m``), each a real image; a log with only train/reward gives only reward.png."""

import math
import os
import subprocess
import sys

import matplotlib.image
import pytest

from openrlhf_ess.tools import plots

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PNGS = ["reward.png", "ess_lr.png", "tis_weights.png", "version_lag.png", "mismatch.png"]
STEPS = range(1, 11)


def _values(step: int) -> dict:
    """Plausible values for every plotted tag at ``step`` (1..10): reward rises, staleness grows then settles."""
    rho = 0.4 + 0.05 * step
    lag_fracs = [0.5, 0.3, 0.15, 0.05] if step % 2 else [0.7, 0.2, 0.1, 0.0]  # sums to 1
    return {
        "train/reward": 0.1 + 0.08 * step,
        "train/rollout/reward_mean": 0.1 + 0.08 * step + 0.01,
        "train/rho_ess": rho,
        "train/lr_scale": max(math.sqrt(rho), 0.1),
        "train/actor_lr": 1e-6,
        "train/actor_lr_effective": 1e-6 * max(math.sqrt(rho), 0.1),
        "train/tis/mean_weight": 1.0 - 0.01 * step,
        "train/tis/max_weight": 2.0,
        "train/tis/clip_frac": 0.02 * step,
        "train/version_lag/mean": sum(i * f for i, f in enumerate(lag_fracs)),
        "train/version_lag/max": 3.0 if step % 2 else 2.0,
        "train/version_lag/frac_0": lag_fracs[0],
        "train/version_lag/frac_1": lag_fracs[1],
        "train/version_lag/frac_2": lag_fracs[2],
        "train/version_lag/frac_3+": lag_fracs[3],
        "train/mismatch/k1": 1e-3 * step,
        "train/mismatch/k3": 1.1e-3 * step,
        "train/mismatch/chi2": 2e-3 * step,
        "train/vllm_kl": 0.9e-3 * step,
    }


def _write_log(tb_dir, tags=None) -> None:
    """Tensorboard scalars for STEPS, as upstream's trainer logs them (SummaryWriter.add_scalar per tag)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb_dir))
    for step in STEPS:
        for tag, value in _values(step).items():
            if tags is None or tag in tags:
                writer.add_scalar(tag, value, step)
    writer.close()


def _assert_png(path) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path
    image = matplotlib.image.imread(path)
    # RGB(A); figures are 8 in wide at 100 dpi and 3.6 in tall per panel, so >= 800 x 360 pixels
    assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
    assert image.shape[0] >= 300 and image.shape[1] >= 700, image.shape
    # not a blank canvas: lines, text and fills give many distinct colours
    assert image.std() > 0.05, f"{path} looks blank"


@pytest.fixture
def full_log(tmp_path):
    tb_dir = tmp_path / "tensorboard"
    _write_log(tb_dir)
    return tb_dir


def test_make_plots_writes_every_figure(full_log, tmp_path):
    out_dir = tmp_path / "plots"
    written, skipped = plots.make_plots(str(full_log), str(out_dir))
    assert sorted(os.path.basename(p) for p in written) == sorted(ALL_PNGS)
    assert skipped == []
    for name in ALL_PNGS:
        _assert_png(out_dir / name)
    # two-panel figures are taller than the one-panel reward figure
    assert (
        matplotlib.image.imread(out_dir / "ess_lr.png").shape[0]
        > matplotlib.image.imread(out_dir / "reward.png").shape[0]
    )


def test_cli_writes_every_figure(full_log, tmp_path):
    out_dir = tmp_path / "cli_plots"
    run = subprocess.run(
        [sys.executable, "-m", "openrlhf_ess.tools.plots", str(full_log), str(out_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    for name in ALL_PNGS:
        assert f"wrote {out_dir / name}" in run.stdout, run.stdout
        _assert_png(out_dir / name)
    assert "skipped" not in run.stdout


def test_reward_only_log_gives_only_reward_plot(tmp_path, capsys):
    tb_dir, out_dir = tmp_path / "tensorboard", tmp_path / "plots"
    _write_log(tb_dir, tags={"train/reward"})
    plots.main([str(tb_dir), str(out_dir)])
    stdout = capsys.readouterr().out
    assert sorted(os.listdir(out_dir)) == ["reward.png"]
    _assert_png(out_dir / "reward.png")
    for name in ALL_PNGS[1:]:
        assert f"skipped {name}" in stdout, stdout
    assert f"wrote {out_dir / 'reward.png'}" in stdout


def test_partial_figure_keeps_only_logged_panels():
    # a run with ESS LR but no version tags: ess_lr keeps both panels with only the logged series;
    # version_lag has no panel at all
    scalars = {"train/rho_ess": [(1, 0.5)], "train/actor_lr": [(1, 1e-6)]}
    specs = {s.filename: s for s in plots.FIGURES}
    panels = plots.present_panels(scalars, specs["ess_lr.png"])
    assert [[tag for tag, _ in p.series] for p in panels] == [["train/rho_ess"], ["train/actor_lr"]]
    assert plots.present_panels(scalars, specs["version_lag.png"]) == []


def test_align_keeps_common_steps():
    # frac_3+ missing at step 2: the stacked area uses steps 1 and 3 only
    steps, values = plots.align([[(1, 0.5), (2, 0.6), (3, 0.7)], [(1, 0.5), (3, 0.3)]])
    assert steps == [1, 3]
    assert values == [[0.5, 0.7], [0.5, 0.3]]


def test_missing_directory_exits(tmp_path):
    with pytest.raises(SystemExit, match="not a directory"):
        plots.main([str(tmp_path / "nope"), str(tmp_path / "out")])


def test_a_learning_rate_wobble_is_drawn_at_its_true_scale():
    """The LR panel starts at 0: an effective LR that wobbles by 0.05 % (an ESS scale of 0.9995) is a flat line at
    its value, not a full-height swing."""
    from matplotlib.figure import Figure

    from openrlhf_ess.tools.plots import FIGURES, draw_panel

    lr = 1e-3
    scalars = {
        "train/actor_lr": [(s, lr) for s in range(1, 11)],
        "train/actor_lr_effective": [(s, lr * (0.9995 if s % 2 else 1.0)) for s in range(1, 11)],
    }
    panel = next(p for f in FIGURES for p in f.panels if p.title == "actor learning rate")
    ax = Figure().subplots()
    draw_panel(ax, scalars, panel)
    low, high = ax.get_ylim()
    assert low == 0.0 and high == pytest.approx(1.1 * lr)
    assert (lr - lr * 0.9995) / (high - low) < 0.001  # the wobble spans under 0.1 % of the panel's height


def _ylim(panel_title: str, scalars) -> tuple:
    from matplotlib.figure import Figure

    panel = next(p for f in plots.FIGURES for p in plots.present_panels(scalars, f) if p.title == panel_title)
    ax = Figure().subplots()
    plots.draw_panel(ax, scalars, panel)
    return ax.get_ylim()


def test_a_wobble_near_a_reference_is_drawn_at_its_true_scale():
    """Every autoscaled panel spans at least 10 % of its values' magnitude: a mean IS weight wobbling by 0.05 % around
    its on-policy value 1 (or a constant lag with a rounding wobble) is a flat line, not a full-height swing."""
    wobble = {"train/tis/mean_weight": [(s, 0.9995 if s % 2 else 1.0) for s in range(1, 11)]}
    low, high = _ylim("IS weight per step", wobble)
    assert low < 0.9995 and high > 1.0
    assert 0.0005 / (high - low) < 0.01  # under 1 % of the panel's height
    assert 0.1 <= high - low <= 0.12  # and no wider than it needs: 10 % of 1, plus margins
    lag = {"train/version_lag/mean": [(s, 1.0 + (1e-7 if s % 2 else 0.0)) for s in range(1, 11)]}
    low, high = _ylim("lag per token", lag)
    assert 1e-7 / (high - low) < 0.01


def test_a_real_change_keeps_matplotlibs_scale():
    # reward 0.1 -> 0.9: far more than 10 % of its magnitude, autoscaled as before (the data fill the panel)
    rising = {"train/reward": [(s, 0.1 + 0.08 * (s - 1)) for s in range(1, 11)]}
    low, high = _ylim("reward per training step", rising)
    assert 0.1 - low < 0.1 and high - 0.82 < 0.1
    assert plots.min_span_ylim([0.1, 0.82]) is None
    assert plots.min_span_ylim([0.0, 0.0]) is None and plots.min_span_ylim([float("nan")]) is None
