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
    """

    def __init__(self, reduced_in_backward: bool = False):
        self.reduced_in_backward = reduced_in_backward

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
        for piece in pieces:
            plan = BackwardPlan()
            with _PLAN.using(plan):
                loss, low_mean = forward(p_in, piece)
            # a loss scale forces it; a low-precision mean only where gradients stay local
            plan.reweight = scale is not None or (low_mean and not self.reduced_in_backward)
            if plan.reweight:
                n = nonzero(loss.count.detach().to(torch.float32))
                factor = 1.0 / n if scale is None else scale / n
                g = torch.autograd.grad(loss.total * factor, leaves, allow_unused=True)
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
                grads = [gi if gi is not None else torch.zeros_like(p) for gi, p in zip(g, leaves)]
                owned = fresh
            elif not owned:  # the first micro-batch's are autograd's: add out of place, once
                pairs = [(a, b) for a, b in zip(grads, g) if b is not None]
                with _kernels(g):
                    summed = iter(foreach.add([a for a, _ in pairs], [b for _, b in pairs]))
                grads = [a.clone() if b is None else next(summed) for a, b in zip(grads, g)]
                owned = True
            else:
                present = [(a, b) for a, b in zip(grads, g) if b is not None]
                with _kernels(g):
                    foreach.add_([a for a, _ in present], [b for _, b in present])
            t, c = loss.total.detach().float(), loss.count.detach()
            total, count = (t, c) if total is None else (total + t, count + c)
            add_aux(aux, loss.aux, len(pieces))
        return Grads(grads, total, count, aux, owned)

    def __repr__(self) -> str:
        if self.reduced_in_backward:
            return "AutogradEngine(reduced_in_backward=True)"
        return "AutogradEngine()"
