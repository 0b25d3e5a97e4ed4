"""What a run trains on: the built-in corpus or ``--data PATH``, and where its token cache lives.

    ftrain train                                   # the Python standard library, byte tokens
    ftrain train --data notes/                     # every file under notes/
    ftrain train --model-dir M --data chats.jsonl  # tokenized with M's tokenizer

The cache folder is named by what it holds (the data's path and the tokenizer's directory), so
runs on different data or with different tokenizers never rebuild each other's caches; the build
itself (``ftrain.data.build_token_dataset``) is redone only when the files change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

from ftrain import data
from ftrain.app.config import TrainConfig

__all__ = ["cache_dir", "eval_cache_dir", "report_build", "sources"]


def sources(cfg: TrainConfig) -> list:
    """The build's sources: the files of ``--data`` (``ftrain.data.data_files``), else the
    standard library's ``.py`` files."""
    return data.data_files(cfg.data) if cfg.data else data.corpora.python_stdlib()


def cache_dir(cfg: TrainConfig) -> Path:
    """The token cache: ``--data-dir``, else under ``$FTRAIN_CACHE`` (default ``~/.cache/ftrain``)
    ``stdlib`` for the built-in corpus with byte tokens, or ``<name>-<hash>`` where the hash
    names the data's absolute path and the ``--model-dir`` whose tokenizer encodes it."""
    if cfg.data_dir:
        return Path(cfg.data_dir)
    root = Path(os.environ.get("FTRAIN_CACHE") or Path.home() / ".cache" / "ftrain")
    if not cfg.data and not cfg.model_dir:
        return root / "stdlib"
    what = str(Path(cfg.data).resolve()) if cfg.data else "stdlib"
    tok = str(Path(cfg.model_dir).resolve()) if cfg.model_dir else "bytes"
    digest = hashlib.sha256(f"{what}|{tok}".encode()).hexdigest()[:12]
    name = Path(cfg.data).name if cfg.data else "stdlib"
    return root / f"{name}-{digest}"


def eval_cache_dir(cfg: TrainConfig) -> Path:
    """The token cache of ``--eval-data``: ``eval-data/`` inside ``--data-dir`` when one is
    given, else named as :func:`cache_dir` names ``--data``'s (by its path and tokenizer)."""
    if cfg.data_dir:
        return Path(cfg.data_dir) / "eval-data"
    return cache_dir(dataclasses.replace(cfg, data=cfg.eval_data))


def report_build(summary: data.BuildSummary, *, file=None) -> None:
    """One line on stderr when the build skipped documents: how many, why, and the first few
    problems with their file and line."""
    n = sum(summary.skipped.values())
    if not n:
        return
    why = ", ".join(f"{k} {v}" for k, v in summary.skipped.items() if v)
    first = "; ".join(summary.problems[:3])
    print(
        f"ftrain train: the data build skipped {n} document(s) ({why}): {first}"
        + (" ..." if n > 3 else "")
        + f" (all listed in {summary.out_dir / 'meta.json'})",
        file=file or sys.stderr,
    )
