"""Collectives over groups of tensors through one flat buffer each, as FSDP2 does.

One collective per group of tensors (per dtype; all-reduces in buckets of bounded size) instead
of one per tensor: a step's traffic is a handful of calls. Sharded tensors are ``Shard(0)``
DTensors: rank ``r`` holds rows ``[r * ceil(n / W), ...)`` of a tensor of ``n`` rows, as
``torch.chunk`` splits them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ftrain.distributed.dtensor import (
    dtensor,
    from_local,
    full_tensor,
    is_dtensor,
    local,
    placements_of,
    redistribute,
)
from ftrain.internals import foreach

__all__ = [
    "Layout",
    "layout",
    "all_gather_into",
    "reduce_scatter_into",
    "by_dtype",
    "all_reduce_flat",
    "as_sharded",
    "gather_leaves",
    "reduce_scatter_leaves",
]

# Elements per flat all-reduce bucket: bounds the extra memory of the flat copy (64 MiB of fp32).
BUCKET_ELEMENTS = 1 << 24


class Layout:
    """Where the ``Shard(0)`` piece of each tensor of a group sits in one flat per-rank segment.

    Tensor ``i`` of shape ``(n, *rest)`` is split into row blocks of ``ceil(n / W)`` rows, as
    ``torch.chunk`` and DTensor split it (a rank past the end holds 0 rows). Rank ``r``'s segment
    is its pieces one after another, padded to the longest segment, so that a group moves in one
    all-gather or reduce-scatter.
    """

    def __init__(self, shapes: tuple[torch.Size, ...], world: int):
        self.shapes, self.world = shapes, world
        self.rows: list[list[tuple[int, int]]] = []  # [rank][i] -> (first row, number of rows)
        self.sizes: list[list[int]] = []  # [rank][i] -> elements
        for r in range(world):
            rows, sizes = [], []
            for shape in shapes:
                n = shape[0]
                per = -(-n // world)
                start = min(r * per, n)
                count = min(per, n - start)
                rows.append((start, count))
                sizes.append(count * math.prod(shape[1:]))
            self.rows.append(rows)
            self.sizes.append(sizes)
        self.segment = max(sum(s) for s in self.sizes)
        self.pads = [self.segment - sum(s) for s in self.sizes]

    def local(self, fulls: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
        """This rank's pieces of whole tensors: views, no copy, no communication."""
        return [t.narrow(0, s, c) for t, (s, c) in zip(fulls, self.rows[rank])]

    def all_gather(self, pieces: Sequence[torch.Tensor], rank: int, group) -> list[torch.Tensor]:
        """The whole tensors from every rank's pieces (one all-gather)."""
        send = self.gather_send(pieces, rank)
        out = send.new_empty(self.world * self.segment)  # (W * segment,)
        all_gather_into(out, send, group)
        return self.gathered(out)

    def gather_send(self, pieces: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """What ``rank`` sends to the all-gather: its pieces, flat, padded to the segment."""
        t0 = pieces[0]
        return torch.cat([p.reshape(-1) for p in pieces] + [t0.new_zeros(self.pads[rank])])

    def gathered(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The whole tensors in the all-gather's flat result ``out`` (W segments)."""
        parts = [
            out[r * self.segment : r * self.segment + sum(self.sizes[r])].split(self.sizes[r])
            for r in range(self.world)
        ]
        return [
            torch.cat([parts[r][i].view(-1, *shape[1:]) for r in range(self.world)])
            for i, shape in enumerate(self.shapes)
        ]

    def reduce_scatter(self, fulls: Sequence[torch.Tensor], rank: int, group) -> list[torch.Tensor]:
        """This rank's pieces of the sums over ranks of whole tensors (one reduce-scatter)."""
        send = self.scatter_send(fulls)
        out = send.new_empty(self.segment)
        reduce_scatter_into(out, send, group)
        return self.scattered(out, rank)

    def scatter_send(self, fulls: Sequence[torch.Tensor]) -> torch.Tensor:
        """What every rank sends to the reduce-scatter: each rank's pieces of ``fulls`` in rank
        order, each segment padded (W * segment elements)."""
        t0 = fulls[0]
        return torch.cat(
            [
                piece.reshape(-1)
                for r in range(self.world)
                for piece in (*self.local(fulls, r), t0.new_zeros(self.pads[r]))
            ]
        )

    def scattered(self, out: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """``rank``'s pieces (views) in the reduce-scatter's flat result ``out`` (one segment)."""
        pieces = out[: sum(self.sizes[rank])].split(self.sizes[rank])
        return [p.view(-1, *s[1:]) for p, s in zip(pieces, self.shapes)]


@functools.lru_cache(maxsize=1024)
def layout(shapes: tuple[torch.Size, ...], world: int) -> Layout:
    """The :class:`Layout` of tensors of these shapes over ``world`` ranks (a pure function of
    its arguments, remembered)."""
    return Layout(shapes, world)


def all_gather_into(out: torch.Tensor, send: torch.Tensor, group) -> None:
    """``out`` (W times ``send``'s size) = every rank's ``send``, in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, send, group=group)


def reduce_scatter_into(out: torch.Tensor, send: torch.Tensor, group) -> None:
    """``out`` = this rank's segment of the sum over ranks of ``send`` (W segments of ``out``'s
    size)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, send, group=group)


def by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The positions of ``tensors`` grouped by dtype (a flat buffer holds one dtype)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def all_reduce_flat(
    tensors: Sequence[torch.Tensor], group, in_place: bool = True
) -> list[torch.Tensor]:
    """Sum ``tensors`` across ranks through few flat buffers (one per dtype and bucket) instead
    of one collective per tensor. Returns the sums as views of the flat buffers (fresh memory,
    one per tensor, even where the inputs share memory); ``in_place`` also copies them back."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in by_dtype(tensors).values():
        bucket: list[int] = []
        size = 0
        for i in [*idx, None]:
            t = tensors[i] if i is not None else None
            if bucket and (t is None or size + t.numel() > BUCKET_ELEMENTS):
                flat = torch.cat([tensors[b].reshape(-1) for b in bucket])  # a copy
                dist.all_reduce(flat, group=group)
                parts = flat.split([tensors[b].numel() for b in bucket])
                for b, part in zip(bucket, parts):
                    out[b] = part.view(tensors[b].shape)
                if in_place:
                    foreach.copy_([tensors[b] for b in bucket], [out[b] for b in bucket])
                bucket, size = [], 0
            if t is not None:
                bucket.append(i)
                size += t.numel()
    return out


# -- plain <-> sharded --------------------------------------------------------------------------


def as_sharded(t: torch.Tensor, mesh, *, copy: bool) -> torch.Tensor:
    """The DTensor (``Shard(0)``, or ``Replicate()`` for 0-d) whose whole value is the plain
    ``t`` that every rank holds: this rank's rows (a view, or a copy with ``copy``), no traffic."""
    if is_dtensor(t):
        if tuple(t.placements) == placements_of(t):
            return t
        return redistribute(t, mesh, placements_of(t))
    if t.dim() == 0:
        mine = t.clone() if copy else t
    else:
        (mine,) = layout((t.shape,), mesh.size()).local([t], mesh.get_local_rank())
        mine = mine.clone() if copy else mine
    return from_local(mine, mesh, placements_of(t), t.shape, t.stride())


def gather_leaves(tensors: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """Whole plain tensors for a list of DTensors (plain tensors pass through); the ``Shard(0)``
    ones move in one flat all-gather per dtype."""
    d = dtensor()
    out: list[torch.Tensor | None] = [None] * len(tensors)
    flat: list[int] = []
    for i, t in enumerate(tensors):
        if not is_dtensor(t):
            out[i] = t
        elif tuple(t.placements) == (d.Shard(0),) and t.device_mesh == mesh:
            flat.append(i)
        else:
            out[i] = full_tensor(t)
    if not flat:  # nothing Shard(0) on this mesh (e.g. a tensor-parallel state's 2-D mesh)
        return out  # type: ignore[return-value]
    rank, group = mesh.get_local_rank(), mesh.get_group()
    for idx in by_dtype([tensors[i] for i in flat]).values():
        chosen = [tensors[flat[j]] for j in idx]
        lay = layout(tuple(t.shape for t in chosen), mesh.size())
        whole = lay.all_gather([local(t) for t in chosen], rank, group)
        for j, w in zip(idx, whole):
            out[flat[j]] = w
    return out  # type: ignore[return-value]


def reduce_scatter_leaves(tensors: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """Sums over ranks of whole plain tensors, each rank keeping its ``Shard(0)`` rows as a
    DTensor (0-d tensors are all-reduced and kept whole, ``Replicate()``). One flat
    reduce-scatter per dtype."""
    d = dtensor()
    rank, group = mesh.get_local_rank(), mesh.get_group()
    out: list[torch.Tensor | None] = [None] * len(tensors)
    scalars = [i for i, t in enumerate(tensors) if t.dim() == 0]
    if scalars:
        summed = [tensors[i].clone() for i in scalars]
        all_reduce_flat(summed, group)
        for i, t in zip(scalars, summed):
            out[i] = from_local(t, mesh, (d.Replicate(),), t.shape, t.stride())
    rows = [i for i, t in enumerate(tensors) if t.dim() > 0]
    for idx in by_dtype([tensors[i] for i in rows]).values():
        chosen = [tensors[rows[j]].contiguous() for j in idx]
        lay = layout(tuple(t.shape for t in chosen), mesh.size())
        for j, t, piece in zip(idx, chosen, lay.reduce_scatter(chosen, rank, group)):
            out[rows[j]] = from_local(piece, mesh, (d.Shard(0),), t.shape, t.stride())
    return out  # type: ignore[return-value]
