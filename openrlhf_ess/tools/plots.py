"""PNG plots of a run from its tensorboard logs: reward, ESS / LR scale, IS weights, version lag, mismatch.

    python -m openrlhf_ess.tools.plots RUN_TENSORBOARD_DIR OUT_DIR

Writes up to five files into OUT_DIR (created if needed), one per figure below, and prints their paths.
A figure none of whose tags were logged (e.g. TIS plots for a run without ``--algo.tis_cap``) is skipped
with a line on stdout; a panel none of whose tags were logged is left out of its figure.

| file              | tags (under ``train/``)                                                              |
|-------------------|--------------------------------------------------------------------------------------|
| reward.png        | reward, rollout/reward_mean                                                          |
| ess_lr.png        | rho_ess, lr_scale; actor_lr, actor_lr_effective                                      |
| tis_weights.png   | tis/mean_weight, tis/max_weight; tis/clip_frac                                       |
| version_lag.png   | version_lag/mean, /max; version_lag/frac_0, /frac_1, /frac_2, /frac_3+ (stacked)     |
| mismatch.png      | mismatch/k1, mismatch/k3, vllm_kl; mismatch/chi2                                     |
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from openrlhf_ess.tools.summary import read_scalars

Scalars = Dict[str, List[Tuple[int, float]]]
LINESTYLES = ("-", "--", "-.", ":")
# An autoscaled y axis spans at least this fraction of its largest |value|: a 0.05 % wobble of a weight near 1 is
# a flat line at 1, not a full-height swing; a change of 10 % or more is drawn as matplotlib scales it.
MIN_REL_SPAN = 0.1


@dataclass(frozen=True)
class Panel:
    """One axes: ``series`` are (tag, legend label); ``stacked`` draws them as a stacked area (fractions)."""

    title: str
    ylabel: str
    series: Tuple[Tuple[str, str], ...]
    stacked: bool = False
    hline: Optional[Tuple[float, str]] = None  # reference line (y, label), e.g. the on-policy value
    ylim: Optional[Tuple[float, float]] = None
    from_zero: bool = False  # the y axis starts at 0: a 0.05 % wobble of a learning rate stays a flat line


@dataclass(frozen=True)
class FigureSpec:
    filename: str
    title: str
    panels: Tuple[Panel, ...] = field(default_factory=tuple)
    caption: str = ""  # one line under the figure: what it shows and what good looks like, for a reader without docs


FIGURES: Tuple[FigureSpec, ...] = (
    FigureSpec(
        "reward.png",
        "Reward",
        (
            Panel(
                "reward per training step",
                "reward",
                (("train/reward", "train/reward"), ("train/rollout/reward_mean", "rollout reward mean")),
            ),
        ),
        caption=(
            "Mean reward of the samples each step trains on (the task's scale; tiny world: 1 = best). Good: "
            "rising, then flat near the best."
        ),
    ),
    FigureSpec(
        "ess_lr.png",
        "Effective sample size and learning rate",
        (
            Panel(
                "effective sample size ratio and LR multiplier",
                "ratio",
                (("train/rho_ess", "ρ = ESS / B"), ("train/lr_scale", "lr_scale = clamp(√ρ, floor, 1)")),
                hline=(1.0, "on-policy (ρ = 1)"),
                ylim=(0.0, 1.05),
            ),
            Panel(
                "actor learning rate",
                "learning rate",
                (("train/actor_lr", "scheduler LR"), ("train/actor_lr_effective", "effective LR (used)")),
                from_zero=True,
            ),
        ),
        caption=(
            "ρ = ESS/B of the per-sample weights π_prox/μ (1 = every sample counts equally). Good: near 1; the LR"
            " multiplier drops below 1 only when a few samples dominate."
        ),
    ),
    FigureSpec(
        "tis_weights.png",
        "Truncated importance weights w = min(π_prox/μ, C)",
        (
            Panel(
                "IS weight per step",
                "weight",
                (("train/tis/mean_weight", "mean weight"), ("train/tis/max_weight", "max weight")),
                hline=(1.0, "on-policy (w = 1)"),
            ),
            Panel(
                "fraction of tokens clipped at C",
                "fraction",
                (("train/tis/clip_frac", "clip fraction"),),
                ylim=(0.0, 1.0),
            ),
        ),
        caption=(
            "Token IS weights min(π_prox/μ, C) (--algo.tis_cap). Good: mean near 1 and few tokens clipped; a "
            "growing clip fraction means samples are too stale or mismatched for the cap."
        ),
    ),
    FigureSpec(
        "version_lag.png",
        "Version lag: weight syncs between sampling and update",
        (
            Panel(
                "lag per token",
                "syncs behind",
                (("train/version_lag/mean", "mean"), ("train/version_lag/max", "max")),
            ),
            Panel(
                "tokens by lag (stacked)",
                "fraction of tokens",
                (
                    ("train/version_lag/frac_0", "lag 0"),
                    ("train/version_lag/frac_1", "lag 1"),
                    ("train/version_lag/frac_2", "lag 2"),
                    ("train/version_lag/frac_3+", "lag ≥ 3"),
                ),
                stacked=True,
                ylim=(0.0, 1.0),
            ),
        ),
        caption=(
            "Weight syncs between the version that sampled a token and the update that uses it (0 = on-policy). "
            "Async training trades lag for throughput; the corrections exist for lag ≥ 1."
        ),
    ),
    FigureSpec(
        "mismatch.png",
        "Train / rollout mismatch: π_prox (trainer) vs μ (vLLM)",
        (
            Panel(
                "KL estimates",
                "KL",
                (
                    ("train/mismatch/k1", "k1, KL(μ‖π_prox)"),
                    ("train/mismatch/k3", "k3, KL(μ‖π_prox)"),
                    ("train/vllm_kl", "vllm_kl (upstream)"),
                ),
                hline=(0.0, "no mismatch"),
            ),
            Panel(
                "variance of the IS weight",
                "χ²",
                (("train/mismatch/chi2", "chi2"),),
                hline=(0.0, "no mismatch"),
            ),
        ),
        caption=(
            "KL(μ‖π_prox) estimates in nats per token between the engine's sampling distribution μ and the "
            "trainer's π_prox. Good: near 0; a rise means staleness (exact π_prox modes) or engine/trainer "
            "numerics."
        ),
    ),
)


def present_panels(scalars: Scalars, spec: FigureSpec) -> List[Panel]:
    """The panels of ``spec`` with at least one logged tag, each keeping only its logged series."""
    panels = []
    for panel in spec.panels:
        series = tuple((tag, label) for tag, label in panel.series if scalars.get(tag))
        if series:
            panels.append(
                Panel(panel.title, panel.ylabel, series, panel.stacked, panel.hline, panel.ylim, panel.from_zero)
            )
    return panels


def align(series: Sequence[List[Tuple[int, float]]]) -> Tuple[List[int], List[List[float]]]:
    """Steps present in every series (sorted) and each series' values at those steps (last value wins)."""
    by_step = [dict(points) for points in series]
    steps = sorted(set.intersection(*(set(d) for d in by_step)))
    return steps, [[d[s] for s in steps] for d in by_step]


