"""A function of whole tensors on row-sharded ones: each tensor computed once, on an owner rank.

Under ``ft.shard`` zero1/zero2/fsdp, rank ``r`` holds a block of rows of each update
(``Shard(0)``, as ``torch.chunk`` splits them; a rank may hold 0 rows). A function that needs a
whole matrix (Muon's Newton–Schulz) could gather every matrix on every rank and compute all of
them there; :func:`on_owners` instead gives each tensor one owner rank (deterministic, balanced by
cost), sends each tensor's rows to its owner (one all-to-all per dtype), calls the function there
on the whole tensors, and sends the result's rows back (a second all-to-all). With ``W`` ranks,
the work and the bytes received per rank fall as ``1 / W``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ftrain.distributed.collectives import by_dtype, layout
from ftrain.distributed.dtensor import (
    dtensor,
    from_local,
    full_tensor,
    is_dtensor,
    local,
    redistribute,
)

__all__ = ["owners", "Exchange", "exchange", "all_to_all_into", "on_owners"]


@functools.lru_cache(maxsize=1024)
def owners(costs: tuple[float, ...], world: int) -> tuple[int, ...]:
    """The owner rank of each tensor, from their costs: the costliest first, each to the least
    loaded rank (the lowest rank among equals). A pure function of its arguments (remembered), so
    every rank computes the same owners; no rank's load exceeds the even share by more than the
    largest single cost."""
    load, owner = [0.0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):  # stable: ties in index order
        owner[i] = load.index(min(load))
        load[owner[i]] += costs[i]
    return tuple(owner)


def all_to_all_into(
    out: torch.Tensor, send: torch.Tensor, out_split: list[int], in_split: list[int], group
) -> None:
    """``out`` = the part of every rank's ``send`` meant for this rank, in rank order (rank ``s``
    sends its ``d``-th ``in_split`` block to rank ``d``)."""
    dist.all_to_all_single(out, send, out_split, in_split, group=group)


class Exchange:
    """Which rows go where when tensors of ``shapes`` (split in rows over ``world`` ranks, as
    :class:`~ftrain.distributed.collectives.Layout`) travel to their ``owner`` ranks and back.

    ``owned[r]`` lists the tensors rank ``r`` owns (in index order); every block of a flat
    buffer is in that order, the senders' blocks in rank order.
    """

    def __init__(self, shapes: tuple[torch.Size, ...], owner: tuple[int, ...], world: int):
        self.shapes, self.owner, self.world = shapes, owner, world
        self.rows = layout(shapes, world).rows  # [rank][i] -> (first row, number of rows)
        self.row_size = [math.prod(s[1:]) for s in shapes]
        self.owned = [[i for i in range(len(shapes)) if owner[i] == r] for r in range(world)]

    def _sizes(self, holder: int, tensors: list[int]) -> list[int]:
        """Elements of ``holder``'s rows of each of ``tensors``."""
        return [self.rows[holder][i][1] * self.row_size[i] for i in tensors]

    def _swap(self, send: list[list[torch.Tensor]], out_sizes: list[list[int]], like, group):
        """One all-to-all: ``send[d]`` (flat pieces) to rank ``d``; the pieces received from each
        rank, cut by ``out_sizes[s]``."""
        in_split = [sum(p.numel() for p in ps) for ps in send]
        out_split = [sum(s) for s in out_sizes]
        flat = torch.cat([p for ps in send for p in ps] or [like.new_empty(0)])
        out = like.new_empty(sum(out_split))
        if self.world == 1:
            out.copy_(flat)
        else:
            all_to_all_into(out, flat, out_split, in_split, group)
        return [part.split(s) for part, s in zip(out.split(out_split), out_sizes)]

    def to_owners(self, pieces: Sequence[torch.Tensor], rank: int, group) -> list[torch.Tensor]:
        """The whole tensors ``rank`` owns (``owned[rank]``'s order), from every rank's
        ``pieces`` (its rows of every tensor): one all-to-all."""
        send = [[pieces[i].reshape(-1) for i in self.owned[d]] for d in range(self.world)]
        mine = self.owned[rank]
        got = self._swap(send, [self._sizes(s, mine) for s in range(self.world)], pieces[0], group)
        return [
            torch.cat([got[s][j].view(-1, *self.shapes[i][1:]) for s in range(self.world)])
            for j, i in enumerate(mine)
        ]

    def back(self, results: Sequence[torch.Tensor], rank: int, group, like) -> list[torch.Tensor]:
        """This rank's rows of every tensor's result, from the whole ``results`` of the tensors
        it owns (``owned[rank]``'s order): one all-to-all. ``like`` gives the dtype and device
        (needed where a rank owns nothing)."""
        mine = self.owned[rank]
        send = [
            [r.narrow(0, *self.rows[d][i]).reshape(-1) for i, r in zip(mine, results)]
            for d in range(self.world)
        ]
        out_sizes = [self._sizes(rank, self.owned[s]) for s in range(self.world)]
        got = self._swap(send, out_sizes, like, group)
        rows: list[torch.Tensor | None] = [None] * len(self.shapes)
        for s in range(self.world):
            for i, p in zip(self.owned[s], got[s]):
                rows[i] = p.view(-1, *self.shapes[i][1:])
        return rows  # type: ignore[return-value]


