"""Documents from data files: plain text, a folder of files, JSON Lines, Parquet.

    files = data_files("data/")              # a file, or every file under a folder, sorted
    for doc in read_documents(files[0]):     # Document(name, text=... | messages=... | skip=...)
        ...

What one file gives, by its suffix:

    .jsonl     one document a line (blank lines are ignored), one of these records:
                 {"text": "..."}
                 {"messages": [{"role": "user", "content": "..."},
                               {"role": "assistant", "content": "..."}, ...]}
                 {"conversations": [{"from": "human", "value": "..."},
                                    {"from": "gpt", "value": "..."}, ...]}     (ShareGPT)
                 {"prompt": "...", "completion": "..."}  (strings, or lists of messages)
               a chat's loss is on the assistant's tokens only, a prompt/completion's on the
               completion only (see ``ftrain.data.chat``); a message's ``content`` may be a list
               of text parts ([{"type": "text", "text": "..."}], joined); ShareGPT's ``human``
               and ``gpt`` are the roles ``user`` and ``assistant`` (others: ``--chat-roles``)
    .parquet   one document a row, from a ``text``, ``messages``, ``conversations`` or
               ``prompt`` and ``completion`` columns (read with pyarrow)
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

__all__ = [
    "SHAREGPT_ROLES",
    "SKIP_REASONS",
    "DataError",
    "Document",
    "check_messages",
    "data_files",
    "read_documents",
]

# undecodable: not UTF-8; unreadable: an OS error; empty: no text; invalid: not the expected shape
SKIP_REASONS = ("undecodable", "unreadable", "empty", "invalid")
# ShareGPT's speaker names ("from") for the roles chat templates know.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


class DataError(ValueError):
    """Data that cannot train what it should (a chat with nothing to learn, no chat template to
    render it with): its message names what was seen and the flag that fixes it. Raised before
    the first step; ``ftrain train`` reports it as a usage error."""


@dataclass(frozen=True)
class Document:
    """One document (``text`` or chat ``messages``), or a skipped one (``skip`` is set).

    ``name`` says where it came from: the file, plus ``:LINE`` (JSON Lines, 1-based) or ``:ROW``
    (Parquet, 0-based row) for a file of many documents. A ``prompt``/``completion`` record is
    ``text=completion`` with its ``prompt`` (plain strings: ``prompt + text`` is the document,
    the loss on ``text``), or ``messages`` whose first ``train_from`` are the prompt's.
    """

    name: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None  # a prompt/completion record of strings: text is the completion
    train_from: int = 0  # messages before this index are context only (a prompt's)
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
    names = file.schema_arrow.names
    columns = next((kind for kind in _KINDS if set(kind) <= set(names)), None)
    if columns is None:
        yield Document(
            str(path),
            skip="invalid",
            problem=f"no 'text', 'messages', 'conversations' or 'prompt' and 'completion' "
            f"column (columns: {names})",
        )
        return
    if file.metadata.num_rows == 0:
        yield Document(str(path), skip="empty", problem="the file has no rows")
        return
    row = 0
    for batch in file.iter_batches(columns=list(columns)):
        for record in batch.to_pylist():
            yield _from_record(f"{path}:{row}", record)
            row += 1


# The columns of each kind of record, in the order a file's columns are matched against them.
_KINDS = (("messages",), ("conversations",), ("prompt", "completion"), ("text",))


def _from_record(where: str, record: Any) -> Document:
    """A JSON object (a JSONL line, a Parquet row) as a Document: its ``messages``, ShareGPT
    ``conversations``, ``prompt`` and ``completion``, or ``text``."""
    if not isinstance(record, dict):
        return Document(where, skip="invalid", problem=f"a {type(record).__name__}, not an object")
    if "messages" in record or "conversations" in record:
        key = "messages" if "messages" in record else "conversations"
        msgs = _messages(record[key], key)
        if isinstance(msgs, str):
            return Document(where, skip="invalid", problem=msgs)
        if not msgs:
            return Document(where, skip="empty", problem=f"{key!r} is an empty list")
        return Document(where, messages=msgs)
    if "prompt" in record and "completion" in record:
        return _prompt_completion(where, record["prompt"], record["completion"])
    if "text" not in record:
        keys = sorted(record)[:8]
        return Document(
            where,
            skip="invalid",
            problem=f"missing field 'text', 'messages', 'conversations' or 'prompt' and "
            f"'completion' (keys: {keys})",
        )
    text = record["text"]
    if not isinstance(text, str):
        return Document(where, skip="invalid", problem=f"'text' is a {type(text).__name__}")
    return Document(where, text=text) if text else Document(where, skip="empty", problem="''")


def _prompt_completion(where: str, prompt: Any, completion: Any) -> Document:
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            return Document(where, skip="empty", problem="'completion' is ''")
        return Document(where, text=completion, prompt=prompt)
    if type(prompt) is not type(completion):
        return Document(
            where, skip="invalid", problem="'prompt' and 'completion' must both be strings or "
            "both lists of messages",
        )  # fmt: skip
    asked, said = _messages(prompt, "prompt"), _messages(completion, "completion")
    for problem in (asked, said):
        if isinstance(problem, str):
            return Document(where, skip="invalid", problem=problem)
    return Document(where, messages=asked + said, train_from=len(asked))


def _messages(value: Any, key: str) -> tuple[dict[str, str], ...] | str:
    """A record's list of messages as ``({"role", "content"}, ...)`` with text contents, or what
    is wrong with it. ShareGPT's ``{"from", "value"}`` become role and content (``human`` and
    ``gpt``: ``user`` and ``assistant``); a content of text parts is their texts joined."""
    if not isinstance(value, list):
        return f"{key!r} is a {type(value).__name__}, not a list"
    out = []
    for i, m in enumerate(value):
        if isinstance(m, dict) and "from" in m and "role" not in m:  # ShareGPT
            who, value = m["from"], m.get("value")
            if not isinstance(value, str):
                got = "missing" if "value" not in m else f"a {type(value).__name__}"
                return f"{key}[{i}] 'value' is {got}, not a string"
            m = {"role": SHAREGPT_ROLES.get(who, who), "content": value}
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = m["content"]
            texts = [
                p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"
            ]
            if len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
                return (
                    f"{key}[{i}] 'content' holds a part that is not {{'type': 'text', 'text': "
                    "...}} (only text is trained)"
                )
            m = {**m, "content": "".join(texts)}
        problem = check_messages([m])
        if problem:
            return problem.replace("messages[0]", f"{key}[{i}]", 1)
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


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
