"""Pre-flight, prompt datasets (checks/preflight/data.py): formats and folders that must pass do, a bad line
past --data.max_samples is not read, a 100k-line JSONL is read fast, a folder's count is what upstream reads, a
partial last rollout is named with the fix.

Shared inputs (the tiny run's flags, FILES): tests/helpers/preflight_inputs.py."""

import json
import os
import shutil
import time

import pytest

from openrlhf_ess.checks import preflight
from openrlhf_ess.config import ConfigError
from tests.helpers.preflight_inputs import (
    _args,
    _offline,  # noqa: F401  (autouse: the hub offline)
)


def test_a_bad_line_past_max_samples_is_not_read(tiny_world, tmp_path):
    """Each file is read up to --data.max_samples records (upstream uses no more); the notice says so."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "ab ="}\n' * 16 + "not json\n")
    notices = preflight.check(_args(tiny_world, tmp_path, ["--data.prompt_dataset", str(path)]))
    assert "16 prompt records in 1 file(s) checked (each file read up to --data.max_samples)" in notices[-1]
    args = _args(tiny_world, tmp_path, ["--data.prompt_dataset", str(path), "--data.max_samples", "100"])
    with pytest.raises(ConfigError, match="line 17: not valid JSON"):
        preflight.check(args)


def test_json_csv_parquet_and_folders_that_pass(tiny_world, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"input": f"p{i} =", "label": "x"} for i in range(8)]  # 8 x 4 samples: one training batch of 32
    (tmp_path / "pretty.json").write_text("\n".join(json.dumps(r, indent=2) for r in rows))  # objects over lines
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=1))
    (tmp_path / "p.csv").write_text("input,label\n" + "".join(f'"{r["input"]}, with comma",x\n' for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "p.parquet"))
    os.makedirs(tmp_path / "folder" / "sub")
    shutil.copy(tiny_world["prompts"], tmp_path / "folder" / "sub" / "train.jsonl")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for spec, count in (
        ("pretty.json", 8),
        ("array.json", 8),
        ("p.csv", 8),
        ("p.parquet", 8),
        ("folder", 16),
        ("saved", 8),
        ("pretty.json,p.csv", 16),
    ):
        spec = ",".join(str(tmp_path / s) for s in spec.split(","))
        notices = preflight.check(
            _args(tiny_world, tmp_path, ["--data.prompt_dataset", spec, "--data.label_key", "label"])
        )
        assert f"{count} prompt records" in notices[-1], (spec, notices)


def test_hub_dataset_is_left_to_the_run(tiny_world, tmp_path):
    notices = preflight.check(_args(tiny_world, tmp_path, ["--data.prompt_dataset", "some-org/some-prompts"]))
    assert any("some-org/some-prompts: a hub dataset id" in n for n in notices), notices
    assert "1 hub/script dataset(s) left to the run" in notices[-1]
    assert "reward_func dry call returned 1 reward" in notices[-1]  # called with a made-up prompt instead


def test_100k_line_jsonl_is_read_fast(tiny_world, tmp_path, capsys):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"input": "a prompt of about the length of a short question =", "label": "digits"}) + "\n"
    path.write_text(line * 100_000)
    args = _args(tiny_world, tmp_path, ["--data.prompt_dataset", str(path), "--data.max_samples", "1000000"])
    start = time.perf_counter()
    notices = preflight.check(args)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\npre-flight with a 100k-line JSONL: {seconds:.2f} s")
    assert "100000 prompt records" in notices[-1]
    assert seconds < 15  # ~0.5 s unloaded; a bound against accidental quadratic work, not a benchmark


@pytest.mark.parametrize(
    "files,readable",
    [
        ({"a.jsonl": 8, "b.json": 4}, True),  # one format for datasets (json): both read
        ({"train.jsonl": 8, "test.jsonl": 4}, True),  # split by name: upstream trains on 'train' only
        ({"a.jsonl": 8, "b.csv": 8}, False),  # two formats: datasets reads json only
        ({"a.jsonl": 4, "b.csv": 8, "c.csv": 8}, False),  # two formats: datasets reads csv only
        ({"sub/a.jsonl": 6, "b.jsonl": 2}, True),
    ],
)
def test_folder_count_is_what_upstream_reads(tiny_world, tmp_path, files, readable):
    """Pre-flight's prompt count for a folder equals the rows upstream's blending_datasets loads from it;
    a folder whose files the loader would partly skip (another format) is refused, naming them."""
    from types import SimpleNamespace

    from openrlhf.datasets.utils import blending_datasets

    folder = tmp_path / "prompts"
    for name, n in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".csv"):
            path.write_text("input\n" + "".join(f"{name} {i} =\n" for i in range(n)))
        else:
            path.write_text("".join(json.dumps({"input": f"{name} {i} ="}) + "\n" for i in range(n)))
    strategy = SimpleNamespace(print=lambda *a: None, is_rank_0=lambda: False, args=SimpleNamespace(use_ms=False))
    loaded = len(blending_datasets(str(folder), None, strategy, dataset_split="train"))
    args = _args(tiny_world, tmp_path, ["--data.prompt_dataset", str(folder), "--data.max_samples", "1000"])
    if not readable:
        assert loaded < sum(files.values())  # what upstream does: some prompts are never read
        with pytest.raises(ConfigError, match="would skip .*csv|would skip .*jsonl") as info:
            preflight.check(args)
        assert "--data.prompt_dataset " + ",".join(str(folder / n) for n in sorted(files)) in str(info.value)
        return
    notices = preflight.check(args)
    assert f"{loaded} prompt records in " in notices[-1], (loaded, notices)
    if "test.jsonl" in files:
        assert any("not read (and not counted): test.jsonl" in n for n in notices), notices


def test_a_partial_last_rollout_is_named_with_the_fix(tiny_world, tmp_path):
    """12 prompts in rollouts of 8: the last rollout of each episode holds 4 prompts x 4 = 16 samples, half a
    training batch of 32: a notice names it and the --data.max_samples that avoids it."""
    notices = preflight.check(_args(tiny_world, tmp_path, ["--data.max_samples", "12"]))
    partial = [n for n in notices if "leave a last rollout" in n]
    assert len(partial) == 1 and "12 prompts leave a last rollout of 4 prompt(s)" in partial[0], notices
    assert "its 16 samples short of a full --train.batch_size" in partial[0]
    assert "--data.max_samples 8" in partial[0]
    full = preflight.check(_args(tiny_world, tmp_path, ["--data.max_samples", "16"]))
    assert not [n for n in full if "leave a last rollout" in n]


def test_an_eval_set_with_another_key_is_told_to_rename_it_not_to_change_the_flag(tiny_world, tmp_path):
    """Upstream reads --eval.dataset with --data.input_key (it has no eval-specific key flag): changing the flag
    would break the training set, so the fix for the eval set is to rename its key."""
    for name, text in (("eval.jsonl", '{"question": "ab ="}\n'), ("eval.csv", "question\nab =\n")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            preflight.check(_args(tiny_world, tmp_path, ["--eval.dataset", str(path)]))
        message = str(info.value)
        assert message.startswith(f"--eval.dataset {path}"), message
        assert "rename the " in message.lower() and " to 'input' in the eval set (--data.input_key applies to " in (
            message
        ), message
        assert "changing --data.input_key would break --data.prompt_dataset" in message
        assert "set --data.input_key to" not in message
