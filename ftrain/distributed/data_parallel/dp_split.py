"""ZeRO and FSDP over the ``dp`` dimension of a tensor-parallel state: where each share sits.

**Rule:** over ``dp``, a tensor-parallel DTensor (``ftrain.distributed.tensor_parallel.mesh``:
``Replicate()`` over ``dp``) is split along the first dimension that ``tp`` does not split:

===============================================  ===============  =============================
over ``tp``                                      over ``dp``      e.g. (GPT plan)
===============================================  ===============  =============================
``Replicate()``, or ``Shard(d)`` with d > 0      ``Shard(0)``     embeddings, norms,
                                                                  ``attn.proj``, ``mlp.proj``
``Shard(0)`` or a fused-block split of dim 0,    ``Shard(1)``     ``mlp.fc.weight``,
two or more dimensions                                            ``attn.qkv.weight``
the same, one dimension                          ``Replicate()``  ``mlp.fc.bias``,
                                                                  ``attn.qkv.bias``
===============================================  ===============  =============================

So the two mesh dimensions never split the same tensor dimension: the placements stay DTensor's
ordinary ones (gathers, norms and ``ft.unshard_state`` are DTensor's own, and a checkpoint
records each piece as the boxes it already knows), and this process's ``dp`` share is a
``torch.chunk`` piece of its ``tp`` piece. Gathering over ``dp`` (:func:`gather_pieces`, fsdp's
gather before a block runs) gives exactly the ``tp`` piece that the tensor-parallel forward
(``ftrain.distributed.tensor_parallel.model``) computes with; reduce-scattering a gradient of that
piece (:func:`reduce_scatter`) lands on the same ``dp`` share. A tensor whole over ``dp`` (the third
row: small biases) has its gradient all-reduced over ``dp`` instead, as under ddp.

Plain tensors and DTensors on the 1-D ``dp`` mesh itself (``ft.shard`` without tensor
parallelism) pass through to ``ftrain.distributed.collectives`` unchanged: ``Shard(0)`` rows.
Each collective moves a group of tensors in one flat buffer per dtype (the split dimension is
moved to the front so that ``collectives.Layout`` cuts the rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ftrain.distributed.collectives import (
    all_reduce_flat,
    as_sharded,
    by_dtype,
    gather_leaves,
    layout,
    reduce_scatter_leaves,
)
from ftrain.distributed.dtensor import dtensor, from_local, is_dtensor, local, shard_dim

__all__ = [
    "is_tp_laid",
    "dp_dim",
    "split_placements",
    "split_over_dp",
    "is_split",
    "is_unreduced",
    "fsdp_gathers",
    "piece_shape",
    "split",
    "unsplit",
    "gather_pieces",
    "reduce_scatter",
    "unreduced",
    "all_reduce_whole",
    "moved_shape",
]


def _dp(t: torch.Tensor) -> int | None:
    """The index of the mesh dimension ``"dp"`` of a DTensor on a mesh of two or more
    dimensions (a tensor-parallel one), else None."""
    if not is_dtensor(t) or t.device_mesh.ndim < 2:
        return None
    names = t.device_mesh.mesh_dim_names or ()
    return names.index("dp") if "dp" in names else None


def is_tp_laid(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor on a multi-dimensional mesh with a ``"dp"`` dimension."""
    return _dp(t) is not None


def dp_dim(t: torch.Tensor) -> int | None:
    """The tensor dimension that ``dp`` splits in the tensor-parallel DTensor ``t`` (the module
    docstring's rule), or None where ``t`` stays whole over ``dp``."""
    i = _dp(t)
    taken = {shard_dim(p) for j, p in enumerate(t.placements) if j != i} - {None}
    if 0 not in taken:
        return 0 if t.dim() > 0 else None
    return 1 if t.dim() > 1 and 1 not in taken else None


def split_placements(t: torch.Tensor) -> tuple:
    """``t``'s placements with the ``dp`` one as the rule says (``Shard(d)`` or
    ``Replicate()``); every other mesh dimension's kept."""
    d, i = dtensor(), _dp(t)
    k = dp_dim(t)
    out = list(t.placements)
    out[i] = d.Shard(k) if k is not None else d.Replicate()
    return tuple(out)


