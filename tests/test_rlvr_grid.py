"""The RLVR grid's measures (benchmarks/rlvr_grid.py) on hand-made eval curves, each checked against a value worked
out by hand; its configuration names against the staleness grid's; the search's GRPO advantages; and the event
reader both grids share."""

import json

import pytest

from benchmarks import rlvr_grid


def _run(points, seed=0):
    # eval rows: [step, s since launch, s since the first step's log, accuracy]
    return {"eval": [[s, t + 60.0, t, v] for s, t, v in points], "seed": seed}


RUN = _run([(25, 10.0, 0.2), (50, 20.0, 0.3), (75, 30.0, 0.4), (100, 40.0, 0.5)])


def test_auc_over_steps_is_the_mean_of_the_evals():
    assert rlvr_grid.auc_steps(RUN) == pytest.approx((0.2 + 0.3 + 0.4 + 0.5) / 4)


def test_final_accuracy_is_the_mean_of_the_last_two_evals():
    assert rlvr_grid.final_acc(RUN) == pytest.approx(0.45)
    assert rlvr_grid.final_acc(RUN, last=1) == pytest.approx(0.5)


def test_auc_against_wall_clock_holds_each_value_until_the_next_eval():
    # [0, 10) at the start value 0.1, [10, 20) 0.2, [20, 30) 0.3, [30, 35) 0.4 -> area 1 + 2 + 3 + 2 = 8 over 35 s
    assert rlvr_grid.auc_wall(RUN, horizon=35.0, start_value=0.1) == pytest.approx(8.0 / 35.0)
    # past the last eval its value holds: [0, 40) as above (10 * (0.1 + 0.2 + 0.3 + 0.4) = 10) + [40, 50) 0.5
    assert rlvr_grid.auc_wall(RUN, horizon=50.0, start_value=0.1) == pytest.approx(15.0 / 50.0)
    # on the since-launch column every eval is 60 s later: [0, 70) 0.1, [70, 80) 0.2 -> (7 + 2) / 80
    assert rlvr_grid.auc_wall(RUN, horizon=80.0, start_value=0.1, column=1) == pytest.approx(9.0 / 80.0)


def test_time_to_a_threshold_is_the_first_eval_that_reaches_it():
    assert rlvr_grid.time_to(RUN, 0.35) == 30.0
    assert rlvr_grid.time_to(RUN, 0.3) == 20.0  # reached exactly counts
    assert rlvr_grid.time_to(RUN, 0.6) is None
    assert rlvr_grid.time_to(RUN, 0.35, column=1) == 90.0


def test_configurations_are_named_as_in_the_staleness_grid():
    from benchmarks.staleness import config_flags

    for key in rlvr_grid.DEFAULT_CONFIGS:
        level, name = rlvr_grid.parse_config(key)
        assert config_flags(level, name) is not None
    assert rlvr_grid.parse_config("async q8 + partial | VCPO (recipe)") == ("async q8 + partial", "VCPO (recipe)")
    with pytest.raises(ValueError, match="expected '<level> | <correction>'"):
        rlvr_grid.parse_config("async q8 | TIS")


def test_the_table_lists_every_seed(tmp_path):
    results = {
        "sync | none": [_run([(25, 10.0, 0.2), (50, 20.0, 0.4)], seed=s) for s in (0, 1)],
        "async q8 + partial | TIS": [_run([(25, 5.0, 0.35), (50, 10.0, 0.45)], seed=0)],
    }
    for runs in results.values():
        for r in runs:
            r.update(lag_mean=None, first_step_s=60.0, wall_s=100.0)
    path = tmp_path / "results.md"
    rlvr_grid.write_table(results, str(path), "python -m benchmarks.rlvr_grid", start_value=0.1)
    text = path.read_text()
    # sync's final = 0.3 (both seeds): async reaches it at its first eval, 5 s after its first step; over the
    # shortest run's 10 s async holds 0.1 for 5 s and 0.35 for 5 s (AUC 0.225), sync 0.1 throughout
    assert (
        "| async q8 + partial: TIS | 1 | 0.400 [0.400, 0.400] | 0.400 [0.400, 0.400] | 0.225 [0.225, 0.225] "
        "| 5 [5, 5] |" in text
    )
    assert (
        "| sync: none | 2 | 0.300 [0.300, 0.300] | 0.300 [0.300, 0.300] | 0.100 [0.100, 0.100] | 20 [20, 20] |" in text
    )
    assert "- seed 0: 25: 0.200 (10 s), 50: 0.400 (20 s)" in text and "- seed 1:" in text


