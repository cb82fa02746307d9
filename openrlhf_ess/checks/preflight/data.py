"""Pre-flight, prompt datasets, as upstream's ``blending_datasets`` reads them (.jsonl/.json/.csv/.parquet/.arrow,
folders): they parse, every record has ``--data.input_key`` (and ``--data.label_key``), no prompt is empty. Streamed;
each file is read up to ``--data.max_samples`` records (100k JSON lines take ~0.3 s); a folder's files are those
datasets' loader reads (one format, the split's files: :func:`_loader_files`). Then the prompt count against one
training batch (:func:`_check_batches_fill`)."""

from __future__ import annotations

import collections
import csv
import glob
import json
import os
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from openrlhf_ess.checks.preflight.model import first_line, hub_id_form
from openrlhf_ess.config import ConfigError

DATA_EXTS = (".json", ".jsonl", ".csv", ".parquet", ".arrow")  # upstream's blending_datasets, case-sensitive


def _check_batches_fill(args: types.SimpleNamespace, data: "_Data", notices: List[str]) -> None:
    """The prompt set against one training batch, where pre-flight counted it."""
    n = data.train_records
    if n is None or args.train.dynamic_batch_enable or args.algo.dynamic_filtering_enable:
        return
    samples = n * args.rollout.n_samples_per_prompt
    if samples < args.train.batch_size:
        raise ConfigError(
            f"--data.prompt_dataset holds {n} prompt(s) x --rollout.n_samples_per_prompt "
            f"{args.rollout.n_samples_per_prompt} = {samples} samples per episode, fewer than one --train.batch_size "
            f"{args.train.batch_size}: no optimizer step would ever happen (grad norm 0, the saved model = the "
            f"initial one). Add prompts, or lower --train.batch_size and --rollout.batch_size to fit "
            f"(e.g. --rollout.batch_size {n} --train.batch_size {samples})."
        )
    left = n % args.rollout.batch_size
    if left and (left * args.rollout.n_samples_per_prompt) % args.train.batch_size:
        keep = n - left
        notices.append(
            f"--data.prompt_dataset: {n} prompts leave a last rollout of {left} prompt(s) per episode (not a multiple "
            f"of --rollout.batch_size {args.rollout.batch_size}); upstream trains it, and its "
            f"{(left * args.rollout.n_samples_per_prompt) % args.train.batch_size} samples short of a full "
            "--train.batch_size add their gradient to the next step. To train on full batches only, pass "
            f"--data.max_samples {keep}" + ("." if keep else " (or more prompts).")
        )


