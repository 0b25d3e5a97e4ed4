"""Tokenizers. `ByteTokenizer` is the default; any object with `encode(str) -> list[int]` works;
`load_tokenizer(model_dir)` reads a Hugging Face model directory's tokenizer (`HFTokenizer`).

A tokenizer used by `build_token_dataset` may also carry:

- `vocab_size` (int): every id is below it; it picks the token file's dtype.
- `eot_id` (int): the end-of-document token appended after every document.
- `encode_array(str) -> np.ndarray`: a fast path that skips building a Python list.

Without `eot_id`, the builder uses one past the largest id it saw (see `build_token_dataset`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


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


class HFTokenizer:
    """A Hugging Face tokenizer read from a model directory: ``tokenizer.json`` (run by the
    ``tokenizers`` library) and ``tokenizer_config.json`` (special tokens, chat template).
    Build it with :func:`load_tokenizer`.

    Guarantees: ``encode`` adds no special tokens (no BOS): a document's end is marked by the
    build with ``eot_id``, the tokenizer's ``eos_token``, which also starts the next document in a
    packed row; ``decode(encode(s)) == s`` wherever the tokenizer itself round-trips;
    ``decode`` drops special tokens. Every id is below ``vocab_size`` (added tokens included).

    Attributes:
        path: the directory it was read from (``tokenizer.json`` and ``tokenizer_config.json``
            there are what an export copies).
        vocab_size, eot_id: as ``build_token_dataset`` reads them.
        chat_template: the Jinja chat template (``tokenizer_config.json``'s ``chat_template`` or
            ``chat_template.jinja``), or None; see ``ftrain.data.chat``.
        special_tokens: ``{"eos_token": "<|endoftext|>", "bos_token": ..., ...}`` as strings.
        fingerprint: sha256 of the files read, so a token cache is rebuilt when they change.
    """

    def __init__(self, tokenizer, path: Path, config: dict, chat_template: str | None):
        self.backend = tokenizer  # a tokenizers.Tokenizer
        self.path = path
        self.chat_template = chat_template
        self.special_tokens = {
            k: _token_text(v)
            for k, v in config.items()
            if k.endswith("_token") and _token_text(v) is not None
        }
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = self.special_tokens.get("eos_token")
        eot = tokenizer.token_to_id(eos) if eos is not None else None
        if eot is None:
            raise ValueError(
                f"load_tokenizer({str(path)!r}): tokenizer_config.json names no eos_token that "
                f"tokenizer.json knows (eos_token={eos!r}); ftrain ends every document with it. "
                'Fix: set "eos_token" in tokenizer_config.json to one of the tokenizer\'s special '
                "tokens (tokenizer.save_pretrained writes it)"
            )
        self.eot_id = int(eot)
        h = hashlib.sha256(tokenizer.to_str().encode())
        h.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        h.update((chat_template or "").encode())
        self.fingerprint = h.hexdigest()

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        """Same ids as ``encode``, as an int64 array."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each token's ``(start, end)`` character span in ``text``
        (what ``ftrain.data.chat`` uses to find the assistant's tokens)."""
        enc = self.backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def decode(self, ids) -> str:
        """Text of ``ids`` (ints, a list, an array or a tensor); special tokens are dropped."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(model_dir: str | os.PathLike) -> HFTokenizer:
    """The tokenizer saved in ``model_dir`` (``tokenizer.save_pretrained`` writes it): local files
    only, read with the ``tokenizers`` library, no ``transformers`` needed.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens; its
    ``eos_token`` becomes ``eot_id``) and the chat template (the config's ``chat_template`` key
    or a ``chat_template.jinja`` file; a list of named templates gives its ``"default"``).

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``model_dir`` (the message says how to write one).
        ValueError: a file is not valid JSON, or no usable ``eos_token``.
        ImportError: ``tokenizers`` is not installed (``pip install 'ftrain[hf]'``).
    """
    path = Path(model_dir)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"--model-dir {str(path)!r} has no tokenizer.json; save the model's tokenizer beside "
            "it (tokenizer.save_pretrained(folder), a fast tokenizer), or train without "
            "--model-dir to use the byte tokenizer"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(
            f"load_tokenizer({str(path)!r}) needs tokenizers: pip install 'ftrain[hf]'"
        ) from e
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a plain Exception for a bad file
        raise ValueError(f"load_tokenizer: {file} cannot be read by tokenizers ({e})") from None
    config: dict = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise ValueError(f"load_tokenizer: {config_file} is not valid JSON ({e})") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    return HFTokenizer(backend, path, config, template if isinstance(template, str) else None)