def split_over_dp(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor-parallel DTensor split over its ``dp`` dimension (fsdp's
    params): the tensor-parallel forward leaves it to fsdp's gather."""
    i = _dp(t)
    return i is not None and t.placements[i].is_shard()


def is_split(t: torch.Tensor, mesh) -> bool:
    """Whether ``t`` holds only a share over ``mesh`` (the ``dp`` mesh): ``Shard`` over it, on
    ``mesh`` itself or on a tensor-parallel mesh's ``"dp"`` dimension."""
    if not is_dtensor(t):
        return False
    if _dp(t) is None:
        return t.device_mesh == mesh
    return split_over_dp(t)


def is_unreduced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor still ``Partial`` (a local gradient to be summed) over a
    mesh dimension."""
    return is_dtensor(t) and any(p.is_partial() for p in t.placements)


def fsdp_gathers(t: torch.Tensor, mesh) -> bool:
    """Whether fsdp gathers the parameter ``t`` before its block runs: a DTensor on ``mesh``, or
    a tensor-parallel one split over ``dp``. A tensor-parallel one whole over ``dp`` is left to
    the tensor-parallel forward (its gradient is all-reduced by ``ft.shard``'s reduce)."""
    return is_dtensor(t) and (not is_tp_laid(t) or is_split(t, mesh))


def piece_shape(t: torch.Tensor) -> torch.Size:
    """The shape :func:`gather_pieces` gives for ``t``: the whole shape, or for a
    tensor-parallel DTensor its ``tp`` piece."""
    if not is_tp_laid(t):
        return t.shape
    shape = list(local(t).shape)
    k = dp_dim(t)
    if k is not None and split_over_dp(t):
        shape[k] = t.shape[k]  # tp never splits dimension k: its tp piece is whole along it
    return torch.Size(shape)


def split(t: torch.Tensor, mesh, *, copy: bool) -> torch.Tensor:
    """This process's share over ``mesh`` of ``t`` (no traffic): a tensor-parallel DTensor split
    over ``dp`` as the rule says (unchanged if already split or whole by the rule), anything else
    as ``collectives.as_sharded`` (``Shard(0)`` rows). A view, or a copy with ``copy``."""
    if not is_tp_laid(t):
        return as_sharded(t, mesh, copy=copy)
    k = dp_dim(t)
    if k is None or is_split(t, mesh):
        return t
    moved = local(t).movedim(k, 0)
    (mine,) = layout((moved.shape,), mesh.size()).local([moved], mesh.get_local_rank())
    mine = mine.movedim(0, k)
    mine = mine.clone() if copy else mine
    return from_local(mine, t.device_mesh, split_placements(t), t.shape, t.stride())


def _whole_placements(t: torch.Tensor) -> tuple:
    out = list(t.placements)
    out[_dp(t)] = dtensor().Replicate()
    return tuple(out)


def gather_pieces(ts: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """Plain tensors gathered over ``mesh``: a tensor-parallel DTensor's ``tp`` piece (what the
    tensor-parallel forward computes with); a DTensor on ``mesh``, its whole tensor. One flat
    all-gather per dtype for the split ones."""
    out: list[torch.Tensor | None] = [None] * len(ts)
    split_ids, others = [], []
    for i, t in enumerate(ts):
        if is_tp_laid(t):
            if is_split(t, mesh):
                split_ids.append(i)
            else:
                out[i] = local(t)
        else:
            others.append(i)
    if others:
        for i, w in zip(others, gather_leaves([ts[i] for i in others], mesh)):
            out[i] = w
    rank, group = mesh.get_local_rank(), mesh.get_group()
    for idx in by_dtype([ts[i] for i in split_ids]).values():
        chosen = [ts[split_ids[j]] for j in idx]
        dims = [dp_dim(t) for t in chosen]
        shapes = tuple(torch.Size(moved_shape(piece_shape(t), k)) for t, k in zip(chosen, dims))
        whole = layout(shapes, mesh.size()).all_gather(
            [local(t).movedim(k, 0) for t, k in zip(chosen, dims)], rank, group
        )
        for j, w, k in zip(idx, whole, dims):
            out[split_ids[j]] = w.movedim(0, k).contiguous()
    return out  # type: ignore[return-value]


def moved_shape(shape, k: int) -> list[int]:
    """``shape`` with dimension ``k`` moved first (``movedim(k, 0)``'s shape): the rows that
    :func:`split` cuts along the dimension ``dp`` splits."""
    s = list(shape)
    return [s[k], *s[:k], *s[k + 1 :]]


def unsplit(ts: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """The inverse of :func:`split` (one all-gather per dtype): a tensor-parallel DTensor back to
    its tensor-parallel layout (whole over ``dp``), anything else its whole plain tensor."""
    pieces = gather_pieces(ts, mesh)
    return [
        from_local(p, t.device_mesh, _whole_placements(t), t.shape, t.stride())
        if is_tp_laid(t)
        else p
        for p, t in zip(pieces, ts)
    ]


def unreduced(x: torch.Tensor, ref: torch.Tensor, mesh) -> torch.Tensor:
    """The plain local gradient ``x`` of the parameter ``ref`` as a DTensor still to be summed
    over ``dp`` (``Partial``): reduced later, by :func:`reduce_scatter`."""
    d = dtensor()
    if not is_tp_laid(ref):
        return from_local(x, mesh, (d.Partial(),), x.shape, x.stride())
    out = list(ref.placements)
    out[_dp(ref)] = d.Partial()
    return from_local(x, ref.device_mesh, tuple(out), ref.shape, ref.stride())


def reduce_scatter(grads: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], mesh) -> list:
    """Sums over ``mesh`` of the plain local gradients ``grads``, each laid out as :func:`split`
    lays out its ``ref`` (the parameter, or the unreduced gradient): this process's share as a
    DTensor; a tensor-parallel one whole over ``dp`` all-reduced. Tensors whose ``ref`` is not
    tensor-parallel go to ``collectives.reduce_scatter_leaves`` (``Shard(0)`` rows)."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    plain = [i for i, r in enumerate(refs) if not is_tp_laid(r)]
    if plain:
        for i, g in zip(plain, reduce_scatter_leaves([grads[i] for i in plain], mesh)):
            out[i] = g
    tp = [i for i, r in enumerate(refs) if is_tp_laid(r)]
    whole = [i for i in tp if dp_dim(refs[i]) is None]
    rows = [i for i in tp if dp_dim(refs[i]) is not None]
    if whole:
        for i, s in zip(whole, all_reduce_flat([grads[i] for i in whole], mesh.get_group(), False)):
            r = refs[i]
            out[i] = from_local(s, r.device_mesh, split_placements(r), r.shape, r.stride())
    rank, group = mesh.get_local_rank(), mesh.get_group()
    for idx in by_dtype([grads[i] for i in rows]).values():
        ids = [rows[j] for j in idx]
        dims = [dp_dim(refs[i]) for i in ids]
        moved = [grads[i].movedim(k, 0).contiguous() for i, k in zip(ids, dims)]
        lay = layout(tuple(m.shape for m in moved), mesh.size())
        for i, k, piece in zip(ids, dims, lay.reduce_scatter(moved, rank, group)):
            r = refs[i]
            piece = piece.movedim(0, k).contiguous()
            out[i] = from_local(piece, r.device_mesh, split_placements(r), r.shape, r.stride())
    return out


def all_reduce_whole(grads: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """``grads`` with each tensor-parallel one that is whole over ``dp`` (never gathered by
    fsdp: its local gradient is this process's own) summed over ``mesh``; the rest unchanged."""
    ids = [
        i
        for i, g in enumerate(grads)
        if is_tp_laid(g) and not is_split(g, mesh) and not is_unreduced(g)
    ]
    if not ids:
        return list(grads)
    out = list(grads)
    summed = all_reduce_flat([local(grads[i]) for i in ids], mesh.get_group(), in_place=False)
    for i, s in zip(ids, summed):
        g = grads[i]
        out[i] = from_local(s, g.device_mesh, _whole_placements(g), g.shape, g.stride())
    return out
