"""The model a tensor-parallel forward runs: a copy that computes on this process's pieces.

Under ``ft.tensor_parallel`` the params are DTensors (``ftrain.distributed.tensor_parallel.mesh``).
The forward does not run DTensor ops (CPU attention has no DTensor rule, and every op would pay its
dispatch): :func:`tp_copy` returns a copy of the model
(``ftrain.internals.blocks.replace_forwards``; the user's module is never modified) in which

* the root, for the extent of the call, puts each parameter's local piece (``to_local``, which
  carries the gradient back to the DTensor) where the module keeps it, so every module's own code
  runs on plain tensors;
* each linear layer a plan names runs column- or row-parallel (``Colwise``: the pair's ``enter``
  collective, then this process's output features; ``Rowwise``: this process's share of the
  input features, the pair's ``exit`` collective, then the bias once);
* each module a ``Divide`` names runs as a copy whose attributes (head counts) are divided.

Parameters no pattern names (embeddings, norms) are whole on every process, and so is every
activation outside the pairs: their gradients come out equal on every process, each the whole
gradient (nothing to sum across the ``tp`` group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ftrain.distributed.data_parallel.dp_split import split_over_dp
from ftrain.distributed.dtensor import is_dtensor
from ftrain.distributed.tensor_parallel.linear import PairCollectives
from ftrain.distributed.tensor_parallel.plans import (
    Colwise,
    Divide,
    Rowwise,
    is_conv1d,
    match_plan,
    resolve_divisions,
)
from ftrain.internals.blocks import MakeForward, replace_forwards
from ftrain.internals.module_tables import copy_module, param_slots

__all__ = ["tp_copy"]


def _matmul(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``module``'s product with its current (local) weight, plus ``bias`` if given."""
    w = module.weight
    if is_conv1d(module):  # weight (in, out_local)
        out = x.reshape(-1, x.shape[-1]) @ w  # (N, out_local)
        out = out.view(*x.shape[:-1], w.shape[1])
        return out if bias is None else out + bias
    return F.linear(x, w, bias)


def _colwise(io: PairCollectives):
    def make(current: nn.Module):
        def forward(x):
            if io.colwise is not None:  # the collective and the product in one (saves x only)
                w = current.weight
                return io.colwise(x, w.t() if is_conv1d(current) else w, current.bias)
            return _matmul(current, io.enter(x), current.bias)

        return forward

    return make


def _rowwise(io: PairCollectives):
    def make(current: nn.Module):
        def forward(x):
            out = io.exit(_matmul(current, x, None))  # partial sums -> the layer's output
            return out if current.bias is None else out + current.bias  # bias added once

        return forward

    return make


def _divided(values: dict):
    def make(current: nn.Module):
        local = copy_module(current)  # our copy: its own attribute values, shared tables
        local.__dict__.update(values)

        def forward(*args, **kwargs):
            return local(*args, **kwargs)

        return forward

    return make


@contextlib.contextmanager
def _local_pieces(slots: list[tuple[dict, str]]) -> Iterator[None]:
    current = [table[name] for table, name in slots]
    for (table, name), t in zip(slots, current):
        # one split over dp too (fsdp) is left to fsdp's gather, which runs when its block does
        if is_dtensor(t) and not split_over_dp(t):
            table[name] = t.to_local()  # a view; its backward gives the DTensor's gradient
    try:
        yield
    finally:
        for (table, name), t in zip(slots, current):
            table[name] = t


def _localizing(slots: list[tuple[dict, str]]):
    def make(current: nn.Module):
        def forward(*args, **kwargs):
            with _local_pieces(slots):
                return current(*args, **kwargs)

        return forward

    return make


def tp_copy(
    module: nn.Module,
    plan: Mapping[str, object],
    tp: int,
    io: PairCollectives | Callable[[str], PairCollectives],
    more: Sequence[tuple[nn.Module, MakeForward]] = (),
) -> nn.Module:
    """A copy of ``module`` that runs tensor-parallel over ``tp`` processes as ``plan`` says,
    with ``io`` around each column/row pair (see the module docstring; or ``io(path)`` for the
    linear at module ``path``), and the forwards of ``more`` replaced too (sequence parallelism's
    split and gather). Same parameter tables as ``module``; ``module`` itself is not modified."""
    modules = dict(module.named_modules())
    divisions = resolve_divisions(module, plan, tp)
    replacements = []
    for name, style in match_plan(module, plan):
        if isinstance(style, Divide):
            replacements.append((modules[name], _divided(divisions[name])))
        elif isinstance(style, (Colwise, Rowwise)):
            pair = io if isinstance(io, PairCollectives) else io(name)
            make = _colwise(pair) if isinstance(style, Colwise) else _rowwise(pair)
            replacements.append((modules[name], make))
    replacements.extend(more)
    replacements.append((module, _localizing(param_slots(module.modules()))))
    return replace_forwards(module, replacements)
