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