def min_span_ylim(values: Sequence[float], rel_span: float = MIN_REL_SPAN) -> Optional[Tuple[float, float]]:
    """Y limits centred on ``values`` that span ``rel_span`` of their largest |value| (plus matplotlib's 5 %
    margins) when the values themselves span less; None (autoscale) otherwise, or without a scale (all 0, none
    finite)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    span = rel_span * max(abs(low), abs(high))
    if span == 0 or high - low >= span:
        return None
    middle = (low + high) / 2
    return middle - 0.55 * span, middle + 0.55 * span


def draw_panel(ax, scalars: Scalars, panel: Panel) -> None:
    """Draw one panel on a matplotlib Axes: lines (markers when there are few points) or a stacked area."""
    tags = [tag for tag, _ in panel.series]
    labels = [label for _, label in panel.series]
    if panel.stacked:
        steps, values = align([scalars[tag] for tag in tags])
        ax.stackplot(steps, values, labels=labels, alpha=0.85)
    else:
        # Distinct line styles: series that coincide (reward vs rollout reward mean) stay both visible.
        for (tag, label), style in zip(panel.series, itertools.cycle(LINESTYLES)):
            steps, values = zip(*scalars[tag])
            marker = "o" if len(steps) <= 30 else None
            ax.plot(steps, values, label=label, linestyle=style, marker=marker, markersize=3)
    if panel.hline is not None:
        ax.axhline(panel.hline[0], color="grey", linestyle="--", linewidth=1, label=panel.hline[1])
    if panel.ylim is not None:
        ax.set_ylim(*panel.ylim)
    elif panel.from_zero:
        top = max(max(v for _, v in scalars[tag]) for tag in tags)
        ax.set_ylim(0.0, top * 1.1 if top > 0 else 1.0)
    else:
        shown = [v for tag in tags for _, v in scalars[tag]] + ([panel.hline[0]] if panel.hline else [])
        ylim = min_span_ylim(shown)
        if ylim is not None:
            ax.set_ylim(*ylim)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if panel.stacked:  # a legend inside would hide part of the filled area
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    else:
        ax.legend(loc="best", fontsize="small")


def plot_figure(scalars: Scalars, spec: FigureSpec, path: str) -> bool:
    """Write ``spec`` as a PNG at ``path``; False (nothing written) if none of its tags were logged."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = present_panels(scalars, spec)
    if not panels:
        return False
    # Figure + Agg canvas rather than pyplot: no global backend switch, nothing left open between figures.
    fig = Figure(figsize=(8, 3.6 * len(panels) + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        draw_panel(ax, scalars, panel)
    axes[-1].set_xlabel("training step")  # shared x axis: label the bottom panel only
    fig.suptitle(spec.title)
    if spec.caption:
        import textwrap

        fig.supxlabel("\n".join(textwrap.wrap(spec.caption, 110)), fontsize="small", color="dimgrey")
    fig.savefig(path, dpi=100)
    return True


def make_plots(tb_dir: str, out_dir: str) -> Tuple[List[str], List[str]]:
    """Plot every figure in FIGURES from ``tb_dir`` into ``out_dir``: (files written, files skipped)."""
    scalars = read_scalars(tb_dir)
    os.makedirs(out_dir, exist_ok=True)
    written, skipped = [], []
    for spec in FIGURES:
        path = os.path.join(out_dir, spec.filename)
        (written if plot_figure(scalars, spec, path) else skipped).append(path)
    return written, skipped


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit(__doc__)
    tb_dir, out_dir = argv
    if not os.path.isdir(tb_dir):
        sys.exit(f"not a directory: {tb_dir}")
    written, skipped = make_plots(tb_dir, out_dir)
    for path in skipped:
        spec = next(s for s in FIGURES if s.filename == os.path.basename(path))
        tags = ", ".join(tag for panel in spec.panels for tag, _ in panel.series)
        print(f"skipped {spec.filename}: none of its tags were logged ({tags})")
    if not written:
        print(f"no plots written: no known scalars under {tb_dir}")
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
