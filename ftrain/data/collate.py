"""Collate functions: a list of examples (dicts of tensors) -> one batch (a dict of tensors)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "PadCollate", "padding_fraction", "stack_collate"]

IGNORE_INDEX = -100  # target value the losses skip (`cross_entropy(..., ignore_index=-100)`)


def _as_tensor(value, key: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic, int, float, bool)):
        return torch.as_tensor(value)
    raise TypeError(
        f"collate: example[{key!r}] is a {type(value).__name__}; examples must map names to "
        "tensors, numpy arrays or numbers"
    )


def stack_collate(examples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack equal-shaped examples: `{k: stack([ex[k] for ex in examples])}`.

    Guarantees: `batch[k][i]` equals `examples[i][k]`; every example has the same keys and, per
    key, the same shape, or a ValueError names the key and the shapes (pad variable-length
    examples with `PadCollate` instead).
    """
    if not examples:
        raise ValueError("stack_collate: got no examples")
    keys = list(examples[0].keys())
    batch = {}
    for k in keys:
        try:
            values = [_as_tensor(ex[k], k) for ex in examples]
        except KeyError:
            raise ValueError(f"stack_collate: examples do not all have the key {k!r}") from None
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(
                f"stack_collate: examples[{k!r}] have different shapes {sorted(shapes)[:4]}; use "
                "collate=ftrain.data.PadCollate() for variable-length examples"
            )
        batch[k] = torch.stack(values)
    return batch


@dataclass(frozen=True)
class PadCollate:
    """Pad variable-length 1-D examples to the longest in the batch, with a mask.

    For examples `{"input": LongTensor[n_i], "target": LongTensor[n_i], ...}` returns
    `{"input": [B, T], "target": [B, T], "mask": BoolTensor[B, T], ...}` where T is the longest
    n_i rounded up to `pad_to_multiple_of`.

    Guarantees: row i holds example i in its first n_i positions; after them `target` is
    `ignore_index` (-100, which `ft.losses.cross_entropy` skips), every other key is `pad_id`, and
    `mask` is False (True exactly on the n_i real positions, usable as an attention key-padding
    mask). All 1-D keys of one example must have the same length. Keys of other ranks are stacked
    as in `stack_collate`.

    Args:
        pad_id: fill value of padded positions of every key but `target`.
        ignore_index: fill value of padded `target` positions.
        pad_to_multiple_of: round T up (e.g. 8 or 64), so a compiled model sees few shapes.
        mask_key: name of the mask entry.
    """

    pad_id: int = 0
    ignore_index: int = IGNORE_INDEX
    pad_to_multiple_of: int = 1
    mask_key: str = "mask"

    def __post_init__(self):
        if not isinstance(self.pad_to_multiple_of, int) or self.pad_to_multiple_of < 1:
            raise ValueError(
                f"PadCollate: pad_to_multiple_of must be a positive int, got {self.pad_to_multiple_of!r}"
            )

    def __call__(self, examples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("PadCollate: got no examples")
        keys = list(examples[0].keys())
        if self.mask_key in keys:
            raise ValueError(f"PadCollate: examples already have a {self.mask_key!r} entry")
        rows = [{k: _as_tensor(ex[k], k) for k in keys} for ex in examples]
        seq_keys = [k for k in keys if rows[0][k].dim() == 1]
        if not seq_keys:
            raise ValueError("PadCollate: examples have no 1-D entry to pad; use stack_collate")
        lengths = []
        for i, row in enumerate(rows):
            ns = {k: row[k].shape[0] for k in seq_keys}
            if len(set(ns.values())) > 1:
                raise ValueError(
                    f"PadCollate: example {i} has 1-D entries of different lengths {ns}"
                )
            lengths.append(ns[seq_keys[0]])
        m = self.pad_to_multiple_of
        T = -(-max(lengths) // m) * m
        B = len(rows)
        batch = {}
        for k in seq_keys:
            fill = self.ignore_index if k == "target" else self.pad_id
            out = torch.full((B, T), fill, dtype=rows[0][k].dtype)  # (B, T)
            for i, row in enumerate(rows):
                out[i, : lengths[i]] = row[k]
            batch[k] = out
        for k in keys:
            if k not in seq_keys:
                batch[k] = stack_collate([{k: row[k]} for row in rows])[k]
        n = torch.tensor(lengths)
        batch[self.mask_key] = torch.arange(T)[None, :] < n[:, None]  # (B, T)
        return batch


def padding_fraction(batch: Mapping[str, torch.Tensor], mask_key: str = "mask") -> float:
    """Fraction of the batch's positions that are padding (0.0 for a batch without a mask)."""
    mask = batch.get(mask_key)
    if mask is None:
        return 0.0
    return 1.0 - float(mask.sum()) / mask.numel()
