"""Megatron-style token datasets: tokenize once, then index cheaply, deterministically, on disk.

A *build* is a folder written by `build_token_dataset`:

    tokens.bin   every document's ids followed by the end-of-document id, back to back; raw
                 little-endian integers of the smallest dtype that holds the vocabulary
    docs.npy     int64[num_docs + 1]: document d is tokens[docs[d]:docs[d + 1]] (its last id is eot)
    meta.json    dtype, counts, vocabulary, the sources' fingerprint, skipped files, a checksum
                 of docs.npy; written last, so a folder without it is not a build
    index/       sample and shuffle indices cached by `TokenDataset` (safe to delete)

`TokenDataset` reads fixed-length samples from a build the way Megatron-LM does:

    doc_idx      the split's documents, shuffled once per epoch, epochs back to back
    sample_idx   int64[S + 1, 2]: sample j starts at (position in doc_idx, offset in that document)
                 and runs seq_len + 1 tokens, across document boundaries; the stream is the
                 documents joined by their end-of-document ids
    shuffle_idx  a permutation of the S samples

all three derived from (seq_len, seed, split, num_epochs) and cached as `.npy` files. No pickle is
read or written anywhere (`np.load(..., allow_pickle=False)`).

Run `python -m ftrain.data.tokens OUT_DIR` to build the standard-library corpus into OUT_DIR.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ftrain.data.collate import PadCollate
from ftrain.data.tokenizers import ByteTokenizer

__all__ = [
    "BuildSummary",
    "DocumentDataset",
    "TokenDataset",
    "build_token_dataset",
    "split_ranges",
]

FORMAT = "ftrain.tokens/1"
TOKENS_FILE = "tokens.bin"
DOCS_FILE = "docs.npy"
META_FILE = "meta.json"
INDEX_DIR = "index"
SPLITS = ("train", "valid", "test")
_PROBE = "ftrain tokenizer probe: Hello, wörld! 123\t\n€ 🙂 def f(x):\n    return x  # é"
_MAX_SKIPPED_LISTED = 50


# ----------------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True)
class BuildSummary:
    """What `build_token_dataset` wrote (or found already written, `cached=True`)."""

    out_dir: Path
    num_docs: int
    num_tokens: int  # end-of-document ids included
    dtype: str  # numpy dtype name of tokens.bin
    vocab_size: int
    eot_id: int
    skipped: dict[str, int]  # {"undecodable": n, "unreadable": n, "empty": n}
    skipped_files: tuple[str, ...] = field(default=())  # the first 50 skipped names
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


def _sources_fingerprint(items: list[Path | tuple[str, str]], tokenizer_fp: str) -> str:
    """Cheap identity of the sources: path, size and mtime of files (like make), hash of texts."""
    h = hashlib.sha256(f"{FORMAT}|{tokenizer_fp}\n".encode())
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


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_build(path: Path, meta: dict | None) -> str | None:
    """None if `path` holds a whole, self-consistent build; else what is wrong, in words."""
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
) -> BuildSummary:
    """Tokenize `sources` once into `out_dir`: a memory-mapped token file plus a document index.

    Guarantees:
      - One document per source, in the given order; each is followed by `eot_id`. The token file
        uses the smallest unsigned dtype that holds the vocabulary (`uint16` for `ByteTokenizer`).
      - Files that are not valid UTF-8, and texts the tokenizer cannot encode (a lone surrogate
        such as U+D800 has no UTF-8) are skipped and counted as "undecodable", files that cannot
        be read as "unreadable", empty texts as "empty"; the counts and the first 50 names are in
        the returned summary and in `meta.json`. A skipped file never stops the build.
      - If `out_dir` already holds a whole build of the same sources (same paths, sizes and
        modification times, or same texts) with the same tokenizer, nothing is read or written
        and the summary says `cached=True`. A stale or damaged build is rebuilt.
      - The build is written to a temporary folder first and moved in; `meta.json` comes last,
        so an interrupted build is never mistaken for a whole one.

    Args:
        sources: file paths (str or PathLike), or `(name, text)` pairs for text in memory.
        out_dir: folder to write into (created if needed).
        tokenizer: any object with `encode(str) -> list[int]`; default `ByteTokenizer()`. If it
            has `vocab_size` and `eot_id` they are used; without `eot_id` the end-of-document id
            is `vocab_size` (or one past the largest id seen) and the vocabulary grows by one.
        progress: show a progress bar (tqdm) while tokenizing.
        force: rebuild even if a valid build of the same sources is there.

    Raises:
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
    fingerprint = _sources_fingerprint(items, _tokenizer_fingerprint(tokenizer))
    t0 = time.perf_counter()

    if not force:
        meta = _read_meta(out)
        if meta is not None and meta.get("sources_fingerprint") == fingerprint:
            if _check_build(out, meta) is None:
                return _summary(out, meta, cached=True, seconds=time.perf_counter() - t0)

    # 1. Tokenize every source; a bad file is counted, never fatal.
    encode_array = getattr(tokenizer, "encode_array", None)
    arrays: list[np.ndarray] = []
    skipped = {"undecodable": 0, "unreadable": 0, "empty": 0}
    skipped_files: list[str] = []

    def skip(reason: str, name: str) -> None:
        skipped[reason] += 1
        if len(skipped_files) < _MAX_SKIPPED_LISTED:
            skipped_files.append(name)

    for item in tqdm(items, desc=f"tokenizing into {out}", unit="doc", disable=not progress):
        if isinstance(item, Path):
            name = str(item)
            try:
                text = item.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                reason = "undecodable"
            except OSError:
                reason = "unreadable"
            else:
                reason = None if text else "empty"
        else:
            name, text = item
            reason = None if text else "empty"
        if reason is not None:
            skip(reason, name)
            continue
        try:
            ids = (
                encode_array(text)
                if encode_array is not None
                else np.asarray(tokenizer.encode(text))
            )
        except UnicodeEncodeError:  # a lone surrogate (U+D800..U+DFFF) has no UTF-8
            skip("undecodable", name)
            continue
        if ids.size == 0:
            skip("empty", name)
            continue
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(
                f"build_token_dataset: tokenizer.encode returned {ids.dtype} of shape {ids.shape} "
                f"for {name!r}; it must return a flat list of ints"
            )
        arrays.append(ids)

    if not arrays:
        n_skipped = sum(skipped.values())
        raise ValueError(
            f"build_token_dataset: the corpus is empty: {len(items)} sources gave no document "
            f"({n_skipped} skipped: {skipped}; first: {skipped_files[:3]}). Pass at least one "
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

    # 3. Write into a temporary folder beside out_dir, then move the files in (meta.json last).
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out))
    try:
        lengths = np.fromiter((a.size + 1 for a in arrays), dtype=np.int64, count=len(arrays))
        docs = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=docs[1:])
        with open(tmp / TOKENS_FILE, "wb") as f:
            for a in arrays:
                buf = np.empty(a.size + 1, dtype=dtype.newbyteorder("<"))
                buf[:-1] = a
                buf[-1] = eot_id
                f.write(buf.tobytes())
            f.flush()
            os.fsync(f.fileno())
        np.save(tmp / DOCS_FILE, docs, allow_pickle=False)
        meta = {
            "format": FORMAT,
            "dtype": dtype.name,
            "num_docs": len(arrays),
            "num_tokens": int(docs[-1]),
            "vocab_size": int(vocab_size),
            "eot_id": int(eot_id),
            "tokenizer": type(tokenizer).__qualname__,
            "sources_fingerprint": fingerprint,
            "docs_sha256": _file_sha256(tmp / DOCS_FILE),
            "skipped": skipped,
            "skipped_files": skipped_files,
            "num_sources": len(items),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (out / META_FILE).unlink(missing_ok=True)  # from here on, out_dir is not a build
        shutil.rmtree(out / INDEX_DIR, ignore_errors=True)  # indices of the old build
        os.replace(tmp / TOKENS_FILE, out / TOKENS_FILE)
        os.replace(tmp / DOCS_FILE, out / DOCS_FILE)
        _write_json_atomic(out / META_FILE, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _summary(out, meta, cached=False, seconds=time.perf_counter() - t0)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Reading


def split_ranges(num_docs: int, splits: Sequence[float] = (969, 30, 1)) -> dict[str, range]:
    """Contiguous document ranges for train/valid/test from weights such as `(969, 30, 1)`.

    Same rule as Megatron-LM's `--split 969,30,1`: weights are normalized, boundaries are rounded
    to whole documents, and the ranges cover `range(num_docs)` exactly once. A split may be
    empty for a tiny corpus; `TokenDataset` refuses an empty split when it is asked for.

    Example:
        >>> split_ranges(1000)
        {'train': range(0, 969), 'valid': range(969, 999), 'test': range(999, 1000)}
    """
    weights = [float(w) for w in splits]
    if (
        len(weights) != 3
        or any(w < 0 or not math.isfinite(w) for w in weights)
        or sum(weights) <= 0
    ):
        raise ValueError(
            f"splits must be three non-negative weights for (train, valid, test) with a positive "
            f"sum, like (969, 30, 1); got {tuple(splits)!r}"
        )
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + round(w / total * num_docs))
    diff = bounds[-1] - num_docs  # rounding may over- or undershoot; shift as Megatron does
    bounds = [0] + [min(max(b - diff, 0), num_docs) for b in bounds[1:]]
    return {name: range(bounds[i], bounds[i + 1]) for i, name in enumerate(SPLITS)}


class _Build:
    """An opened, validated build (shared by TokenDataset and DocumentDataset)."""

    def __init__(self, path: str | os.PathLike, who: str):
        self.path = Path(path)
        meta = _read_meta(self.path)
        problem = _check_build(self.path, meta)
        if problem is not None:
            raise ValueError(
                f"{who}: {str(self.path)!r} does not hold a valid token build: {problem}. Build it "
                f"again with build_token_dataset(sources, {str(self.path)!r}) (it rebuilds a stale "
                "or damaged folder)"
            )
        assert meta is not None
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        self.docs = np.load(self.path / DOCS_FILE, allow_pickle=False)
        self.vocab_size = int(meta["vocab_size"])
        self.eot_id = int(meta["eot_id"])
        self._tokens: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:  # opened lazily, so a pickled dataset reopens its own map
            mapped = np.memmap(self.path / TOKENS_FILE, dtype=self.dtype, mode="r")
            self._tokens = mapped.view(np.ndarray)  # plain ndarray: no Python-level __getitem__
        return self._tokens

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None  # never pickle the mapped file's contents
        return state

    def split(self, who: str, split: str, splits: Sequence[float]) -> range:
        if split not in SPLITS:
            raise ValueError(f"{who}: split must be one of {SPLITS}, got {split!r}")
        docs = split_ranges(len(self.docs) - 1, splits)[split]
        if len(docs) == 0:
            raise ValueError(
                f"{who}: split {split!r} is empty: splits={tuple(splits)} gives it no document of "
                f"the {len(self.docs) - 1} in {str(self.path)!r}; give it more weight or use a "
                "larger corpus"
            )
        return docs


def _load_mapped(path: Path) -> np.ndarray:
    """A memory-mapped .npy as a plain ndarray view (np.memmap indexing runs Python code)."""
    return np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)


