"""Records from the user's files, streamed: JSONL line by line, Parquet and Arrow batch by batch.

A record is `(where, value)`: `where` names the file and the line (`path:LINE`), the record of a
JSON array (`path record N`) or the table row (`path row N`, counted from 1) so every error can
point at it; `value` is the decoded JSON value or row dict (checked by the caller), or, for a
.txt file, the whole text as one string.

Parquet and Arrow go through pyarrow, one record batch at a time (Arrow files memory-mapped), so
a table larger than RAM never is in RAM; a `datasets.Dataset.save_to_disk` directory is its
Arrow files (IPC stream format) listed in `state.json`, read the same way without `datasets`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tierlm.data.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet", ".arrow")
_UTF8_BOM = b"\xef\xbb\xbf"
_ROWS_PER_BATCH = 1024  # Parquet rows decoded at a time: bounded memory, few Python calls


def data_files(path: Path, *, flag: str) -> list[Path]:
    """The files `path` names: itself, a `save_to_disk` directory's Arrow files, or a
    directory's data files (recursively, sorted, hidden entries skipped)."""
    if not path.exists():
        raise DataError(f"{path}: no such file or directory; check {flag}")
    if not path.is_dir():
        return [path]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"{path}: a DatasetDict saved with save_to_disk (splits: {', '.join(splits) or 'none'})"
            f"; point {flag} at one split, e.g. {path / (splits[0] if splits else 'train')}"
        )
    if (path / "state.json").is_file():
        return _saved_dataset_files(path)
    found = []
    for file in path.rglob("*"):
        # Hidden entries are tool state (.git, .ipynb_checkpoints), not corpus text.
        if any(part.startswith(".") for part in file.relative_to(path).parts):
            continue
        if file.is_file() and file.suffix.lower() in SUFFIXES:
            found.append(file)
    if not found:
        raise DataError(
            f"{path}: directory holds no .txt, .jsonl, .json, .parquet or .arrow files; add some "
            f"or point {flag} at a file"
        )
    return sorted(found)


def _saved_dataset_files(path: Path) -> list[Path]:
    state_file = path / "state.json"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"{state_file}: not a datasets save_to_disk state file (expected '_data_files': "
            f"[{{'filename': ...}}]): {err}"
        ) from err
    files = [path / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"{state_file}: lists Arrow files that are missing: {missing or 'none'}")
    return files


def iter_records(file: Path) -> Iterator[tuple[str, Any]]:
    """Every record of one file, in order (see the module docstring)."""
    suffix = file.suffix.lower()
    if suffix == ".txt":
        yield str(file), _read_text(file)
    elif suffix == ".jsonl":
        yield from _jsonl(file)
    elif suffix == ".json":
        yield from _json(file)
    elif suffix in (".parquet", ".arrow"):
        yield from _table(file)
    else:
        raise DataError(
            f"{file}: unsupported file type '{file.suffix}'; use .txt (one document), .jsonl (one "
            "JSON object per line), .json (an array of objects), .parquet or .arrow"
        )


def _decode(data: bytes, file: Path, offset: int, line: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        at = offset + err.start
        line += data.count(b"\n", 0, err.start)
        raise DataError(
            f"{file}: not valid UTF-8 at byte {at} (line {line}); convert the file to UTF-8, "
            f"e.g. `iconv -f latin1 -t utf-8 {file} > converted{file.suffix}`"
        ) from err


def _read_text(file: Path) -> str:
    data = file.read_bytes()
    # Editors on Windows often prepend a BOM; it is not part of the text.
    start = len(_UTF8_BOM) if data.startswith(_UTF8_BOM) else 0
    text = _decode(data[start:], file, start, 1)
    if not text.strip():
        raise DataError(f"{file}: file is empty or only whitespace; remove it or add text")
    # Same newline handling as Python's text mode, so Windows files train like Unix ones.
    return text.replace("\r\n", "\n")


def _jsonl(file: Path) -> Iterator[tuple[str, Any]]:
    offset, any_text = 0, False
    with file.open("rb") as f:
        # Binary lines split on b"\n" only: U+2028 and friends may sit inside JSON strings.
        for lineno, raw in enumerate(f, start=1):
            start = len(_UTF8_BOM) if lineno == 1 and raw.startswith(_UTF8_BOM) else 0
            line = _decode(raw[start:], file, offset + start, lineno)
            offset += len(raw)
            if not line.strip():
                continue
            any_text = True
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{file}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); each line "
                    "of a '.jsonl' file must be one JSON object"
                ) from err
            yield f"{file}:{lineno}", record
    if not any_text:
        raise DataError(f"{file}: file is empty or only whitespace; remove it or add text")


def _json(file: Path) -> Iterator[tuple[str, Any]]:
    # One JSON document has to be parsed whole; large data belongs in .jsonl or .parquet.
    text = _read_text(file)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{file}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); a "
            "'.json' file must hold one array of objects"
        ) from err
    if not isinstance(data, list):
        raise DataError(
            f"{file}: expected a JSON array of records, got {type(data).__name__}; write one "
            "object per array element, or one per line as .jsonl"
        )
    for i, record in enumerate(data, start=1):
        yield f"{file} record {i}", record


def _table(file: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # imported here: plain-text runs never need it

    try:
        batches = _parquet_batches(file) if file.suffix.lower() == ".parquet" else _arrow_batches(
            file
        )
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield f"{file} row {row}", record
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{file}: could not read it as {file.suffix[1:]}: {err}") from err
    if row == 0:
        raise DataError(f"{file}: table has no rows; remove it or add data")


def _parquet_batches(file: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    yield from pq.ParquetFile(file).iter_batches(batch_size=_ROWS_PER_BATCH)


def _arrow_batches(file: Path) -> Iterator[Any]:
    import pyarrow as pa

    # save_to_disk writes the IPC stream format; Feather v2 / IPC file format also occurs.
    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            return
        yield from reader
