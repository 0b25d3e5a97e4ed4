"""Sequence parallelism inside ``ft.tensor_parallel``: the wiring of
``ftrain.distributed.tensor_parallel.sequence``.

Under ``ft.tensor_parallel(model, plan, mesh, sequence_parallel=True)`` the modules a plan marks
``SequenceParallel()`` (the *region*: the blocks) run on this process's slice of the sequence:

* entering the first module of the region, the hidden states (its first argument, ``(B, T, C)``)
  are split along ``T`` (:func:`~ftrain.distributed.tensor_parallel.sequence.split_sequence`;
  backward all-gathers their gradient, so the embeddings get the whole gradient on every process);
* each column/row pair inside is entered by an all-gather over the sequence and left by a
  reduce-scatter over it (:func:`sequence_pair`, what ``TensorParallel.collectives`` returns);
  the column-parallel linear keeps only the slice for backward (``colwise_linear_sp``);
* leaving the last module, the hidden states are gathered whole (``sum_grad=False``: everything
  after runs whole on every process, so each keeps its slice of an equal gradient).

The norms and residual adds between the pairs then hold ``1 / tp`` of the positions. Their
parameters (and the row-parallel biases, added after the reduce-scatter) are whole but see only
this process's positions: :func:`partial_params` names them and :class:`SumPartialGrads` sums
their gradients over the ``tp`` group after backward, one flat all-reduce per step.

Each ``nn.Dropout`` of the region draws its mask from a key (one draw from the step's random
stream, which the ``tp`` processes share) and each entry's global index along dim 1
(:func:`~ftrain.distributed.tensor_parallel.sequence.sequence_dropout` with this slice's offset):
between the pairs dim 1 is the sequence, so the processes' slices together carry the masks
``sequence_dropout`` gives the whole sequence on one process, none repeated. (A dropout inside a
pair on a tensor split by heads, ``(B, heads / tp, T, T)``, is indexed by global head the same way.)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftrain import tree
from ftrain.distributed.collectives import all_reduce_flat
from ftrain.distributed.dtensor import like, local
from ftrain.distributed.tensor_parallel.linear import PairCollectives
from ftrain.distributed.tensor_parallel.plans import SequenceParallel, Split
from ftrain.distributed.tensor_parallel.sequence import (
    colwise_linear_sp,
    gather_sequence,
    reduce_scatter_sequence,
    sequence_dropout,
    split_sequence,
)
from ftrain.internals.blocks import MakeForward
from ftrain.step.engine import Grads

__all__ = [
    "sequence_pair",
    "region",
    "in_region",
    "partial_params",
    "sequence_forwards",
    "SumPartialGrads",
]


def sequence_pair(group) -> PairCollectives:
    """The pair collectives of sequence parallelism over ``group``: all-gather the sequence (dim
    1) entering a column-parallel layer, reduce-scatter it leaving a row-parallel one; the
    column-parallel linear saves only the slice (``colwise_linear_sp``)."""
    return PairCollectives(
        lambda x: gather_sequence(x, group, 1),
        lambda y: reduce_scatter_sequence(y, group, 1),
        lambda x, w, b: colwise_linear_sp(x, w, b, group, 1),
    )


def region(model: nn.Module, plan: Mapping[str, object]) -> list[str]:
    """The paths of the modules ``plan`` marks ``SequenceParallel()``, outermost matches only
    (``"blocks.*"`` names ``blocks.0``, not ``blocks.0.attn``), in ``named_modules`` order.

    Raises ``ValueError`` when there is none, naming the fix."""
    patterns = [p for p, s in plan.items() if isinstance(s, SequenceParallel)]
    names = [
        n
        for n, _ in model.named_modules()
        if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)
    ]
    outer = _outermost(names)
    if not outer:
        raise ValueError(
            "ft.tensor_parallel(..., sequence_parallel=True): the plan marks no module "
            "SequenceParallel(), so nothing says where the sequence is split. Fix: add the "
            "blocks, e.g. plan['blocks.*'] = SequenceParallel() (gpt_plan() and hf_gpt2_plan() "
            "have it; hf_llama_plan() cannot: Llama's attention reshapes by its input's length), "
            "or sequence_parallel=False."
        )
    _check_consecutive(model, outer)
    return outer


def _check_consecutive(model: nn.Module, names: list[str]) -> None:
    """Refuse a region that skips a module: every module between its first and last (in
    ``named_modules`` order, the order ``region`` splits and gathers by) runs on slices, so one
    left out would see slices without its partial gradients summed or its dropout per position."""
    order = [n for n, _ in model.named_modules() if n]
    span = order[order.index(names[0]) : order.index(names[-1]) + 1]
    skipped = [n for n in span if not in_region(n, names)]
    outermost = _outermost(skipped)
    if outermost:
        raise ValueError(
            f"ft.tensor_parallel(..., sequence_parallel=True): the SequenceParallel() region "
            f"{names[0]!r} .. {names[-1]!r} skips {outermost[:4]}, which would run on sequence "
            "slices without their partial gradients summed. Fix: mark every module between the "
            "first and the last (e.g. 'blocks.*')."
        )


def _outermost(names: list[str]) -> list[str]:
    """``names`` without the paths inside another of them, in order."""
    return [n for n in names if not any(n.startswith(m + ".") for m in names)]


def in_region(path: str, names) -> bool:
    """Whether module ``path`` is one of the modules ``names`` or inside one."""
    return any(path == r or path.startswith(r + ".") for r in names)


def partial_params(
    model: nn.Module, names: list[str], splits: Mapping[str, Split]
) -> frozenset[str]:
    """The parameters under the modules ``names`` that are whole on every process (``splits``
    says ``Split(None)``): norms, row-parallel biases. Their gradients are partial sums."""
    out = set()
    for name in names:
        for sub, _ in dict(model.named_modules())[name].named_parameters():
            path = f"{name}.{sub}"
            if splits[path].dim is None:
                out.add(path)
    return frozenset(out)


def _ends(name: str, group, tp: int, split: bool, gather: bool) -> MakeForward:
    """The forward of a region's first module (``split``: its first argument split along the
    sequence) and/or last one (``gather``: its output, or the output's first element, gathered)."""

    def make(current: nn.Module):
        def forward(x, *args, **kwargs):
            if split:
                if x.dim() < 2 or x.shape[1] % tp:
                    up = -(-x.shape[1] // tp) * tp if x.dim() >= 2 else tp
                    raise ValueError(
                        f"ft.tensor_parallel(..., sequence_parallel=True): the hidden states "
                        f"entering {name!r} have shape {tuple(x.shape)}; their sequence "
                        f"dimension (dim 1, the batch's T) must divide by tp={tp}. Fix: pad or "
                        f"crop the batch's sequences to a multiple of {tp} (e.g. {up}), or "
                        "sequence_parallel=False."
                    )
                x = split_sequence(x, group, 1)  # (B, T / tp, C)
            out = current(x, *args, **kwargs)
            if not gather:
                return out
            if isinstance(out, tuple):  # (hidden states, extras): a GPT block's balance loss
                return (gather_sequence(out[0], group, 1, sum_grad=False), *out[1:])
            return gather_sequence(out, group, 1, sum_grad=False)  # (B, T, C)

        return forward

    return make


def _dropout(group) -> MakeForward:
    """An ``nn.Dropout`` on this process's slice along dim 1: masks per global index."""

    def make(current: nn.Module):
        def forward(x):
            if not current.training or current.p == 0 or x.dim() < 2:
                return current(x)
            # one draw from the step's stream: the same key on every tp process (they share the
            # stream) and again when activation checkpointing recomputes (it restores the stream)
            key = torch.randint(0, 2**62, (), device=x.device)
            offset = dist.get_rank(group) * x.shape[1]  # this slice's first global index
            return sequence_dropout(x, current.p, key, dim=1, offset=offset)

        return forward

    return make


def sequence_forwards(
    module: nn.Module, names: list[str], group, tp: int
) -> list[tuple[nn.Module, MakeForward]]:
    """The forwards to replace in ``module``'s tensor-parallel copy: split entering the first
    module of the region ``names``, gather leaving the last, and every ``nn.Dropout`` inside
    drawing its mask per global position (:func:`_dropout`)."""
    modules = dict(module.named_modules())
    drops = [
        (m, _dropout(group))
        for name in names
        for m in modules[name].modules()
        if isinstance(m, nn.Dropout)
    ]
    if len(names) == 1:
        return [*drops, (modules[names[0]], _ends(names[0], group, tp, True, True))]
    return [
        *drops,
        (modules[names[0]], _ends(names[0], group, tp, True, False)),
        (modules[names[-1]], _ends(names[-1], group, tp, False, True)),
    ]


class SumPartialGrads:
    """A gradient engine that runs ``inner`` and then sums over ``group``, in one flat
    all-reduce, the gradients of the params whose paths are in ``paths`` (DTensors: their local
    pieces). Every other gradient is ``inner``'s."""

    def __init__(self, inner: Any, paths: frozenset[str], group):
        self.inner, self.paths, self.group = inner, paths, group

    def __call__(self, forward, params, pieces, scale) -> Grads:
        out = self.inner(forward, params, pieces, scale)
        index = [i for i, p in enumerate(tree.paths(params)) if p in self.paths]
        if not index or dist.get_world_size(self.group) == 1:
            return out
        grads = list(out.grads)
        summed = all_reduce_flat([local(grads[i]) for i in index], self.group, in_place=False)
        for i, s in zip(index, summed):
            grads[i] = like(s, grads[i])
        return out._replace(grads=grads)
