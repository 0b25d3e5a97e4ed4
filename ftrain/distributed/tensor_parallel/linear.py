"""Megatron's tensor-parallel linear layers on local pieces, with the two collectives they need.

Under a plan (``ftrain.distributed.tensor_parallel.plans``) each process of the ``tp`` group holds a
piece of the block matrices. A column-parallel linear takes the whole input and gives this process's
share of the output features; a row-parallel linear takes that share and gives a partial output that
the group sums. Two autograd functions carry the communication (Megatron's *f* and *g*):

* :func:`copy_to_tp`: identity forward, all-reduce of the gradient in backward (the input of a
  column-parallel layer reaches every process; its gradient is the sum of theirs).
* :func:`reduce_from_tp`: all-reduce forward, identity backward (the row-parallel partial sums).

So a column-then-row pair (attention's qkv and output projection, the MLP) costs one all-reduce
forward and one backward, and every activation between the pairs is whole on every process.

Which collectives enter and leave a pair is chosen in one place, :class:`PairCollectives`
(:func:`megatron` gives f and g): sequence parallelism swaps them for an all-gather over the
sequence on the way in and a reduce-scatter over it on the way out, and the linear layers
(``ftrain.distributed.tensor_parallel.model``) stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "PairCollectives",
    "megatron",
    "copy_to_tp",
    "reduce_from_tp",
    "colwise_linear",
    "rowwise_linear",
]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` unchanged; in backward its gradient is summed over ``group``."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group``; in backward the gradient passes unchanged."""
    return _ReduceFromTP.apply(x, group)


class PairCollectives(NamedTuple):
    """The communication around a column-then-row parallel pair, one function each way:
    ``enter(x)`` makes the input of a column-parallel layer (whole on every process afterwards),
    ``exit(y)`` turns a row-parallel layer's partial output into the layer's output (before its
    bias). Each is an autograd function whose backward is the other's dual.

    ``colwise(x, weight, bias)``, when given, is the whole column-parallel linear (``weight``
    ``(out / tp, in)``): ``F.linear(enter(x), weight, bias)`` in value and gradients, free to keep
    less for backward (sequence parallelism keeps ``x``'s slice, not the gathered input)."""

    enter: Callable[[torch.Tensor], torch.Tensor]
    exit: Callable[[torch.Tensor], torch.Tensor]
    colwise: Callable[..., torch.Tensor] | None = None


def megatron(group) -> PairCollectives:
    """Megatron's f and g over ``group``: identity in / all-reduce of the gradient, all-reduce
    out / identity gradient. Activations outside the pairs are whole on every process."""
    return PairCollectives(lambda x: copy_to_tp(x, group), lambda y: reduce_from_tp(y, group))


def colwise_linear(x, weight_piece, bias_piece, group) -> torch.Tensor:
    """Column-parallel linear: the whole input ``x`` times this process's rows of the weight
    (``(out / tp, in)``), giving its share of the output features."""
    return F.linear(copy_to_tp(x, group), weight_piece, bias_piece)


def rowwise_linear(x_piece, weight_piece, bias, group) -> torch.Tensor:
    """Row-parallel linear: this process's share of the input features times its columns of the
    weight (``(out, in / tp)``), summed over ``group``; the whole ``bias`` is added once, after."""
    out = reduce_from_tp(F.linear(x_piece, weight_piece), group)
    return out if bias is None else out + bias
