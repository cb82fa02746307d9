"""benchmarks/staleness.py's measures of the interior-optimum task, by hand, and its comparison figure."""

import pytest

from benchmarks import staleness


def test_distance_stats_by_hand():
    # f* = 0.5; f climbs from 0.1, crosses at step 4, overshoots to 0.8, settles at 0.55 / 0.45
    f = [0.1, 0.2, 0.3, 0.5, 0.8, 0.7, 0.55, 0.45]
    s = staleness.distance_stats(f, 0.5, window=2)
    assert s["final"] == pytest.approx(0.05)  # mean(|0.05|, |−0.05|)
    assert s["start"] == pytest.approx((0.4 + 0.3 + 0.2 + 0.0) / 4)
    assert s["overshoot"] == pytest.approx(0.3)  # 0.8 − 0.5, on the far side from the start
    assert s["reach"] == 4  # first step within 0.05 of f*
    assert s["diverged"] == 0


def test_distance_stats_from_above_never_reached_and_diverged():
    # starts above f* and moves away: no crossing, so no overshoot; never within 0.05; ends further than it began
    s = staleness.distance_stats([0.6, 0.62, 0.64, 0.66, 0.8, 0.9], 0.5, window=2)
    assert s["overshoot"] == 0.0 and s["reach"] is None and s["diverged"] == 1
    assert s["final"] == pytest.approx(0.35)
    # starting above and overshooting below: overshoot is measured downwards
    assert staleness.distance_stats([0.9, 0.6, 0.3, 0.5], 0.5, window=1)["overshoot"] == pytest.approx(0.2)


def _run(fractions, rewards):
    steps = range(1, len(fractions) + 1)
    return {
        "train/reward": [[s, r] for s, r in zip(steps, rewards)],
        "train/digit_fraction": [[s, f] for s, f in zip(steps, fractions)],
        "train/version_lag/mean": [],
        "train/rho_ess": [[s, 0.9] for s in steps],
        "train/lr_scale": [[s, 0.95] for s in steps],
        staleness.WALL: [[70.0 + s, r] for s, r in zip(steps, rewards)],
        "wall/total_s": 90.0,
    }


def test_target_table_and_figures(tmp_path):
    results = {
        "sync | none": [_run([0.1, 0.3, 0.5, 0.5], [0.2, 0.6, 1.0, 1.0])],
        "async q8 + partial | TIS": [_run([0.1, 0.2, 0.9, 0.7], [0.2, 0.4, 0.2, 0.6])] * 2,
    }
    paths = staleness.render(results, str(tmp_path), "cmd", ["sync", "async q8 + partial"], "target")
    names = {p.rsplit("/", 1)[1] for p in paths}
    assert {"reward.png", "fraction.png", "comparison.png", "ess_lr.png"} <= names
    table = (tmp_path / "results.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| async q8"))
    # overshoot 0.9 − 0.5 = 0.4 in both seeds; ρ min 0.9, scale 0.95; never within 0.05 of f*
    assert "| 0.400 [0.400, 0.400] |" in row and "| 0.900 | 0.950 |" in row and "| never |" in row


def test_launch_logs_the_command_returns_its_code_and_kills_it_past_the_timeout(tmp_path):
    import os
    import subprocess

    from benchmarks.staleness import launch

    rc = launch(["bash", "-c", "echo launched; exit 3"], str(tmp_path), dict(os.environ), pin_engine_core=False)
    assert rc == 3
    assert (tmp_path / "log.txt").read_text() == "launched\n"
    assert not (tmp_path / "pinned.txt").exists()
    with pytest.raises(subprocess.TimeoutExpired):
        launch(["sleep", "30"], str(tmp_path), dict(os.environ), pin_engine_core=False, timeout=0.5)
