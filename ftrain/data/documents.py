"""Documents from data files: plain text, a folder of files, JSON Lines, Parquet.

    files = data_files("data/")              # a file, or every file under a folder, sorted
    for doc in read_documents(files[0]):     # Document(name, text=... | messages=... | skip=...)
        ...

What one file gives, by its suffix:

    .jsonl     one document a line: {"text": "..."}, or a chat {"messages": [{"role": "user",
               "content": "..."}, {"role": "assistant", "content": "..."}, ...]}, whose loss is
               on the assistant's tokens only (see ``ftrain.data.chat``); blank lines are ignored
    .parquet   one document a row, from a ``text`` or a ``messages`` column (read with pyarrow)
    others     the whole file is one UTF-8 text document

Bad data never stops a build and is never silently dropped: it comes back as a Document with
``skip`` (why, one of ``SKIP_REASONS``) and ``problem`` (what, with the file and line), which
``build_token_dataset`` counts and lists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SKIP_REASONS", "Document", "check_messages", "data_files", "read_documents"]

# undecodable: not UTF-8; unreadable: an OS error; empty: no text; invalid: not the expected shape
SKIP_REASONS = ("undecodable", "unreadable", "empty", "invalid")


@dataclass(frozen=True)
class Document:
    """One document (``text`` or chat ``messages``), or a skipped one (``skip`` is set).

    ``name`` says where it came from: the file, plus ``:LINE`` (JSON Lines, 1-based) or ``:ROW``
    (Parquet, 0-based row) for a file of many documents.
    """

    name: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    skip: str | None = None  # one of SKIP_REASONS, or None for a document to use
    problem: str = ""  # for a skipped document: what is wrong, in words


def data_files(path: str | os.PathLike) -> list[Path]:
    """The files ``--data PATH`` names: ``[PATH]`` for a file; for a folder, every file under it
    (recursively) in sorted order, hidden ones (a name starting with ".") left out.

    Raises:
        FileNotFoundError: ``path`` does not exist, or a folder holds no file.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(
            f"--data {str(p)!r} does not exist; pass a text file, a folder of them, a .jsonl or "
            "a .parquet file"
        )
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        raise FileNotFoundError(f"--data {str(p)!r} is a folder without files; put data in it")
    return files


def read_documents(source: Path | tuple[str, str]) -> Iterator[Document]:
    """The documents of one source: a path (read by its suffix, see the module docstring) or a
    ``(name, text)`` pair. A file that cannot be read is one skipped Document."""
    if not isinstance(source, Path):
        name, text = source
        yield Document(name, text=text) if text else Document(name, skip="empty")
        return
    name = str(source)
    if source.suffix == ".parquet":
        yield from _read_parquet(source)
        return
    try:
        text = source.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        yield Document(
            name, skip="undecodable", problem=f"not UTF-8 ({e.reason} at byte {e.start})"
        )
        return
    except OSError as e:
        yield Document(name, skip="unreadable", problem=e.strerror or str(e))
        return
    if source.suffix == ".jsonl" and text.strip():
        yield from _read_jsonl(name, text)
    elif text and source.suffix != ".jsonl":
        yield Document(name, text=text)
    else:
        yield Document(name, skip="empty", problem="the file is empty")


def _read_jsonl(name: str, text: str) -> Iterator[Document]:
    # Lines end at "\n" only: str.splitlines() would also cut at U+2028 or U+0085, which a JSON
    # string may hold unescaped, splitting one record in two.
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            record = json.loads(line)
        except ValueError as e:
            yield Document(where, skip="invalid", problem=f"not JSON ({e})")
            continue
        yield _from_record(where, record)


def _read_parquet(path: Path) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"--data {str(path)!r}: reading .parquet needs pyarrow: pip install 'ftrain[hf]'"
        ) from e
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError
        yield Document(str(path), skip="unreadable", problem=f"not a Parquet file ({e})")
        return
    columns = [c for c in ("messages", "text") if c in file.schema_arrow.names]
    if not columns:
        yield Document(
            str(path),
            skip="invalid",
            problem=f"no 'text' or 'messages' column (columns: {file.schema_arrow.names})",
        )
        return
    if file.metadata.num_rows == 0:
        yield Document(str(path), skip="empty", problem="the file has no rows")
        return
    row = 0
    for batch in file.iter_batches(columns=columns[:1]):
        for value in batch.column(0).to_pylist():
            yield _from_record(f"{path}:{row}", {columns[0]: value})
            row += 1


def _from_record(where: str, record: Any) -> Document:
    """A JSON object (a JSONL line, a Parquet row) as a Document: its "messages" or its "text"."""
    if not isinstance(record, dict):
        return Document(where, skip="invalid", problem=f"a {type(record).__name__}, not an object")
    if "messages" in record:
        problem = check_messages(record["messages"])
        if problem:
            return Document(where, skip="invalid", problem=problem)
        if not record["messages"]:
            return Document(where, skip="empty", problem="'messages' is an empty list")
        msgs = tuple({"role": m["role"], "content": m["content"]} for m in record["messages"])
        return Document(where, messages=msgs)
    if "text" not in record:
        keys = sorted(record)[:8]
        return Document(
            where, skip="invalid", problem=f"missing field 'text' or 'messages' (keys: {keys})"
        )
    text = record["text"]
    if not isinstance(text, str):
        return Document(where, skip="invalid", problem=f"'text' is a {type(text).__name__}")
    return Document(where, text=text) if text else Document(where, skip="empty", problem="''")


def check_messages(messages: Any) -> str:
    """What is wrong with a chat's ``messages`` ('' if nothing): it must be a list of objects,
    each with a string ``role`` and a string ``content``."""
    if not isinstance(messages, list):
        return f"'messages' is a {type(messages).__name__}, not a list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] is a {type(m).__name__}, not an object"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"a {type(m[key]).__name__}"
                return f"messages[{i}] {key!r} is {got}, not a string"
    return ""