class _Records:
    """Checks records of one data file against --data.input_key / --data.label_key."""

    def __init__(self, flag: str, path: str, args):
        self.flag, self.path = flag, path
        self.input_key, self.label_key = args.data.input_key, args.data.label_key
        self.chat = args.data.apply_chat_template
        self.count = 0
        self.first: Optional[dict] = None

    def eval_fix(self, key: str, flag: str, what: str) -> Optional[str]:
        """For --eval.dataset: the fix that keeps the training set working, or None for the training set. Upstream
        reads the eval set with the training set's keys (it has no --eval.input_key), so changing the flag would
        break --data.prompt_dataset."""
        if self.flag != "--eval.dataset":
            return None
        return (
            f"rename the {what} to {key!r} in the eval set ({flag} applies to --eval.dataset too, and upstream has "
            f"no key flag of its own for the eval set: changing {flag} would break --data.prompt_dataset)"
        )

    def where(self, where: str = "") -> str:
        return f"{self.flag} {self.path}{' ' + where if where else ''}"

    def example(self) -> str:
        label = f', "{self.label_key}": "..."' if self.label_key else ""
        return f'{{"{self.input_key}": "..."{label}}}'

    def record(self, where: str, record: Any) -> None:
        """One JSON record: an object with the keys, a non-empty prompt."""
        if not isinstance(record, dict):
            raise ConfigError(
                f"{self.where(where)}: a JSON {type(record).__name__}, not an object; each record must be an object "
                f"such as {self.example()}."
            )
        for key, flag, fix in (
            (self.input_key, "--data.input_key", "set --data.input_key to the key that holds the prompt"),
            (self.label_key, "--data.label_key", "drop --data.label_key if the reward needs no label"),
        ):
            if key is not None and key not in record:
                keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
                raise ConfigError(
                    f"{self.where(where)}: no key {key!r} ({flag}); its keys: {keys}. Add it to that record, or "
                    f"{self.eval_fix(key, flag, 'key') or fix}."
                )
        self.value(where, record[self.input_key], record)

    def value(self, where: str, prompt: Any, record: Optional[dict] = None) -> None:
        """One prompt value (the input_key column of a table, or a record's)."""
        self.count += 1
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError(
                    f"{self.where(where)}: empty prompt ({self.input_key!r} is {prompt!r}). Fill it in or remove the "
                    "record: an empty prompt gives the engine nothing to continue."
                )
        elif self.chat and isinstance(prompt, list):
            if not prompt:
                raise ConfigError(f"{self.where(where)}: empty prompt ({self.input_key!r} is an empty message list).")
        elif prompt is None:
            raise ConfigError(
                f"{self.where(where)}: empty prompt ({self.input_key!r} is null). Fill it in or remove the record."
            )
        else:
            chat = "" if self.chat else " (a list of chat messages needs --data.apply_chat_template)"
            raise ConfigError(
                f"{self.where(where)}: the prompt ({self.input_key!r}) is a {type(prompt).__name__}, not text{chat}."
            )
        if self.first is None:
            self.first = dict(record) if record is not None else {self.input_key: prompt}

    def columns(self, where: str, names: List[str], what: str) -> None:
        """A table's header: it must have the input (and label) columns."""
        for key, flag in ((self.input_key, "--data.input_key"), (self.label_key, "--data.label_key")):
            if key is not None and key not in names:
                shown = ", ".join(repr(n) for n in names[:12]) or "none"
                fix = self.eval_fix(key, flag, what) or f"rename the {what}, or set {flag} to the {what} that holds it"
                raise ConfigError(
                    f"{self.where(where)}: no {what} {key!r} ({flag}); its {what}s: {shown}. "
                    f"{fix[0].upper()}{fix[1:]}."
                )

    def empty(self, why: str) -> ConfigError:
        return ConfigError(
            f"{self.flag} {self.path}: no records ({why}). Add prompts, e.g. one JSON object per line such as "
            f"{self.example()}."
        )


def _json_error(records: _Records, line: int, e: ValueError, column: Optional[int] = None) -> ConfigError:
    if isinstance(e, UnicodeDecodeError):
        what = f"not UTF-8 text ({e.reason})"
    else:
        what = f"not valid JSON ({getattr(e, 'msg', e)}, column {column or getattr(e, 'colno', '?')})"
    return ConfigError(
        f"{records.where(f'line {line}')}: {what}. Each record must be one JSON object such as {records.example()}; "
        "fix or remove that line."
    )


