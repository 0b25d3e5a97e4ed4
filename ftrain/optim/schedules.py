"""Learning-rate schedules: pure functions ``count -> value`` of a 0-d integer tensor.

Each factory checks its arguments once and returns a function built from tensor ops only
(``torch.where``, ``clamp``, ``cos``), so the value is computed on the same device as the counter,
without a host sync, and a compiled step sees the same graph at every step. Values are float64
0-d tensors; ``count`` is the number of updates applied before this one (0 for the first).
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


def _t(count: torch.Tensor) -> torch.Tensor:
    return count.to(torch.float64)


def _nonneg_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
    return value


def constant(value: float) -> Schedule:
    """``value`` at every step."""
    value = float(value)
    return lambda count: torch.full((), value, dtype=torch.float64, device=count.device)


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """From ``init_value`` at count 0 to ``end_value`` at ``transition_steps``, then constant.

    With ``transition_steps == 0`` it is ``end_value`` throughout.
    """
    n = _nonneg_int("transition_steps", transition_steps)

    def schedule(count):
        if n == 0:
            return torch.full((), float(end_value), dtype=torch.float64, device=count.device)
        frac = (_t(count) / n).clamp(0.0, 1.0)
        return init_value + (end_value - init_value) * frac

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear from ``init_value`` at count 0 to ``peak_value`` at ``warmup_steps``, then constant."""
    return linear_schedule(init_value, peak_value, warmup_steps)


def linear_decay(init_value: float, decay_steps: int, end_value: float = 0.0) -> Schedule:
    """Linear from ``init_value`` at count 0 to ``end_value`` at ``decay_steps``, then constant."""
    return linear_schedule(init_value, end_value, decay_steps)


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Half a cosine from ``init_value`` (count 0) to ``alpha * init_value`` (``decay_steps``),
    then constant at ``alpha * init_value``."""
    n = _nonneg_int("decay_steps", decay_steps)

    def schedule(count):
        if n == 0:
            return torch.full((), init_value * alpha, dtype=torch.float64, device=count.device)
        frac = (_t(count) / n).clamp(0.0, 1.0)
        cosine = 0.5 * (1 + torch.cos(math.pi * frac))
        return init_value * ((1 - alpha) * cosine + alpha)

    return schedule


def inverse_sqrt(peak_value: float, warmup_steps: int) -> Schedule:
    """Linear warmup to ``peak_value`` over ``warmup_steps``, then ``peak * sqrt(warmup / count)``
    (the original Transformer schedule). ``warmup_steps`` must be >= 1."""
    w = _nonneg_int("warmup_steps", warmup_steps)
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
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join: {len(schedules)} schedules need {len(schedules) - 1} boundaries, "
            f"got {len(boundaries)}."
        )
    bounds = [_nonneg_int("boundaries[i]", b) for b in boundaries]
    if any(b2 < b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"join: boundaries must be increasing, got {list(boundaries)}.")

    def schedule(count):
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
    w = _nonneg_int("warmup_steps", warmup_steps)
    total = _nonneg_int("decay_steps", decay_steps)
    if total < w:
        raise ValueError(
            f"warmup_cosine: decay_steps ({total}) is the total length and must be >= "
            f"warmup_steps ({w})."
        )
    alpha = end_value / peak_value if peak_value else 0.0
    return join(
        [linear_warmup(peak_value, w, init_value), cosine_decay(peak_value, total - w, alpha)],
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
    w = _nonneg_int("warmup_steps", warmup_steps)
    s = _nonneg_int("stable_steps", stable_steps)
    d = _nonneg_int("decay_steps", decay_steps)
    return join(
        [
            linear_warmup(peak_value, w, init_value),
            constant(peak_value),
            linear_decay(peak_value, d, end_value),
        ],
        [w, w + s],
    )
