"""The inputs the pre-flight tests (tests/test_preflight*.py) build: the tiny run's flags without its Ray folder, the
files the "Rejected in pre-flight" rows of docs/bad_inputs.md name (FILES), and the offline hub."""

import os
import re
import shutil

import pytest

from openrlhf_ess.cli import train_ppo_ray as cli
from tests.helpers.e2e import tiny_args
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