def _check_json_file(records: _Records, cap: int) -> None:
    """JSON Lines, streamed; else (a JSON array, or pretty-printed objects) the whole file, as HF's loader does."""
    lineno = 0
    with open(records.path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                if records.count == 0 and not isinstance(e, UnicodeDecodeError):
                    break  # not JSON Lines: maybe an array or multi-line objects
                raise _json_error(records, lineno, e) from None
            if records.count == 0 and not isinstance(record, dict):
                break
            records.record(f"line {lineno}", record)
            if records.count >= cap:
                return
        else:
            if records.count == 0:
                raise records.empty("the file is empty" if lineno == 0 else "only blank lines")
            return
    _check_json_document(records, cap)


def _check_json_document(records: _Records, cap: int) -> None:
    with open(records.path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _json_error(records, raw.count(b"\n", 0, e.start) + 1, e) from None
    decoder = json.JSONDecoder()
    pos, line, counted = 0, 1, 0

    def line_at(p: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, p)
        counted = p
        return line

    def skip(p: int) -> int:
        while p < len(text) and text[p] in " \t\r\n":
            p += 1
        return p

    def decode(p: int) -> Tuple[Any, int]:
        try:
            return decoder.raw_decode(text, p)
        except json.JSONDecodeError as e:
            raise _json_error(records, e.lineno, e, e.colno) from None

    pos = skip(0)
    in_array = text.startswith("[", pos)
    if in_array:
        pos = skip(pos + 1)
    while pos < len(text) and records.count < cap:
        if in_array and text[pos] == "]":
            break
        record, end = decode(pos)
        records.record(f"line {line_at(pos)}", record)
        pos = skip(end)
        if in_array and pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)
        elif in_array and not text.startswith("]", pos):
            raise _json_error(records, line_at(pos), ValueError("expected ',' or ']' between array elements"), 1)
    if records.count == 0:
        raise records.empty("an empty JSON array" if in_array else "the file is empty")


def _check_csv_file(records: _Records, cap: int) -> None:
    csv.field_size_limit(2**31 - 1)  # HF reads CSV with pandas, which has no field size limit
    try:
        with open(records.path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise records.empty("the file is empty")
            records.columns("line 1 (the header)", list(reader.fieldnames), "column")
            for row in reader:
                records.value(f"line {reader.line_num}", row.get(records.input_key), row)
                if records.count >= cap:
                    return
    except (csv.Error, UnicodeDecodeError) as e:
        raise ConfigError(f"{records.where()}: not a readable CSV file ({first_line(e)}).") from None
    if records.count == 0:
        raise records.empty("a header but no rows")


def _check_batches(records: _Records, batches: Iterator[Any], cap: int) -> None:
    """Rows of an Arrow-backed table (Parquet, Arrow, a saved HF dataset), as column batches."""
    row = 0
    for batch in batches:
        columns = batch if isinstance(batch, dict) else batch.to_pydict()
        prompts = columns[records.input_key]
        for i, prompt in enumerate(prompts):
            row += 1
            first = {k: v[i] for k, v in columns.items()} if records.first is None else None
            records.value(f"row {row}", prompt, first)
            if records.count >= cap:
                return
    if records.count == 0:
        raise records.empty("a table with no rows")


def _table_columns(records: _Records) -> List[str]:
    return [k for k in (records.input_key, records.label_key) if k is not None]


def _check_parquet_file(records: _Records, cap: int) -> None:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(records.path)
        names = pf.schema_arrow.names
    except Exception as e:
        raise ConfigError(f"{records.where()}: not a readable Parquet file ({first_line(e)}).") from None
    records.columns("(schema)", names, "column")
    _check_batches(records, pf.iter_batches(batch_size=4096, columns=_table_columns(records)), cap)


def _check_arrow_file(records: _Records, cap: int) -> None:
    import pyarrow as pa

    with pa.memory_map(records.path) as source:
        try:
            try:
                reader = pa.ipc.open_stream(source)  # as HF's "arrow" builder: stream format, else file format
                batches = iter(reader)
            except (OSError, pa.lib.ArrowInvalid):
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except Exception as e:
            raise ConfigError(f"{records.where()}: not a readable Arrow file ({first_line(e)}).") from None
        records.columns("(schema)", reader.schema.names, "column")
        _check_batches(records, (batch.select(_table_columns(records)) for batch in batches), cap)


_FILE_CHECKS: Dict[str, Callable[[_Records, int], None]] = {
    ".json": _check_json_file,
    ".jsonl": _check_json_file,
    ".csv": _check_csv_file,
    ".parquet": _check_parquet_file,
    ".arrow": _check_arrow_file,
}


class _Data:
    """What the prompt checks found: counts per dataset, and the first training record (for the reward dry call)."""

    def __init__(self):
        self.files = 0
        self.records = 0
        self.capped = False
        self.unchecked = 0
        self.first: Optional[Tuple[dict, str]] = None  # (record, where it came from)
        self.train_records: Optional[int] = None  # --data.prompt_dataset's prompts, where every entry was counted

    def summary(self) -> str:
        text = f"{self.records} prompt records in {self.files} file(s) checked"
        if self.capped:
            text += " (each file read up to --data.max_samples)"
        if self.unchecked:
            text += f", {self.unchecked} hub/script dataset(s) left to the run"
        return text


def _check_prompt_datasets(args: types.SimpleNamespace, tokenizer, notices: List[str]) -> _Data:
    data = _Data()
    for flag, value, split, split_flag in (
        ("--data.prompt_dataset", args.data.prompt_dataset, args.data.prompt_split, "--data.prompt_split"),
        ("--eval.dataset", args.eval.dataset, args.eval.split, "--eval.split"),
    ):
        if not value:
            continue
        records, unchecked = data.records, data.unchecked
        for entry in value.split(","):
            if not entry.strip():
                raise ConfigError(
                    f"{flag} {value}: an empty entry in the comma-separated list; remove the stray comma."
                )
            # As upstream: "path@data_dir" loads data_dir inside a folder or hub dataset.
            spec = entry.split("@")[0].strip()
            data_dir = entry.split("@")[1].strip() if "@" in entry else None
            found = _check_dataset(flag, spec, data_dir, split, split_flag, args, notices, data)
            if found is not None and data.first is None and flag == "--data.prompt_dataset":
                data.first = found
        if flag == "--data.prompt_dataset" and data.unchecked == unchecked and args.data.prompt_probs is None:
            # upstream's train_data.select(range(min(max_samples, len))) after blending the entries
            data.train_records = min(data.records - records, args.data.max_samples)
    if data.first is not None:
        _check_first_prompt(args, tokenizer, data)
    return data


def _check_dataset(flag, spec, data_dir, split, split_flag, args, notices, data: _Data):
    """One entry of a dataset list, classified as upstream's blending_datasets does; returns its first record."""
    ext = os.path.splitext(spec)[1]
    if ext == ".py" or (os.path.isdir(spec) and os.path.exists(os.path.join(spec, os.path.basename(spec) + ".py"))):
        notices.append(f"{flag} {spec}: a dataset script, loaded when the run starts (not checked now).")
        data.unchecked += 1
        return None
    if ext in DATA_EXTS:
        files = sorted(glob.glob(spec)) if glob.has_magic(spec) else ([spec] if os.path.exists(spec) else [])
        if not files:
            raise ConfigError(
                f"{flag} {spec}: no such file ({os.path.abspath(spec)}). Check the path (prompts are a .jsonl, .json, "
                ".csv or .parquet file, a folder, or a hub dataset id)."
            )
        if split and split != "train":
            raise ConfigError(
                f"{split_flag} {split}: local data files ({flag} {spec}) load as the single split 'train' (upstream's "
                f"blending_datasets), so split {split!r} does not exist; drop {split_flag}."
            )
        return _check_files(flag, files, args, data)
    if os.path.isdir(spec):
        return _check_folder(flag, spec, data_dir, split, split_flag, args, data, notices)
    if os.path.exists(spec):
        raise ConfigError(
            f"{flag} {spec}: unsupported file type {ext or '(no extension)'!r}; upstream reads .json, .jsonl, .csv, "
            ".parquet and .arrow files (lower-case extension), folders and hub datasets."
        )
    if args.use_ms or hub_id_form(spec):
        notices.append(f"{flag} {spec}: a hub dataset id, loaded (and checked) when the run starts, not now.")
        data.unchecked += 1
        return None
    raise ConfigError(
        f"{flag} {spec}: no such file or folder ({os.path.abspath(spec)}), and not a hub dataset id (org/name). "
        "Check the path."
    )


def _check_files(flag: str, files: List[str], args, data: _Data):
    """The files of one dataset entry; like upstream's max_count, --data.max_samples bounds the entry's records."""
    cap, first = args.data.max_samples, None
    for path in files:
        if os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: is a folder, but its name ends like a data file; pass the folder name.")
        records = _Records(flag, path, args)
        _FILE_CHECKS[os.path.splitext(path)[1].lower()](records, cap)
        data.files += 1
        data.records += records.count
        cap -= records.count
        first = first or (records.first, f"{path} (first record)")
        if cap <= 0:
            data.capped = True
            break
    return first


def _check_folder(flag, spec, data_dir, split, split_flag, args, data: _Data, notices: List[str]):
    saved = [n for n in ("dataset_dict.json", "state.json") if os.path.exists(os.path.join(spec, n))]
    if saved:  # a dataset written by datasets' save_to_disk: upstream's load_from_disk
        import datasets

        try:
            ds = datasets.load_from_disk(spec)
        except Exception as e:
            raise ConfigError(f"{flag} {spec}: a saved HF dataset that does not load ({first_line(e)}).") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(
                    f"{split_flag} {split}: {flag} {spec} has the splits {', '.join(ds)}, not {split!r}; set "
                    f"{split_flag} to one of them."
                )
            ds = ds[split]
        records = _Records(flag, spec, args)
        records.columns("(schema)", list(ds.column_names), "column")
        cap = args.data.max_samples
        ds = ds.select_columns(_table_columns(records))
        _check_batches(records, ds.iter(batch_size=4096), cap)
        data.files += 1
        data.records += records.count
        data.capped = data.capped or records.count >= cap
        return records.first, f"{spec} (first record)"
    root = os.path.join(spec, data_dir) if data_dir else spec
    files = sorted(
        os.path.join(d, n)
        for d, _, names in os.walk(root)
        for n in names
        if os.path.splitext(n)[1].lower() in DATA_EXTS and not n.startswith(".") and n != "dataset_info.json"
    )
    if not files:
        raise ConfigError(
            f"{flag} {spec}: the folder{' ' + repr(data_dir) if data_dir else ''} holds no data files (.jsonl, .json, "
            ".csv, .parquet, .arrow) and is not a saved HF dataset. Point it at the prompt file."
        )
    read = _loader_files(flag, spec, data_dir, split, split_flag, files, notices)
    return _check_files(flag, read, args, data)


def _loader_files(flag, spec, data_dir, split, split_flag, walked: List[str], notices: List[str]) -> List[str]:
    """The files of a folder that upstream's loader reads: ``load_dataset(folder, data_dir=...)`` (blending_datasets),
    whose module factory picks ONE format, the folder's most common extension (datasets' load.py:
    infer_module_for_data_files_list), and assigns files to splits by name (train/test/validation...), of which
    upstream keeps --data.prompt_split. A data file of another format would be skipped without a word and
    pre-flight would count prompts never trained: refused, naming the files and the fix; files of
    other splits are a notice (HF's naming convention), and not counted."""
    from datasets.load import LocalDatasetModuleFactory

    try:
        module = LocalDatasetModuleFactory(spec, data_dir=data_dir).get_module()
    except Exception as e:
        raise ConfigError(
            f"{flag} {spec}: datasets cannot load the folder as upstream does ({first_line(e)})."
        ) from None
    params = module.builder_configs_parameters
    configs = {c.name: c for c in params.builder_configs}
    config_ = configs.get(params.default_config_name) or params.builder_configs[0]
    splits = {str(name): [os.path.realpath(f) for f in files] for name, files in (config_.data_files or {}).items()}
    fmt = module.module_path.split(".")[-1]  # datasets.packaged_modules.json.json -> json
    base = os.path.join(spec, data_dir) if data_dir else spec

    def names(paths) -> str:
        shown = [os.path.relpath(p, os.path.realpath(base)) for p in sorted(paths)]
        return ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")

    from datasets.packaged_modules import _MODULE_TO_EXTENSIONS

    every = {f for files in splits.values() for f in files}
    skipped = [f for f in map(os.path.realpath, walked) if f not in every]
    of_format = set(_MODULE_TO_EXTENSIONS.get(fmt, []))
    same_format = [f for f in skipped if os.path.splitext(f)[1].lower() in of_format]  # hidden folders, say
    skipped = [f for f in skipped if f not in same_format]
    if same_format:
        notices.append(f"{flag} {spec}: datasets' loader does not read {names(same_format)} (not counted).")
    read = splits.get(split, [])
    unchecked = sorted({os.path.splitext(f)[1].lower() for f in read} - set(_FILE_CHECKS))
    if skipped or unchecked:
        present = sorted(set(map(os.path.realpath, walked)) | set(read))
        exts = collections.Counter(os.path.splitext(f)[1].lower() for f in present)
        counts = ", ".join(f"{n} {ext}" for ext, n in sorted(exts.items()))
        other = skipped or sorted(set(present) - set(read))
        listed = ",".join(os.path.join(spec, os.path.relpath(f, os.path.realpath(spec))) for f in present)
        raise ConfigError(
            f"{flag} {spec}: the folder holds data files of {len(exts)} formats ({counts}); upstream's loader "
            f"(datasets.load_dataset on a folder) reads only the most common one ({fmt}: {names(read)}) and would "
            f"skip {names(other)} without a word, so those prompts would never be trained. Keep one format per "
            "folder, or pass the files themselves (each is loaded, then they are concatenated): "
            f"--data.prompt_dataset {listed if len(present) <= 4 else 'FILE1,FILE2,...'}."
        )
    if split not in splits:
        raise ConfigError(
            f"{split_flag} {split}: {flag} {spec} has the splits {', '.join(splits)} (datasets names them after the "
            f"files: train*, test*, validation*...), not {split!r}; set {split_flag} to one of them."
        )
    if len(splits) > 1:
        others = [f for name, files in splits.items() if name != split for f in files]
        notices.append(
            f"{flag} {spec}: datasets assigns files to splits by their names; training reads split {split!r} "
            f"({split_flag}): {names(read)}; not read (and not counted): {names(others)}."
        )
    return sorted(read)


def _check_first_prompt(args, tokenizer, data: _Data) -> None:
    """The first record through upstream's own preprocessing and the tokenizer: catches a chat template that fails
    and a tokenizer that turns the prompt into no tokens."""
    from openrlhf.datasets.prompts_dataset import preprocess_data

    record, where = data.first
    chat = None
    if tokenizer is None and args.data.apply_chat_template:
        data.first = None  # a hub model's tokenizer is not loaded now: no chat template to render with
        return
    if args.data.apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"--data.apply_chat_template: the tokenizer of --actor.model_name_or_path "
                f"{args.actor.model_name_or_path} has no chat template. Drop --data.apply_chat_template (prompts are "
                "then used as written, or through --data.input_template), or use a chat model."
            )
        chat = tokenizer.apply_chat_template
    try:
        prompt, label = preprocess_data(
            record, args.data.input_template, args.data.input_key, args.data.label_key, chat
        )
    except Exception as e:
        raise ConfigError(
            f"--data.prompt_dataset {where}: upstream's prompt preprocessing fails on it ({first_line(e)})."
        ) from None
    ids = tokenizer(text=prompt, add_special_tokens=False)["input_ids"] if tokenizer is not None else [0]
    if not len(ids):
        raise ConfigError(
            f"--data.prompt_dataset {where}: the tokenizer of --actor.model_name_or_path turns the prompt "
            f"{prompt[:60]!r} into no tokens. Check that the tokenizer belongs to the model."
        )
    data.first = ({"prompt": prompt, "label": label}, where)
