"""Read dataset records from JSON, JSONL or parquet, each with where it came from.

`read_records(path)` yields (location, record) pairs, of one file or of every data file
under a directory (DeepCoder ships sharded parquet files); `location` is "FILE:LINE" (JSON and
JSONL) or "FILE row N" (parquet), so that a malformed row can be reported where a user
can find it. A record that is not even valid JSON is yielded as a `BadRecord`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from areal.config import ConfigError


class BadRecord(str):
    """The reason a record could not be read (yielded in place of the record)."""


SUFFIXES = (".json", ".jsonl", ".parquet")


def read_records(path: str | Path) -> Iterator[tuple[str, dict | BadRecord]]:
    """Records of one file, or of every data file under a directory (sharded datasets)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix.lower() in SUFFIXES and f.is_file())
        if not files:
            raise ConfigError(f"dataset.path={str(path)!r} is a directory without data files")
        for f in files:
            yield from read_records(f)
        return
    if not p.is_file():
        raise ConfigError(
            f"dataset.path={str(path)!r} does not exist: give a .json, .jsonl or .parquet "
            "file, or a directory of them"
        )
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl(p)
    elif suffix == ".json":
        yield from _json(p)
    elif suffix == ".parquet":
        yield from _parquet(p)
    else:
        raise ConfigError(
            f"dataset.path={str(path)!r}: unknown file type {suffix!r}; "
            "use .json (a list of objects), .jsonl (one object per line) or .parquet"
        )


def _jsonl(p: Path) -> Iterator[tuple[str, dict | BadRecord]]:
    with p.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{p}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{p}:{n}", BadRecord(f"invalid JSON ({e.msg})")


def _json(p: Path) -> Iterator[tuple[str, dict | BadRecord]]:
    """A JSON array, decoded item by item so each record knows its line."""
    text = p.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = _skip(text, 0)
    if not text.startswith("[", i):  # a JSONL file named .json is common enough to accept
        yield from _jsonl(p)
        return
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "]":
        line = text.count("\n", 0, i) + 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # One broken item breaks the array: what follows cannot be found reliably.
            yield f"{p}:{line}", BadRecord(f"invalid JSON ({e.msg}); the rest of the file is lost")
            return
        yield f"{p}:{line}", record
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _parquet(p: Path) -> Iterator[tuple[str, dict | BadRecord]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"dataset.path={str(p)!r} is a parquet file, which needs pyarrow: "
            "pip install pyarrow (or convert the file to JSONL)"
        ) from None
    for n, record in enumerate(pq.read_table(p).to_pylist()):
        yield f"{p} row {n}", record
