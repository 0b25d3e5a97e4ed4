"""Gradient accumulation: one optimizer update from k micro-batches."""

from __future__ import annotations

import dataclasses
from typing import Any

from ftrain.internals.batch import batch_rows, split_batch
from ftrain.step import Step, Transform
from ftrain.step.capabilities import SPLITS_BATCH

__all__ = ["Accumulate", "accumulate"]


@dataclasses.dataclass(frozen=True, eq=False)
class Accumulate(Transform):
    """Split the batch into ``micro_batches`` pieces (the ``split`` hook); see :func:`accumulate`."""

    micro_batches: int

    def __post_init__(self) -> None:
        k = self.micro_batches
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"ft.accumulate(micro_batches={k!r}): must be an integer >= 1 "
                "(the number of pieces each batch is split into)."
            )

    def capabilities(self):
        return {SPLITS_BATCH: f"micro_batches={self.micro_batches}"}

    def split(self, batch: Any) -> list[Any]:
        k = self.micro_batches
        rows = batch_rows(batch)
        if rows is not None and rows < k:
            raise ValueError(
                f"ft.accumulate(micro_batches={k}) got a batch of {rows} rows; every micro-batch "
                f"needs at least one row. Use micro_batches <= {rows}."
            )
        return split_batch(batch, k)


def accumulate(step: Step, micro_batches: int) -> Step:
    """Split each batch along dim 0 into ``micro_batches`` parts and apply the optimizer once.

    Each micro-batch runs forward and backward on its own (so activation memory is that of one
    micro-batch); gradients add into a single buffer, loss totals and counts add up, and the
    division by the total count happens once. Splits may be uneven (``torch.tensor_split``).
    Under ``ft.compile``, one micro-batch's forward and backward is compiled once and called for
    each piece, so the compile does not grow with ``micro_batches`` (see :func:`ftrain.compile`).

    **Invariant:** equals ``step`` on the whole batch, also for token-weighted losses whose
    micro-batches hold different numbers of valid tokens (fp32: params agree to 1e-5 relative).
    A batch with fewer rows than ``micro_batches`` is an error.
    """
    return Accumulate(micro_batches)(step)
