"""An exponential moving average of the params, kept in the state."""

from __future__ import annotations

import dataclasses

from ftrain import tree
from ftrain.internals import foreach
from ftrain.state import TrainState
from ftrain.step import Step, StepFn, Transform

__all__ = ["Ema", "ema"]


@dataclasses.dataclass(frozen=True, eq=False)
class Ema(Transform):
    """``state.extra["ema"]`` follows the params (the ``init`` hook, and ``wrap`` at the eager
    stage: the average is taken outside any compiled graph); see :func:`ema`."""

    decay: float = 0.999

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"ft.ema(decay={self.decay!r}): must be in [0, 1).")

    def capabilities(self):
        return {"keeps state.extra['ema']": ""}

    def init(self, state: TrainState) -> TrainState:
        if "ema" in state.extra.keys():
            return state
        extra = state.extra.clone(recurse=False)  # a new container: the input state is untouched
        extra["ema"] = state.params.clone()
        return state.replace(extra=extra)

    def wrap(self, fn: StepFn, stage: str) -> StepFn:
        if stage != "eager":
            return fn
        weight = 1.0 - self.decay

        def ema_step(state, batch):
            new_state, metrics = fn(state, batch)
            avg = tree.leaves(state.extra["ema"])
            # ema + (1 - decay) * (params - ema), for all tensors in one multi-tensor kernel
            new_avg = foreach.lerp(avg, tree.leaves(new_state.params), weight)
            extra = new_state.extra.clone(recurse=False)
            extra["ema"] = tree.unflatten(state.extra["ema"], new_avg)
            return new_state.replace(extra=extra), metrics

        return ema_step


def ema(step: Step, decay: float = 0.999) -> Step:
    """Keep ``state.extra["ema"] = decay * ema + (1 - decay) * params`` after every step.

    The average starts as a copy of the params on the first call and is saved with the state.
    Use it for evaluation: ``ft.apply(model, state.extra["ema"], x)``.

    **Invariant:** after n steps, ``ema == decay**n * p0 + sum_i (1-decay) decay**(n-i) p_i``; the
    params and metrics are those of ``step``.
    """
    return Ema(decay)(step)