def _read(tokens: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.asarray(tokens[start:stop], dtype=np.int64)


def _lm_example(toks: np.ndarray) -> dict[str, torch.Tensor]:
    x = torch.from_numpy(toks)
    return {"input": x[:-1], "target": x[1:]}


class TokenDataset:
    """Fixed-length language-model samples over a build, Megatron-style, cached and seeded.

    `ds[i]` is `{"input": LongTensor[seq_len], "target": LongTensor[seq_len]}` where `target` is
    `input` shifted by one: `seq_len + 1` consecutive tokens of the stream made of the split's
    documents (in a new shuffled order each epoch) joined by their end-of-document ids. The
    samples of all `num_epochs` epochs are then shuffled together.

    Guarantees:
      - Deterministic: the same build, `seq_len`, `seed`, `split`, `splits` and `num_epochs` give
        the same `ds[i]` on every machine and run. The indices are built once (vectorized numpy)
        and cached under `<dir>/index/` as `.npy` files; a damaged cache file is rebuilt.
      - Coverage: sample starts are `seq_len` apart along the stream, so every token of it is
        predicted exactly once, except the very first and a final tail shorter than `seq_len`.
      - Sample j and j+1 of the stream (before the shuffle) share one token: the last token of
        sample j's input-plus-target is the first of sample j+1, as in Megatron-LM.
      - Validation at construction: the build must be whole (sizes, checksum, every document ends
        with eot) or it is refused with the command that rebuilds it; a split too small for one
        sample is refused with its token count.

    Args:
        path: a folder written by `build_token_dataset`.
        seq_len: tokens per sample (the model's context length).
        seed: seeds the document shuffle and the sample shuffle (0 <= seed < 2**32).
        split: "train", "valid" or "test".
        splits: weights of the three splits over documents, Megatron's `--split 969,30,1`.
        num_epochs: epochs of the split to index (default 1), each with its own document order.
        num_samples: alternatively, the number of samples the run needs; enough epochs are indexed
            to hold at least that many (`len(ds) >= num_samples`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        seq_len: int,
        seed: int = 0,
        *,
        split: str = "train",
        splits: Sequence[float] = (969, 30, 1),
        num_epochs: int | None = None,
        num_samples: int | None = None,
    ):
        who = "TokenDataset"
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"{who}: seq_len must be a positive int, got {seq_len!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"{who}: seed must be an int in [0, 2**32), got {seed!r}")
        if num_epochs is not None and num_samples is not None:
            raise ValueError(f"{who}: pass num_epochs or num_samples, not both")
        for name, v in (("num_epochs", num_epochs), ("num_samples", num_samples)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{who}: {name} must be a positive int or None, got {v!r}")
        self._build = _Build(path, who)
        self.path = self._build.path
        self.seq_len, self.seed, self.split, self.splits = seq_len, seed, split, tuple(splits)
        self.vocab_size, self.eot_id = self._build.vocab_size, self._build.eot_id
        self.doc_range = self._build.split(who, split, splits)
        docs = self._build.docs
        self._starts = docs[self.doc_range.start : self.doc_range.stop]
        sizes = docs[self.doc_range.start + 1 : self.doc_range.stop + 1] - self._starts
        self._sizes = sizes
        self.tokens_per_epoch = int(sizes.sum())
        if self.tokens_per_epoch < seq_len + 1:
            raise ValueError(
                f"{who}: seq_len={seq_len} is longer than split {split!r}, which holds "
                f"{self.tokens_per_epoch} tokens in {len(sizes)} documents (a sample reads "
                f"seq_len + 1 = {seq_len + 1}); lower seq_len, give the split more weight "
                "(splits=...) or build a larger corpus"
            )
        if num_samples is not None:
            # smallest e with (e * tokens_per_epoch - 1) // seq_len >= num_samples
            num_epochs = max(1, -(-(num_samples * seq_len + 1) // self.tokens_per_epoch))
        self.num_epochs = num_epochs or 1
        self._doc_idx, self._sample_idx, self._shuffle_idx = self._indices(sizes)

    def _indices(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (
            f"{self.split}-L{self.seq_len}-seed{self.seed}-ep{self.num_epochs}"
            f"-split{'_'.join(f'{w:g}' for w in self.splits)}"
            f"-{self._build.meta['docs_sha256'][:12]}"
        )
        folder = self.path / INDEX_DIR
        names = ("doc_idx", "sample_idx", "shuffle_idx")
        files = [folder / f"{key}.{n}.npy" for n in names]
        self._index_files = files
        try:
            arrays = tuple(_load_mapped(f) for f in files)
            if self._indices_ok(sizes, *arrays):
                return arrays  # type: ignore[return-value]
        except (OSError, ValueError):
            pass
        arrays = _megatron_indices(sizes, self.seq_len, self.num_epochs, self.seed)
        folder.mkdir(exist_ok=True)
        for f, a in zip(files, arrays, strict=True):
            tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as fh:
                np.save(fh, a, allow_pickle=False)
            os.replace(tmp, f)
        return tuple(_load_mapped(f) for f in files)  # type: ignore[return-value]

    def __getstate__(self) -> dict:
        # For process workers: send the index file names, not the (memory-mapped) indices.
        state = self.__dict__.copy()
        for name in ("_doc_idx", "_sample_idx", "_shuffle_idx"):
            state[name] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        names = ("_doc_idx", "_sample_idx", "_shuffle_idx")
        for name, f in zip(names, self._index_files, strict=True):
            setattr(self, name, _load_mapped(f))

    def _indices_ok(self, sizes, doc_idx, sample_idx, shuffle_idx) -> bool:
        n_samples = (self.num_epochs * self.tokens_per_epoch - 1) // self.seq_len
        return (
            doc_idx.shape == (self.num_epochs * len(sizes),)
            and sample_idx.shape == (n_samples + 1, 2)
            and shuffle_idx.shape == (n_samples,)
        )

    @property
    def samples_per_epoch(self) -> float:
        """Samples in one epoch of the split (fractional: samples may straddle epochs)."""
        return (self.tokens_per_epoch - 1) / self.seq_len

    def __len__(self) -> int:
        return len(self._shuffle_idx)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self._shuffle_idx)
        if not -n <= i < n:
            raise IndexError(f"TokenDataset index {i} out of range for {n} samples")
        j = int(self._shuffle_idx[i])
        (d0, o0), (d1, o1) = self._sample_idx[j], self._sample_idx[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        toks, starts, sizes = self._build.tokens, self._starts, self._sizes
        if d0 == d1:  # the common case: one document holds the whole sample
            s = int(starts[self._doc_idx[d0]])
            return _lm_example(_read(toks, s + o0, s + o1 + 1))
        pieces = []  # (the last token of one piece is eot, then the next document follows)
        for d in range(d0, d1 + 1):
            doc = int(self._doc_idx[d])
            lo = int(starts[doc]) + (o0 if d == d0 else 0)
            hi = int(starts[doc]) + (o1 + 1 if d == d1 else int(sizes[doc]))
            pieces.append(_read(toks, lo, hi))
        return _lm_example(np.concatenate(pieces))

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.path)!r}, seq_len={self.seq_len}, seed={self.seed}, "
            f"split={self.split!r}, {len(self)} samples, {self.num_epochs} epoch(s))"
        )


def _megatron_indices(
    sizes: np.ndarray, seq_len: int, num_epochs: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """doc_idx, sample_idx, shuffle_idx as in Megatron-LM's GPT dataset, vectorized.

    `RandomState` (not `Generator`) because its streams are frozen across numpy versions.
    """
    rng = np.random.RandomState(seed)
    n_docs = len(sizes)
    # documents, shuffled per epoch, epochs back to back               # (num_epochs * n_docs,)
    doc_idx = np.concatenate([rng.permutation(n_docs) for _ in range(num_epochs)]).astype(np.int64)
    # sample j starts at stream position j * seq_len; find its document and offset
    cum = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], out=cum[1:])
    n_samples = (int(cum[-1]) - 1) // seq_len
    pos = np.arange(n_samples + 1, dtype=np.int64) * seq_len  # (S + 1,)
    doc_pos = np.searchsorted(cum, pos, side="right") - 1
    sample_idx = np.stack([doc_pos, pos - cum[doc_pos]], axis=1)  # (S + 1, 2)
    shuffle_idx = rng.permutation(n_samples).astype(np.int64)  # (S,)
    return doc_idx, sample_idx, shuffle_idx


class DocumentDataset:
    """Variable-length examples: each document of a split, cut into pieces of at most `max_len`.

    `ds[i]` is `{"input": LongTensor[n], "target": LongTensor[n]}` with `1 <= n <= max_len`: n + 1
    consecutive tokens of one document (its end-of-document id included), `target` shifted by one.
    `ds.lengths[i] == n`, known without reading tokens, which is what length bucketing needs
    (`loader(ds, ..., order="length")`), and `ds.collate` pads a batch (see `PadCollate`).

    Guarantees: the pieces of a document are consecutive and predict each of its tokens after the
    first exactly once; only the last piece of a document is shorter than `max_len`. Examples are
    in document order (the loader shuffles them). Validation as in `TokenDataset`.

    Args:
        path: a folder written by `build_token_dataset`.
        max_len: the longest example, in predicted tokens.
        split, splits: as in `TokenDataset`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        max_len: int,
        *,
        split: str = "train",
        splits: Sequence[float] = (969, 30, 1),
    ):
        who = "DocumentDataset"
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"{who}: max_len must be a positive int, got {max_len!r}")
        self._build = _Build(path, who)
        self.path, self.max_len, self.split = self._build.path, max_len, split
        self.vocab_size, self.eot_id = self._build.vocab_size, self._build.eot_id
        self.doc_range = self._build.split(who, split, splits)
        docs = self._build.docs[self.doc_range.start : self.doc_range.stop + 1]
        n_pred = np.diff(docs) - 1  # predicted tokens per document  # (D,)
        n_pieces = -(-n_pred // max_len)  # (D,)
        doc = np.repeat(np.arange(len(n_pred)), n_pieces)  # (P,)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)  # (P,)
        self._starts = docs[:-1][doc] + k * max_len
        self.lengths = np.minimum(max_len, n_pred[doc] - k * max_len)
        self.collate = PadCollate(pad_id=self.eot_id)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self._starts[i])
        return _lm_example(_read(self._build.tokens, s, s + int(self.lengths[i]) + 1))

    def __repr__(self) -> str:
        return (
            f"DocumentDataset({str(self.path)!r}, max_len={self.max_len}, split={self.split!r}, "
            f"{len(self)} examples)"
        )


if __name__ == "__main__":  # python -m ftrain.data.tokens OUT_DIR
    import sys

    from ftrain.data.corpora import python_stdlib

    if len(sys.argv) != 2:
        sys.exit("usage: python -m ftrain.data.tokens OUT_DIR")
    print(build_token_dataset(python_stdlib(), sys.argv[1]))
