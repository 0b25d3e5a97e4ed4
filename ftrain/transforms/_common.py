"""Shared argument checks for transforms."""

from __future__ import annotations

from ftrain.step import Step


def check_step(step, transform: str) -> Step:
    """``step`` if it is an ftrain Step, else an error that says how to get one."""
    if isinstance(step, Step):
        return step
    hint = ""
    if callable(step):
        hint = (
            " A plain function cannot be transformed because its phases are hidden; build the step "
            "with ft.train_step(loss_fn, optimizer), apply ftrain's transforms, and add your own "
            "with ft.wrap(step, wrapper)."
        )
    raise TypeError(f"ft.{transform}(step): expected an ft.Step, got {type(step).__name__}.{hint}")


def already(step: Step, transform: str) -> bool:
    return transform in step.transforms
