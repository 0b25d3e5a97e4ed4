"""``torch.compile`` of the whole step, optimizer update included."""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any

import torch

from ftrain.dynamo import refused_rematerialization, tracing_autograd
from ftrain.step import Step, StepFn, Transform

__all__ = ["Compile", "compile"]


class Compile(Transform):
    """The ``wrap`` hook: ``torch.compile`` of the step's function; see :func:`compile`.
    Immutable: its ``torch.compile`` options are a read-only mapping."""

    name = "compile"

    def __init__(self, **torch_compile_kwargs: Any):
        object.__setattr__(self, "options", MappingProxyType(dict(torch_compile_kwargs)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ft.compile's transform is immutable; build a new one ({name}).")

    def check(self, inner, outer) -> None:
        if any(isinstance(t, Compile) for t in (*inner, *outer)):
            raise ValueError(
                "ft.compile was applied twice; the step is already compiled. Apply it once, last."
            )
        for t in (*inner, *outer):
            reason = t.compile_refusal()
            if reason is not None:
                raise ValueError(f"ft.compile cannot compile a step with ft.{t.name}: {reason}")

    def wrap(self, fn: StepFn) -> StepFn:
        return _CompiledStep(torch.compile(fn, **self.options))

    def __repr__(self) -> str:
        return f"Compile({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


class _CompiledStep:
    """``torch.compile`` of the step function, called with dynamo tracing ``torch.autograd.grad``
    into the graph (scoped to each call: the setting is read while dynamo traces).

    Where the compiler refuses to recompute checkpointed blocks inside that one graph (see
    ``ftrain.dynamo.refused_rematerialization``), the backward is compiled apart instead: dynamo
    then hands the forward to AOT autograd, whose joint graph recomputes the blocks with their
    random numbers, and the update is a graph of its own. That is decided on the first call (the
    compile is refused before anything runs, so nothing was changed) and said once.
    """

    def __init__(self, fn: StepFn):
        self.fn = fn
        self.backward_apart = False

    def __call__(self, state, batch):
        if not self.backward_apart:
            try:
                with tracing_autograd():
                    return self.fn(state, batch)
            except Exception as e:
                if not refused_rematerialization(e):
                    raise
                self.backward_apart = True
                warnings.warn(
                    "ft.compile: the compiler cannot recompute the checkpointed blocks inside one "
                    "graph of forward, backward and update (they draw random numbers, e.g. "
                    "dropout or scaled_dot_product_attention, or several micro-batches recompute); "
                    "compiling the backward apart instead (same results, same memory).",
                    stacklevel=3,
                )
        return self.fn(state, batch)


def compile(step: Step, **torch_compile_kwargs) -> Step:  # noqa: A001 - mirrors torch.compile
    """Compile the step's phases (forward, backward, reduction, optimizer update) with
    ``torch.compile(**torch_compile_kwargs)``, as one graph.

    The gradient is ``torch.autograd.grad`` inside the step; dynamo traces it (its
    ``trace_autograd_ops`` setting, switched on for the compiled calls only), so forward, backward
    and update are one graph that inductor fuses across: the optimizer's pointwise math lands in
    the kernels that produce the gradients. Dynamo captures ``ft.checkpoint``'s blocks in that
    graph too, as checkpointed regions. torch 2.13's compiler recomputes such regions inside a
    graph that holds the backward only when they draw no random numbers (no dropout, and no
    ``scaled_dot_product_attention``, whose kernels are tagged as random even at dropout 0) and
    only one backward recomputes (no ``ft.accumulate``); otherwise the backward is compiled apart
    (AOT autograd's joint graph, which handles both), with the same results and memory, and a
    warning says so once.

    What is compiled does not depend on where compile sits among the transforms: every hook that
    acts inside the step (split, forward contexts, model rewrites, the engine, loss scaling, the
    reduction, the gradients, the optimizer) is compiled, whichever transform it comes from and
    whenever it was applied. Only the set-up runs eagerly around the compiled function: seeding
    from ``state.rng``, the ``init`` and ``around_step`` hooks, and the ``wrap`` hooks of
    transforms applied *after* compile (those applied before are compiled with the step; ``ft.vmap``
    is always compiled: its ``wrap_order`` puts it innermost).
    Learning rates and other changing hyper-parameters are tensors computed inside, so a schedule
    never triggers a recompile. Compiling twice is refused, and so is compiling a step with a
    transform that dynamo cannot trace (``ft.shard(step, "fsdp")``), in either order.

    **Invariant:** the same result as the eager step within floating-point tolerance; one graph
    (``ftrain.testing.assert_one_graph``); no recompiles across steps once the first call has
    compiled (``ftrain.testing.assert_no_recompile``).
    """
    return Compile(**torch_compile_kwargs)(step)
