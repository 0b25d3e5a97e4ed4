"""Learning-rate schedules: pure functions ``count -> value`` of a 0-d integer tensor.

Each factory checks its arguments once and returns a function built from tensor ops only
(``torch.where``, ``clamp``, ``cos``), so the value is computed on the same device as the counter,
without a host sync, and a compiled step sees the same graph at every step. Values are float64
0-d tensors; ``count`` is the number of updates applied before this one (0 for the first). A
Python ``int`` works as ``count`` too (handy for plotting a schedule).

>>> from ftrain.optim import warmup_cosine
>>> lr = warmup_cosine(1e-3, warmup_steps=100, decay_steps=1000)
>>> [round(float(lr(t)), 6) for t in (0, 50, 100, 550, 1000, 5000)]
[0.0, 0.0005, 0.001, 0.0005, 0.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "Schedule",
    "constant",
    "linear_schedule",
    "linear_warmup",
    "linear_decay",
    "cosine_decay",
    "inverse_sqrt",
    "warmup_cosine",
    "wsd",
    "join",
]

Schedule = Callable[[torch.Tensor], torch.Tensor]
"""A learning-rate (or any hyper-parameter) schedule: ``count -> value``, a 0-d integer tensor
to a 0-d float tensor, built from tensor ops only."""


def _count(count) -> torch.Tensor:
    return count if isinstance(count, torch.Tensor) else torch.tensor(count, dtype=torch.int64)


def _t(count) -> torch.Tensor:
    return _count(count).to(torch.float64)


def _full(value: float, count) -> torch.Tensor:
    return torch.full((), float(value), dtype=torch.float64, device=_count(count).device)


def _nonneg_int(fn: str, name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{fn}: {name} must be an integer >= 0 (a number of steps), got {value!r}."
        )
    return value


def _number(fn: str, name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise TypeError(f"{fn}: {name} must be a number, got {value!r}.")
    return float(value)


def constant(value: float) -> Schedule:
    """``value`` at every step."""
    value = _number("constant", "value", value)
    return lambda count: _full(value, count)


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """From ``init_value`` at count 0 to ``end_value`` at ``transition_steps``, then constant.

    With ``transition_steps == 0`` it is ``end_value`` throughout.
    """
    init_value = _number("linear_schedule", "init_value", init_value)
    end_value = _number("linear_schedule", "end_value", end_value)
    n = _nonneg_int("linear_schedule", "transition_steps", transition_steps)

    def schedule(count):
        if n == 0:
            return _full(end_value, count)
        frac = (_t(count) / n).clamp(0.0, 1.0)
        return init_value + (end_value - init_value) * frac

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear from ``init_value`` at count 0 to ``peak_value`` at ``warmup_steps``, then constant."""
    return linear_schedule(init_value, peak_value, warmup_steps)


def linear_decay(init_value: float, decay_steps: int, end_value: float = 0.0) -> Schedule:
    """Linear from ``init_value`` at count 0 to ``end_value`` at ``decay_steps``, then constant."""
    return linear_schedule(init_value, end_value, decay_steps)


def _cosine(fn: str, init_value: float, end_value: float, steps: int) -> Schedule:
    init_value = _number(fn, "init_value", init_value)
    end_value = _number(fn, "end_value", end_value)
    n = _nonneg_int(fn, "decay_steps", steps)

    def schedule(count):
        if n == 0:
            return _full(end_value, count)
        frac = (_t(count) / n).clamp(0.0, 1.0)
        cosine = 0.5 * (1 + torch.cos(math.pi * frac))  # 1 at the start, 0 at the end
        return end_value + (init_value - end_value) * cosine

    return schedule


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Half a cosine from ``init_value`` (count 0) to ``alpha * init_value`` (``decay_steps``),
    then constant at ``alpha * init_value``."""
    init_value = _number("cosine_decay", "init_value", init_value)
    alpha = _number("cosine_decay", "alpha", alpha)
    return _cosine("cosine_decay", init_value, alpha * init_value, decay_steps)


def inverse_sqrt(peak_value: float, warmup_steps: int) -> Schedule:
    """Linear warmup to ``peak_value`` over ``warmup_steps``, then ``peak * sqrt(warmup / count)``
    (the original Transformer schedule). ``warmup_steps`` must be >= 1."""
    peak_value = _number("inverse_sqrt", "peak_value", peak_value)
    w = _nonneg_int("inverse_sqrt", "warmup_steps", warmup_steps)
    if w == 0:
        raise ValueError("inverse_sqrt: warmup_steps must be >= 1 (the decay is relative to it).")

    def schedule(count):
        t = _t(count)
        warm = peak_value * t / w
        decay = peak_value * torch.sqrt(w / t.clamp_min(1.0))
        return torch.where(t < w, warm, decay)

    return schedule


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i]`` between ``boundaries[i-1]`` and ``boundaries[i]``.

    Each schedule sees the count relative to its own start, so ``join([warmup, decay], [w])``
    starts the decay from its count 0 at step ``w``. ``len(boundaries) == len(schedules) - 1``;
    boundaries are increasing.
    """
    schedules = list(schedules)
    if not schedules or not all(callable(s) for s in schedules):
        raise TypeError("join: schedules must be a non-empty list of functions count -> value.")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join: {len(schedules)} schedules need {len(schedules) - 1} boundaries, "
            f"got {len(boundaries)}."
        )
    bounds = [_nonneg_int("join", "boundaries[i]", b) for b in boundaries]
    if any(b2 < b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"join: boundaries must be increasing, got {list(boundaries)}.")

    def schedule(count):
        count = _count(count)
        out = schedules[0](count).to(torch.float64)
        for start, s in zip(bounds, schedules[1:]):
            out = torch.where(count >= start, s(count - start).to(torch.float64), out)
        return out

    return schedule


def warmup_cosine(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then a cosine to
    ``end_value`` at ``decay_steps`` (the *total* length, warmup included), then constant."""
    w = _nonneg_int("warmup_cosine", "warmup_steps", warmup_steps)
    total = _nonneg_int("warmup_cosine", "decay_steps", decay_steps)
    if total < w:
        raise ValueError(
            f"warmup_cosine: decay_steps ({total}) is the total length and must be >= "
            f"warmup_steps ({w})."
        )
    return join(
        [
            linear_warmup(peak_value, w, init_value),
            _cosine("warmup_cosine", peak_value, end_value, total - w),
        ],
        [w],
    )


def wsd(
    peak_value: float,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Warmup-stable-decay: linear warmup to ``peak_value`` (``warmup_steps``), constant for
    ``stable_steps``, linear decay to ``end_value`` over ``decay_steps``, then constant."""
    w = _nonneg_int("wsd", "warmup_steps", warmup_steps)
    s = _nonneg_int("wsd", "stable_steps", stable_steps)
    d = _nonneg_int("wsd", "decay_steps", decay_steps)
    return join(
        [
            linear_warmup(peak_value, w, init_value),
            constant(peak_value),
            linear_decay(peak_value, d, end_value),
        ],
        [w, w + s],
    )


def as_schedule(lr: float | Schedule, name: str = "learning rate") -> Schedule:
    """``lr`` as a schedule: a schedule as it is, a number ``>= 0`` as a constant schedule."""
    if callable(lr):
        return lr
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"{name} must be a number or a schedule function, got {lr!r}.")
    if lr < 0:
        raise ValueError(f"{name} must be >= 0, got {lr}.")
    value = float(lr)
    return lambda count: torch.full((), value, dtype=torch.float64, device=count.device)
