"""Prompt rows from files: JSONL, Parquet, and datasets saved with ``save_to_disk``.

Columns are mapped by ``DataConfig.fields`` (prompt, answer, metadata). Every row gets a
uid from a hash of its mapped content (duplicates get ``-1``, ``-2``, ... suffixes), which
is stable across runs and file re-orderings. Without ``eval_path``, ``eval_size`` rows are
held out by hash (independent of row order and of the run seed); rows identical to an eval
row are dropped from train.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.config import DataConfig
from engine.data.errors import DataError

Row = tuple[str, str, str | None, dict[str, Any]]  # uid, raw prompt, answer, metadata

_MISSING = object()


def _records(
    path: Path, source: str, split: str | None
) -> tuple[Iterator[tuple[str, dict[str, Any]]], list[str] | None]:
    """``(where, record)`` pairs of a file (where = "line 12" / "row 12") and its columns when known."""
    if not path.exists():
        raise DataError(
            f"{path}: file not found; set data.path (or data.eval_path) to an existing {source} file"
        )
    if source == "jsonl":
        if not path.is_file():
            raise DataError(
                f"{path} is a directory, not a JSONL file; use data.source 'disk' for a saved dataset"
            )
        return _jsonl_records(path), None
    if source == "parquet":
        return _parquet_records(path)
    if source == "disk":
        return _disk_records(path, split)
    raise DataError(f"unknown data.source '{source}'")


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot open ({exc.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text ({exc.reason}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line must be one JSON object"
                ) from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield f"line {lineno}", obj


def _parquet_records(path: Path) -> tuple[Iterator[tuple[str, dict[str, Any]]], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read as Parquet ({exc}); check data.source and the file") from None

    def it() -> Iterator[tuple[str, dict[str, Any]]]:
        for i, rec in enumerate(table.to_pylist()):
            yield f"row {i}", rec

    return it(), list(table.column_names)


def _disk_records(path: Path, split: str | None) -> tuple[Iterator[tuple[str, dict[str, Any]]], list[str]]:
    import datasets

    if not path.is_dir():
        raise DataError(f"{path} is not a directory saved with datasets.save_to_disk; check data.source")
    try:
        ds = datasets.load_from_disk(str(path))
    except IndexError:
        # datasets saves an empty Dataset with no shards and then cannot load it
        if _saved_without_shards(path):
            raise DataError(f"{path}: the dataset is empty; it needs at least one row") from None
        raise
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(f"{path}: cannot load with datasets.load_from_disk ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if split is None:
            if len(names) != 1:
                raise DataError(f"{path} is a DatasetDict with splits {names}; set data.split to one of them")
            split = names[0]
        if split not in ds:
            raise DataError(f"{path} has no split '{split}'; set data.split to one of {names}")
        ds = ds[split]
    elif not isinstance(ds, datasets.Dataset):
        raise DataError(f"{path}: expected a Dataset or DatasetDict, got {type(ds).__name__}")

    def it() -> Iterator[tuple[str, dict[str, Any]]]:
        for i, rec in enumerate(ds):
            yield f"row {i}", rec

    return it(), list(ds.column_names)


def _saved_without_shards(path: Path) -> bool:
    states = [path / "state.json", *path.glob("*/state.json")]
    for state in states:
        try:
            if json.loads(state.read_text()).get("_data_files") == []:
                return True
        except (OSError, ValueError):
            continue
    return False


def _check_columns(path: Path, columns: list[str], cfg: DataConfig) -> None:
    wanted = [("data.fields.prompt", cfg.fields.prompt)]
    if cfg.fields.answer is not None:
        wanted.append(("data.fields.answer", cfg.fields.answer))
    wanted += [("data.fields.metadata", m) for m in cfg.fields.metadata]
    for setting, col in wanted:
        if col not in columns:
            fix = (
                " (or set data.fields.answer to null if there is no answer)"
                if setting == "data.fields.answer"
                else ""
            )
            raise DataError(
                f"{path}: no column '{col}' (from {setting}); the file has {columns}: set {setting}{fix}"
            )


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(text: str | None) -> str | None:
    """A JSONL row may hold a lone surrogate (``"\\ud800"`` is valid JSON) that no tokenizer
    can encode (nor UTF-8): it becomes U+FFFD, as it would in any UTF-8 text."""
    return _LONE_SURROGATE.sub("\ufffd", text) if text else text


def _row_uid(raw: str, answer: str | None, meta: dict[str, Any]) -> str:
    blob = json.dumps([raw, answer, meta], sort_keys=True, ensure_ascii=False, default=str)
    return "row-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_rows(path: str | Path, cfg: DataConfig) -> list[Row]:
    """The mapped rows of one file; errors name the file, the row and the field."""
    p = Path(path).expanduser()
    records, columns = _records(p, cfg.source, cfg.split)
    if columns is not None:
        _check_columns(p, columns, cfg)
    rows: list[Row] = []
    seen: dict[str, int] = {}
    for where, rec in records:
        raw = rec.get(cfg.fields.prompt, _MISSING)
        if raw is _MISSING:
            raise DataError(
                f"{p}, {where}: no field '{cfg.fields.prompt}' (data.fields.prompt); "
                f"the row has {sorted(rec)}: fix the row or set data.fields.prompt"
            )
        if not isinstance(raw, str) or not raw:
            raise DataError(
                f"{p}, {where}: field '{cfg.fields.prompt}' must be a non-empty string, got {raw!r}"
            )
        raw = _no_lone_surrogates(raw)
        answer: str | None = None
        if cfg.fields.answer is not None:
            value = rec.get(cfg.fields.answer, _MISSING)
            if value is _MISSING:
                raise DataError(
                    f"{p}, {where}: no field '{cfg.fields.answer}' (data.fields.answer); fix the row or set "
                    "data.fields.answer to the answer column (null if there is none)"
                )
            answer = _no_lone_surrogates(_answer_text(value))
        meta: dict[str, Any] = {}
        for col in cfg.fields.metadata:
            value = rec.get(col, _MISSING)
            if value is _MISSING:
                raise DataError(f"{p}, {where}: no field '{col}' (listed in data.fields.metadata)")
            meta[col] = value
        uid = _row_uid(raw, answer, meta)
        n = seen.get(uid, 0)
        seen[uid] = n + 1
        rows.append((uid if n == 0 else f"{uid}-{n}", raw, answer, meta))
    if not rows:
        raise DataError(
            f"{p}: the dataset is empty; it needs at least one row with a '{cfg.fields.prompt}' field"
        )
    return rows


def _answer_text(value: Any) -> str | None:
    """Answers are strings: numbers become their text, lists/dicts JSON, null stays None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | dict):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _content_key(uid: str) -> str:
    return uid.split("-", 2)[0] + "-" + uid.split("-", 2)[1]


