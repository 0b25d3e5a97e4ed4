"""Read a token build (`ftrain.data.build`) as datasets: fixed-length samples or documents.

`TokenDataset` reads fixed-length samples the way Megatron-LM does:

    doc_idx      the split's documents, shuffled once per epoch, epochs back to back
    sample_idx   int64[S + 1, 2]: sample j starts at (position in doc_idx, offset in that document)
                 and runs seq_len + 1 tokens, across document boundaries; the stream is the
                 documents joined by their end-of-document ids
    shuffle_idx  a permutation of the S samples

all three derived from (seq_len, seed, split, num_epochs), so the same arguments give the same
samples on every machine, and cached as `.npy` files under the build's `index/`, each committed
with `ftrain.io.atomic` (a damaged cache file is rebuilt). `DocumentDataset` gives each document,
cut into pieces of at most `max_len`. Both refuse a build that `check_build` finds damaged, and
read the tokens through a memory map. No pickle is read or written anywhere
(`np.load(..., allow_pickle=False)`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ftrain.data.build import DOCS_FILE, INDEX_DIR, MASK_FILE, TOKENS_FILE, check_build, read_meta
from ftrain.data.collate import IGNORE_INDEX, PadCollate
from ftrain.io import atomic

__all__ = ["DocumentDataset", "TokenDataset", "restarting_positions", "split_ranges"]

SPLITS = ("train", "valid", "test")


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
        meta = read_meta(self.path)
        problem = check_build(self.path, meta)
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
        self.masked = bool(meta.get("masked", False))  # mask.bin: chats' loss masks
        self._tokens: np.ndarray | None = None
        self._mask: np.ndarray | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:  # opened lazily, so a pickled dataset reopens its own map
            mapped = np.memmap(self.path / TOKENS_FILE, dtype=self.dtype, mode="r")
            self._tokens = mapped.view(np.ndarray)  # plain ndarray: no Python-level __getitem__
        return self._tokens

    @property
    def mask(self) -> np.ndarray | None:
        """mask.bin (uint8, 1 where a token is predicted) mapped, or None for a build without."""
        if self._mask is None and self.masked:
            self._mask = np.memmap(self.path / MASK_FILE, dtype=np.uint8, mode="r").view(np.ndarray)
        return self._mask

    def example(self, ranges: list[tuple[int, int]], pack: bool) -> dict[str, torch.Tensor]:
        """The LM example of the tokens in ``ranges`` (token-file [start, stop) spans, one per
        document piece, joined): ``input``, ``target`` (IGNORE_INDEX where the mask says the
        token is not predicted) and, with ``pack``, ``position_ids`` restarting at each document
        (see :func:`restarting_positions`)."""
        toks = np.concatenate([_read(self.tokens, lo, hi) for lo, hi in ranges])
        ex = _lm_example(toks)
        if self.masked:
            mask = np.concatenate([self.mask[lo:hi] for lo, hi in ranges])
            predicted = torch.from_numpy(mask[1:] != 0)
            ex["target"] = torch.where(predicted, ex["target"], IGNORE_INDEX)
        if pack:
            ex["position_ids"] = restarting_positions([hi - lo for lo, hi in ranges])
        return ex

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = state["_mask"] = None  # never pickle the mapped files' contents
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


def _clip(docs: np.ndarray, token_range, who: str) -> tuple[range, np.ndarray, np.ndarray]:
    """The documents overlapping the token-file span ``token_range`` = [lo, hi), and the starts
    and sizes of their pieces within it (the first and last may be cut mid-document)."""
    lo, hi = token_range
    if not 0 <= lo < hi <= int(docs[-1]):
        raise ValueError(
            f"{who}: token_range must be (lo, hi) with 0 <= lo < hi <= {int(docs[-1])} (the "
            f"build's tokens), got {token_range!r}"
        )
    first = int(np.searchsorted(docs, lo, side="right")) - 1  # the document holding token lo
    last = int(np.searchsorted(docs, hi, side="left"))  # one past the document holding hi - 1
    starts = np.maximum(docs[first:last], lo)  # (D,)
    stops = np.minimum(docs[first + 1 : last + 1], hi)  # (D,)
    return range(first, last), starts, stops - starts


def _load_mapped(path: Path) -> np.ndarray:
    """A memory-mapped .npy as a plain ndarray view (np.memmap indexing runs Python code)."""
    return np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)


def _read(tokens: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.asarray(tokens[start:stop], dtype=np.int64)


def _lm_example(toks: np.ndarray) -> dict[str, torch.Tensor]:
    x = torch.from_numpy(toks)
    return {"input": x[:-1], "target": x[1:]}


def restarting_positions(sizes: Sequence[int]) -> torch.Tensor:
    """Position ids of a packed row: for a row read as pieces of ``sizes`` tokens (one piece per
    document, each but the last ending with its end-of-document id), the positions of the
    ``sum(sizes) - 1`` inputs, restarting at 0 where each document starts.

    A document starts at the input that is the previous document's end-of-document id: that id
    is what a document alone starts from (the stream's documents are joined by it). So a packed
    row's document sees the same inputs at the same positions as when it is run alone, and a
    model that keeps attention within runs of increasing positions (``position_ids`` with
    ``GPT`` and Hugging Face models) computes the same losses for it.

    Example:
        >>> restarting_positions([3, 4, 2]).tolist()   # inputs: a a E | b b b E | c
        [0, 1, 0, 1, 2, 3, 0, 1]
    """
    n = int(sum(sizes)) - 1
    starts = np.zeros(n, dtype=bool)  # (n,)
    starts[0] = True
    starts[np.cumsum(sizes)[:-1] - 1] = True
    idx = np.arange(n, dtype=np.int64)
    return torch.from_numpy(idx - np.maximum.accumulate(np.where(starts, idx, 0)))


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
        token_range: alternatively to `split`, the tokens [lo, hi) of the build's token file
            (`ftrain.data.plan_split` cuts a corpus of too few documents this way); a document
            cut by it is a shorter piece, joined to the next without an end-of-document id.
        pack: also give `"position_ids"` (LongTensor[seq_len]) restarting at 0 where each
            document of the row starts (`restarting_positions`), so that a model given them keeps
            attention within documents (`ftrain train --pack`). The samples are the same.

    A build with a loss mask (chats: `mask.bin`) gives `target == -100` where the token is not
    to be predicted (the system and user turns), in this dataset and in `DocumentDataset`.
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
        pack: bool = False,
        token_range: tuple[int, int] | None = None,
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
        self.pack = bool(pack)
        self.vocab_size, self.eot_id = self._build.vocab_size, self._build.eot_id
        self.token_range = None if token_range is None else tuple(map(int, token_range))
        if self.token_range is None:
            self.doc_range = self._build.split(who, split, splits)
            docs = self._build.docs
            self._starts = docs[self.doc_range.start : self.doc_range.stop]
            sizes = docs[self.doc_range.start + 1 : self.doc_range.stop + 1] - self._starts
        else:  # the documents' pieces within [lo, hi) of the token file
            self.doc_range, self._starts, sizes = _clip(self._build.docs, self.token_range, who)
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
            + ("" if self.token_range is None else "-tokens{}_{}".format(*self.token_range))
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
            with atomic.write_file(f) as fh:
                np.save(fh, a, allow_pickle=False)
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
        if d0 == d1 and not (self.pack or self._build.masked):  # the common case: one read
            s = int(starts[self._doc_idx[d0]])
            return _lm_example(_read(toks, s + o0, s + o1 + 1))
        pieces = []  # (the last token of one piece is eot, then the next document follows)
        for d in range(d0, d1 + 1):
            doc = int(self._doc_idx[d])
            lo = int(starts[doc]) + (o0 if d == d0 else 0)
            hi = int(starts[doc]) + (o1 + 1 if d == d1 else int(sizes[doc]))
            pieces.append((lo, hi))
        return self._build.example(pieces, self.pack)

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
        return self._build.example([(s, s + int(self.lengths[i]) + 1)], pack=False)

    def __repr__(self) -> str:
        return (
            f"DocumentDataset({str(self.path)!r}, max_len={self.max_len}, split={self.split!r}, "
            f"{len(self)} examples)"
        )
