"""An exponential moving average of the params, kept in the state: a user-style transform.

Written with ``ft.wrap`` exactly as a user would write their own transform.
"""

from __future__ import annotations

import torch

from ftrain import tree
from ftrain.step import Step, wrap
from ftrain.transforms._common import check_step

__all__ = ["ema"]


def ema(step: Step, decay: float = 0.999) -> Step:
    """Keep ``state.extra["ema"] = decay * ema + (1 - decay) * params`` after every step.

    The average starts as a copy of the params on the first call and is saved with the state.
    Use it for evaluation: ``ft.apply(model, state.extra["ema"], x)``.

    **Invariant:** after n steps, ``ema == decay**n * p0 + sum_i (1-decay) decay**(n-i) p_i``; the
    params and metrics are those of ``step``.
    """
    step = check_step(step, "ema")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ft.ema(decay={decay!r}): must be in [0, 1).")

    def init(state):
        if "ema" in state.extra.keys():
            return state
        extra = state.extra.clone(recurse=False)
        extra["ema"] = state.params.clone()
        return state.replace(extra=extra)

    def wrapper(inner):
        def ema_step(state, batch):
            new_state, metrics = inner(state, batch)
            avg = tree.leaves(state.extra["ema"])
            new_avg = torch._foreach_lerp(avg, tree.leaves(new_state.params), 1.0 - decay)
            extra = new_state.extra.clone(recurse=False)
            extra["ema"] = tree.unflatten(state.extra["ema"], new_avg)
            return new_state.replace(extra=extra), metrics

        return ema_step

    return wrap(step, wrapper, name="ema", init=init)
