"""DTensor plumbing: the one module that touches DTensor's private API.

Sharded leaves of a state are ``DTensor``\\ s placed ``Shard(0)`` on a 1-D ``DeviceMesh`` (a
tensor's rows split as ``torch.chunk`` splits them); 0-d tensors are ``Replicate()``. This module
builds them cheaply, takes their local shards, and fills the few gaps DTensor leaves for
optimizers (:func:`on_shards`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

# the extension point torch documents for __torch_dispatch__ modes, from a module named private
from torch.utils._python_dispatch import TorchDispatchMode

from ftrain import tree
from ftrain.optim.base import GradientTransformation, accepts_inplace

__all__ = [
    "dtensor",
    "is_dtensor",
    "from_local",
    "local",
    "placements_of",
    "on_shards",
    "laid_out_like",
    "like",
    "redistribute",
    "full_tensor",
    "split_placement",
    "split_factor",
    "shard_dim",
]


def dtensor():
    """``torch.distributed.tensor``, imported when first used (a heavy import that
    single-process users never need)."""
    from torch.distributed import tensor

    return tensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (a tensor laid out across processes)."""
    return isinstance(t, dtensor().DTensor)


def placements_of(t: torch.Tensor) -> tuple:
    """How :func:`ftrain.distributed.shard_state` places a tensor: ``Shard(0)`` with one or more
    dimensions, ``Replicate()`` when 0-d."""
    d = dtensor()
    return (d.Shard(0),) if t.dim() > 0 else (d.Replicate(),)


@functools.lru_cache(maxsize=4096)
def _spec(
    mesh_id: int,
    mesh,
    placements: tuple,
    shape: tuple,
    stride: tuple,
    dtype: torch.dtype,
    blocks: bool = False,
):
    # Keyed by the mesh's identity too: two meshes compare equal by their layout, but a spec must
    # hold the very mesh (and process group) it is used with, not an equal one destroyed since.
    # Private: DTensorSpec and TensorMeta. The public replacement is DTensor.from_local, which
    # runs an autograd function (about 0.3 ms a call on a CPU; a step makes one per tensor).
    # ``blocks``: a strided placement means k blocks each split on its own (split_placement),
    # not a sharding order over mesh dimensions, DTensor's default reading (see redistribute).
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), stride, dtype)
    if blocks:
        return DTensorSpec(
            mesh, placements, tensor_meta=meta, use_strided_shard_as_shard_order=False
        )
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def _strided(placements: Sequence) -> bool:
    """Whether some placement of ``placements`` is :func:`split_placement`'s strided one."""
    return any(split_factor(p) > 1 for p in placements)


def split_placement(dim: int, chunks: int = 1):
    """The placement of a tensor split along ``dim`` over one mesh dimension: ``Shard(dim)``, or,
    with ``chunks=k``, k equal blocks along ``dim`` each split on its own, this process holding
    the concatenation of its slice of every block (a fused q/k/v projection keeps whole heads).

    The second is torch's private ``_StridedShard(dim, split_factor=k)``: DTensor gathers and
    redistributes it correctly, and nothing public describes it. The public replacement would be
    a strided ``Shard`` placement, should DTensor publish one."""
    d = dtensor()
    if chunks == 1:
        return d.Shard(dim)
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=chunks)


def split_factor(placement) -> int:
    """How many blocks a ``Shard``-like placement splits each on its own: ``k`` for one made by
    :func:`split_placement` with ``chunks=k`` (``_StridedShard``), 1 for ``Shard``."""
    return int(getattr(placement, "split_factor", 1))


def shard_dim(placement) -> int | None:
    """The tensor dimension a placement splits (``Shard`` or :func:`split_placement`'s strided
    one), or None (``Replicate``, ``Partial``)."""
    if placement.is_shard() or split_factor(placement) > 1:
        return placement.dim
    return None


