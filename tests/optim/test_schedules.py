"""Every schedule at its corner points: count 0, end of warmup, middle, end, and past the end.

The expected values are written out by hand from each schedule's definition.
"""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import ftrain as ft
from ftrain.optim import schedules as S

PEAK = 1e-3


def at(schedule, *counts) -> list[float]:
    out = []
    for c in counts:
        v = schedule(torch.tensor(c, dtype=torch.int64))
        assert v.dim() == 0 and v.dtype == torch.float64  # a 0-d float64 tensor, never a float
        out.append(float(v))
    return out


def assert_values(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_constant():
    assert_values(at(S.constant(PEAK), 0, 1, 10**6), [PEAK, PEAK, PEAK])


def test_linear_warmup_and_decay():
    assert_values(
        at(S.linear_warmup(PEAK, 10), 0, 5, 10, 11, 1000), [0.0, PEAK / 2, PEAK, PEAK, PEAK]
    )
    assert_values(at(S.linear_warmup(PEAK, 4, init_value=1e-4), 0, 2, 4), [1e-4, 5.5e-4, PEAK])
    assert_values(
        at(S.linear_decay(PEAK, 10, end_value=1e-4), 0, 5, 10, 20), [PEAK, 5.5e-4, 1e-4, 1e-4]
    )
    assert_values(
        at(S.linear_schedule(1.0, 3.0, 0), 0, 7), [3.0, 3.0]
    )  # no transition: the end value


def test_cosine_decay():
    s = S.cosine_decay(PEAK, 100, alpha=0.1)
    quarter = 0.1 * PEAK + 0.9 * PEAK * 0.5 * (1 + math.cos(math.pi / 4))
    assert_values(at(s, 0, 25, 50, 100, 250), [PEAK, quarter, 0.55 * PEAK, 0.1 * PEAK, 0.1 * PEAK])


def test_inverse_sqrt():
    s = S.inverse_sqrt(PEAK, 16)
    assert_values(at(s, 0, 8, 16, 64, 1600), [0.0, PEAK / 2, PEAK, PEAK / 2, PEAK / 10])


def test_warmup_cosine():
    s = S.warmup_cosine(PEAK, warmup_steps=10, decay_steps=110, end_value=1e-5)
    mid = 1e-5 + (PEAK - 1e-5) * 0.5
    assert_values(at(s, 0, 5, 10, 60, 110, 500), [0.0, PEAK / 2, PEAK, mid, 1e-5, 1e-5])
    # a zero peak still ends at end_value (from zero, not from a ratio of it)
    assert_values(at(S.warmup_cosine(0.0, 0, 10, end_value=1e-4), 0, 10), [0.0, 1e-4])


def test_wsd():
    s = S.wsd(PEAK, warmup_steps=10, stable_steps=80, decay_steps=10, end_value=1e-5)
    assert_values(
        at(s, 0, 5, 10, 50, 90, 95, 100, 1000),
        [0.0, PEAK / 2, PEAK, PEAK, PEAK, (PEAK + 1e-5) / 2, 1e-5, 1e-5],
    )


def test_join_gives_each_piece_its_own_count():
    s = S.join([S.constant(1.0), S.linear_decay(1.0, 10), S.constant(0.5)], [5, 15])
    assert_values(at(s, 0, 4, 5, 10, 14, 15, 99), [1.0, 1.0, 1.0, 0.5, 0.1, 0.5, 0.5])


def test_python_int_counts_and_the_module_doctest():
    s = S.warmup_cosine(PEAK, 10, 20)
    assert float(s(10)) == float(s(torch.tensor(10)))
    assert doctest.testmod(S).failed == 0


def test_schedule_drives_the_learning_rate_metric():
    """``scale_by_learning_rate`` evaluates the schedule at 0, 1, 2, ... and the train step reports
    the value it used as ``metrics["lr"]``."""
    params = ft.params_of(torch.nn.Linear(2, 1))
    sched = S.linear_warmup(PEAK, 4)
    opt = ft.optim.sgd(sched)
    step = ft.train_step(lambda p, b: ft.apply(torch.nn.Linear(2, 1), p, b).pow(2).mean(), opt)
    state = ft.TrainState.create(params, opt)
    lrs = []
    for _ in range(6):
        state, metrics = step(state, torch.ones(3, 2))
        lrs.append(float(metrics["lr"]))
    assert lrs == pytest.approx([float(sched(torch.tensor(i))) for i in range(6)], rel=1e-6)


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: S.linear_warmup(PEAK, -1),
            r"linear_schedule: transition_steps must be an integer",
        ),
        (lambda: S.cosine_decay(PEAK, 10.5), r"cosine_decay: decay_steps must be an integer >= 0"),
        (lambda: S.inverse_sqrt(PEAK, 0), r"inverse_sqrt: warmup_steps must be >= 1"),
        (lambda: S.warmup_cosine(PEAK, 10, 5), r"decay_steps \(5\) is the total length"),
        (lambda: S.wsd(PEAK, 1, -2, 3), r"wsd: stable_steps must be an integer >= 0"),
        (lambda: S.join([S.constant(1.0)], [3]), r"join: 1 schedules need 0 boundaries, got 1"),
        (lambda: S.join([S.constant(1.0)] * 3, [5, 2]), r"boundaries must be increasing"),
        (lambda: S.join([1.0, 2.0], [3]), r"join: schedules must be a non-empty list of functions"),
        (lambda: S.constant("1e-3"), r"constant: value must be a number"),
    ],
)
def test_bad_arguments_are_refused_by_name(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()