def file_rows(cfg: DataConfig) -> tuple[list[Row], list[Row], int]:
    """Train rows, eval rows and how many train rows were dropped for duplicating an eval row."""
    if cfg.path is None:
        raise DataError(f"data.path is required when data.source is '{cfg.source}'")
    rows = read_rows(cfg.path, cfg)
    if cfg.eval_path:
        eval_rows = read_rows(cfg.eval_path, cfg)[: cfg.eval_size]
    elif cfg.eval_size == 0:
        eval_rows = []
    else:
        if cfg.eval_size >= len(rows):
            raise DataError(
                f"{cfg.path} has {len(rows)} rows; holding out data.eval_size={cfg.eval_size} leaves none "
                "for training: lower data.eval_size or set data.eval_path"
            )
        ranked = sorted(range(len(rows)), key=lambda i: (hashlib.sha256(rows[i][0].encode()).digest(), i))
        chosen = set(ranked[: cfg.eval_size])
        eval_rows = [r for i, r in enumerate(rows) if i in chosen]
        rows = [r for i, r in enumerate(rows) if i not in chosen]
    eval_keys = {_content_key(r[0]) for r in eval_rows}
    train = [r for r in rows if _content_key(r[0]) not in eval_keys]
    if not train:
        raise DataError(
            f"{cfg.path}: every training row also appears in the eval set; use different eval data"
        )
    return train, eval_rows, len(rows) - len(train)