def from_local(local_t: torch.Tensor, mesh, placements: tuple, shape, stride) -> torch.Tensor:
    """``DTensor.from_local(local_t, mesh, placements, shape=shape, stride=stride)`` without its
    autograd function: for tensors that need no gradient (state, grads, updates)."""
    d = dtensor()
    try:
        spec = _spec(id(mesh), mesh, tuple(placements), tuple(shape), tuple(stride), local_t.dtype)
    except ImportError:  # a torch that moved the private spec: the public, slower way
        return d.DTensor.from_local(
            local_t, mesh, placements, run_check=False, shape=shape, stride=stride
        )
    return d.DTensor(local_t, spec, requires_grad=False)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (no autograd: ``to_local``'s no-grad path)."""
    with torch.no_grad():
        return t.to_local()


def like(local_t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``local_t`` as a DTensor laid out as ``ref`` (its local piece; no traffic), or ``local_t``
    itself when ``ref`` is a plain tensor."""
    if not is_dtensor(ref):
        return local_t
    return from_local(local_t, ref.device_mesh, ref.placements, ref.shape, ref.stride())


def redistribute(t: torch.Tensor, mesh, placements: Sequence) -> torch.Tensor:
    """``t.redistribute(mesh, placements)`` for tensors that need no gradient, also where either
    side holds :func:`split_placement`'s strided placement.

    DTensor reads a strided placement as a sharding order over mesh dimensions unless its spec
    says otherwise: torch 2.11 then refuses to move one whose factor is no product of mesh sizes
    (a fused q/k/v split in 3 blocks over 2 processes), where 2.13 falls back to reading blocks.
    So such a move runs DTensor's private ``redistribute_local_tensor`` between two specs built
    for it that say blocks (the same collectives, on both). Only for the move: the DTensors
    handed out keep DTensor's default spec, since 2.13's ops treat a tensor of the other
    reading beside one of the default as laid out differently (and move one of them wrongly)."""
    placements = tuple(placements)
    if mesh == t.device_mesh and tuple(t.placements) == placements:
        return t
    if not (_strided(t.placements) or _strided(placements)):
        return t.redistribute(mesh, placements)
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    shape, stride = tuple(t.shape), tuple(t.stride())
    src = _spec(id(t.device_mesh), t.device_mesh, tuple(t.placements), shape, stride, t.dtype, True)
    dst = _spec(id(mesh), mesh, placements, shape, stride, t.dtype, True)
    with torch.no_grad():
        moved = redistribute_local_tensor(local(t), src, dst)
    return from_local(moved, mesh, placements, shape, stride)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor as a plain, contiguous tensor on every process
    (``full_tensor`` for tensors that need no gradient, strided placements included:
    :func:`redistribute`); a plain tensor as it is.

    Contiguous as one process would hold it: torch 2.11 gathers a tensor split unevenly along a
    dimension other than 0 into a padded buffer and returns a view of it (strides of the padded
    shape), and a reduction over such a view adds in another order (a sum 1 ulp off the same
    sum over the plain tensor). The copy costs nothing where the gather is already contiguous."""
    if not is_dtensor(t):
        return t
    mesh = t.device_mesh
    return local(redistribute(t, mesh, (dtensor().Replicate(),) * mesh.ndim)).contiguous()


def _to_local(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_to_local(t) for t in x]
    return local(x) if is_dtensor(x) else x


class _LocalForeach(TorchDispatchMode):
    """Elementwise ``torch._foreach_*`` ops that DTensor has no sharding rule for (e.g.
    ``_foreach_copy_``; ``_foreach_lerp`` on torch 2.11) run on the local shards, when the
    operands at each list position are laid out alike (same mesh, placements and shape, or 0-d).
    A replicated operand beside a sharded one (ZeRO's replicated gradients beside its sharded
    moments) is cut to the sharded layout first, a local slice as DTensor's own rule would take;
    not the one an in-place op writes. Every other op goes to DTensor."""

    _REDUCTIONS = ("aten::_foreach_norm", "aten::_foreach_max")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except NotImplementedError:
            name = func.name()
            if not name.startswith("aten::_foreach_") or name.startswith(self._REDUCTIONS):
                raise
            like = _alike(args, writes_first=name.split(".")[0].endswith("_"))
            if like is None:
                raise
            args = _aligned(args, like)
        out = func(*_to_local(list(args)), **{k: _to_local(v) for k, v in kwargs.items()})
        if out is None or not isinstance(out, (list, tuple)):
            return out  # in place: the shards were written
        return [
            from_local(o, ref.device_mesh, ref.placements, ref.shape, ref.stride())
            if ref is not None
            else o
            for o, ref in zip(out, like)
        ]


def _replicated(t: torch.Tensor) -> bool:
    return is_dtensor(t) and all(p.is_replicate() for p in t.placements)


def _is_tensor_list(a: Any) -> bool:
    return isinstance(a, (list, tuple)) and bool(a) and isinstance(a[0], torch.Tensor)


def _alike(args: Sequence[Any], writes_first: bool = False) -> list | None:
    """Per list position, the DTensor whose layout every operand there shares or can be cut to
    (a replicated one of the same mesh and shape; not in the first list when the op writes it),
    None where all are plain; or None when some position mixes layouts otherwise."""
    lists = [a for a in args if _is_tensor_list(a)]
    scalars = [a for a in args if isinstance(a, torch.Tensor)]
    if not lists or any(s.dim() > 0 for s in scalars):
        return None
    refs: list = []
    for column in zip(*lists):
        ref = None
        for t in column:
            if t.dim() == 0 and (not is_dtensor(t) or _replicated(t)):
                continue
            if not is_dtensor(t):
                return None
            if ref is None or (_replicated(ref) and not _replicated(t)):
                ref = t
        for i, t in enumerate(column):
            if t.dim() == 0 and (not is_dtensor(t) or _replicated(t)):
                continue
            if (t.device_mesh, t.placements, t.shape) == (
                ref.device_mesh,
                ref.placements,
                ref.shape,
            ):
                continue
            cut = _replicated(t) and (t.device_mesh, t.shape) == (ref.device_mesh, ref.shape)
            if not cut or (writes_first and i == 0):
                return None
        refs.append(ref)
    return refs


def _aligned(args: Sequence[Any], refs: list) -> list:
    """``args`` with each replicated DTensor of a list cut to its position's layout in ``refs``
    (``redistribute`` from ``Replicate()`` to a ``Shard``: a local slice, no traffic)."""
    out = []
    for a in args:
        if _is_tensor_list(a):
            a = [
                redistribute(t, r.device_mesh, r.placements)
                if r is not None and t.dim() > 0 and _replicated(t) and not _replicated(r)
                else t
                for t, r in zip(a, refs)
            ]
        out.append(a)
    return out


@contextlib.contextmanager
def _plain_as_replicated() -> Iterator[None]:
    """A plain tensor that meets a DTensor counts as ``Replicate()``.

    True of the plain tensors an optimizer makes inside its update: they are computed the same
    way on every process from constants and replicated values (e.g. the ``sqrt(numel)`` of each
    tensor that ``clip_by_block_rms`` divides the norms by). DTensor would refuse the mixed op;
    ``implicit_replication`` is its switch for this, scoped here and restored on exit. Whether it
    is already on is read from the private ``_allow_implicit_replication`` (no public getter)."""
    from torch.distributed.tensor.experimental import implicit_replication

    dispatcher = dtensor().DTensor._op_dispatcher
    if getattr(dispatcher, "_allow_implicit_replication", False):
        yield  # already on (the caller's own implicit_replication): leave it on
        return
    with implicit_replication():
        yield


def laid_out_like(new: TensorDictBase, old: TensorDictBase) -> TensorDictBase:
    """``new`` with each DTensor leaf placed as the same leaf of ``old`` (a tree of the same
    structure); ``new`` itself when nothing moves.

    An optimizer's out-of-place op may return another placement than its input had: the new
    value of a statistic reduced over the shards comes back ``Replicate()`` (adafactor's
    ``v_col``). Put back, the state keeps the layout ``shard_state`` gave it, step after step.
    ``Replicate`` to ``Shard(0)`` keeps this rank's rows (no traffic); ``Partial`` to ``Shard(0)``
    is a reduce-scatter."""
    news, olds = tree.leaves(new), tree.leaves(old)
    moved = [
        redistribute(n, o.device_mesh, o.placements)
        if is_dtensor(n) and is_dtensor(o) and n.placements != o.placements
        else n
        for n, o in zip(news, olds)
    ]
    if all(m is n for m, n in zip(moved, news)):
        return new
    return tree.unflatten(new, moved)


def on_shards(inner: GradientTransformation) -> GradientTransformation:
    """``inner`` run on DTensors: the gaps of DTensor filled (foreach ops it has no rule for run
    on the local shards; plain tensors count as replicated), and the updates and new state laid
    out as the grads and state that came in (:func:`laid_out_like`)."""
    takes_inplace = accepts_inplace(inner.update)

    def update(updates, state, params=None, *, inplace=False):
        try:
            with _LocalForeach(), _plain_as_replicated():
                if takes_inplace:
                    new_u, new_s = inner.update(updates, state, params, inplace=inplace)
                else:
                    new_u, new_s = inner.update(updates, state, params)
                return laid_out_like(new_u, updates), laid_out_like(new_s, state)
        except (RuntimeError, NotImplementedError) as e:
            if "DTensor" not in str(e) and "harding" not in str(e) or "ft.shard:" in str(e):
                raise  # not DTensor's, or already said (on_shards within on_shards)
            raise type(e)(
                "ft.shard: the optimizer cannot run on sharded state: DTensor refused one of its "
                f"operations ({str(e).strip().splitlines()[0]}). Use strategy 'ddp' with this "
                "optimizer, or write the operation out of place (e.g. x.square() rather than "
                "x.square_() on a reduced tensor) so that DTensor can finish the reduction first."
            ) from e
        except ValueError as e:
            if "shard_order" not in str(e):
                raise
            # torch 2.11: a move DTensor plans itself, from or to a tensor split in blocks
            raise NotImplementedError(
                f"ft.shard: torch {torch.__version__}'s DTensor cannot move a tensor split in "
                "blocks (tensor parallelism's fused q/k/v projection, split over 'tp') between "
                "the layouts one of the optimizer's reductions needs (e.g. adafactor's row and "
                "column statistics under fsdp over 'dp'); torch 2.13 can. On this torch, pair "
                "tensor parallelism with an optimizer whose update is elementwise per tensor "
                f"(adamw, sgd, lion). DTensor said: {str(e).strip().splitlines()[0]}"
            ) from e

    return GradientTransformation(inner.init, update)
