"""Tokenize a corpus once into a build folder that datasets then read cheaply, deterministically.

A *build* is a folder written by `build_token_dataset`:

    tokens.bin   every document's ids followed by the end-of-document id, back to back; raw
                 little-endian integers of the smallest dtype that holds the vocabulary
    docs.npy     int64[num_docs + 1]: document d is tokens[docs[d]:docs[d + 1]] (its last id is eot)
    mask.bin     only when a document has a loss mask (a chat): uint8, one per token of tokens.bin,
                 1 where the token is to be predicted (the assistant's), 0 where it is not
    meta.json    dtype, counts, vocabulary, the sources' fingerprint, skipped files, a checksum
                 of docs.npy; written last, so a folder without it is not a build
    index/       sample and shuffle indices cached by the datasets (safe to delete)

Guarantees: every file is committed with `ftrain.io.atomic` (written beside its target, fsynced,
renamed in) and `meta.json` is removed before the others are replaced and written after them, so
an interrupted build is never mistaken for a whole one; `check_build` verifies a build before it is
used (sizes, docs.npy checksum, every document ends with eot). No pickle is read or written
(`np.save(..., allow_pickle=False)`). Reading a build: `ftrain.data.datasets`.

Run `python -m ftrain.data.build OUT_DIR` to build the standard-library corpus into OUT_DIR.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ftrain.data.chat import (
    BUILTIN_CHAT_TEMPLATE,
    empty_mask_error,
    encode_chat,
    encode_completion,
    parse_chat_roles,
)
from ftrain.data.documents import SKIP_REASONS, read_documents
from ftrain.data.tokenizers import ByteTokenizer
from ftrain.io import atomic

__all__ = [
    "BuildSummary",
    "build_token_dataset",
    "check_build",
    "read_meta",
    "smallest_dtype",
]

FORMAT = "ftrain.tokens/1"
TOKENS_FILE = "tokens.bin"
DOCS_FILE = "docs.npy"
MASK_FILE = "mask.bin"
META_FILE = "meta.json"
INDEX_DIR = "index"
_PROBE = "ftrain tokenizer probe: Hello, wörld! 123\t\n€ 🙂 def f(x):\n    return x  # é"
_MAX_SKIPPED_LISTED = 50


@dataclass(frozen=True)
class BuildSummary:
    """What `build_token_dataset` wrote (or found already written, `cached=True`)."""

    out_dir: Path
    num_docs: int
    num_tokens: int  # end-of-document ids included
    dtype: str  # numpy dtype name of tokens.bin
    vocab_size: int
    eot_id: int
    skipped: dict[str, int]  # {"undecodable": n, "unreadable": n, "empty": n, "invalid": n}
    skipped_files: tuple[str, ...] = field(default=())  # the first 50 skipped names
    problems: tuple[str, ...] = field(default=())  # the first 50 as "name: what is wrong"
    masked: bool = False  # a loss mask was written (mask.bin): some documents are chats
    cached: bool = False
    seconds: float = 0.0


def smallest_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds every id below `vocab_size`."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    cls = type(tokenizer)
    ids = list(map(int, tokenizer.encode(_PROBE)))
    parts = [
        f"{cls.__module__}.{cls.__qualname__}",
        str(getattr(tokenizer, "vocab_size", None)),
        str(getattr(tokenizer, "eot_id", None)),
        str(getattr(tokenizer, "fingerprint", "")),
        ",".join(map(str, ids)),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _as_items(sources: Any) -> list[Path | tuple[str, str]]:
    if isinstance(sources, (str, os.PathLike)):
        raise TypeError(
            f"build_token_dataset: sources must be an iterable of file paths or (name, text) pairs, "
            f"got the single path {str(sources)!r}; wrap it in a list ([path]) or pass "
            "ftrain.data.corpora.python_stdlib()"
        )
    items: list[Path | tuple[str, str]] = []
    for s in sources:
        if isinstance(s, (str, os.PathLike)):
            items.append(Path(s))
        elif isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], str):
            items.append((str(s[0]), s[1]))
        else:
            raise TypeError(
                "build_token_dataset: each source must be a path (str or os.PathLike) or a "
                f"(name, text) pair of strings, got {type(s).__name__}: {s!r:.80}"
            )
    return items


def _sources_fingerprint(
    items: list[Path | tuple[str, str]], tokenizer_fp: str, roles: dict[str, str] | None = None
) -> str:
    """Cheap identity of the sources: path, size and mtime of files (like make), hash of texts;
    with the tokenizer and the chat roles, which change the tokens and the mask."""
    renamed = f"|{sorted(roles.items())}" if roles else ""  # no roles: as before they existed
    head = f"{FORMAT}|{tokenizer_fp}|{BUILTIN_CHAT_TEMPLATE}{renamed}\n"
    h = hashlib.sha256(head.encode())
    for item in items:
        if isinstance(item, Path):
            try:
                st = item.stat()
                h.update(f"f|{item.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
            except OSError:
                h.update(f"f|{item}|missing\n".encode())
        else:
            name, text = item
            digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()
            h.update(f"t|{name}|{digest}\n".encode())
    return h.hexdigest()


def read_meta(path: str | os.PathLike) -> dict | None:
    """The parsed ``meta.json`` of the build folder ``path``, or None if it is missing or not a
    JSON object. Not verified: see `check_build`."""
    try:
        meta = json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_build(path: str | os.PathLike, meta: dict | None) -> str | None:
    """None if `path` holds a whole, self-consistent build; else what is wrong, in words.

    `meta` is `read_meta(path)`. Checked: the format, every field, the size of tokens.bin, the
    checksum, dtype and shape of docs.npy, non-empty documents that each end with eot.
    """
    path = Path(path)
    if meta is None:
        return f"{META_FILE} is missing or not valid JSON"
    if meta.get("format") != FORMAT:
        return f"{META_FILE} has format {meta.get('format')!r}, expected {FORMAT!r}"
    try:
        dtype = np.dtype(meta["dtype"])
        num_tokens, num_docs, eot = (
            int(meta["num_tokens"]),
            int(meta["num_docs"]),
            int(meta["eot_id"]),
        )
        docs_sha = meta["docs_sha256"]
    except (KeyError, TypeError, ValueError) as e:
        return f"{META_FILE} lacks a valid field ({e})"
    tokens_path, docs_path = path / TOKENS_FILE, path / DOCS_FILE
    if not tokens_path.is_file() or not docs_path.is_file():
        return f"{TOKENS_FILE} or {DOCS_FILE} is missing"
    size = tokens_path.stat().st_size
    if size != num_tokens * dtype.itemsize:
        return (
            f"{TOKENS_FILE} holds {size} bytes but {META_FILE} says {num_tokens} tokens of "
            f"{dtype.name} ({num_tokens * dtype.itemsize} bytes)"
        )
    if _file_sha256(docs_path) != docs_sha:
        return f"{DOCS_FILE} does not match the checksum in {META_FILE}"
    try:
        docs = np.load(docs_path, allow_pickle=False)
    except ValueError as e:
        return f"{DOCS_FILE} cannot be read ({e})"
    if docs.dtype != np.int64 or docs.shape != (num_docs + 1,):
        return f"{DOCS_FILE} has shape {docs.shape} {docs.dtype}, expected ({num_docs + 1},) int64"
    if docs[0] != 0 or docs[-1] != num_tokens or np.any(np.diff(docs) < 2):
        return f"{DOCS_FILE} does not describe {num_tokens} tokens in non-empty documents"
    if meta.get("masked") and not (
        (path / MASK_FILE).is_file() and (path / MASK_FILE).stat().st_size == num_tokens
    ):
        return f"{MASK_FILE} is missing or does not hold one byte per token"
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
    if np.any(tokens[docs[1:] - 1] != eot):
        return f"the document index and {TOKENS_FILE} disagree: a document does not end with eot"
    return None


def _summary(path: Path, meta: dict, *, cached: bool, seconds: float) -> BuildSummary:
    return BuildSummary(
        out_dir=path,
        num_docs=int(meta["num_docs"]),
        num_tokens=int(meta["num_tokens"]),
        dtype=str(meta["dtype"]),
        vocab_size=int(meta["vocab_size"]),
        eot_id=int(meta["eot_id"]),
        skipped={k: int(v) for k, v in meta.get("skipped", {}).items()},
        skipped_files=tuple(meta.get("skipped_files", ())),
        problems=tuple(meta.get("problems", ())),
        masked=bool(meta.get("masked", False)),
        cached=cached,
        seconds=seconds,
    )


def build_token_dataset(
    sources: Iterable[str | os.PathLike | tuple[str, str]],
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    *,
    progress: bool = True,
    force: bool = False,
    chat_roles: str | dict[str, str] | None = None,
) -> BuildSummary:
    """Tokenize `sources` once into `out_dir`: a memory-mapped token file plus a document index.

    Guarantees:
      - The documents of each source in the given order (`ftrain.data.read_documents`: one per
        text file or pair, one per line of a `.jsonl`, one per row of a `.parquet`); each is
        followed by `eot_id`. The token file uses the smallest unsigned dtype that holds the
        vocabulary (`uint16` for `ByteTokenizer`).
      - Chat documents (`messages`, ShareGPT `conversations`) are rendered with
        `ftrain.data.encode_chat`, their roles renamed by `chat_roles` first, and a loss mask is
        written beside the tokens (`mask.bin`: 1 on the assistant's tokens, and on a document's
        eot when its last token is; 1 on every token of a text document); a `prompt` /
        `completion` record's mask is 1 on the completion only (`encode_completion`). A chat
        with nothing to learn (no assistant message) is skipped as "empty", and data whose loss
        mask is empty altogether is refused (`DataError`: the roles seen, counted, and the
        `--chat-roles` that would fix it) before anything is written.
      - Files that are not valid UTF-8, and texts the tokenizer cannot encode (a lone surrogate
        such as U+D800 has no UTF-8) are skipped and counted as "undecodable", files that cannot
        be read as "unreadable", empty texts as "empty", records of the wrong shape (a JSONL line
        that is not JSON, a missing field) as "invalid"; the counts, the first 50 names and the
        first 50 problems ("file:line: what is wrong") are in the returned summary and in
        `meta.json`. A skipped document never stops the build.
      - If `out_dir` already holds a whole build of the same sources (same paths, sizes and
        modification times, or same texts) with the same tokenizer, nothing is read or written
        and the summary says `cached=True`. A stale or damaged build is rebuilt.
      - Each file is written beside its target and renamed in (`ftrain.io.atomic`); `meta.json`
        is removed first and comes last, so an interrupted build is never mistaken for a whole
        one.

    Args:
        sources: file paths (str or PathLike), or `(name, text)` pairs for text in memory.
        out_dir: folder to write into (created if needed).
        tokenizer: any object with `encode(str) -> list[int]`; default `ByteTokenizer()`. If it
            has `vocab_size` and `eot_id` they are used; without `eot_id` the end-of-document id
            is `vocab_size` (or one past the largest id seen) and the vocabulary grows by one.
        progress: show a progress bar (tqdm) while tokenizing.
        force: rebuild even if a valid build of the same sources is there.
        chat_roles: chat roles renamed before rendering (`{"human": "user", "gpt":
            "assistant"}` or `"human=user,gpt=assistant"`: `ftrain.data.parse_chat_roles`).

    Raises:
        DataError: the loss mask is empty (no document has a token to learn), or a chat
            document meets a model tokenizer without a chat template (`ftrain.data.template_of`).
        ValueError: no source gave a document (an empty corpus), or the tokenizer produced an id
            outside [0, vocab_size).
        TypeError: a source is neither a path nor a (name, text) pair, or the tokenizer has no
            `encode`.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"build_token_dataset: tokenizer {tokenizer!r:.80} has no encode(str) -> list[int] "
            "method; pass ftrain.data.ByteTokenizer() or an object with one"
        )
    out = Path(out_dir)
    items = _as_items(sources)
    roles = parse_chat_roles(chat_roles)
    fingerprint = _sources_fingerprint(items, _tokenizer_fingerprint(tokenizer), roles)
    t0 = time.perf_counter()

    if not force:
        meta = read_meta(out)
        if meta is not None and meta.get("sources_fingerprint") == fingerprint:
            if check_build(out, meta) is None:
                return _summary(out, meta, cached=True, seconds=time.perf_counter() - t0)

    # 1. Tokenize every document; a bad one is counted and listed, never fatal.
    encode_array = getattr(tokenizer, "encode_array", None)
    arrays: list[np.ndarray] = []
    masks: list[np.ndarray | None] = []  # None: every token of the document is predicted
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    skipped_files: list[str] = []
    problems: list[str] = []
    seen: dict[str, int] = {}  # chat roles (renamed), counted over every message

    def skip(reason: str, name: str, problem: str = "") -> None:
        skipped[reason] += 1
        if len(skipped_files) < _MAX_SKIPPED_LISTED:
            skipped_files.append(name)
            problems.append(f"{name}: {problem or reason}")

    for item in tqdm(items, desc=f"tokenizing into {out}", unit="file", disable=not progress):
        for doc in read_documents(item):
            if doc.skip is not None:
                skip(doc.skip, doc.name, doc.problem)
                continue
            mask = None
            try:
                if doc.messages is not None:
                    msgs = [{**m, "role": roles.get(m["role"], m["role"])} for m in doc.messages]
                    for m in msgs:
                        seen[m["role"]] = seen.get(m["role"], 0) + 1
                    ids, mask = encode_chat(tokenizer, msgs, train_from=doc.train_from)
                    if not mask.any():
                        learnt = ", ".join(sorted({m["role"] for m in msgs}))
                        skip("empty", doc.name, f"no assistant message to learn (roles: {learnt})")
                        continue
                elif doc.prompt is not None:
                    ids, mask = encode_completion(tokenizer, doc.prompt, doc.text)
                elif encode_array is not None:
                    ids = encode_array(doc.text)
                else:
                    ids = np.asarray(tokenizer.encode(doc.text))
            except UnicodeEncodeError:  # a lone surrogate (U+D800..U+DFFF) has no UTF-8
                skip("undecodable", doc.name, "a lone surrogate (not encodable as UTF-8)")
                continue
            if ids.size == 0:
                skip("empty", doc.name, "no tokens")
                continue
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise TypeError(
                    f"build_token_dataset: tokenizer.encode returned {ids.dtype} of shape "
                    f"{ids.shape} for {doc.name!r}; it must return a flat list of ints"
                )
            arrays.append(ids)
            masks.append(mask)

    if not arrays and seen:
        raise empty_mask_error(seen, roles, sum(skipped.values()) - skipped["empty"], problems)
    if not arrays:
        n_skipped = sum(skipped.values())
        raise ValueError(
            f"build_token_dataset: the corpus is empty: {len(items)} sources gave no document "
            f"({n_skipped} skipped: {skipped}; first: {problems[:3]}). Pass at least one "
            "non-empty UTF-8 text file, e.g. ftrain.data.corpora.python_stdlib()"
        )

    # 2. Vocabulary and dtype.
    lo = min(int(a.min()) for a in arrays)
    hi = max(int(a.max()) for a in arrays)
    vocab_size = getattr(tokenizer, "vocab_size", None)
    eot_id = getattr(tokenizer, "eot_id", None)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"build_token_dataset: tokenizer {type(tokenizer).__name__} produced id {bad}, outside "
            f"[0, vocab_size={vocab_size}); fix the tokenizer or its vocab_size"
        )
    if eot_id is None:
        eot_id = vocab_size if vocab_size is not None else hi + 1
    vocab_size = max(vocab_size or 0, hi + 1, eot_id + 1)
    dtype = smallest_dtype(vocab_size)

    # 3. Write every file beside its target, then swap them in: meta.json is removed first and
    #    written last, so the folder is a build exactly when it has meta.json.
    out.mkdir(parents=True, exist_ok=True)
    lengths = np.fromiter((a.size + 1 for a in arrays), dtype=np.int64, count=len(arrays))
    docs = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=docs[1:])
    docs_npy = BytesIO()
    np.save(docs_npy, docs, allow_pickle=False)
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "num_docs": len(arrays),
        "num_tokens": int(docs[-1]),
        "vocab_size": int(vocab_size),
        "eot_id": int(eot_id),
        "tokenizer": type(tokenizer).__qualname__,
        "sources_fingerprint": fingerprint,
        "docs_sha256": hashlib.sha256(docs_npy.getvalue()).hexdigest(),
        "skipped": skipped,
        "skipped_files": skipped_files,
        "problems": problems,
        "masked": any(m is not None for m in masks),
        "num_sources": len(items),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    masked = meta["masked"]
    with (
        atomic.write_file(out / TOKENS_FILE) as tokens_file,
        atomic.write_file(out / DOCS_FILE) as docs_file,
        atomic.write_file(out / MASK_FILE) if masked else contextlib.nullcontext() as mask_file,
    ):
        for a, m in zip(arrays, masks):
            buf = np.empty(a.size + 1, dtype=dtype.newbyteorder("<"))
            buf[:-1] = a
            buf[-1] = eot_id
            tokens_file.write(buf.tobytes())
            if masked:  # 1 where the token is predicted; eot is when the last token is
                mbuf = np.ones(a.size + 1, dtype=np.uint8)
                if m is not None:
                    mbuf[:-1], mbuf[-1] = m, m[-1]
                mask_file.write(mbuf.tobytes())
        docs_file.write(docs_npy.getvalue())
        (out / META_FILE).unlink(missing_ok=True)  # from here on, out_dir is not a build
        if not masked:
            (out / MASK_FILE).unlink(missing_ok=True)  # an older build's
        shutil.rmtree(out / INDEX_DIR, ignore_errors=True)  # indices of the old build
    atomic.write_json(out / META_FILE, meta)
    return _summary(out, meta, cached=False, seconds=time.perf_counter() - t0)


if __name__ == "__main__":  # python -m ftrain.data.build OUT_DIR
    import sys

    from ftrain.data.corpora import python_stdlib

    if len(sys.argv) != 2:
        sys.exit("usage: python -m ftrain.data.build OUT_DIR")
    print(build_token_dataset(python_stdlib(), sys.argv[1]))
