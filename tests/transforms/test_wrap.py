"""ft.wrap (ftrain.transforms.wrap): a user's function around the whole step composes with the
built-ins, runs once per step, and its init adds state."""

import pytest
import torch

import ftrain as ft
from ftrain.testing import assert_steps_close, max_rel_error

from _tiny import UNEVEN, gpt_step, lm_batch


def param_norm(step):
    """A user transform: report the norm of the updated params; count its calls."""
    calls = []

    def wrapper(inner):
        def new_step(state, batch):
            calls.append(1)
            state, metrics = inner(state, batch)
            norm = torch.linalg.vector_norm(
                torch.stack([p.norm() for p in ft.tree.leaves(state.params)])
            )
            return state, {**metrics, "param_norm": norm}

        return new_step

    return ft.wrap(step, wrapper, name="param_norm"), calls


def test_user_transform_stays_composable():
    _, step, state = gpt_step(dropout=0.1)
    batch = lm_batch(16, lengths=UNEVEN)
    mine, calls = param_norm(step)
    composed = ft.checkpoint(ft.accumulate(mine, 4))
    assert composed.names == ("param_norm", "accumulate", "checkpoint")
    reference = ft.checkpoint(ft.accumulate(step, 4))
    assert_steps_close(composed, reference, state, batch, steps=2, rtol=1e-6)
    assert len(calls) == 2  # once per step, not once per micro-batch
    new, metrics = composed(state, batch)
    expected = torch.linalg.vector_norm(
        torch.cat([p.flatten() for p in ft.tree.leaves(new.params)])
    )
    assert max_rel_error(metrics["param_norm"], expected) < 1e-5


def test_wrap_init_adds_state_that_the_wrapper_keeps():
    """A step counter of the wrapper's own in state.extra, created when missing."""
    _, step, state = gpt_step()

    def init(state):
        if "seen" in state.extra.keys():
            return state
        extra = state.extra.clone(recurse=False)
        extra["seen"] = torch.zeros((), dtype=torch.int64)
        return state.replace(extra=extra)

    def counting(inner):
        def new_step(state, batch):
            new, metrics = inner(state, batch)
            extra = new.extra.clone(recurse=False)
            extra["seen"] = state.extra["seen"] + 1
            return new.replace(extra=extra), metrics

        return new_step

    counted = ft.wrap(step, counting, name="count", init=init)
    assert counted.names == ("count",)
    assert int(counted.init_extra(state).extra["seen"]) == 0
    s = state
    for i in range(3):
        s, _ = counted(s, lm_batch(4, seed=i))
    assert int(s.extra["seen"]) == 3 and "seen" not in state.extra.keys()


def test_wrap_arguments_are_checked():
    _, step, _ = gpt_step()
    with pytest.raises(TypeError, match=r"wrapper must be callable as wrapper\(inner\)"):
        ft.wrap(step, "log")
    with pytest.raises(TypeError, match=r"init must be callable as init\(state\)"):
        ft.wrap(step, lambda fn: fn, init=0)
