"""``torch.compile`` of the whole step, optimizer update included."""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any

import torch

from ftrain import tree
from ftrain.internals import foreach
from ftrain.internals.dynamo import (
    refused_rematerialization,
    traces_whole_steps,
    tracing_autograd,
)
from ftrain.step import Grads, Step, StepFn, Transform
from ftrain.step.capabilities import COMPILES
from ftrain.step.engine import add_aux

__all__ = ["Compile", "compile"]


class Compile(Transform):
    """The ``wrap`` hook at the ``"compile"`` stage: ``torch.compile`` of the step's function
    (under ``ft.accumulate``, of one micro-batch and of the update); see :func:`compile`. Immutable: its ``torch.compile``
    options are a read-only mapping."""

    name = "compile"

    def __init__(self, **torch_compile_kwargs: Any):
        object.__setattr__(self, "options", MappingProxyType(dict(torch_compile_kwargs)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ft.compile's transform is immutable; build a new one ({name}).")

    def capabilities(self):
        return {COMPILES: ""}

    def wrap(self, fn: StepFn, stage: str) -> StepFn:
        if stage != "compile":
            return fn
        step = _bare_core(fn)
        if step is not None and step.piecewise:
            return _LoopedStep(step, self.options)
        return _CompiledStep(torch.compile(fn, **self.options))

    def __repr__(self) -> str:
        return f"Compile({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


class _CompiledStep:
    """A ``torch.compile``d function, called with dynamo tracing ``torch.autograd.grad`` into the
    graph (scoped to each call: the setting is read while dynamo traces).

    Where the compiler refuses to recompute checkpointed blocks inside that one graph (see
    ``ftrain.internals.dynamo.refused_rematerialization``), the backward is compiled apart instead:
    dynamo then hands the forward to AOT autograd, whose joint graph recomputes the blocks with
    their random numbers, and the rest is a graph of its own. That is decided on the first call (the
    compile is refused before anything runs, so nothing was changed) and said once.

    Where dynamo cannot capture the step as one graph at all (torch 2.11 breaks it at the leaf
    copies' ``requires_grad_``: ``traces_whole_steps``), the backward is compiled apart from the
    start, silently: the fusion across forward and update is lost there anyway, and the graph
    after the break would hold forward and backward without AOT autograd's partition, keeping
    what eager autograd saves (on torch 2.11 inductor even computed the loss's value after the
    backward, holding the logits through it: 1.20x the peak of ``torch.compile`` on the model,
    which compiling apart matches; ``benchmarks/RESULTS.md``).
    """

    def __init__(self, fn, stacklevel: int = 3):
        self.fn = fn
        self.backward_apart: bool | None = None  # None: decided at the first call
        self.stacklevel = stacklevel  # the warning points at the user's call of the step

    def __call__(self, *args):
        if self.backward_apart is None:
            self.backward_apart = not traces_whole_steps()
        if not self.backward_apart:
            try:
                with tracing_autograd():
                    return self.fn(*args)
            except Exception as e:
                if not refused_rematerialization(e):
                    raise
                self.backward_apart = True
                warnings.warn(
                    "ft.compile: the compiler cannot recompute the checkpointed blocks inside one "
                    "graph of forward, backward and update (they draw random numbers, e.g. "
                    "dropout or scaled_dot_product_attention); compiling the backward apart "
                    "instead (same results, same memory).",
                    stacklevel=self.stacklevel,
                )
        return self.fn(*args)


def _bare_core(fn: StepFn) -> Step | None:
    """The step whose own :meth:`Step.core` ``fn`` is (no other ``wrap`` hook inside ft.compile),
    or None."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, Step) and getattr(fn, "__func__", None) is Step.core:
        return owner
    return None


class _LoopedStep:
    """A :attr:`~ftrain.Step.piecewise` step compiled as two functions: one micro-batch's
    forward and backward (added into the gradient buffers), called once per piece, and the rest
    (reduction, division, ``gradients`` hooks, optimizer update). Each is compiled once, so the
    compile does not grow with the number of micro-batches; the loop between them runs eagerly.
    """

    def __init__(self, step: Step, options):
        self.step = step
        self.piece = _CompiledStep(torch.compile(self._piece, **options), stacklevel=4)
        self.finish = torch.compile(step.finish, **options)

    def _piece(self, state, piece, scale, of: int, grads: list[torch.Tensor]):
        """One piece's forward and backward; its gradients added into ``grads`` in place."""
        g = self.step.backward(state, [piece], scale, of=of)
        foreach.add_(grads, g.grads)
        return g.total, g.count, g.aux

    def __call__(self, state, batch):
        pieces, scale = self.step.split(batch), self.step.loss_scale(state)
        grads = [torch.zeros_like(p) for p in tree.leaves(state.params)]
        total = count = None
        aux: dict[str, torch.Tensor] = {}
        for piece in pieces:
            t, c, piece_aux = self.piece(state, piece, scale, len(pieces), grads)
            total, count = (t, c) if total is None else (total + t, count + c)
            add_aux(aux, piece_aux, len(pieces))
        return self.finish(state, Grads(grads, total, count, aux, True), scale)


def compile(step: Step, **torch_compile_kwargs) -> Step:  # noqa: A001 - mirrors torch.compile
    """Compile the step's phases (forward, backward, reduction, optimizer update) with
    ``torch.compile(**torch_compile_kwargs)``: as one graph, or under ``ft.accumulate`` as one
    micro-batch graph, looped, and one update graph.

    The gradient is ``torch.autograd.grad`` inside the step; dynamo traces it (its
    ``trace_autograd_ops`` setting, switched on for the compiled calls only), so forward, backward
    and update are one graph that inductor fuses across: the optimizer's pointwise math lands in
    the kernels that produce the gradients. (torch 2.11's dynamo breaks the graph at the
    ``requires_grad_`` that makes the leaf copies: there the step compiles as several graphs,
    with the same results and no fusion across them, the backward apart from the forward as
    ``torch.compile`` of a module compiles it, with its memory;
    ``ftrain.internals.dynamo.traces_whole_steps`` says which.) Dynamo captures
    ``ft.checkpoint``'s blocks in that graph too, as checkpointed regions. torch 2.13's compiler
    recomputes such regions inside a graph that holds the backward only when they draw no
    random numbers (no dropout, and no
    ``scaled_dot_product_attention``, whose kernels are tagged as random even at dropout 0);
    otherwise the backward is compiled apart (AOT autograd's joint graph), with the same results
    and memory, and a warning says so once.

    **Micro-batches.** A step that splits its batch (``ft.accumulate``) is compiled as two
    functions, each compiled once whatever the number of micro-batches k: one micro-batch's
    forward and backward, which adds its gradients into the step's buffers (in place), called
    for each piece in a plain Python loop; and the rest (the reduction, the one division by the
    count, the ``gradients`` hooks and the optimizer update). So the compile time does not grow
    with k (unrolling k micro-batches into one graph made it grow about linearly), and each
    micro-batch graph holds one backward, which the compiler can recompute checkpointed blocks
    in. Uneven splits (``torch.tensor_split``: 10 rows in 4 are 3, 3, 2, 2) compile the
    micro-batch once more on the first call, where dynamo meets the second shape and makes the
    batch dimension dynamic; later steps with the same batch shape recompile nothing. The price
    is per call: each compiled call checks dynamo's guards on its inputs (about 0.5 ms on a
    2-core CPU), k + 1 times a step instead of once (a step 1.22x the one graph's at k = 8 for a
    GPT whose micro-batch takes 3 ms: ``benchmarks/RESULTS.md``; less as micro-batches grow).
    The step is kept as one graph, and compile time grows with k as before, where it cannot be
    split so: a ``wrap`` at the ``"traced"`` stage (``ft.vmap``, ``ft.wrap(..., stage="traced")``)
    wraps the function ft.compile is given, which then hides the loop, and a transform that
    declares ``REPLACES_ENGINE`` (``ft.dp_sgd``'s clipped sum, ``ft.vmap``'s) may look at all
    pieces at once.

    What is compiled does not depend on where compile sits among the transforms: every hook that
    acts inside the step (split, the forward hooks, the engine, loss scaling, the reduction, the
    gradients, the optimizer) and every ``wrap`` at the ``"traced"`` stage (``ft.vmap``) is
    compiled, whichever transform it comes from and whenever it was applied. Only the set-up runs
    eagerly around the compiled function: seeding from ``state.rng``, the ``init`` hooks, the
    ``wrap`` hooks at the ``"eager"`` stage (``ft.ema``, ``ft.shard``'s seeding, TF32), and the
    micro-batch loop itself (the split, the read of the loss scale, the 0-d sums of loss totals,
    counts and aux metrics). ``step.explain()`` marks each hook eager or compiled.
    Learning rates and other changing hyper-parameters are tensors computed inside, so a schedule
    never triggers a recompile. Compiling twice is refused, and so is compiling a step with a
    transform that dynamo cannot trace (``ft.shard(step, "fsdp")``), in either order.

    **Invariant:** the same result as the eager step within floating-point tolerance; one graph
    (``ftrain.testing.assert_one_graph``) for a step that does not split its batch, and for one
    that does, the same graphs whatever the number of micro-batches; no recompiles across steps
    once the first call has compiled (``ftrain.testing.assert_no_recompile``).
    """
    return Compile(**torch_compile_kwargs)(step)