def test_the_search_uses_grpo_advantages_worked_by_hand():
    import torch

    from benchmarks.rlvr_search import grpo_advantages

    # one right of four: mean 0.25, sample std sqrt((0.75² + 3 · 0.25²) / 3) = 0.5 -> (1.5, −0.5, −0.5, −0.5);
    # a group all wrong carries no signal
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]), atol=1e-6)
    centred = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), normalize=False)
    assert torch.allclose(centred, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_the_search_counts_a_rise_in_eval_standard_errors():
    from benchmarks.rlvr_search import eval_se, rise

    # 788 samples at 0.5: sqrt(0.25 / 788) = 0.017812; at 0.15: sqrt(0.1275 / 788) = 0.012720
    assert eval_se(0.5) == pytest.approx(0.017812, abs=1e-6)
    assert eval_se(0.15) == pytest.approx(0.012720, abs=1e-6)
    # rows [step, greedy, T = 1]: start 0.15, end = mean of the last two (0.45 + 0.55) / 2 = 0.5, rise 0.35, over
    # the larger of the two errors (0.017812): 19.65
    curve = [[0, 0.3, 0.15], [10, 0.4, 0.3], [20, 0.5, 0.45], [30, 0.6, 0.55]]
    r = rise(curve)
    assert (r["start"], r["end"], r["rise"]) == (0.15, pytest.approx(0.5), pytest.approx(0.35))
    assert r["in_se"] == pytest.approx(19.65, abs=0.01)
    # greedy column: 0.3 -> 0.55, rise 0.25 over max(se(0.3) = 0.016325, se(0.55) = 0.017722) = 14.11
    assert rise(curve, column=1)["in_se"] == pytest.approx(14.11, abs=0.01)
    # a fall counts negative: 0.3 -> 0.2 over se(0.3) = -6.13
    assert rise([[0, 0.0, 0.3], [10, 0.0, 0.2]], last=1)["in_se"] == pytest.approx(-6.13, abs=0.01)


def test_the_search_keeps_one_record_per_setting_and_renders_it(tmp_path):
    from benchmarks.rlvr_search import load, render, save

    path = str(tmp_path / "search.json")
    setting = {"seed": 0, "target": 0.27, "warm_check_every": 5, "lr": 1e-4, "prompts": 32, "samples": 8, "steps": 30}
    setting["clip"] = 1.0
    curve = [[0, 0.3, 0.15], [10, 0.4, 0.3], [20, 0.5, 0.45], [30, 0.6, 0.55]]
    save(path, setting, {"steps": 325}, [[0, 0.3, 0.15]], 1.0)
    save(path, {**setting, "lr": 3e-4}, {"steps": 325}, curve, 2.0)
    save(path, setting, {"steps": 325}, curve, 3.0)  # a rerun of the first setting replaces its record
    records = load(path)
    assert [(r["setting"]["lr"], r["seconds"]) for r in records] == [(3e-4, 2.0), (1e-4, 3.0)]
    row = render(records).splitlines()[3]
    assert row == (
        "| 0 | warm 0.27, checked every 5 (325) | 0.0001 | 32 × 8 | 30 | clip 1 | 0.150 → 0.500 (0.550) | +0.350 "
        "| 19.6 | 0.300 → 0.550 | 3 |"
    )


def test_the_search_counts_a_grid_runs_rise_from_the_files_start_value():
    from benchmarks.rlvr_search import render_grid_rises

    # start 0.15 (the file's own), evals 0.3, 0.45, 0.55 -> end (0.45 + 0.55) / 2 = 0.5, +0.35, 19.6 as above
    grid = {"_warm_start_accuracy": 0.15, "sync | none": [_run([(25, 1.0, 0.3), (50, 2.0, 0.45), (75, 3.0, 0.55)])]}
    assert render_grid_rises(grid).splitlines()[2] == "| sync: none | 0 | 0.150 → 0.500 | +0.350 | 19.6 |"


def test_the_search_counts_a_larger_eval_sets_samples():
    import random

    from benchmarks.rlvr_search import eval_samples, render, render_grid_rises

    # the split by hand: the 4,095 unordered pairs of 10..99 shuffled with seed 0; the first n asked in both orders,
    # a pair a + a once; 4 passes each
    unordered = [(a, b) for a in range(10, 100) for b in range(a, 100)]
    random.Random(0).shuffle(unordered)
    for n in (100, 800):
        assert eval_samples(n) == 4 * sum(1 if a == b else 2 for a, b in unordered[:n])
    assert eval_samples(100) == 788  # the default eval set: 197 problems
    # a grid run on 800 pairs counts its rise over sqrt(0.25 / 6356) = 0.0062716 at 0.5: 0.35 / 0.0062716 = 55.8
    assert eval_samples(800) == 6356
    run = {**_run([(25, 1.0, 0.3), (50, 2.0, 0.45), (75, 3.0, 0.55)]), "task_env": {"N_EVAL": "800"}}
    grid = {"_warm_start_accuracy": 0.15, "sync | none": [run]}
    assert render_grid_rises(grid).splitlines()[2] == "| sync: none | 0 | 0.150 → 0.500 | +0.350 | 55.8 |"
    # and a search record on 800 pairs, the same curve: 55.8, its eval set named in the row
    setting = {"seed": 0, "target": 0.6, "lr": 2e-4, "prompts": 32, "samples": 16, "steps": 30, "n_eval": 800}
    curve = [[0, 0.3, 0.15], [10, 0.4, 0.3], [20, 0.5, 0.45], [30, 0.6, 0.55]]
    row = render([{"setting": setting, "warm_start": {"steps": 385}, "curve": curve, "seconds": 3.0}])
    assert "| eval 800 pairs | 0.150 → 0.500 (0.550) | +0.350 | 55.8 |" in row.splitlines()[2]


def test_measures_compare_runs_on_the_eval_steps_they_share():
    # an async run that ended before its last eval (100): the comparison uses steps 25-75 for every run
    short = _run([(25, 10.0, 0.1), (50, 20.0, 0.2), (75, 30.0, 0.3)])
    steps = rlvr_grid.common_steps({"a": [RUN], "b": [short]})
    assert steps == [25, 50, 75]
    assert rlvr_grid.auc_steps(RUN, steps) == pytest.approx((0.2 + 0.3 + 0.4) / 3)
    assert rlvr_grid.final_acc(RUN, steps=steps) == pytest.approx(0.35)
    assert rlvr_grid.final_acc(short, steps=steps) == pytest.approx(0.25)


def test_scalar_events_read_steps_wall_times_and_values_in_step_order(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from benchmarks.common import scalar_events
    from benchmarks.staleness import reward_vs_wall

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, wall, value in ((2, 1000.5, 0.25), (1, 1000.0, 0.5), (3, 1002.0, 0.75)):  # logged out of order
        writer.add_scalar("train/reward", value, step, walltime=wall)
    writer.add_scalar("eval/other", 9.0, 1, walltime=999.0)
    writer.close()
    events = scalar_events(str(tmp_path / "tb"), "train/reward")
    assert [(s, pytest.approx(w), v) for s, w, v in events] == [(1, 1000.0, 0.5), (2, 1000.5, 0.25), (3, 1002.0, 0.75)]
    assert scalar_events(str(tmp_path / "tb"), "missing") == []
    assert reward_vs_wall(str(tmp_path / "tb"), t0=1000.0) == [[0.0, 0.5], [0.5, 0.25], [2.0, 0.75]]


def test_scalar_events_parse_a_file_once_for_all_its_tags_and_again_when_it_grows(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing import event_accumulator
    from torch.utils.tensorboard import SummaryWriter

    from benchmarks import common

    parsed = []
    real = event_accumulator.EventAccumulator

    def counting(path, **kw):
        parsed.append(path)
        return real(path, **kw)

    monkeypatch.setattr(event_accumulator, "EventAccumulator", counting)
    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("a", 1.0, 1, walltime=10.0)
    writer.add_scalar("b", 2.0, 1, walltime=10.0)
    writer.flush()
    assert [v for _, _, v in common.scalar_events(str(tmp_path / "tb"), "a")] == [1.0]
    assert [v for _, _, v in common.scalar_events(str(tmp_path / "tb"), "b")] == [2.0]
    assert len(parsed) == 1  # the second tag came from the first parse
    writer.add_scalar("a", 3.0, 2, walltime=11.0)  # the run goes on: the file grows
    writer.close()
    assert [v for _, _, v in common.scalar_events(str(tmp_path / "tb"), "a")] == [1.0, 3.0]
    assert len(parsed) == 2


def test_phase_timing_is_the_mean_after_the_warm_up_steps(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    # steps 1..5 (warm-up, left out) at 9 s; steps 6..9 generation 0.5, 0.7, 0.5, 0.7 -> 0.6; broadcast once only
    for step in range(1, 10):
        writer.add_scalar("train/timing/generation", 9.0 if step <= 5 else (0.5 if step % 2 == 0 else 0.7), step)
    writer.add_scalar("train/timing/broadcast", 0.25, 7)
    writer.close()
    assert rlvr_grid.WARMUP_STEPS == 5
    timing = rlvr_grid.read_timing(str(tmp_path / "tb"))
    assert timing == {"generation": pytest.approx(0.6), "broadcast": pytest.approx(0.25)}


def test_the_time_table_spans_the_seeds_of_each_phase():
    phases = ("generation", "make_experience", "ppo_train", "broadcast", "step_total")
    results = {
        "sync | none": [
            {"timing": dict(zip(phases, (0.4, 0.1, 0.1, 0.0, 0.6)))},
            {"timing": dict(zip(phases, (0.6, 0.1, 0.3, 0.2, 1.2)))},
        ],
        "async q2 + partial | TIS": [{"eval": []}],  # recorded without timing: no row
    }
    lines = rlvr_grid.time_table(results)
    assert (
        "| sync: none | 2 | 0.500 [0.400, 0.600] | 0.100 [0.100, 0.100] | 0.200 [0.100, 0.300] | "
        "0.100 [0.000, 0.200] | 0.900 [0.600, 1.200] |" in lines
    )
    assert not any(line.startswith("| async q2") for line in lines)
    assert rlvr_grid.time_table({"sync | none": [{"eval": []}]}) == []


def test_run_folders_are_named_from_the_configuration_and_seed():
    assert rlvr_grid.run_dir_name("async q8 + partial | VCPO (recipe)", 3) == "async_q8_p_partial__VCPO_recipe_s3"
    assert rlvr_grid.run_dir_name("sync | none", 0) == "sync__none_s0"


def test_the_target_task_holds_out_prompts_the_training_never_sees(tmp_path):
    world = rlvr_grid.target_world(str(tmp_path))
    read = lambda path: [json.loads(line)["input"] for line in open(path)]  # noqa: E731
    train, held_out = read(world["prompts"]), read(world["eval"])
    assert len(train) == 64 and len(held_out) == 64 and len(set(held_out)) == 64
    assert not set(train) & set(held_out)
    assert world["reward"].endswith("reward_target.py")
    assert rlvr_grid.target_world(str(tmp_path))["eval"] == world["eval"]  # built once: the same file again
    assert read(world["eval"]) == held_out


def test_the_target_run_has_the_recorded_regime_and_vcpo_its_recipes_one_epoch(tmp_path):
    world = {"model": "m", "prompts": "p.jsonl", "reward": "r.py", "eval": "e.jsonl"}

    def value(cmd, flag):  # the last occurrence wins, as in argparse
        return cmd[len(cmd) - 1 - cmd[::-1].index(flag) + 1]

    tis = rlvr_grid.target_command(world, str(tmp_path), "TIS")
    assert value(tis, "--actor.adam.lr") == "1e-2" and value(tis, "--train.max_epochs") == "4"
    assert value(tis, "--train.num_episodes") == "4" and value(tis, "--data.max_samples") == "64"
    assert value(tis, "--eval.dataset") == "e.jsonl" and value(tis, "--eval.steps") == "4"
    assert value(tis, "--reward.remote_url") == "r.py"
    vcpo = rlvr_grid.target_command(world, str(tmp_path), "VCPO (recipe)")
    assert "--train.max_epochs" not in vcpo and value(vcpo, "--actor.adam.lr") == "1e-2"


def test_the_target_table_speaks_of_reward(tmp_path):
    results = {"sync | none": [_run([(4, 10.0, 0.6), (8, 20.0, 0.8)])]}
    results["sync | none"][0].update(lag_mean=None, first_step_s=30.0, wall_s=90.0)
    path = tmp_path / "results.md"
    rlvr_grid.write_table(results, str(path), "python -m benchmarks.rlvr_grid --task target", 0.2, task="target")
    text = path.read_text()
    assert text.startswith("# The decisive grid on the interior-optimum task")
    assert "0.200 (the random model)" in text and "mean reward" in text and "accuracy" not in text
    # AUC (wall) over the 20 s horizon: 10 s at 0.2, 10 s at 0.6
    assert "| sync: none | 1 | 0.700 [0.700, 0.700] | 0.700 [0.700, 0.700] | 0.400 [0.400, 0.400] |" in text


def test_the_target_training_side_table_reads_overshoot_and_clip_shares():
    # f: 0.1, 0.3, 0.6, 0.7 -> first reaches 0.5 at step 3, goes 0.2 past it; |f - 0.5| over the (fewer than 8)
    # steps: (0.4 + 0.2 + 0.1 + 0.2) / 4 = 0.225
    dyn = {"fraction": [[1, 0.1], [2, 0.3], [3, 0.6], [4, 0.7]], "ppo_clip": 0.3, "tis_clip": None}
    other = {"fraction": [[1, 0.1], [2, 0.5], [3, 0.4], [4, 0.5]], "ppo_clip": 0.1, "tis_clip": 0.05}
    results = {"async q8 + partial | TIS": [{"dynamics": dyn}, {"dynamics": other}], "sync | none": [{"eval": []}]}
    lines = rlvr_grid.dynamics_table(results)
    # the second run never goes past 0.5: overshoot 0; final (0.4 + 0 + 0.1 + 0) / 4 = 0.125
    assert (
        "| async q8 + partial: TIS | 2 | 0.100 [0.000, 0.200] | 0.175 [0.125, 0.225] | 0.200 [0.100, 0.300] | "
        "0.050 [0.050, 0.050] |" in lines
    )
    assert not any(line.startswith("| sync") for line in lines)
    assert rlvr_grid.dynamics_table({"sync | none": [{"eval": []}]}) == []


def _timed(points, seed, lag=None, step=None):
    run = _run(points, seed)
    run.update(lag_mean=lag, timing={"step_total": step} if step is not None else {})
    return run


def test_against_sync_gives_gain_over_the_start_beside_the_plain_auc_and_the_frozen_floor():
    # start 0.1. sync: seed 0 evals 0.2, 0.4 (AUC 0.3), seed 1 0.3, 0.5 (AUC 0.4): mean AUC 0.35, gain 0.25;
    # its mean final (both evals) 0.35, reached at 20 s in both seeds; steps 0.5 and 0.7 s -> 0.6 s
    sync = [
        _timed([(25, 10.0, 0.2), (50, 20.0, 0.4)], 0, step=0.5),
        _timed([(25, 10.0, 0.3), (50, 20.0, 0.5)], 1, step=0.7),
    ]
    # TIS: seed 0 AUC 0.2 (gain 0.1), never reaches 0.35; seed 1 AUC 0.3 (gain 0.2), reaches it at 5 s < 20 s
    tis = [
        _timed([(25, 5.0, 0.1), (50, 10.0, 0.3)], 0, lag=2.0, step=0.9),
        _timed([(25, 5.0, 0.4), (50, 15.0, 0.2)], 1, lag=4.0, step=1.5),
    ]
    # none: AUC 0.05 in both seeds, below the start: gain -0.05
    none = [_timed([(25, 5.0, 0.05), (50, 10.0, 0.05)], 0), _timed([(25, 5.0, 0.0), (50, 10.0, 0.1)], 1)]
    results = {"sync | none": sync, "async q8 + partial | TIS": tis, "async q8 + partial | none": none}
    lines = rlvr_grid.against_sync(results, 0.1, [25, 50], target=0.35)
    assert "| sync: none | 2 | 0.250 | 1.00× (1.00) | 0.350 | 1.00× (1.00) | 0 | 0.600 | 1.00× | – |" in lines
    # gain 0.15 / 0.25 = 0.60x, per seed 0.1 / 0.2 = 0.50 and 0.2 / 0.3 = 0.67; AUC 0.25 / 0.35 = 0.71x, per seed
    # 0.2 / 0.3 = 0.67 and 0.3 / 0.4 = 0.75; lag (2 + 4) / 2; step 1.2 s = 2x sync's 0.6 s
    assert (
        "| async q8 + partial: TIS | 2 | 0.150 | 0.60× (0.50–0.67) | 0.250 | 0.71× (0.67–0.75) | 3.00 (2.00–4.00) "
        "| 1.200 | 2.00× | 1 of 2 |" in lines
    )
    # -0.05 / 0.25 = -0.20x, per seed -0.05 / 0.2 = -0.25 and -0.05 / 0.3 = -0.17; AUC 0.05 / 0.35 = 0.14x, per
    # seed 0.05 / 0.4 = 0.125 (printed 0.12: half to even) and 0.05 / 0.3 = 0.17
    assert (
        "| async q8 + partial: none | 2 | −0.050 | −0.20× (−0.25 to −0.17) | 0.050 | 0.14× (0.12–0.17) | – | – | – "
        "| 0 of 2 |" in lines
    )
    # never trained: 0.1 at every eval, gain 0; AUC 0.1 / 0.35 = 0.29x, per seed 0.1 / 0.4 = 0.25 to 0.1 / 0.3 = 0.33
    assert (
        f"| {rlvr_grid.FROZEN} | – | 0.000 | 0.00× (0.00) | 0.100 | 0.29× (0.25–0.33) | 0 | – | – | never |" in lines
    )
    assert "Every async row's step against sync's: 2.00×." in lines
    assert rlvr_grid.against_sync({"async q8 + partial | TIS": tis}, 0.1, [25, 50], target=None) == []


def test_each_eval_is_read_with_the_version_it_measured_and_its_own_time(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("train/reward", 0.1, 1, walltime=1000.0)
    # labelled 25 and 50, logged 30 s and 55 s after step 1; the evals themselves measured versions 33 and 58 and
    # started 20 s and 40 s after step 1's start
    for step, wall, version, clock in ((25, 1030.0, 33, 20.0), (50, 1055.0, 58, 40.0)):
        writer.add_scalar(rlvr_grid.EVAL, 0.2 if step == 25 else 0.3, step, walltime=wall)
        writer.add_scalar("eval/weight_version", version, step, walltime=wall)
        writer.add_scalar("eval/wall_clock_since_step1_s", clock, step, walltime=wall)
    for step, rho, lag in ((1, 0.5, 0.0), (2, 0.7, 1.5)):
        writer.add_scalar("train/rho_ess", rho, step, walltime=1000.0 + step)
        writer.add_scalar("train/version_lag/mean", lag, step, walltime=1000.0 + step)
    writer.close()
    run = rlvr_grid.read_run(str(tmp_path / "tb"), launched=990.0)
    assert run["lag"] == [[1, 0.0], [2, 1.5]] and run["lag_mean"] == pytest.approx(0.75)  # where a queue settles
    assert run["eval_stamps"] == [[25, 33.0, pytest.approx(20.0)], [50, 58.0, pytest.approx(40.0)]]
    assert [[s, pytest.approx(t)] for s, _, t, _ in run["eval"]] == [[25, 30.0], [50, 55.0]]
    assert rlvr_grid.stamped(run, 1) == [[33.0, pytest.approx(0.2)], [58.0, pytest.approx(0.3)]]
    assert rlvr_grid.stamped(run, 2) == [
        [pytest.approx(20.0), pytest.approx(0.2)],
        [pytest.approx(40.0), pytest.approx(0.3)],
    ]
    assert run["dynamics"]["rho_ess"] == pytest.approx(0.6) and run["dynamics"]["lr_scale"] is None
    # version - label: 8 both times; logged - ran: 30 - 20 = 10 and 55 - 40 = 15 s
    lines = rlvr_grid.stamp_table({"async q8 + partial | TIS": [run]})
    assert "| async q8 + partial: TIS | 2 | 8.0 [8.0, 8.0] | 12.5 [10.0, 15.0] |" in lines
    assert rlvr_grid.stamp_table({"sync | none": [RUN]}) == [] and rlvr_grid.stamped(RUN, 1) == []


def test_stamped_evals_get_their_own_figures(tmp_path):
    plain = dict(_run([(25, 10.0, 0.2), (50, 20.0, 0.3)]), eval_stamps=[])
    stamped = dict(_run([(25, 10.0, 0.2), (50, 20.0, 0.3)]), eval_stamps=[[25, 31.0, 8.0], [50, 56.0, None]])
    names = lambda paths: sorted(p.rsplit("/", 1)[1] for p in paths)  # noqa: E731
    assert names(rlvr_grid.plot({"sync | none": [plain]}, str(tmp_path), 0.1)) == ["eval_steps.png", "eval_wall.png"]
    paths = rlvr_grid.plot({"sync | none": [plain], "async q8 + partial | TIS": [stamped]}, str(tmp_path), 0.1)
    assert names(paths) == ["eval_steps.png", "eval_time.png", "eval_version.png", "eval_wall.png"]


def test_a_rerender_reads_the_stamps_of_runs_recorded_without_them_from_their_folders(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    out, workdir = tmp_path / "out", tmp_path / "runs"
    out.mkdir()
    run = dict(_run([(25, 10.0, 0.2)]), lag_mean=None, first_step_s=30.0, wall_s=90.0, timing={}, reward=[[1, 0.25]])
    other = dict(run, reward=[[1, 0.5]])  # its folder now holds a later run of the same name: not read
    results = {"_warm_start_accuracy": 0.1, "sync | none": [run], "async q8 + partial | TIS": [other]}
    (out / "results.json").write_text(json.dumps(results))
    later = SummaryWriter(str(workdir / rlvr_grid.run_dir_name("async q8 + partial | TIS", 0) / "tensorboard"))
    later.add_scalar("train/reward", 0.75, 1)
    later.add_scalar("eval/weight_version", 25, 25)
    later.close()
    writer = SummaryWriter(str(workdir / rlvr_grid.run_dir_name("sync | none", 0) / "tensorboard"))
    writer.add_scalar("eval/weight_version", 25, 25)
    writer.add_scalar("eval/wall_clock_since_step1_s", 9.5, 25)
    writer.add_scalar("train/reward", 0.25, 1)
    writer.close()
    monkeypatch.setattr("sys.argv", ["rlvr_grid", "--from-json", "--out", str(out), "--workdir", str(workdir)])
    rlvr_grid.main()
    saved = json.loads((out / "results.json").read_text())
    assert saved["sync | none"][0]["eval_stamps"] == [[25, 25.0, pytest.approx(9.5)]]
    assert saved["sync | none"][0]["curves"] == {"reward": [[1, 0.25]]}  # the update's curves, from the folder too
    assert "curves" not in saved["async q8 + partial | TIS"][0]  # another run's folder: nothing read from it
    assert "eval_stamps" not in saved["async q8 + partial | TIS"][0]
    assert "- seed 0: 25: 0.200 (10 s; version 25, ran at 10 s)" in (out / "results.md").read_text()
    assert (out / "eval_version.png").exists() and (out / "eval_time.png").exists()


def test_the_update_is_read_per_step_and_tabled_as_window_means_at_five_checkpoints(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in range(1, 21):  # reward = step / 100 at steps 1..20
        writer.add_scalar("train/reward", step / 100, step)
    writer.add_scalar("train/mismatch/k1", 0.5, 20)  # logged once, at the last step
    writer.close()
    curves = rlvr_grid.read_curves(str(tmp_path / "tb"))
    assert set(curves) == {"reward", "k1_mu_prox"}  # a tag the run did not log is absent
    assert curves["reward"][:2] == [[1, pytest.approx(0.01)], [2, pytest.approx(0.02)]]
    # checkpoints of a 20-step run: 2, 5, 10, 15, 20; each the mean over the 5 steps up to it (fewer at the start)
    # by hand: (0.01+0.02)/2, (0.01..0.05)/5, (0.06..0.10)/5, (0.11..0.15)/5, (0.16..0.20)/5
    assert rlvr_grid.CURVE_WINDOW == 5
    lines = rlvr_grid.curves_table({"async q16 + partial | seq TIS": [{"seed": 3, "curves": curves}]})
    row = next(line for line in lines if line.startswith("| async q16"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["async q16 + partial: seq TIS", "3", "2/5/10/15/20", "0.015 / 0.03 / 0.08 / 0.13 / 0.18"]
    assert cells[4] == "–" and cells[5] == "– / – / – / – / 0.5"  # not logged; logged at the end only
    header = next(line for line in lines if line.startswith("| configuration"))
    names = [c.strip() for c in header.strip("|").split("|")]
    assert len(names) == len(cells) == 3 + len(rlvr_grid.CURVES)  # a column per curve, each under its own name
    assert names[5:7] == ["k1 μ‖π_prox", "ESS/B"]
    assert rlvr_grid.curves_table({"sync | none": [{"seed": 0, "eval": []}]}) == []  # recorded without curves


def test_a_run_records_its_cpu_whether_bf16_is_native_and_its_dtype(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENRLHF_ESS_CPU_DTYPE", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    info = tmp_path / "cpuinfo"
    for flags, bf16, dtype in (
        ("fpu avx2 fma", "emulated", "fp32"),
        ("fpu avx2 avx512f avx512_bf16", "native", "bf16"),
        ("amx_bf16", "native", "bf16"),
    ):
        info.write_text(f"processor\t: 0\nmodel name\t: Test CPU 9\nflags\t\t: {flags}\nprocessor\t: 1\n")
        m = rlvr_grid.machine(str(info))
        assert (m["cpu"], m["bf16"], m["dtype"]) == ("Test CPU 9", bf16, dtype)
    assert rlvr_grid.machine(str(tmp_path / "absent"))["cpu"] == "unknown"
    assert rlvr_grid.machine_text({"machine": {**m, "dtype": "fp32"}}).endswith("bf16 native, trained in fp32")
    assert rlvr_grid.machine_text({"machine": m}).endswith("bf16 native")  # bf16: as the runs stored before


def test_a_file_of_runs_on_two_machines_says_which_seed_ran_where(tmp_path):
    fast = {"cpu": "A", "cores": 2, "torch_cpu_capability": "AVX512", "bf16": "native"}
    slow = {"cpu": "B", "cores": 2, "torch_cpu_capability": "AVX2", "bf16": "emulated"}
    results = {
        "sync | none": [_run([(25, 10.0, 0.2), (50, 20.0, 0.4)], seed=s) for s in (0, 1)],
        "async q8 + partial | TIS": [_run([(25, 5.0, 0.35), (50, 10.0, 0.45)], seed=s) for s in (0, 1, 2)],
    }
    for runs in results.values():
        for r in runs:
            r.update(lag_mean=None, first_step_s=60.0, wall_s=100.0)
    results["async q8 + partial | TIS"][1]["machine"] = slow
    results["async q8 + partial | TIS"][2]["machine"] = slow
    results["sync | none"][1]["machine"] = fast
    assert rlvr_grid.machine_table({"sync | none": results["sync | none"][1:]}) == []  # one machine: no section
    path = tmp_path / "results.md"
    rlvr_grid.write_table(results, str(path), "python -m benchmarks.rlvr_grid", start_value=0.1)
    text = path.read_text()
    assert "## Machines" in text and "compare seconds only between runs of one machine" in text
    assert "| sync: none | A, 2 cores, AVX512, bf16 native | 1 |" in text
    assert "| sync: none | not recorded | 0 |" in text
    assert "| async q8 + partial: TIS | B, 2 cores, AVX2, bf16 emulated | 1, 2 |" in text
    assert "| async q8 + partial: TIS | not recorded | 0 |" in text


def test_steps_on_two_machines_are_neither_averaged_nor_set_against_sync():
    slow = {"cpu": "B", "cores": 2, "torch_cpu_capability": "AVX2", "bf16": "emulated"}
    sync = [_run([(25, 10.0, 0.2), (50, 20.0, 0.4)], seed=0)]
    same = [_run([(25, 5.0, 0.35), (50, 10.0, 0.45)], seed=0)]
    apart = [_run([(25, 5.0, 0.35), (50, 10.0, 0.45)], seed=s) for s in (0, 1)]
    apart[1]["machine"] = slow
    for r, step in ((sync[0], 2.0), (same[0], 3.0), (apart[0], 3.0), (apart[1], 12.0)):
        r.update(lag_mean=None, timing={"step_total": step})
    results = {"sync | none": sync, "async q8 + partial | TIS": same, "async q8 + partial | none": apart}
    text = "\n".join(rlvr_grid.against_sync(results, 0.1, [25, 50], None))
    assert "| 3.000 | 1.50× |" in text  # one machine: 3 s against sync's 2 s
    assert "| mixed machines | – |" in text and "7.500" not in text
    assert "Every async row's step against sync's: 1.50×." in text


def test_the_lag_table_per_seed_worked_by_hand():
    # start 0.2; sync: evals 0.3, 0.5 (final over the last two = 0.4, so the target is 0.9 × 0.4 = 0.36)
    sync = _run([(25, 10.0, 0.3), (50, 20.0, 0.5)])
    held = _run([(25, 10.0, 0.25), (50, 20.0, 0.45)])  # gain 0.15 against sync's 0.2: 0.75×; reaches 0.36 at 50
    fell = _run([(25, 10.0, 0.1), (50, 20.0, 0.15)])  # gain −0.075: −0.375×, below the start from step 25, never 0.36
    held["flags"] = ["--train.stale_k", "16", "--train.max_epochs", "2"]
    fell["flags"] = ["--train.stale_k", "16"]
    held["curves"] = {"k1_mu_prox": [[s, {1: 0.0, 2: 0.07}.get(s, 0.1) if s <= 16 else 0.5] for s in range(1, 51)]}
    held["curves"]["ess_frac"] = [[s, 1.0 if s <= 16 else 0.8] for s in range(1, 51)]
    results = {"sync | none": [sync], "stale k16 | TIS": [held], "stale k16 | none": [fell]}
    text = "\n".join(rlvr_grid.lag_table(results, 0.2, [25, 50]))
    # sync reached 0.36 at step 50, so r = 50 / 50 = 1.00; steps 17-50 give the k1 and ESS/B means; step 2's k1 is
    # one step's
    # final gain: the mean of the last two evals less the start, over sync's: (0.35 − 0.2) / (0.4 − 0.2) = 0.75 and
    # (0.125 − 0.2) / 0.2 = −0.375
    assert "| stale k16: TIS | 16 / 32 | 1 | 0.75 | 0.75 | – | 50 | 1.00 | 0.500 | 0.800 | 0.070 |" in text
    assert "| stale k16: none | 16 / 16 | 1 | −0.38 | −0.38 | 25 | – | – | – | – | – |" in text
    assert "0.9 × sync's mean final (0.360; sync's seeds reached it at 50)" in text
    # sync read 16 steps late: 0.2 + 0.1 · 9/25 = 0.236 at 25, 0.3 + 0.2 · 9/25 = 0.372 at 50, AUC gain 0.104: 0.52×;
    # 32 late (the TIS row's 16 versions of 2 steps): 0.2 at 25, 0.2 + 0.1 · 18/25 = 0.272 at 50: 0.036 / 0.2 = 0.18×
    assert "| sync delayed 16 steps (computed) | – / 16 | 1 | 0.52 | 0.52 | – |" in text
    assert "| sync delayed 32 steps (computed) | – / 32 | 1 | 0.18 | 0.18 | – |" in text
    assert rlvr_grid.lag_table({"sync | none": [sync]}, 0.2, [25, 50]) == []  # no row set a lag


def test_a_version_is_as_many_optimizer_steps_as_epochs_times_minibatches(tmp_path):
    script = tmp_path / "task.sh"
    script.write_text("SEED=${SEED:-0}\nPROMPTS=${PROMPTS:-32}\nSAMPLES=${SAMPLES:-32}\n")
    assert rlvr_grid.script_default("SAMPLES", str(script)) == 32
    with pytest.raises(ValueError, match="no default for STEPS"):
        rlvr_grid.script_default("STEPS", str(script))
    # the stored script's defaults: 32 prompts x 32 samples, the whole batch one minibatch
    assert (rlvr_grid.script_default("PROMPTS"), rlvr_grid.script_default("SAMPLES")) == (32, 32)
    assert rlvr_grid.steps_per_version({"flags": ["--train.stale_k", "16"]}) == 1
    assert rlvr_grid.steps_per_version({"flags": ["--train.max_epochs", "2"]}) == 2
    four = {"flags": ["--train.stale_k", "16", "--train.batch_size", "256"]}
    assert rlvr_grid.steps_per_version(four) == 4  # 1,024 samples in minibatches of 256
    assert rlvr_grid.steps_per_version({**four, "task_env": {"SAMPLES": "8"}}) == 1  # 32 x 8 = 256: one
    assert rlvr_grid.steps_per_version({"flags": four["flags"] + ["--train.max_epochs", "2"]}) == 8
    with pytest.raises(ValueError, match="does not divide"):
        rlvr_grid.steps_per_version({"flags": ["--train.batch_size", "300"]})
    # the lag table reports both units: 16 versions of 4 steps, and the delayed reference 64 steps late
    sync = _run([(25, 10.0, 0.3), (50, 20.0, 0.5)])
    lagged = _run([(25, 10.0, 0.25), (50, 20.0, 0.45)])
    lagged["flags"] = four["flags"]
    results = {"sync | none": [sync], "stale k16 | AReaL (decoupled)": [lagged]}
    text = "\n".join(rlvr_grid.lag_table(results, 0.2, [25, 50]))
    assert "| stale k16: AReaL (decoupled) | 16 / 64 | 1 |" in text
    assert "| sync delayed 64 steps (computed) | – / 64 |" in text
    # a sync of 4 minibatches a batch is its own reference: 4 versions at 4 steps are 16 steps, and read 16 steps late
    # its curve is 4 versions late: 0.2 + 0.1 · 21/25 = 0.284 at 25, 0.3 + 0.2 · 21/25 = 0.468 at 50, an AUC gain of
    # 0.176 against its 0.2: 0.88× (read 16 versions late it would be 0.2 + 0.1 · 9/25 = 0.236 and 0.372: 0.52×)
    sync4 = {**sync, "flags": ["--train.batch_size", "256"]}
    lagged4 = {**lagged, "flags": ["--train.stale_k", "4", "--train.batch_size", "256"]}
    text = "\n".join(
        rlvr_grid.lag_table({"sync | none": [sync4], "stale k4 | AReaL (decoupled)": [lagged4]}, 0.2, [25, 50])
    )
    assert "| stale k4: AReaL (decoupled) | 4 / 16 | 1 |" in text
    assert "| sync delayed 16 steps (computed) | – / 16 | 1 | 0.88 | 0.88 | – |" in text


def test_the_lag_tables_final_gain_is_the_last_two_evals_not_the_area():
    """A run that starts late and ends close: start 0.2; sync 0.3, 0.4, 0.6 (AUC gain 0.233, final gain over the last
    two 0.3); the lagged run 0.2, 0.3, 0.6 (AUC gain 0.167: 0.71×; final gain 0.25: 0.83×)."""
    sync = _run([(25, 10.0, 0.3), (50, 20.0, 0.4), (75, 30.0, 0.6)])
    late = _run([(25, 10.0, 0.2), (50, 20.0, 0.3), (75, 30.0, 0.6)])
    late["flags"] = ["--train.stale_k", "16"]
    text = "\n".join(rlvr_grid.lag_table({"sync | none": [sync], "stale k16 | TIS": [late]}, 0.2, [25, 50, 75]))
    assert "| stale k16: TIS | 16 / 16 | 1 | 0.71 | 0.83 |" in text


def test_each_run_records_the_dtypes_its_flags_ask_for():
    assert rlvr_grid.run_dtypes([]) == {"trainer": "bf16", "engine": "bfloat16"}
    flags = ["--ds.param_dtype", "bf16", "--vllm.dtype", "float32", "--ds.param_dtype", "fp32"]
    assert rlvr_grid.run_dtypes(flags) == {"trainer": "fp32", "engine": "float32"}  # argparse: the last one wins
    # the script chose fp32 (a CPU that emulates bf16) and the grid's flags said nothing else
    assert rlvr_grid.run_dtypes([], "fp32") == {"trainer": "fp32", "engine": "float32"}
    assert rlvr_grid.run_dtypes(["--vllm.dtype", "bfloat16"], "fp32") == {"trainer": "fp32", "engine": "bfloat16"}
