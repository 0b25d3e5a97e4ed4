"""``torch.compile`` of the whole step, optimizer update included."""

from __future__ import annotations

from typing import Any

import torch

from ftrain.dynamo import tracing_autograd
from ftrain.step import Step, StepFn, Transform
from ftrain.step.transform import INNER_HOOKS

__all__ = ["Compile", "compile"]


class Compile(Transform):
    """The ``wrap`` hook: ``torch.compile`` of everything applied before; see :func:`compile`."""

    name = "compile"

    def __init__(self, **torch_compile_kwargs: Any):
        self.kwargs = dict(torch_compile_kwargs)

    def check(self, inner, outer) -> None:
        if any(isinstance(t, Compile) for t in (*inner, *outer)):
            raise ValueError(
                "ft.compile was applied twice; the step is already compiled. Apply it once, last."
            )
        for t in (*inner, *outer):
            reason = t.compile_refusal()
            if reason is not None:
                raise ValueError(f"ft.compile cannot compile a step with ft.{t.name}: {reason}")
        for t in outer:
            acting = [h for h in INNER_HOOKS if t.uses(h)]
            if acting:
                raise ValueError(
                    f"ft.{t.name} was applied after ft.compile; compile must come last: "
                    f"ft.compile(ft.{t.name}(step)). The compiled function would not see what it "
                    f"changes ({', '.join(acting)})."
                )

    def wrap(self, fn: StepFn) -> StepFn:
        return _tracing_autograd(torch.compile(fn, **self.kwargs))

    def __repr__(self) -> str:
        return f"Compile({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


def _tracing_autograd(fn: StepFn) -> StepFn:
    """``fn`` called with dynamo tracing ``torch.autograd.grad`` into the graph instead of breaking
    the graph at it. The setting is read while dynamo traces (first call, recompiles), so it is set
    around every call and restored after; other compiled code in the process is left as it was."""

    def compiled_step(state, batch):
        with tracing_autograd():
            return fn(state, batch)

    return compiled_step


def compile(step: Step, **torch_compile_kwargs) -> Step:  # noqa: A001 - mirrors torch.compile
    """Compile the step's phases (forward, backward, reduction, optimizer update) with
    ``torch.compile(**torch_compile_kwargs)``, as one graph.

    The gradient is ``torch.autograd.grad`` inside the step; dynamo traces it (its
    ``trace_autograd_ops`` setting, switched on for the compiled calls only), so forward, backward
    and update are one graph that inductor fuses across: the optimizer's pointwise math lands in
    the kernels that produce the gradients. ``ft.checkpoint`` compiles into the same graph (its
    blocks become checkpointed regions that AOT autograd recomputes in backward).

    The seeding from ``state.rng``, the ``around_step`` contexts and the ``wrap`` hooks of
    transforms applied *after* compile run eagerly around the compiled function. Learning rates and
    other changing hyper-parameters are tensors computed inside, so a schedule never triggers a
    recompile. A transform that acts inside the step (any hook but ``wrap``, ``init``,
    ``around_step`` and ``check``) applied after compile is refused, and so is compiling twice or
    compiling a transform that dynamo cannot trace (``ft.shard(step, "fsdp")``).

    **Invariant:** the same result as the eager step within floating-point tolerance; one graph
    (``ftrain.testing.assert_one_graph``); no recompiles across steps once the first call has
    compiled (``ftrain.testing.assert_no_recompile``).
    """
    return Compile(**torch_compile_kwargs)(step)
