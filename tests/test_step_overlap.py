"""The overlap formula's table (benchmarks/step_overlap.py): the step formulas, the parts read from made-up grid
results and the per-step overhead table, the rows, each against values worked out by hand; and the doc's block
is what the function renders from the stored results."""

import os

import pytest

from benchmarks import step_overlap as so


def _run(gen, make, ppo, sync, total=0.0):
    return {
        "timing": {
            "generation": gen,
            "make_experience": make,
            "ppo_train": ppo,
            "broadcast": sync,
            "step_total": total,
        }
    }


def test_sync_adds_the_phases_and_async_overlaps_generation_with_training():
    assert so.sync_step(3.0, 1.0, 0.5) == pytest.approx(4.5)  # 3 + 1 + 0.5
    assert so.async_step(3.0, 1.0, 0.5) == pytest.approx(3.5)  # max(3, 1) + 0.5
    # a correction's 2.5 makes the trainer the slower side: max(3, 1 + 2.5) + 0.5 = 4
    assert so.async_step(3.0, 1.0, 0.5, extra=2.5) == pytest.approx(4.0)


def test_the_parts_are_shares_of_the_training_time():
    grid = {
        # sync: two seeds, means generation 2.0, make 0.25, update 0.75, sync 0.1 -> training 1.0
        so.SYNC: [_run(1.8, 0.2, 0.8, 0.1), _run(2.2, 0.3, 0.7, 0.1)],
        # uncorrected async: make 0.2 + update 0.6 = 0.8, its pause 0.4
        so.UNCORRECTED: [_run(0.9, 0.2, 0.6, 0.4)],
        "async q8 + partial | TIS": [_run(0.9, 0.24, 0.5, 0.4)],
        "async q8 + partial | TIS + snapshot": [_run(0.9, 0.36, 0.5, 0.4)],
        "async q8 + partial | bypass": [_run(0.9, 0.04, 0.5, 0.4)],
        "async q8 + partial | VCPO (recipe)": [_run(0.9, 1.0, 0.5, 0.4)],
    }
    overhead = {"TIS token": 1.05, "TIS seq": 1.03, "ESS-LR": 1.04, "off": 1.0}
    p = so.parts(grid, overhead)
    assert p["gen_over_train"] == pytest.approx(2.0)  # 2.0 / (0.25 + 0.75)
    assert p["sync_share"] == pytest.approx(0.1)  # 0.1 / 1.0
    assert p["async_sync_share"] == pytest.approx(0.5)  # 0.4 / 0.8
    extras = p["extras"]
    assert extras["none"] == pytest.approx(0.0)
    # TIS: make 0.24 - 0.2 = 0.04, update 5 % of 0.6 = 0.03 -> 0.07 / 0.8
    assert extras["TIS"] == pytest.approx(0.0875)
    # + snapshot: make 0.16, update 0.03 -> 0.19 / 0.8
    assert extras["TIS + snapshot"] == pytest.approx(0.2375)
    # bypass: make 0.04 - 0.2 = -0.16, no update extra -> -0.2
    assert extras["bypass"] == pytest.approx(-0.2)
    # VCPO: make 0.8, update (3 % + 4 %) of 0.6 = 0.042 -> 0.842 / 0.8
    assert extras["VCPO (recipe)"] == pytest.approx(1.0525)


def test_rows_put_sync_without_a_correction_against_async_with_each():
    table = so.rows(0.1, 0.5, {"a": 0.0, "b": 1.5}, ratios=[1, 3])
    # r = 1: sync 1 + 1 + 0.1 = 2.1; a: max(1, 1) + 0.5 = 1.5 (1.4x); b: max(1, 2.5) + 0.5 = 3.0 (0.7x)
    assert table[0] == pytest.approx([1, 2.1, 1.5, 1.4, 3.0, 0.7])
    # r = 3: sync 4.1; a: 3.5 (4.1 / 3.5 = 1.1714); b: max(3, 2.5) + 0.5 = 3.5, the same
    assert table[1] == pytest.approx([3, 4.1, 3.5, 4.1 / 3.5, 3.5, 4.1 / 3.5])


def test_the_check_takes_the_sync_pause_out_of_the_batchs_generation():
    grid = {row: [_run(0.6, 0.15, 0.2, 0.2, total=0.9)] for row, _ in so.CORRECTIONS.values()}
    name, gen, train, sync, formula, measured = so.check_rows(grid)[0]
    # G = 0.6 - 0.2 = 0.4, E + U = 0.35, formula max(0.4, 0.35) + 0.2 = 0.6 against the measured 0.9
    assert (name, gen, train, sync, formula, measured) == (
        "none",
        pytest.approx(0.4),
        pytest.approx(0.35),
        0.2,
        pytest.approx(0.6),
        0.9,
    )


def test_the_overhead_table_is_read_by_configuration():
    text = (
        "| config | s / ppo_train | ratio | IQR s |\n|---|---|---|---|\n| off | 0.0881 | 1.000 | 0.0124 |\n"
        "| TIS token | 0.0904 | 1.027 | 0.0121 |\n"
    )
    assert so.read_overhead(text) == {"off": 1.0, "TIS token": 1.027}


def test_the_doc_carries_what_the_stored_results_give():
    with open(so.DOC) as f:
        text = f.read()
    block = text[text.index(so.BEGIN) + len(so.BEGIN) : text.index(so.END)]
    assert block == "\n" + so.render_stored(), "re-render: python -m benchmarks.step_overlap --write"
    assert os.path.exists(so.GRID) and os.path.exists(so.OVERHEAD)
