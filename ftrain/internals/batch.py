"""Batches: a tensor, or a dict, list, tuple or namedtuple of them (nested), rows along dim 0."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["split_batch", "batch_rows"]


def split_batch(batch: Any, k: int) -> list[Any]:
    """Split every tensor of ``batch`` into ``k`` parts along dim 0, as evenly as possible
    (``torch.tensor_split``: the first ``rows % k`` parts get one row more). The containers keep
    their types; 0-d tensors and non-tensor leaves are shared by every part."""
    if k == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * k
        return list(torch.tensor_split(batch, k))
    if isinstance(batch, Mapping):
        parts = {key: split_batch(v, k) for key, v in batch.items()}
        return [type(batch)({key: parts[key][i] for key in batch}) for i in range(k)]
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(v, k) for v in batch]
        if hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
            return [type(batch)(*(p[i] for p in parts)) for i in range(k)]
        return [type(batch)(p[i] for p in parts) for i in range(k)]
    return [batch] * k


def batch_rows(batch: Any) -> int | None:
    """The leading dimension of the first batched tensor in ``batch`` (depth first, in order), or
    None if it holds none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif not isinstance(batch, (tuple, list)):
        return None
    for v in batch:
        rows = batch_rows(v)
        if rows is not None:
            return rows
    return None
