"""Where records come from: a Hugging Face dataset (`name` or `name:config`) or local files.

Local files: JSON lines (`.jsonl`, `.json`), Parquet (`.parquet`) and plain text (`.txt`, one document per
non-empty line, as the Hugging Face `text` builder reads it), or a directory of them (recursively, in name
order). Everything streams: nothing holds more than one batch of records in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.errors import UserError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
TEXT_COLUMN_OF_TXT = "text"


@dataclass
class ReadStats:
    """What reading skipped; reported in the manifest."""

    bad_records: int = 0
    examples_of_bad_records: list[str] = field(default_factory=list)

    def skip(self, where: str) -> None:
        self.bad_records += 1
        if len(self.examples_of_bad_records) < 5:
            self.examples_of_bad_records.append(where)


@dataclass(frozen=True)
class Source:
    """A parsed `--source`: either local files or a hub dataset."""

    spec: str
    files: tuple[Path, ...] = ()
    dataset: str | None = None
    config: str | None = None

    @property
    def is_local(self) -> bool:
        return self.dataset is None

    def fingerprint(self, split: str) -> dict[str, Any]:
        """Identifies the input so a rerun can reuse a completed output."""
        if self.is_local:
            digest = hashlib.sha256()
            for path in self.files:
                stat = path.stat()
                digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
            return {"files": len(self.files), "files_sha256": digest.hexdigest()}
        return {"dataset": self.dataset, "config": self.config, "split": split}


def resolve_source(spec: str) -> Source:
    """Decide whether `spec` is a local path or a hub dataset name, and check that local files exist."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES))
        if not files:
            raise UserError(f"--source {spec}: directory has no {', '.join(LOCAL_SUFFIXES)} files")
        return Source(spec=spec, files=files)
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise UserError(f"--source {spec}: unsupported file type; allowed: {', '.join(LOCAL_SUFFIXES)}")
        return Source(spec=spec, files=(path,))
    if spec.startswith(("/", "./", "../", "~")) or path.suffix in LOCAL_SUFFIXES:
        raise UserError(f"--source {spec}: no such file or directory")
    name, _, config = spec.partition(":")
    return Source(spec=spec, dataset=name, config=config or None)


def iter_records(source: Source, *, column: str, split: str, skip_bad_records: bool, stats: ReadStats) -> Iterator[Any]:
    """The values of `column`, record by record, in a deterministic order."""
    if not source.is_local:
        yield from _iter_hub(source, column=column, split=split)
        return
    for path in source.files:
        if path.suffix == ".parquet":
            yield from _iter_parquet(path, column)
        elif path.suffix == ".txt":
            if column != TEXT_COLUMN_OF_TXT:
                raise UserError(f"{path}: plain text files have only the column '{TEXT_COLUMN_OF_TXT}', not '{column}'")
            yield from _iter_text_lines(path, skip_bad_records, stats)
        else:
            yield from _iter_json_lines(path, column, skip_bad_records, stats)


def _decode(line: bytes, path: Path, offset: int, skip: bool, stats: ReadStats) -> str | None:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        where = f"{path}: byte offset {offset + error.start}"
        if skip:
            stats.skip(where)
            return None
        raise UserError(
            f"{where}: not valid UTF-8; fix the file or pass --skip-bad-records to skip such records"
        ) from None


def _iter_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, raw line) of a file, read in binary so offsets are exact."""
    offset = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            yield number, offset, line
            offset += len(line)


def _iter_text_lines(path: Path, skip: bool, stats: ReadStats) -> Iterator[str]:
    for _, offset, raw in _iter_lines(path):
        text = _decode(raw, path, offset, skip, stats)
        if text is not None and text.strip():
            yield text.rstrip("\r\n")


def _iter_json_lines(path: Path, column: str, skip: bool, stats: ReadStats) -> Iterator[Any]:
    for number, offset, raw in _iter_lines(path):
        if not raw.strip():
            continue
        text = _decode(raw, path, offset, skip, stats)
        if text is None:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            where = f"{path}: line {number} (byte offset {offset})"
            if skip:
                stats.skip(where)
                continue
            raise UserError(
                f"{where}: not valid JSON ({error.msg}); pass --skip-bad-records to skip such records"
            ) from None
        if not isinstance(record, dict) or column not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise UserError(
                f"{path}: line {number}: no column '{column}' (found: {keys}); choose it with the column option"
            )
        yield record[column]


def _iter_parquet(path: Path, column: str) -> Iterator[Any]:
    import pyarrow.parquet as parquet

    try:
        handle = parquet.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for unreadable files
        raise UserError(f"{path}: not a readable Parquet file ({error})") from None
    names = handle.schema_arrow.names
    if column not in names:
        raise UserError(f"{path}: no column '{column}' (found: {', '.join(names)}); choose it with the column option")
    for batch in handle.iter_batches(columns=[column], batch_size=1000):
        yield from batch.column(0).to_pylist()


def _iter_hub(source: Source, *, column: str, split: str) -> Iterator[Any]:
    import datasets

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    # The hub client logs every failed request and retry; a failure is reported once, in the error below.
    hub_log.setLevel(logging.ERROR)
    try:
        dataset = datasets.load_dataset(source.dataset, source.config, split=split, streaming=True)
    except Exception as error:  # the hub client raises many types; all mean "cannot open this dataset"
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        offline = " (no network access to the hub?)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        raise UserError(f"--source {source.spec}: cannot load dataset split '{split}'{offline}: {first_line}") from None
    finally:
        hub_log.setLevel(level)
    names = list(dataset.features or {})
    if names and column not in names:
        raise UserError(f"--source {source.spec}: no column '{column}' (found: {', '.join(names)})")
    for record in dataset:
        if column not in record:
            raise UserError(f"--source {source.spec}: no column '{column}' (found: {', '.join(record)})")
        yield record[column]
