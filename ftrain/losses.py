"""Losses that say what they are normalized by.

A loss for ftrain is a *sum* and the *count* it will be divided by. Keeping them apart is what makes
gradient accumulation and data parallelism exact: micro-batches and ranks add their sums and their
counts, and the division happens once, over the whole batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ftrain.batch import batch_rows

__all__ = ["Loss", "cross_entropy", "as_loss"]


class Loss(NamedTuple):
    """A loss declared as ``total / count``.

    Attributes:
        total: 0-d tensor, the *sum* of per-example (or per-token) losses.
        count: 0-d tensor, what ``total`` is normalized by (e.g. the number of valid tokens).
        aux: mapping of extra 0-d tensors reported as metrics (not differentiated), e.g. accuracy;
            None means none.

    The value that is minimized is ``total / count`` over the whole batch, however the batch is
    split across micro-batches or processes.
    """

    total: torch.Tensor
    count: torch.Tensor
    aux: Mapping[str, torch.Tensor] | None = None

    @property
    def value(self) -> torch.Tensor:
        """``total / count`` (a count of zero gives zero, not NaN)."""
        return self.total / torch.where(self.count != 0, self.count, torch.ones_like(self.count))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> Loss:
    """Token cross-entropy as ``Loss(sum over valid tokens, number of valid tokens)``.

    ``logits`` is ``(..., V)`` and ``targets`` is ``(...)``; positions where
    ``targets == ignore_index`` contribute nothing to either the sum or the count. The sum is
    computed in fp32 whatever the logits' dtype.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} "
            "plus a trailing vocabulary dimension."
        )
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (targets != ignore_index).sum()
    return Loss(total, count)


def _rows(batch) -> int:
    rows = batch_rows(batch)
    if rows is None:
        raise TypeError(
            "a loss_fn that returns a plain scalar is taken as a mean over batch rows, but the "
            f"batch ({type(batch).__name__}) holds no tensor with a leading batch dimension. "
            "Return ft.Loss(total, count) instead."
        )
    return rows


def as_loss(out, batch) -> Loss:
    """Normalize what a ``loss_fn`` returned into a :class:`Loss`.

    Accepted: a :class:`Loss`; a 0-d tensor (a mean over the batch rows, so ``count`` is the
    number of rows); a ``(loss, aux)`` pair where ``loss`` is either of those.
    """
    aux = {}
    if isinstance(out, tuple) and not isinstance(out, Loss):
        if len(out) != 2:
            raise TypeError(
                f"loss_fn returned a tuple of {len(out)} items; return a Loss, a scalar tensor, "
                "or a (loss, aux_dict) pair."
            )
        out, aux = out
    if isinstance(out, Loss):
        total, count = out.total, out.count
        aux = {**(out.aux or {}), **aux}
    elif isinstance(out, torch.Tensor):
        if out.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar loss, got a tensor of shape {tuple(out.shape)}. "
                "Reduce it (e.g. .mean()), or return ft.Loss(total=losses.sum(), count=n)."
            )
        rows = _rows(batch)
        # in fp32: a bf16 `rows` would round (257 -> 256) and bias every gradient; fp16 overflows
        total, count = out.float() * rows, torch.tensor(rows, device=out.device)
    else:
        raise TypeError(
            f"loss_fn returned {type(out).__name__}; return ft.Loss(total, count), a scalar "
            "tensor (a mean over batch rows), or a (loss, aux_dict) pair."
        )
    if not isinstance(total, torch.Tensor) or total.dim() != 0:
        raise ValueError("Loss.total must be a 0-d tensor (the sum of the losses).")
    if not torch.is_floating_point(total):
        raise TypeError(f"Loss.total must be a floating-point tensor, got {total.dtype}.")
    if not isinstance(count, torch.Tensor):
        count = torch.tensor(count, device=total.device)
    if count.dim() != 0:
        raise ValueError("Loss.count must be a 0-d tensor (what the total is divided by).")
    return Loss(total, count, aux)
