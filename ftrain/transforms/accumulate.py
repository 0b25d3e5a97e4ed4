"""Gradient accumulation: one optimizer update from k micro-batches."""

from __future__ import annotations

from ftrain.step import Step
from ftrain.transforms._common import check_step

__all__ = ["accumulate"]


def accumulate(step: Step, micro_batches: int) -> Step:
    """Split each batch along dim 0 into ``micro_batches`` parts and apply the optimizer once.

    Each micro-batch runs forward and backward on its own (so activation memory is that of one
    micro-batch); gradients add into a single buffer, loss totals and counts add up, and the
    division by the total count happens once. Splits may be uneven (``torch.tensor_split``).

    **Invariant:** equals ``step`` on the whole batch, also for token-weighted losses whose
    micro-batches hold different numbers of valid tokens (fp32: params agree to 1e-5 relative).
    A batch with fewer rows than ``micro_batches`` is an error.
    """
    step = check_step(step, "accumulate")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(
            f"ft.accumulate(micro_batches={micro_batches!r}): must be an integer >= 1 "
            "(the number of pieces each batch is split into)."
        )
    if step.micro_batches != 1:
        raise ValueError(
            f"ft.accumulate: the step already accumulates over {step.micro_batches} micro-batches. "
            f"Apply accumulate once, with micro_batches={step.micro_batches * micro_batches}."
        )
    return step.replace("accumulate", micro_batches=micro_batches)
