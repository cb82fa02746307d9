"""Pre-flight, prompt datasets, as upstream's ``blending_datasets`` reads them (.jsonl/.json/.csv/.parquet/.arrow,
folders): they parse, every record has ``--data.input_key`` (and ``--data.label_key``), no prompt is empty. Each file
is read by datasets itself (``load_dataset(builder, data_files=..., streaming=True)``, the builder from
:data:`BUILDERS`), up to ``--data.max_samples`` records; a folder's files are those datasets' loader reads (one
format, the split's files: :func:`_loader_files`). Rows carry no line number: where a check fails, the file as written
names the line (:class:`_JsonSource`, :func:`_csv_line`). Then the prompt count against one training batch
(:func:`_check_batches_fill`)."""

from __future__ import annotations

import collections
import contextlib
import csv
import glob
import itertools
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
    """Checks the rows datasets reads from one data file against --data.input_key / --data.label_key. Rows carry no
    position: ``locate(i)`` names row ``i`` (0-based) in the file ("line 3", "row 2") when a check fails, and for JSON
    ``raw(i)`` is the record as written, which tells a missing key from a null (datasets fills both with None)."""

    def __init__(self, flag: str, path: str, args, locate: Callable[[int], str], raw=None):
        self.flag, self.path = flag, path
        self.input_key, self.label_key = args.data.input_key, args.data.label_key
        self.chat = args.data.apply_chat_template
        self.locate, self.raw = locate, raw
        self.count = 0
        self.first: Optional[dict] = None

    def reset(self) -> None:
        self.count, self.first = 0, None

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

    def not_object(self, where: str, record: Any) -> ConfigError:
        return ConfigError(
            f"{self.where(where)}: a JSON {type(record).__name__}, not an object; each record must be an object "
            f"such as {self.example()}."
        )

    def record(self, i: int, row: dict) -> None:
        """Row ``i`` of a JSON file: the record has the keys (a key datasets filled with None is looked up in the
        record as written), a non-empty prompt."""
        for key, flag, fix in (
            (self.input_key, "--data.input_key", "set --data.input_key to the key that holds the prompt"),
            (self.label_key, "--data.label_key", "drop --data.label_key if the reward needs no label"),
        ):
            if key is None or row.get(key) is not None:
                continue
            record = self.raw(i)
            if not isinstance(record, dict):
                raise self.not_object(self.locate(i), record)
            if key not in record:
                keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
                raise ConfigError(
                    f"{self.where(self.locate(i))}: no key {key!r} ({flag}); its keys: {keys}. Add it to that "
                    f"record, or {self.eval_fix(key, flag, 'key') or fix}."
                )
        self.value(i, row.get(self.input_key), row)

    def value(self, i: int, prompt: Any, record: Optional[dict] = None) -> None:
        """Row ``i``'s prompt value (the input_key column of a table, or a record's)."""
        self.count += 1
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ConfigError(
                    f"{self.where(self.locate(i))}: empty prompt ({self.input_key!r} is {prompt!r}). Fill it in or "
                    "remove the record: an empty prompt gives the engine nothing to continue."
                )
        elif self.chat and isinstance(prompt, list):
            if not prompt:
                raise ConfigError(
                    f"{self.where(self.locate(i))}: empty prompt ({self.input_key!r} is an empty message list)."
                )
        elif prompt is None:
            raise ConfigError(
                f"{self.where(self.locate(i))}: empty prompt ({self.input_key!r} is null). Fill it in or remove the "
                "record."
            )
        else:
            chat = "" if self.chat else " (a list of chat messages needs --data.apply_chat_template)"
            raise ConfigError(
                f"{self.where(self.locate(i))}: the prompt ({self.input_key!r}) is a {type(prompt).__name__}, not "
                f"text{chat}."
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

    def table_columns(self) -> List[str]:
        return [k for k in (self.input_key, self.label_key) if k is not None]

    def empty(self, why: str) -> ConfigError:
        return ConfigError(
            f"{self.flag} {self.path}: no records ({why}). Add prompts, e.g. one JSON object per line such as "
            f"{self.example()}."
        )


@contextlib.contextmanager
def _datasets_quiet():
    """datasets logs a file it fails to parse at ERROR level; pre-flight says it once, in its own words."""
    import datasets

    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _dataset(path: str, builder: str, **config):
    """One local file as datasets reads it (upstream: ``load_dataset(builder, data_files=path)``), streamed: only
    the rows asked for, and the chunk they are in, are read."""
    import datasets

    return datasets.load_dataset(builder, data_files=[path], split="train", streaming=True, **config)


def _first_rows(ds, cap: int) -> Iterator[dict]:
    """The first ``cap`` rows, one by one: nothing after the row that makes ``cap`` is asked of datasets (its
    ``take`` and batched ``iter`` read on into the next chunk, which may hold a line past ``cap`` that does not
    parse)."""
    return itertools.islice(iter(ds), max(cap, 0))


class _JsonSource:
    """One JSON file as written, read with the standard library's ``json`` only where datasets' rows say too little:
    the line a row starts on, the record behind a None (a missing key, a null, not an object), and the record that
    made datasets fail. JSON Lines are indexed line by line, as far as asked; a JSON array (or objects spread over
    lines) is decoded whole, as datasets does."""

    def __init__(self, records: _Records):
        self.records, self.path = records, records.path
        self.items: List[Tuple[int, int, Any]] = []  # (line, byte offset, value) per record
        self.problem: Optional[Tuple[int, int, ConfigError]] = None  # (index, byte offset, error) of the first bad one
        self.document = False
        self.lines = 0  # lines of a JSON Lines file seen so far
        self._walk: Optional[Iterator[None]] = None

    def _error(self, line: int, e: ValueError, column: Optional[int] = None) -> ConfigError:
        if isinstance(e, UnicodeDecodeError):
            what = f"not UTF-8 text ({e.reason})"
        else:
            what = f"not valid JSON ({getattr(e, 'msg', e)}, column {column or getattr(e, 'colno', '?')})"
        return ConfigError(
            f"{self.records.where(f'line {line}')}: {what}. Each record must be one JSON object such as "
            f"{self.records.example()}; fix or remove that line."
        )

    def _json_lines(self) -> Iterator[None]:
        offset = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                self.lines, at, offset = lineno, offset, offset + len(line)
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError as e:
                    if not self.items and not isinstance(e, UnicodeDecodeError):
                        break  # not JSON Lines: maybe an array or multi-line objects
                    self.problem = (len(self.items), at, self._error(lineno, e))
                    return
                if not self.items and not isinstance(value, dict):
                    break
                self.items.append((lineno, at, value))
                if not isinstance(value, dict):
                    self.problem = (len(self.items) - 1, at, self.records.not_object(f"line {lineno}", value))
                    return
                yield
            else:
                return
        self.document, self.items = True, []
        self._json_document()

    def _json_document(self) -> None:
        with open(self.path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            self.problem = (0, 0, self._error(raw.count(b"\n", 0, e.start) + 1, e))
            return
        decoder = json.JSONDecoder()

        def skip(p: int) -> int:
            while p < len(text) and text[p] in " \t\r\n":
                p += 1
            return p

        pos = skip(0)
        in_array = text.startswith("[", pos)
        if in_array:
            pos = skip(pos + 1)
        while pos < len(text) and not (in_array and text[pos] == "]"):
            line = text.count("\n", 0, pos) + 1
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                self.problem = (len(self.items), pos, self._error(e.lineno, e, e.colno))
                return
            self.items.append((line, pos, value))
            if not isinstance(value, dict) and not (in_array and isinstance(value, str)):
                self.problem = (len(self.items) - 1, pos, self.records.not_object(f"line {line}", value))
                return
            pos = skip(end)
            if in_array and pos < len(text) and text[pos] == ",":
                pos = skip(pos + 1)
            elif in_array and not text.startswith("]", pos):
                error = ValueError("expected ',' or ']' between array elements")
                self.problem = (len(self.items), pos, self._error(text.count("\n", 0, pos) + 1, error, 1))
                return

    def _upto(self, index: Optional[int]) -> None:
        """Read records until record ``index`` is known, or (None) to the end or the first bad one."""
        if self._walk is None:
            self._walk = self._json_lines()
        while (index is None or len(self.items) <= index) and self.problem is None:
            if next(self._walk, StopIteration) is StopIteration:
                return

    def line(self, i: int) -> str:
        self._upto(i)
        return f"line {self.items[i][0]}" if i < len(self.items) else f"record {i + 1}"

    def value(self, i: int) -> Any:
        self._upto(i)
        return self.items[i][2] if i < len(self.items) else None

    def first_problem(self) -> Optional[Tuple[int, int, ConfigError]]:
        self._upto(None)
        return self.problem

    def why_empty(self) -> str:
        self._upto(None)
        if self.document:
            return "an empty JSON array"
        return "the file is empty" if self.lines == 0 else "only blank lines"


def _check_json_file(records: _Records, cap: int) -> None:
    """The rows datasets' "json" builder reads, up to ``cap``. Where datasets fails (a line that is not JSON, a record
    that is not an object), the record at fault is found in the file: the rows of JSON Lines before it are read
    again, the read bounded just before it (datasets' ``chunksize``), so a bad line past ``cap`` is never read."""
    source = _JsonSource(records)
    records.locate, records.raw = source.line, source.value
    bound: Optional[int] = None
    while True:
        try:
            with _datasets_quiet():
                config = {"chunksize": bound} if bound else {}
                for row in _first_rows(_dataset(records.path, "json", **config), cap):
                    records.record(records.count, row)
            break
        except ConfigError:
            raise
        except Exception as e:
            problem = source.first_problem()
            if problem is None and not source.items:  # datasets cannot load an empty file at all
                raise records.empty(source.why_empty()) from None
            if problem is None:
                raise ConfigError(f"{records.where()}: datasets cannot read it as JSON ({first_line(e)}).") from None
            index, offset, error = problem
            if bound is not None or source.document or index == 0:
                raise error from None
            records.reset()
            bound = offset - 1  # datasets reads this many bytes, then to the end of that line: the line before
    if records.count == 0:
        problem = source.first_problem()
        if problem is not None:
            raise problem[2]
        raise records.empty(source.why_empty())


def _csv_line(path: str, i: int) -> str:
    """The line row ``i`` of a CSV file ends on (a quoted value may span lines); the header is line 1."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for n, _ in enumerate(reader):
            if n == i + 1:
                return f"line {reader.line_num}"
    return f"row {i + 1}"


def _csv_header(path: str) -> List[str]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        return next(csv.reader(f), [])


def _is_blank(path: str) -> bool:
    with open(path, "rb") as f:
        return not f.read(1 << 16).strip()


def _check_table(records: _Records, cap: int, builder: str, what: str, header: str) -> None:
    """The rows datasets' csv/parquet/arrow builder reads, up to ``cap``: the header holds the input (and label)
    columns, then each row's prompt."""
    try:
        with _datasets_quiet():
            ds = _dataset(records.path, builder)
            names = list(ds.features) if ds.features is not None else None  # Parquet/Arrow: the file's schema
            if names is not None:
                records.columns(header, names, "column")
                ds = ds.select_columns(records.table_columns())
            for row in _first_rows(ds, cap):
                if names is None:  # CSV: the header, as the first row's columns
                    names = list(row)
                    records.columns(header, names, "column")
                records.value(records.count, row[records.input_key], row)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{records.where()}: not a readable {what} file ({first_line(e)}).") from None
    if records.count == 0:
        if builder == "csv":
            records.columns(header, _csv_header(records.path), "column")
            raise records.empty("a header but no rows")
        raise records.empty("a table with no rows")


def _check_csv_file(records: _Records, cap: int) -> None:
    if _is_blank(records.path):
        raise records.empty("the file is empty")
    records.locate = lambda i: _csv_line(records.path, i)
    _check_table(records, cap, "csv", "CSV", "line 1 (the header)")


def _check_parquet_file(records: _Records, cap: int) -> None:
    _check_table(records, cap, "parquet", "Parquet", "(schema)")


def _check_arrow_file(records: _Records, cap: int) -> None:
    _check_table(records, cap, "arrow", "Arrow", "(schema)")


# datasets' builder for a local data file, by its (lower-case) extension: what upstream's blending_datasets passes to
# load_dataset for a file, and what datasets infers for a folder's files.
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}

_FILE_CHECKS: Dict[str, Callable[[_Records, int], None]] = {
    "json": _check_json_file,
    "csv": _check_csv_file,
    "parquet": _check_parquet_file,
    "arrow": _check_arrow_file,
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
        records = _Records(flag, path, args, locate=lambda i: f"row {i + 1}")
        _FILE_CHECKS[BUILDERS[os.path.splitext(path)[1].lower()]](records, cap)
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
        records = _Records(flag, spec, args, locate=lambda i: f"row {i + 1}")
        records.columns("(schema)", list(ds.column_names), "column")
        cap = args.data.max_samples
        ds = ds.select_columns(records.table_columns())
        for batch in ds.select(range(min(cap, len(ds)))).iter(batch_size=4096):
            for j, prompt in enumerate(batch[records.input_key]):
                first = {k: v[j] for k, v in batch.items()} if records.first is None else None
                records.value(records.count, prompt, first)
        if records.count == 0:
            raise records.empty("a table with no rows")
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
    which picks ONE format, the folder's most common extension, and assigns files to splits by name
    (train/test/validation...), of which upstream keeps --data.prompt_split. Asked of datasets itself
    (``load_dataset_builder``: the builder it picks and its config's data files, nothing read). A data file of
    another format would be skipped without a word and pre-flight would count prompts never trained: refused, naming
    the files and the fix; files of other splits are a notice (HF's naming convention), and not counted."""
    import datasets

    try:
        with _datasets_quiet():
            builder = datasets.load_dataset_builder(spec, data_dir=data_dir)
    except Exception as e:
        raise ConfigError(
            f"{flag} {spec}: datasets cannot load the folder as upstream does ({first_line(e)})."
        ) from None
    data_files = builder.config.data_files or {}
    splits = {str(name): [os.path.realpath(f) for f in files] for name, files in data_files.items()}
    fmt = builder.name  # "json", "csv", ...
    base = os.path.join(spec, data_dir) if data_dir else spec

    def names(paths) -> str:
        shown = [os.path.relpath(p, os.path.realpath(base)) for p in sorted(paths)]
        return ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")

    every = {f for files in splits.values() for f in files}
    skipped = [f for f in map(os.path.realpath, walked) if f not in every]
    of_format = {ext for ext, builder_name in BUILDERS.items() if builder_name == fmt}
    same_format = [f for f in skipped if os.path.splitext(f)[1].lower() in of_format]  # hidden folders, say
    skipped = [f for f in skipped if f not in same_format]
    if same_format:
        notices.append(f"{flag} {spec}: datasets' loader does not read {names(same_format)} (not counted).")
    read = splits.get(split, [])
    checked = {ext for ext, builder_name in BUILDERS.items() if builder_name in _FILE_CHECKS}
    unchecked = sorted({os.path.splitext(f)[1].lower() for f in read} - checked)
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
