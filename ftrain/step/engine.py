"""Gradient engines: how a step turns micro-batches into the gradient of their summed loss.

The default, :class:`AutogradEngine`, runs ``torch.autograd.grad`` over leaf copies of the params,
one backward per micro-batch, and adds the results into one buffer. Not ``torch.func.grad``: that
refuses saved-tensor hooks, which non-reentrant activation checkpointing uses. A transform swaps
in another engine with its ``engine`` hook (e.g. one built on ``torch.func`` for vmapped steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from tensordict import TensorDict
from torch._subclasses.fake_tensor import FakeTensor

from ftrain import tree
from ftrain.internals import foreach
from ftrain.internals.scoped import Scoped
from ftrain.losses import Loss

__all__ = [
    "Grads",
    "Forward",
    "GradEngine",
    "AutogradEngine",
    "GradientSink",
    "GradientReducer",
    "BackwardPlan",
    "backward_plan",
    "nonzero",
    "add_aux",
    "exclusive",
]

# The step's forward: the loss of one micro-batch, and whether the loss function returned a
# bf16/fp16 scalar mean (see AutogradEngine).
Forward = Callable[[TensorDict, Any], tuple[Loss, bool]]


class Grads(NamedTuple):
    """What an engine returns."""

    grads: list[torch.Tensor]  # of the summed loss totals (times the scale), params' leaf order
    total: torch.Tensor  # fp32 sum of the micro-batches' loss totals (detached)
    count: torch.Tensor  # sum of their counts (detached)
    aux: dict[str, torch.Tensor]  # aux metrics averaged over micro-batches, with equal weight
    owned: bool  # fresh buffers the step may overwrite; else autograd's own (they may alias)


class GradEngine(Protocol):
    """``engine(forward, params, pieces, scale) -> Grads``: run ``forward(params, piece)`` for
    each piece and differentiate the summed ``Loss.total`` with respect to ``params`` (times
    ``scale`` when given, a 0-d tensor). A parameter the loss does not use gets a zero gradient.

    A transform that swaps in an engine of its own declares ``REPLACES_ENGINE``; one whose engine
    gives every row the same weight by design (DP-SGD's clipped sum) declares ``WEIGHS_ROWS``."""

    def __call__(
        self,
        forward: Forward,
        params: TensorDict,
        pieces: Sequence[Any],
        scale: torch.Tensor | None,
    ) -> Grads: ...


class GradientSink(Protocol):
    """Where :class:`AutogradEngine` hands each parameter's gradient of the step's whole summed
    loss as soon as the last micro-batch's backward has produced it, while backward goes on
    (``ft.offload`` copies it to the host there). The engine then returns :meth:`result`."""

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether it can take the gradients of ``params`` (the engine's leaves, each laid out
        as its gradient will be); where not, the engine does not use it for that backward."""

    def take(self, i: int, grad: torch.Tensor) -> None:
        """The final gradient of the ``i``-th param (the params' leaf order): the sum over every
        micro-batch, not yet divided by the count. Called once per param and step, possibly on
        autograd's worker thread; ``grad`` may be read only until this returns, or on the
        device's current stream (a copy issued there, or on a stream that waits for it)."""

    def result(self, n: int) -> list[torch.Tensor]:
        """The ``n`` gradients taken (one per param), in the params' leaf order, ready to be read
        (copies finished); called once backward has returned. The step reads them, never writes them, and only
        until the engine's next call (a sink may reuse its buffers then)."""


class GradientReducer(Protocol):
    """Where :class:`AutogradEngine` hands each parameter's final *local* gradient when a
    transform reduces the gradients across processes (``ft.shard``'s ddp/zero1/zero2 buckets): the
    reduction then runs during backward, and the engine returns the reduced gradients, in fresh
    buffers the step may overwrite, marked so that the transform's ``reduce`` hook knows (it
    reduces only what the engine did not)."""

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether it can reduce the gradients of ``params`` (the engine's leaves); where not,
        the engine does not use it for that backward, and the ``reduce`` hook reduces them."""

    def laid_out(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` laid out as their reduced gradients will be: what a sink after it (a
        :class:`GradientSink`) is asked whether it :meth:`~GradientSink.holds`."""

    def start(self, params: Sequence[torch.Tensor], then: GradientSink | None) -> GradientSink:
        """A sink for one backward over ``params``: it takes the final local gradients, reduces
        them, and hands each reduced one on to ``then`` (when given) during backward; its
        ``result`` is the reduced gradients (``then``'s result where given)."""


class BackwardPlan:
    """What the engine decided about one micro-batch's backward, for code that runs during it.

    ``reweight``: the engine backpropagates the micro-batch's mean and multiplies the gradients
    by its count afterwards (see :class:`AutogradEngine`); gradients reduced across processes
    *during* backward (fsdp's reduce-scatter) must then stay local, to be reduced after. Decided
    after the forward: read it during backward, from the object :func:`backward_plan` returned
    in the forward (backward may run on autograd's worker threads, which see no scoped value).
    """

    __slots__ = ("reweight",)

    def __init__(self) -> None:
        self.reweight = False


_PLAN: Scoped[BackwardPlan | None] = Scoped("ftrain.step.engine backward plan", None)


def backward_plan() -> BackwardPlan | None:
    """The :class:`BackwardPlan` of the micro-batch whose forward is running now (on this
    thread), or None outside an engine's forward."""
    return _PLAN.get()


def add_aux(aux: dict[str, torch.Tensor], piece: Mapping[str, torch.Tensor], pieces: int) -> None:
    """Add one micro-batch's aux metrics into ``aux``, each detached, in fp32 and divided by
    ``pieces``: what an engine returns is their mean over micro-batches, with equal weight."""
    for k, v in piece.items():
        v = v.detach().float() / pieces
        aux[k] = v if k not in aux else aux[k] + v


def nonzero(count: torch.Tensor) -> torch.Tensor:
    """``count``, or 1 where it is 0 (an empty batch); a fractional count (weights) is kept."""
    return torch.where(count != 0, count, torch.ones_like(count))


def exclusive(grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether every tensor of ``grads`` is a plain dense tensor alone in its memory: filling its
    whole storage (no broadcast, no slice of a bigger buffer), no storage shared with another
    gradient. Such gradients, fresh from ``torch.autograd.grad``, are the step's to overwrite (the
    division by the count in place: no second gradient-sized buffer). Fake tensors answer as real ones would (``ft.memory`` plans
    the same step). Under ``torch.compile`` (which plans buffers itself) and for wrapped tensors
    (vmap's, DTensors) the answer is False: the step then divides out of place."""
    if torch.compiler.is_compiling():
        return False
    seen = set()  # the storages' Python objects, one per storage while it lives
    for g in grads:
        if g is None:
            continue
        if type(g) not in (torch.Tensor, FakeTensor) or not g.is_contiguous():
            return False
        try:
            storage = g.untyped_storage()
        except (RuntimeError, NotImplementedError):  # functorch-wrapped: no storage of its own
            return False
        if storage.nbytes() != g.numel() * g.element_size() or id(storage) in seen:
            return False
        seen.add(id(storage))
    return True


def _kernels(grads: Sequence[torch.Tensor | None]) -> contextlib.AbstractContextManager:
    """Where the gradients are laid out across processes (DTensors), the multi-tensor kernels
    run per tensor (``foreach.looped``): torch 2.11's DTensor has no rule that keeps a
    ``Partial`` operand (fsdp's local gradients, left unreduced for reweighting) through a
    ``torch._foreach_*`` op; it all-reduces each one to ``Replicate`` (a hidden collective per
    tensor), which the step's reduction then sums a second time. Its per-tensor ``mul`` and
    ``add`` keep ``Partial``, as 2.13's multi-tensor ones do."""
    if any(hasattr(g, "placements") for g in grads):
        return foreach.looped()
    return contextlib.nullcontext()


class AutogradEngine:
    """``torch.autograd.grad`` of each micro-batch's loss over leaf copies of the params, summed.

    Usually each micro-batch's ``total`` is differentiated directly. Two cases backpropagate the
    micro-batch's *mean* instead and multiply the result by its count, so that the gradient
    entering the loss graph is O(1): with a loss ``scale`` (fp16), where ``total * scale`` would
    overflow fp16 for large counts; and when the loss function returned a bf16/fp16 scalar mean,
    where the count would be rounded on its way into the graph (257 rows is 256 in bf16: every
    gradient off by 256/257), unless the gradients are reduced across processes during backward
    (then the sum is backpropagated; ``reduced_in_backward``, which the step sets when a
    transform declares ``REDUCES_IN_BACKWARD``). Each micro-batch's :class:`BackwardPlan` says
    which.

    With a ``sink`` (:class:`GradientSink`, :meth:`handing_over`), each param's final gradient is
    handed to it during the last micro-batch's backward, as soon as autograd has added up every
    use of the param (a tensor hook on the leaf copy: it fires once per backward, with the sum):
    the earlier micro-batches' sum plus this one's, the same additions in the same order as
    without a sink. Autograd keeps a zero-stride placeholder in its place, so the gradient's
    memory is freed as soon as the sink is done with it, and the engine returns the sink's
    :meth:`~GradientSink.result`. A reweighted micro-batch's gradient is multiplied by its count
    as it is handed over (the multiplication the engine makes after backward otherwise, on the
    same values). Only where that is the step's final gradient: not when ``reduced_after`` (a
    transform reduces the gradients across processes after the engine, or splits the model over
    processes), nor while ``torch.compile`` traces, nor for fake params (``ft.memory``'s plan);
    there the sink is not used. With ``reduced_in_backward`` alone (``ft.shard``'s fsdp: each
    block's gradients reduce-scattered as its backward ends) the gradient autograd hands a leaf
    is this rank's reduced shard (a DTensor), final once handed: the sink gets it per block.

    With a ``reducer`` (:class:`GradientReducer`, :meth:`reducing`: ``ft.shard``'s ddp, zero1 and
    zero2, which reduce after backward) the same hook hands each final local gradient to the
    reducer instead, which reduces it across processes during backward; the engine returns the
    reduced gradients, and a ``sink`` given too gets them from the reducer (``ft.offload``'s
    copies then follow each bucket's reduction). Not while ``torch.compile`` traces, for fake
    params, or where the reducer does not hold the params (tensor-parallel DTensors): there the
    step's ``reduce`` hook reduces them after backward. Neither is used for a reweighted
    micro-batch under ``reduced_in_backward`` (fsdp keeps its gradients local, reduced after).
    """

    def __init__(
        self,
        reduced_in_backward: bool = False,
        reduced_after: bool = False,
        sink: GradientSink | None = None,
        reducer: GradientReducer | None = None,
    ):
        self.reduced_in_backward = reduced_in_backward
        self.reduced_after = reduced_after
        self.sink = sink
        self.reducer = reducer

    def handing_over(self, sink: GradientSink) -> AutogradEngine:
        """This engine with ``sink`` (see the class docstring). It is used where the engine's
        gradients are the step's final ones: not where the step reduces or sums gradients across
        processes after backward, unless a reducer reduces them in backward (given before or
        after the sink)."""
        return AutogradEngine(self.reduced_in_backward, self.reduced_after, sink, self.reducer)

    def reducing(self, reducer: GradientReducer) -> AutogradEngine:
        """This engine with ``reducer``: the gradients reduced across processes during the last
        backward (see the class docstring); a sink it has gets the reduced ones."""
        return AutogradEngine(self.reduced_in_backward, self.reduced_after, self.sink, reducer)

    def trusted(self, compiled: bool, reduced_first: bool) -> AutogradEngine:
        """This engine without the sink and reducer a step cannot trust it with: neither under
        ``ft.compile`` (``compiled``: a piecewise-compiled step calls the engine once per
        micro-batch, and a piece dynamo leaves eager would hand over each one as if it were
        the last; a rank falling back to eager alone would send buckets where the others send
        one flat reduction), nor a reducer whose transform's ``reduce`` hook does not run first
        (``reduced_first`` False: an earlier one, a transform of yours inside ``ft.shard``, would
        get the reduced gradients and hand back new ones, which would be reduced again)."""
        if compiled and (self.sink, self.reducer) != (None, None):
            return AutogradEngine(self.reduced_in_backward, self.reduced_after)
        if self.reducer is not None and not reduced_first:
            return AutogradEngine(self.reduced_in_backward, self.reduced_after, self.sink)
        return self

    def adds_sink_to(self, before: object) -> bool:
        """Whether this engine is ``before`` (an AutogradEngine) with a sink or a reducer added:
        the same gradients once the step's ``reduce`` hooks have run, so a transform that
        replaces the engine may drop them."""
        return (
            isinstance(before, AutogradEngine)
            and (self.reduced_in_backward, self.reduced_after)
            == (before.reduced_in_backward, before.reduced_after)
            and before.sink in (None, self.sink)
            and before.reducer in (None, self.reducer)
            and (self.sink, self.reducer) != (before.sink, before.reducer)
        )

    def _receiver(self, leaves: list[torch.Tensor]) -> tuple[GradientSink, bool] | None:
        """The sink the last backward hands the gradients over to, and whether what it returns
        is the step's to overwrite; None where the engine hands nothing over."""
        if (self.sink is None and self.reducer is None) or torch.compiler.is_compiling():
            return None
        if any(isinstance(t, FakeTensor) for t in leaves):  # ft.memory's plan: without them
            return None
        if self.reducer is not None and self.reducer.holds(leaves):
            then = self.sink
            if then is not None and not then.holds(self.reducer.laid_out(leaves)):
                then = None  # copied after the reduction, by the transform's own hook
            return self.reducer.start(leaves, then), then is None
        if self.sink is None or self.reduced_after:  # changed after backward: not final
            return None
        # DTensors only where reduced in backward
        if not self.reduced_in_backward and any(hasattr(t, "placements") for t in leaves):
            return None
        return (self.sink, False) if self.sink.holds(leaves) else None

    def __call__(
        self,
        forward: Forward,
        params: TensorDict,
        pieces: Sequence[Any],
        scale: torch.Tensor | None,
    ) -> Grads:
        values, tdef = tree.flatten(params)
        leaves = [p.detach().requires_grad_(True) for p in values]
        p_in = tdef.unflatten(leaves)
        grads: list[torch.Tensor] | None = None
        total = count = None
        owned = False
        aux: dict[str, torch.Tensor] = {}
        for k, piece in enumerate(pieces):
            plan = BackwardPlan()
            with _PLAN.using(plan):
                loss, low_mean = forward(p_in, piece)
            # a loss scale forces it; a low-precision mean only where gradients stay local
            plan.reweight = scale is not None or (low_mean and not self.reduced_in_backward)
            # fsdp leaves a reweighted micro-batch's gradients local: not final in backward
            last = k == len(pieces) - 1 and not (plan.reweight and self.reduced_in_backward)
            receiver = self._receiver(leaves) if last else None
            if receiver is not None:
                # the last backward: each final gradient handed over as autograd produces it
                target, n = _objective(loss, plan.reweight, scale)
                grads = _hand_over(receiver[0], target, n, leaves, grads)
                owned = receiver[1]
            else:
                grads, owned = _add_backward(loss, leaves, plan.reweight, scale, grads, owned)
            t, c = loss.total.detach().float(), loss.count.detach()
            total, count = (t, c) if total is None else (total + t, count + c)
            add_aux(aux, loss.aux, len(pieces))
        return Grads(grads, total, count, aux, owned)

    def __repr__(self) -> str:
        args = [f"{k}=True" for k in ("reduced_in_backward", "reduced_after") if getattr(self, k)]
        args += [f"{k}={getattr(self, k)!r}" for k in ("sink", "reducer") if getattr(self, k)]
        return f"AutogradEngine({', '.join(args)})"


def _add_backward(
    loss: Loss,
    leaves: list[torch.Tensor],
    reweight: bool,
    scale: torch.Tensor | None,
    grads: list[torch.Tensor] | None,
    owned: bool,
) -> tuple[list[torch.Tensor], bool]:
    """``grads`` (the earlier micro-batches' sum, None before the first) plus the gradient of
    ``loss.total`` (times ``scale``) with respect to ``leaves``; whether the result is the
    step's to overwrite. See :class:`AutogradEngine` for ``reweight``."""
    if reweight:
        target, n = _objective(loss, reweight, scale)
        g = torch.autograd.grad(target, leaves, allow_unused=True)
        # weight by the count, out of place: the gradient of the sum, in fresh buffers
        with _kernels(g):
            weighted = iter(foreach.mul([x for x in g if x is not None], n))
        g = [None if x is None else next(weighted) for x in g]
        fresh = True
    else:
        g = torch.autograd.grad(loss.total, leaves, allow_unused=True)
        # autograd's own may share memory ((a + b).sum() gives a and b one gradient
        # tensor) or be broadcast views: written in place only when none does
        fresh = exclusive(g)
    if grads is None:  # later micro-batches add into these
        return [gi if gi is not None else torch.zeros_like(p) for gi, p in zip(g, leaves)], fresh
    if not owned:  # the first micro-batch's are autograd's: add out of place, once
        pairs = [(a, b) for a, b in zip(grads, g) if b is not None]
        with _kernels(g):
            summed = iter(foreach.add([a for a, _ in pairs], [b for _, b in pairs]))
        return [a.clone() if b is None else next(summed) for a, b in zip(grads, g)], True
    present = [(a, b) for a, b in zip(grads, g) if b is not None]
    with _kernels(g):
        foreach.add_([a for a, _ in present], [b for _, b in present])
    return grads, True


def _objective(
    loss: Loss, reweight: bool, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What one micro-batch's backward differentiates, and the count its gradients are then
    multiplied by (None: the total itself, nothing to multiply). See :class:`AutogradEngine`."""
    if not reweight:
        return loss.total, None
    n = nonzero(loss.count.detach().to(torch.float32))
    factor = 1.0 / n if scale is None else scale / n
    return loss.total * factor, n


def _hand_over(
    sink: GradientSink,
    target: torch.Tensor,
    n: torch.Tensor | None,
    leaves: list[torch.Tensor],
    sums: list[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """The backward of ``target`` with each leaf's whole gradient (``sums[i]``, the earlier
    micro-batches', plus this backward's, times ``n`` where given) handed to ``sink`` as soon as
    autograd has it; a leaf the loss does not use hands over its sum so far (zeros without one)
    after the backward."""
    taken = [False] * len(leaves)

    def hook(i: int):
        def take(g: torch.Tensor) -> torch.Tensor:
            mine = g if n is None else g * n  # the engine's weighting by the count
            whole = mine if sums is None else sums[i] + mine  # the engine's add, elementwise
            if sums is not None:
                sums[i] = None  # dropped: the earlier sum is freed with this backward's
            sink.take(i, whole)
            taken[i] = True
            return _placeholder(g)  # what autograd keeps: no memory

        return take

    handles = [leaf.register_hook(hook(i)) for i, leaf in enumerate(leaves)]
    try:
        torch.autograd.grad(target, leaves, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for i, leaf in enumerate(leaves):
        if not taken[i]:
            sink.take(i, torch.zeros_like(leaf) if sums is None else sums[i])
    return sink.result(len(leaves))


def _placeholder(g: torch.Tensor) -> torch.Tensor:
    """A zero-stride zero tensor with ``g``'s metadata (a DTensor laid out as ``g``, over a
    zero-stride local tensor): what autograd may keep in place of a gradient handed over."""
    if not hasattr(g, "placements"):
        return g.new_zeros(()).expand(g.shape)
    mine = g.to_local()
    return type(g).from_local(
        mine.new_zeros(()).expand(mine.shape),
        g.device_mesh,
        g.placements,
        run_check=False,
        shape=g.shape,
        stride=g.stride(),
    )
