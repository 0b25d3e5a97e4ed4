"""``ft.shard`` as the planner runs it: one rank's allocations, without the other ranks.

The collectives of ``ft.shard`` need live processes, so the planner puts :class:`ShardLayout` in
its place: a transform with the same hooks (``optimizer``, ``reduce``) that allocates what this
rank's side of each collective allocates and nothing is sent. ZeRO lays rows out as
``torch.chunk`` does (``ftrain.distributed.dtensor``): :func:`rows` gives this rank's.

=========  ====================================================================================
ddp        ``reduce``: one flat copy of the gradients (the all-reduce buffer; its views are the
           reduced gradients).
zero1      as ddp; ``optimizer``: the update runs on this rank's rows of the gradients, params
           and optimizer state; the updates' rows are packed flat and gathered into one flat whole buffer, then
           copied out leaf by leaf.
zero2      ``reduce``: a flat whole copy (the reduce-scatter's input) and this rank's rows out;
           ``optimizer`` as zero1.
=========  ====================================================================================

``bucketed`` (:func:`reduces_in_buckets`: ``ft.shard``'s default ``bucket_mb``, gradients that
fill more than one bucket): the gradients are reduced during backward (``engine``), each copied
into its bucket's flat buffer as autograd
produces it and autograd's own freed then, so no second gradient-sized copy is alive at once and
``reduce`` sums only the loss total and count. ddp and zero1: the engine returns the buckets (the
same bytes as the gradients, the step's own: divided in place). zero2: the buckets (the
reduce-scatters' inputs) and this rank's rows out are alive as backward ends, then the engine
returns the rows only. A transient of one bucket is not counted.

``fsdp`` gathers each block's parameters inside the forward and the backward; no stand-in is
made for it: the planner runs the sharded step itself on fake shards
(:mod:`ftrain.memory.fake_fsdp`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ftrain import tree
from ftrain.distributed.data_parallel.buckets import bucket_bytes, overlaps
from ftrain.optim.base import GradientTransformation, accepts_inplace
from ftrain.step import AutogradEngine, Transform
from ftrain.step.capabilities import (
    COMBINES_ROWS,
    COMPILES,
    DATA_PARALLEL_OVER,
    REPLACES_ENGINE,
    SPLITS_MATRICES,
)

__all__ = ["ShardLayout", "reduces_in_buckets", "rows"]

# the real step reduces after backward under these (no hand-over hooks, reweighted or DTensors)
_AFTER_BACKWARD = (COMPILES, SPLITS_MATRICES, DATA_PARALLEL_OVER, REPLACES_ENGINE)


def reduces_in_buckets(transforms, shard, params) -> bool:
    """Whether ``shard`` (``ft.shard``'s transform: ddp, zero1, zero2) reduces the gradients of
    ``params`` in buckets during backward in a step of ``transforms``: not with ``bucket_mb``
    None, nor where they fill one bucket (``buckets.overlaps``), nor under ``ft.compile``,
    tensor/pipeline parallelism or an engine replaced (``vmap``, ``dp_sgd``): reduced after
    backward there."""
    caps = [t.capabilities() for t in transforms]
    if shard.bucket_mb is None or any(c in cs for c in _AFTER_BACKWARD for cs in caps):
        return False
    return overlaps(params, bucket_bytes(shard.bucket_mb), shard.strategy == "zero2")


def rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of this rank's rows of a dimension of ``n`` split as ``torch.chunk``
    splits it into ``world`` parts (the last parts may be shorter or empty)."""
    size = math.ceil(n / world) if n else 0
    start = min(rank * size, n)
    return start, max(0, min(size, n - start))


def local_shape(shape: torch.Size, world: int, rank: int) -> tuple[int, ...]:
    """The shape of this rank's ``Shard(0)`` piece of a tensor of ``shape`` (0-d: whole)."""
    if len(shape) == 0:
        return tuple(shape)
    return (rows(shape[0], world, rank)[1], *shape[1:])


def _narrow(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    if t.dim() == 0:
        return t
    start, length = rows(t.shape[0], world, rank)
    return t.narrow(0, start, length)


def _flat_views(tensors: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """One new flat buffer per dtype, cut into views of ``shapes`` (what a flat collective
    returns)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        sizes = [math.prod(shapes[i]) for i in idx]
        flat = tensors[idx[0]].new_empty(sum(sizes))
        for i, piece in zip(idx, flat.split(sizes)):
            out[i] = piece.view(shapes[i])
    return out  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, eq=False)
class ShardLayout(Transform):
    """The planning stand-in of ``ft.shard(step, strategy)`` for ``rank`` of ``world``."""

    strategy: str
    world: int
    rank: int
    bucketed: bool = False  # reduced in buckets during backward (module docstring)

    name = "shard"

    def __post_init__(self) -> None:
        if self.strategy not in ("ddp", "zero1", "zero2"):
            raise ValueError(
                f"ShardLayout({self.strategy!r}): the planner runs fsdp as it is, on fake shards."
            )

    def capabilities(self):
        return {COMBINES_ROWS: ""}

    def engine(self, engine):
        if not self.bucketed or not isinstance(engine, AutogradEngine):
            return engine
        return _InBackward(engine, self)

    def reduce(self, grads, sums):
        if self.bucketed:  # by the engine's buckets (_InBackward): only the loss sums here
            return grads, sums.clone()
        if self.strategy in ("ddp", "zero1"):
            *summed, total = _flat_views([*grads, sums], [*(tuple(g.shape) for g in grads), (2,)])
            return summed, total
        whole = [g.contiguous() for g in grads]
        flat_in = _flat_views(whole, [tuple(g.shape) for g in whole])  # the reduce-scatter input
        mine = _flat_views(whole, [local_shape(g.shape, self.world, self.rank) for g in whole])
        del flat_in
        return mine, sums.clone()

    def optimizer(self, optimizer: GradientTransformation) -> GradientTransformation:
        if self.strategy == "ddp":
            return optimizer
        world, rank = self.world, self.rank
        takes_inplace = accepts_inplace(optimizer.update)

        def update(updates, state, params=None, *, inplace=False):
            p = tree.leaves(params) if params is not None else None
            u = tree.leaves(updates)
            whole = [tuple(x.shape) for x in (p if p is not None else u)]
            u_rows = [
                x if tuple(x.shape) != w else _narrow(x, world, rank) for x, w in zip(u, whole)
            ]
            p_td = None
            if p is not None:
                p_td = tree.unflatten(params, [_narrow(x, world, rank) for x in p])
            kw = {"inplace": inplace} if takes_inplace else {}
            new_u, new_state = optimizer.update(tree.unflatten(updates, u_rows), state, p_td, **kw)
            # the all-gather fills one flat buffer, then each leaf is put together (a copy)
            mine = tree.leaves(new_u)
            sent = _flat_views(mine, [tuple(x.shape) for x in mine])  # this rank's piece, flat
            flat = _flat_views(mine, whole)
            gathered = [x.clone() for x in flat]
            del flat, sent
            return tree.unflatten(updates, gathered), new_state

        return GradientTransformation(optimizer.init, update)


class _InBackward:
    """The gradient engine of a bucketed :class:`ShardLayout`: ``inner``'s, with its gradients
    replaced as the buckets leave them (the module docstring); the whole ones are freed when it
    returns, as the real step frees its buckets' inputs."""

    def __init__(self, inner, layout: ShardLayout) -> None:
        self.inner, self.layout = inner, layout

    def __call__(self, forward, params, pieces, scale):
        out = self.inner(forward, params, pieces, scale)
        grads = out.grads
        if self.layout.strategy == "zero2":  # this rank's rows out, the whole buckets freed
            world, rank = self.layout.world, self.layout.rank
            whole = [g.contiguous() for g in grads]
            return out._replace(
                grads=_flat_views(whole, [local_shape(g.shape, world, rank) for g in whole]),
                owned=True,
            )
        return out._replace(grads=[g.view(g.shape) for g in grads], owned=True)