@functools.lru_cache(maxsize=1024)
def exchange(shapes: tuple[torch.Size, ...], owner: tuple[int, ...], world: int) -> Exchange:
    """The :class:`Exchange` of these shapes and owners (a pure function, remembered)."""
    return Exchange(shapes, owner, world)


def _is_rows(t: torch.Tensor) -> bool:
    """A DTensor in ``ft.shard``'s layout: ``Shard(0)`` on a 1-D mesh, one or more dims."""
    return (
        is_dtensor(t)
        and t.dim() > 0
        and t.device_mesh.ndim == 1
        and tuple(t.placements) == (dtensor().Shard(0),)
    )


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * max(shape[k + 1], 1)
    return tuple(strides)


def on_owners(
    fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    tensors: Sequence[torch.Tensor],
    cost: Callable[[torch.Size], float] = math.prod,
    dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """``fn`` of each whole tensor, laid out as the tensor came in; each row-sharded tensor's
    result is computed on one rank only.

    ``fn`` takes a list of whole plain tensors and returns one result per tensor, of the same
    shape and dtype; it is called exactly once on every rank (with an empty list where a rank has
    nothing to compute), so it may batch its tensors. Of ``tensors``:

    * ``Shard(0)`` DTensors on a 1-D mesh (``ft.shard``'s layout; those on the mesh of the first
      of them): each gets an owner rank, from :func:`owners` of ``cost(shape)`` (the same on
      every rank). Its rows travel to the owner (one all-to-all per dtype), ``fn`` runs there,
      and the result's rows come back (a second all-to-all): each rank gets its rows of the result
      as a ``Shard(0)`` DTensor.
    * other DTensors are gathered whole (``full_tensor``) and computed on every rank, the result
      laid out in their placements (a local split);
    * plain tensors are computed on every rank (they hold the same value everywhere).

    ``dtype`` casts every tensor (each rank's rows, before they travel) for ``fn``: bfloat16
    halves the bytes of float32; the results then come back in ``dtype`` (cast them back where
    the caller needs the input's). **Invariant:** the whole value of each result equals
    ``fn([whole])[0]`` in one process (``whole.to(dtype)`` when ``dtype`` is given), for a ``fn`` that computes each tensor independently and
    gives the same bits batched or alone (rows may be 0 on some rank; any world size).
    """
    d = dtensor() if any(is_dtensor(t) for t in tensors) else None
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    rows = [i for i, t in enumerate(tensors) if d is not None and _is_rows(t)]
    mesh = tensors[rows[0]].device_mesh if rows else None
    rows = [i for i in rows if tensors[i].device_mesh == mesh]
    sharded = set(rows)
    here = [i for i in range(len(tensors)) if i not in sharded]  # computed on every rank
    wholes = [cast(full_tensor(tensors[i])) for i in here]
    trips = []  # per dtype: (positions in tensors, exchange, pieces, owned wholes)
    if rows:
        rank, group = mesh.get_local_rank(), mesh.get_group()
        pieces = [cast(local(tensors[i])) for i in rows]
        for idx in by_dtype(pieces).values():
            shapes = tuple(tensors[rows[j]].shape for j in idx)
            owner = owners(tuple(float(cost(s)) for s in shapes), mesh.size())
            ex = exchange(shapes, owner, mesh.size())
            chosen = [pieces[j] for j in idx]
            trips.append(([rows[j] for j in idx], ex, chosen, ex.to_owners(chosen, rank, group)))
    todo = wholes + [w for *_, owned in trips for w in owned]
    done = list(fn(todo))
    if len(done) != len(todo):
        raise ValueError(
            f"on_owners(fn, ...): fn returned {len(done)} tensors for {len(todo)}; it must return "
            "one per input, in order."
        )
    for x, y in zip(todo, done):
        if y.shape != x.shape or y.dtype != x.dtype:
            raise ValueError(
                f"on_owners(fn, ...): fn must return one tensor per input of the same shape and "
                f"dtype (the other ranks expect its rows); got {tuple(y.shape)} {y.dtype} for "
                f"{tuple(x.shape)} {x.dtype}."
            )
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for i, o in zip(here, done):
        t = tensors[i]
        if is_dtensor(t):  # Replicate to any placement is a local split
            mesh_t = t.device_mesh
            everywhere = from_local(o, mesh_t, (d.Replicate(),) * mesh_t.ndim, o.shape, o.stride())
            o = redistribute(everywhere, t.device_mesh, t.placements)
        out[i] = o
    start = len(here)
    for positions, ex, chosen, owned in trips:
        results = done[start : start + len(owned)]
        start += len(owned)
        for i, r in zip(positions, ex.back(results, rank, group, chosen[0])):
            t = tensors[i]
            out[i] = from_local(r, mesh, (d.Shard(0),), t.shape, _contiguous(t.shape))
    return out  # type: ignore[return-value]
