"""Tokenizers. `ByteTokenizer` is the default; any object with `encode(str) -> list[int]` works.

A tokenizer used by `build_token_dataset` may also carry:

- `vocab_size` (int): every id is below it; it picks the token file's dtype.
- `eot_id` (int): the end-of-document token appended after every document.
- `encode_array(str) -> np.ndarray`: a fast path that skips building a Python list.

Without `eot_id`, the builder uses one past the largest id it saw (see `build_token_dataset`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, id 256 ends a document.

    Guarantees: `decode(encode(s)) == s` for every string `s` that UTF-8 can encode (all but
    strings with a lone surrogate such as U+D800, where `encode` raises UnicodeEncodeError,
    as `str.encode("utf-8")` does); every id is `< vocab_size` (257),
    so a token file fits in `uint16`. `decode` drops end-of-document tokens and replaces byte
    sequences that are not valid UTF-8 (as a model may sample) with U+FFFD instead of raising.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [104, 195, 169]
        >>> tok.decode([104, 195, 169, tok.eot_id])
        'hé'
    """

    vocab_size: int = 257
    eot_id: int = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Same ids as `encode`, as a `uint8` array without a Python list in between."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        """Text of `ids` (ints, a list, an array or a tensor); end-of-document ids are dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
