"""``ft.wrap``: a transform from a function that wraps the whole step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ftrain.state import TrainState
from ftrain.step import STAGES, Step, StepFn, Transform

__all__ = ["Wrap", "wrap"]


@dataclasses.dataclass(frozen=True, eq=False)
class Wrap(Transform):
    """The ``wrap`` hook (and optionally ``init``) from plain functions; see :func:`wrap`."""

    wrapper: Callable[[StepFn], StepFn]
    name: str = "wrap"
    init_fn: Callable[[TrainState], TrainState] | None = None
    stage: str = "eager"

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"ft.wrap(stage={self.stage!r}): legal stages are {STAGES}.")
        if not callable(self.wrapper):
            raise TypeError("ft.wrap(step, wrapper): wrapper must be callable as wrapper(inner).")
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError("ft.wrap(..., init=...): init must be callable as init(state).")

    def init(self, state: TrainState) -> TrainState:
        return self.init_fn(state) if self.init_fn is not None else state

    def wrap(self, fn: StepFn, stage: str) -> StepFn:
        return self.wrapper(fn) if stage == self.stage else fn

    def __repr__(self) -> str:
        return f"Wrap({getattr(self.wrapper, '__qualname__', self.wrapper)!r}, name={self.name!r})"


def wrap(
    step: Step,
    wrapper: Callable[[StepFn], StepFn],
    *,
    name: str = "wrap",
    init: Callable[[TrainState], TrainState] | None = None,
    stage: str = "eager",
) -> Step:
    """Add an outer layer to ``step``: the new step calls ``wrapper(inner)(state, batch)``.

    The quickest way to add behaviour around a whole step (logging, a metric of the result).
    ``wrapper`` must return a function with the step's signature and must not mutate its inputs.
    ``init(state) -> state`` adds the entries the wrapper keeps in ``state.extra`` when they are
    missing; the step runs it before every call, and ``step.init_extra(state)`` runs it up front.
    ``stage``: ``"eager"`` (default) wraps the step from outside, eagerly even under
    ``ft.compile``; ``"traced"`` wraps the step's core inside, compiled with it (keep it
    traceable: no ``.item()``, no printing).
    To act *inside* the step (on the gradients, the forward, the batch split), subclass
    ``ft.Transform`` instead: see docs/transforms.md.
    """
    return Wrap(wrapper, name=name, init_fn=init, stage=stage)(step)
