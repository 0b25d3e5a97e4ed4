"""Which tokens of a build train and which validate: whole documents when there are enough of
them, a cut through the token stream when there are not, or no validation at all.

    plan = data.plan_split("data/notes", seq_len=128, val_fraction=0.1)
    train = data.TokenDataset("data/notes", 128, **plan.train)
    valid = data.TokenDataset("data/notes", 128, **plan.valid) if plan.valid else None
    print(plan.how, plan.reason)        # "documents" / "tokens" / "off", and why it is off

A plan never fails on a small corpus: where a validation split would hold less than one row
(``seq_len + 1`` tokens), validation is off, the training split is the whole build and
``reason`` says why. Only a build too small to train on at all is an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ftrain.data.build import DOCS_FILE
from ftrain.data.datasets import split_ranges

__all__ = ["DEFAULT_SPLITS", "SplitPlan", "check_settings", "plan_split"]

DEFAULT_SPLITS = (969, 30, 1)  # Megatron's --split 969,30,1: what a run uses without a fraction
EVERYTHING = {"splits": (1, 0, 0)}  # every document trains


@dataclass(frozen=True)
class SplitPlan:
    """The keyword arguments of ``TokenDataset`` for the training rows and the validation rows
    (``valid`` None: validation off), how the build was cut and, when off, why."""

    train: dict[str, Any]  # split=/splits= (by documents) or token_range= (by tokens)
    valid: dict[str, Any] | None
    how: str  # "documents", "tokens" or "off"
    reason: str = ""  # why validation is off, in words ("" when it is on)


def plan_split(
    path: str | os.PathLike, seq_len: int, val_fraction: float | None = None
) -> SplitPlan:
    """How to cut the build at ``path`` into training and validation rows of ``seq_len``.

    - ``val_fraction`` None: Megatron's weights ``DEFAULT_SPLITS`` over documents (what runs
      always used), validation the ``"valid"`` split.
    - ``val_fraction`` F in (0, 1): the last ``round(F * documents)`` documents validate; when
      that is no document, every document, or fewer than ``seq_len + 1`` tokens on either side,
      the last ``round(F * tokens)`` tokens of the stream validate instead (the document they cut
      is split between the two).
    - ``val_fraction`` 0: validation off.

    **Invariant:** training and validation never share a token, and each side holds at least
    ``seq_len + 1`` tokens (one row); where no cut gives validation that much, ``valid`` is None,
    ``train`` is every document and ``reason`` says why. ``ValueError`` when the whole build is
    shorter than one row.
    """
    if val_fraction is not None and not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1) (0 = no validation), got {val_fraction}")
    docs = np.load(Path(path) / DOCS_FILE, allow_pickle=False)  # (D + 1,) token offsets
    n, total, need = len(docs) - 1, int(docs[-1]), seq_len + 1
    if total < need:
        raise ValueError(
            f"the data holds {total} tokens in {n} document(s), fewer than one row of seq_len "
            f"{seq_len} + 1; lower seq_len to {total - 1} or less, or give more data"
        )
    if val_fraction == 0:
        return SplitPlan(EVERYTHING, None, "off", "a validation fraction of 0")
    if val_fraction is None:
        r = split_ranges(n, DEFAULT_SPLITS)
        t = int(docs[r["train"].stop] - docs[r["train"].start])
        v = int(docs[r["valid"].stop] - docs[r["valid"].start])
        if t >= need and v >= need:
            valid = {"split": "valid", "splits": DEFAULT_SPLITS}
            return SplitPlan({"splits": DEFAULT_SPLITS}, valid, "documents")
        return SplitPlan(EVERYTHING, None, "off", (
            f"the default split ({DEFAULT_SPLITS[1] / sum(DEFAULT_SPLITS):.0%} of the documents) "
            f"gives validation {len(r['valid'])} of the {n} document(s), {v} tokens, less than "
            f"one row of seq_len {seq_len} + 1"
        ))  # fmt: skip
    k = round(val_fraction * n)  # by documents: the last k
    if 1 <= k < n and int(docs[n - k]) >= need and total - int(docs[n - k]) >= need:
        weights = (n - k, k, 0)  # exact: split_ranges gives train n - k documents, valid k
        return SplitPlan({"splits": weights}, {"split": "valid", "splits": weights}, "documents")
    v = round(val_fraction * total)  # by tokens: the last v of the stream
    if v >= need and total - v >= need:
        return SplitPlan({"token_range": (0, total - v)}, {"token_range": (total - v, total)},
                         "tokens")  # fmt: skip
    return SplitPlan(EVERYTHING, None, "off", (
        f"a validation fraction of {val_fraction:g} is {v} of the data's {total} tokens, and "
        f"each side needs one row of seq_len {seq_len} + 1"
    ))  # fmt: skip


def check_settings(
    epochs: int | None,
    max_steps_given: bool,
    max_steps: int,
    val_fraction: float | None,
    eval_data: str | None,
) -> None:
    """``ftrain train``'s validation settings: one way to validate (``--eval-data`` or
    ``--val-fraction``), one length (``--epochs`` or ``--max-steps``, which counts as given when
    it differs from its default). A ``ValueError`` naming the flags otherwise."""
    e, f, d = epochs, val_fraction, eval_data
    for bad, message in (
        (e is not None and max_steps_given,
         f"--epochs {e} and --max-steps {max_steps} both set the run's length; pass one"),
        (e is not None and (isinstance(e, bool) or e < 1), f"--epochs must be >= 1, got {e!r}"),
        (f is not None and not 0.0 <= f < 1.0,
         f"--val-fraction must be in [0, 1) (0 = no validation), got {f}"),
        (d is not None and f is not None,
         f"--eval-data {d!r} and --val-fraction {f} both choose the validation data; pass one"),
        (d is not None and not Path(d).exists(),
         f"--eval-data {d!r} does not exist; pass a file or a folder, as for --data"),
    ):  # fmt: skip
        if bad:
            raise ValueError(message)
