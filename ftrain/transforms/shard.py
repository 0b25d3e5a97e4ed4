"""Data parallelism over ``torch.distributed``: DDP, ZeRO-1, ZeRO-2 and FSDP, exact and composable.

**Rule:** N processes, each given 1/N of the batch, take the same step as one process given the
whole batch. Gradients, loss totals and token counts are *summed* across processes and divided
once by the global count, so token-weighted losses stay exact however the padding falls.

What each strategy keeps per process (W processes, P = parameter bytes) and what one step sends:

=========  ==============  ====================  ===============  ==================================
strategy   params          grads after reduce    optimizer state  communication per step
=========  ==============  ====================  ===============  ==================================
``ddp``    whole           whole (all-reduce)    whole            all-reduce of the grads
``zero1``  whole           whole (all-reduce)    1/W (Shard(0))   + all-gather of the updates
``zero2``  whole           1/W (reduce-scatter)  1/W              reduce-scatter, all-gather updates
``fsdp``   1/W (Shard(0))  1/W                   1/W              per block: all-gather params (in
                                                                  forward and again in backward),
                                                                  reduce-scatter its grads
=========  ==============  ====================  ===============  ==================================

Sharded leaves are ``DTensor``\\ s placed ``Shard(0)`` on a 1-D ``DeviceMesh`` (a tensor's rows
split as ``torch.chunk`` splits them; 0-d tensors are ``Replicate()``). The optimizers of
``ftrain.optim`` run on them unchanged: their ``torch._foreach_*`` math is elementwise, and DTensor
makes every reduction in them global (the norm in ``clip_by_global_norm``, ``metrics["grad_norm"]``,
``adafactor``'s statistics of a matrix whose rows are split: a few small collectives a matrix).
Checked against ddp: ``sgd``, ``adam``, ``adamw``, ``lion`` and ``adamw8bit`` give the same bits
under zero1/zero2/fsdp; ``lamb`` and clipping agree to rounding (a norm summed over shards);
``adafactor`` equals one process to 1e-5. Plain tensors that an optimizer makes inside its update
(e.g. the ``sqrt(numel)`` of each tensor) count as ``Replicate()``, since every process computes
them alike. The new state is put back in the layout it came in (a statistic reduced over the
shards comes back ``Replicate()``), so the layout that :func:`shard_state` chose holds step after
step. An optimizer that DTensor cannot run (an in-place op on a partly reduced tensor) fails on
its first step with an error that says so. The few elementwise ``_foreach_*`` ops that DTensor
has no rule for (``_foreach_copy_``) run on the local shards. The bulk traffic goes through one
flat buffer per group of tensors (per step for ddp/zero, per block for fsdp), as FSDP2 does, not
one collective per tensor.

``fsdp`` runs the model's blocks (found as ``ft.checkpoint`` finds them: the children of its
largest ``ModuleList``) one at a time: right before a block runs, its parameters are all-gathered
into whole tensors; right after, they are dropped. Tensors that backward needs from them are not
kept: they are saved as a reference to the shard and gathered again when backward reaches the block
(under ``ft.checkpoint`` the recompute gathers them). The gradient of a gathered tensor is
reduce-scattered straight back to its shard. So the parameter memory of a process is its shard plus
about one block at a time (:func:`track_gathered` measures it); the parameters outside the blocks
(embeddings, final norm) are gathered for the whole forward.

Composition:

* ``ft.accumulate``: grads are reduced once per optimizer step, after the last micro-batch (ddp,
  zero1, zero2). ``fsdp`` reduce-scatters each micro-batch's grads during its backward, as FSDP
  does, so that no process ever holds whole gradients; the sum is the same.
* ``ft.checkpoint`` and ``ft.autocast`` compose in any order. Under autocast without checkpoint,
  ``fsdp`` keeps the bf16/fp16 *casts* of each block's weights for backward (autocast makes them;
  half the bytes of the gathered block); with ``ft.checkpoint`` nothing of them is kept.
* fp16 loss scaling: each rank backpropagates its loss divided by its own token count, and the
  step weights the gradients by that count afterwards; so under ``fsdp`` the gradients are
  reduce-scattered once per step, after that (held whole until then), not during backward. A
  step with non-finite gradients is skipped on every rank alike. fp16 results equal ddp's; against
  one process they differ by fp16 rounding (the scaled activations differ).
* ``ft.compile`` (last): works for ``ddp``, ``zero1`` and ``zero2`` (same result as eager; the
  collectives and DTensor break the graph). Refused for ``fsdp`` when the step is built, in
  either order: dynamo cannot trace the per-block gathering (module hooks installed during the
  step, saved-tensor hooks). Compiled anyway, a 2-layer GPT on 2 CPU ranks gave eager's result
  but hit dynamo's recompile limit in those hooks on every step and ran about 70 times slower
  than eager (1.5 s against 0.02 s a step, after 75 s for the first). Use ``fsdp`` eagerly, or
  ``zero2`` compiled.
* The model must be called through ``ft.apply`` inside the loss (``fsdp`` gathers there).
* Randomness: each process folds its rank into the step's random stream, so dropout masks differ
  between ranks (as they would between the rows of one big batch), and a sharded run with dropout
  equals one process only in distribution, not bit for bit.

Saving: :func:`unshard_state` gathers a whole, plain state (every process calls it), which
``ft.save`` writes from rank 0; after ``ft.load``, :func:`shard_state` shards it again for any
number of processes, since a whole state does not depend on the world size.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ftrain import tree
from ftrain.optim.base import GradientTransformation, _accepts_inplace
from ftrain.state import TrainState, module_hooks
from ftrain.step import Step, _mix
from ftrain.transforms._common import check_step
from ftrain.transforms.checkpoint import _Checkpointed, find_blocks

__all__ = [
    "STRATEGIES",
    "shard",
    "shard_state",
    "unshard_state",
    "unshard",
    "local_bytes",
    "track_gathered",
    "default_mesh",
]

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")

# Tensors per flat all-reduce bucket: bounds the extra memory of the flat copy (64 MiB of fp32).
_BUCKET_ELEMENTS = 1 << 24


def _dtensor():
    # Imported when used: torch.distributed.tensor is a heavy import for single-process users.
    from torch.distributed import tensor

    return tensor


def _is_dtensor(t: object) -> bool:
    return isinstance(t, _dtensor().DTensor)


_SPECS: dict[tuple, Any] = {}


def _wrap(local: torch.Tensor, mesh, placements: tuple, shape, stride) -> torch.Tensor:
    """``DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)`` without its
    autograd function (about 0.3 ms a call on a CPU; a step makes one per tensor): the DTensor is
    built from a cached spec. For tensors that need no gradient (state, grads, updates)."""
    d = _dtensor()
    key = (mesh, placements, tuple(shape), tuple(stride), local.dtype)
    spec = _SPECS.get(key)
    if spec is None:
        try:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        except ImportError:  # a torch that moved it: the public, slower way
            return d.DTensor.from_local(
                local, mesh, placements, run_check=False, shape=shape, stride=stride
            )
        meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
        spec = _SPECS[key] = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return d.DTensor(local, spec, requires_grad=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (no autograd: ``to_local``'s no-grad path)."""
    with torch.no_grad():
        return t.to_local()


# -- checks and the mesh ----------------------------------------------------------------------


def _check_strategy(strategy: object, fn: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(
            f"ft.{fn}(strategy={strategy!r}): unknown strategy; legal strategies are "
            f"{', '.join(repr(s) for s in STRATEGIES)} (data parallel; ZeRO-1: optimizer state "
            "sharded; ZeRO-2: gradients too; FSDP: parameters too)."
        )
    return strategy


def _require_group(fn: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"ft.{fn}: no torch.distributed process group. Launch with torchrun (e.g. "
            "`torchrun --nproc_per_node 2 train.py`) and call ft.distributed.init() before "
            "building the step; in tests and notebooks use "
            "ft.testing.run_distributed(fn, world_size=2)."
        )


_MESHES: dict[tuple, Any] = {}


def default_mesh() -> Any:
    """The 1-D ``DeviceMesh`` over every process of the default group (``cuda`` under NCCL,
    ``cpu`` otherwise); made once per process group."""
    _require_group("default_mesh")
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    key = (device, id(dist.group.WORLD), dist.get_world_size())
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = init_device_mesh(device, (dist.get_world_size(),))
    return mesh


def _check_mesh(mesh: Any, fn: str) -> Any:
    if mesh is None:
        return default_mesh()
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"ft.{fn}(mesh=...): expected a 1-D torch.distributed.device_mesh.DeviceMesh (data "
            f"parallel over its processes), got {mesh!r}. Leave it None for all processes."
        )
    return mesh


# -- flat collectives: one buffer per group of tensors -----------------------------------------


class _Layout:
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
        t0 = pieces[0]
        send = torch.cat(
            [p.reshape(-1) for p in pieces] + [t0.new_zeros(self.pads[rank])]
        )  # (segment,)
        out = t0.new_empty(self.world * self.segment)  # (W * segment,)
        _all_gather(out, send, group)
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
        t0 = fulls[0]
        send = torch.cat(
            [
                piece.reshape(-1)
                for r in range(self.world)
                for piece in (*self.local(fulls, r), t0.new_zeros(self.pads[r]))
            ]
        )  # (W * segment,)
        out = t0.new_empty(self.segment)
        _reduce_scatter(out, send, group)
        pieces = out[: sum(self.sizes[rank])].split(self.sizes[rank])
        return [p.view(-1, *s[1:]) for p, s in zip(pieces, self.shapes)]


@functools.lru_cache(maxsize=1024)
def _layout(shapes: tuple[torch.Size, ...], world: int) -> _Layout:
    return _Layout(shapes, world)


def _all_gather(out: torch.Tensor, send: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, send, group=group)


def _reduce_scatter(out: torch.Tensor, send: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, send, group=group)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _all_reduce_flat(
    tensors: Sequence[torch.Tensor], group, in_place: bool = True
) -> list[torch.Tensor]:
    """Sum ``tensors`` across ranks through few flat buffers (one per dtype and bucket) instead
    of one collective per tensor. Returns the sums as views of the flat buffers (fresh memory,
    one per tensor, even where the inputs share memory); ``in_place`` also copies them back."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in _by_dtype(tensors).values():
        bucket: list[int] = []
        size = 0
        for i in [*idx, None]:
            t = tensors[i] if i is not None else None
            if bucket and (t is None or size + t.numel() > _BUCKET_ELEMENTS):
                flat = torch.cat([tensors[b].reshape(-1) for b in bucket])  # a copy
                dist.all_reduce(flat, group=group)
                parts = flat.split([tensors[b].numel() for b in bucket])
                for b, part in zip(bucket, parts):
                    out[b] = part.view(tensors[b].shape)
                if in_place:
                    torch._foreach_copy_([tensors[b] for b in bucket], [out[b] for b in bucket])
                bucket, size = [], 0
            if t is not None:
                bucket.append(i)
                size += t.numel()
    return out


# -- plain <-> sharded --------------------------------------------------------------------------


def _placements(t: torch.Tensor) -> tuple:
    d = _dtensor()
    return (d.Shard(0),) if t.dim() > 0 else (d.Replicate(),)


def _as_sharded(t: torch.Tensor, mesh, *, copy: bool) -> torch.Tensor:
    """The DTensor (``Shard(0)``, or ``Replicate()`` for 0-d) whose whole value is the plain
    ``t`` that every rank holds: this rank's rows (a view, or a copy with ``copy``), no traffic."""
    if _is_dtensor(t):
        if tuple(t.placements) == _placements(t):
            return t
        return t.redistribute(mesh, _placements(t))
    if t.dim() == 0:
        local = t.clone() if copy else t
    else:
        (local,) = _layout((t.shape,), mesh.size()).local([t], mesh.get_local_rank())
        local = local.clone() if copy else local
    return _wrap(local, mesh, _placements(t), t.shape, t.stride())


def _gather_leaves(tensors: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """Whole plain tensors for a list of DTensors (plain tensors pass through); the ``Shard(0)``
    ones move in one flat all-gather per dtype."""
    d = _dtensor()
    out: list[torch.Tensor | None] = [None] * len(tensors)
    flat: list[int] = []
    for i, t in enumerate(tensors):
        if not _is_dtensor(t):
            out[i] = t
        elif tuple(t.placements) == (d.Shard(0),) and t.device_mesh == mesh:
            flat.append(i)
        else:
            out[i] = t.full_tensor()
    rank, group = mesh.get_local_rank(), mesh.get_group()
    for idx in _by_dtype([tensors[i] for i in flat]).values():
        chosen = [tensors[flat[j]] for j in idx]
        layout = _layout(tuple(t.shape for t in chosen), mesh.size())
        whole = layout.all_gather([_local(t) for t in chosen], rank, group)
        for j, w in zip(idx, whole):
            out[flat[j]] = w
    return out  # type: ignore[return-value]


def _reduce_scatter_leaves(tensors: Sequence[torch.Tensor], mesh) -> list[torch.Tensor]:
    """Sums over ranks of whole plain tensors, each rank keeping its ``Shard(0)`` rows as a
    DTensor (0-d tensors are all-reduced and kept whole, ``Replicate()``). One flat
    reduce-scatter per dtype."""
    d = _dtensor()
    rank, group = mesh.get_local_rank(), mesh.get_group()
    out: list[torch.Tensor | None] = [None] * len(tensors)
    scalars = [i for i, t in enumerate(tensors) if t.dim() == 0]
    if scalars:
        summed = [tensors[i].clone() for i in scalars]
        _all_reduce_flat(summed, group)
        for i, t in zip(scalars, summed):
            out[i] = _wrap(t, mesh, (d.Replicate(),), t.shape, t.stride())
    rows = [i for i, t in enumerate(tensors) if t.dim() > 0]
    for idx in _by_dtype([tensors[i] for i in rows]).values():
        chosen = [tensors[rows[j]].contiguous() for j in idx]
        layout = _layout(tuple(t.shape for t in chosen), mesh.size())
        for j, t, piece in zip(idx, chosen, layout.reduce_scatter(chosen, rank, group)):
            out[rows[j]] = _wrap(piece, mesh, (d.Shard(0),), t.shape, t.stride())
    return out  # type: ignore[return-value]


def unshard(td: TensorDictBase) -> TensorDictBase:
    """``td`` with every DTensor leaf replaced by its whole, plain tensor (on every rank).

    A collective: every process must call it. Plain leaves are returned as they are.
    """
    leaves = tree.leaves(td)
    sharded = [t for t in leaves if _is_dtensor(t)]
    if not sharded:
        return td
    mesh = sharded[0].device_mesh
    return tree.unflatten(td, _gather_leaves(leaves, mesh))


def unshard_state(state: TrainState) -> TrainState:
    """A plain copy of a sharded state: every DTensor gathered into its whole tensor.

    Every process must call it (it all-gathers); each gets the whole state. Save it from rank 0
    with ``ft.save`` (the checkpoint then holds no DTensor and no trace of the world size), and
    after ``ft.load`` give it back to :func:`shard_state`, with this or any other number of
    processes.
    """
    if not isinstance(state, TrainState):
        raise TypeError(
            f"ft.unshard_state(state): expected an ft.TrainState, got {type(state).__name__}."
        )
    return state.replace(
        params=unshard(state.params), opt_state=unshard(state.opt_state), extra=unshard(state.extra)
    )


def local_bytes(td: TensorDictBase | TrainState) -> int:
    """Bytes this process holds for the tensors of ``td``: a DTensor counts its local shard."""
    if isinstance(td, TrainState):
        return sum(local_bytes(getattr(td, f)) for f in ("params", "opt_state", "extra"))
    total = 0
    for t in tree.leaves(td):
        if _is_dtensor(t):
            t = _local(t)
        total += t.numel() * t.element_size()
    return total


def _shard_tree(td: TensorDictBase, mesh, *, copy: bool) -> TensorDictBase:
    """Every leaf with one or more dimensions as a ``Shard(0)`` DTensor; 0-d leaves stay plain."""
    leaves = tree.leaves(td)
    return tree.unflatten(
        td, [_as_sharded(t, mesh, copy=copy) if t.dim() > 0 else t for t in leaves]
    )


def _check_replicated(state: TrainState, group) -> None:
    """Every rank must start from the same params: compare a checksum per leaf (one collective)."""
    leaves = [t for t in tree.leaves(state.params) if not _is_dtensor(t)]
    if not leaves or dist.get_world_size(group) == 1:
        return
    sums = torch.stack([t.detach().double().sum() for t in leaves]).cpu()
    if leaves[0].device.type == "cuda":
        sums = sums.cuda()
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    differs = ((low != high) & ~(low.isnan() & high.isnan())).nonzero().flatten().tolist()
    if differs:
        path = tree.paths(state.params)[differs[0]]
        raise ValueError(
            f"ft.shard_state: the params differ between processes (first: {path!r}). Every process "
            "must start from the same state: build the model with the same seed everywhere, or "
            "load the same checkpoint."
        )


def shard_state(state: TrainState, strategy: str = "ddp", mesh: Any = None) -> TrainState:
    """Lay ``state`` out for ``ft.shard(step, strategy)``: this process keeps its shards.

    ``ddp``: unchanged (plain, whole). ``zero1``/``zero2``: the optimizer state's tensors of one
    or more dimensions become ``Shard(0)`` DTensors (counters stay plain). ``fsdp``: the params and
    the tensors in ``state.extra`` too (e.g. ``ft.ema``'s average, which follows the params).

    ``state`` must be the same whole state on every process (a fresh one from the same seed, or
    one loaded from a checkpoint); this is checked (one small collective). No other traffic: each
    process copies out its own rows, so the whole tensors can be freed afterwards. A state that is
    already sharded is re-laid out (gathered first if needed), so ``shard_state`` is idempotent.
    """
    strategy = _check_strategy(strategy, "shard_state")
    _require_group("shard_state")
    mesh = _check_mesh(mesh, "shard_state")
    if not isinstance(state, TrainState):
        raise TypeError(
            f"ft.shard_state(state, ...): expected an ft.TrainState, got {type(state).__name__}."
        )
    _check_device(state, mesh)
    if strategy != "fsdp" and any(_is_dtensor(t) for t in tree.leaves(state.params)):
        state = state.replace(params=unshard(state.params), extra=unshard(state.extra))
    if strategy == "ddp" and any(_is_dtensor(t) for t in tree.leaves(state.opt_state)):
        state = state.replace(opt_state=unshard(state.opt_state))
    _check_replicated(state, mesh.get_group())
    if strategy == "ddp":
        return state
    opt_state = _shard_tree(state.opt_state, mesh, copy=True)
    if strategy != "fsdp":
        return state.replace(opt_state=opt_state)
    return state.replace(
        params=_shard_tree(state.params, mesh, copy=True),
        opt_state=opt_state,
        extra=_shard_tree(state.extra, mesh, copy=True),
    )


def _check_device(state: TrainState, mesh) -> None:
    for t in tree.leaves(state.params)[:1]:
        if t.device.type != mesh.device_type:
            raise ValueError(
                f"ft.shard_state: the params are on {t.device.type} but the mesh is on "
                f"{mesh.device_type} (gloo: cpu, NCCL: cuda). Move the state first, e.g. "
                f"state = state.to('{mesh.device_type}')."
            )


# -- the reduce phase ---------------------------------------------------------------------------


class _AllReduce:
    """ddp, zero1: sum grads, loss total and count across ranks in flat buckets. The summed
    grads are new tensors (views of the flat buffers); ``sums`` is summed in place."""

    after_backward = True  # see ftrain.step._reduces_after

    def __init__(self, mesh):
        self.mesh = mesh

    def reduce(self, grads: list[torch.Tensor], sums: torch.Tensor) -> list[torch.Tensor]:
        *summed, total = _all_reduce_flat([*grads, sums], self.mesh.get_group(), in_place=False)
        sums.copy_(total)
        return summed


class _ReduceScatter:
    """zero2: sums of the grads land as ``Shard(0)`` DTensors, each rank holding its rows."""

    after_backward = True  # see ftrain.step._reduces_after

    def __init__(self, mesh):
        self.mesh = mesh

    def reduce(self, grads: list[torch.Tensor], sums: torch.Tensor) -> list[torch.Tensor]:
        _all_reduce_flat([sums], self.mesh.get_group())
        return _reduce_scatter_leaves(grads, self.mesh)


class _CountsOnly:
    """fsdp: the grads were reduce-scattered in backward; the loss total and count remain. Under
    fp16 loss scaling the backward leaves them unreduced (``Partial``, see :class:`_Session`) and
    they are reduce-scattered here, once per step."""

    def __init__(self, mesh):
        self.mesh = mesh

    def reduce(self, grads: list[torch.Tensor], sums: torch.Tensor) -> list[torch.Tensor] | None:
        dist.all_reduce(sums, group=self.mesh.get_group())
        partial = [i for i, g in enumerate(grads) if g.placements[0].is_partial()]
        if not partial:
            return None
        out = list(grads)
        summed = _reduce_scatter_leaves([_local(grads[i]) for i in partial], self.mesh)
        for i, g in zip(partial, summed):
            out[i] = g
        return out


# -- the update phase ----------------------------------------------------------------------------


class _LocalForeach(TorchDispatchMode):
    """Elementwise ``torch._foreach_*`` ops that DTensor has no sharding rule for (e.g.
    ``_foreach_copy_``) run on the local shards, when the operands at each list position are laid
    out alike (same mesh, placements and shape, or 0-d). Every other op goes to DTensor."""

    _REDUCTIONS = ("aten::_foreach_norm", "aten::_foreach_max")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except NotImplementedError:
            name = func.name()
            if not name.startswith("aten::_foreach_") or name.startswith(self._REDUCTIONS):
                raise
            like = _alike(args)
            if like is None:
                raise
        local = [_to_local(a) for a in args]
        out = func(*local, **{k: _to_local(v) for k, v in kwargs.items()})
        if out is None or not isinstance(out, (list, tuple)):
            return out  # in place: the shards were written
        return [
            _wrap(o, ref.device_mesh, ref.placements, ref.shape, ref.stride())
            if ref is not None
            else o
            for o, ref in zip(out, like)
        ]


def _to_local(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_to_local(t) for t in x]
    return _local(x) if _is_dtensor(x) else x


def _alike(args: Sequence[Any]) -> list | None:
    """Per list position, the DTensor whose layout every operand there shares (None where all
    are plain), or None when some position mixes layouts."""
    lists = [
        a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)
    ]
    scalars = [a for a in args if isinstance(a, torch.Tensor)]
    if not lists or any(s.dim() > 0 for s in scalars):
        return None
    refs: list = []
    for column in zip(*lists):
        ref = None
        for t in column:
            if t.dim() == 0 and (not _is_dtensor(t) or all(p.is_replicate() for p in t.placements)):
                continue
            if not _is_dtensor(t):
                return None
            if ref is None:
                ref = t
            elif (t.device_mesh, t.placements, t.shape) != (
                ref.device_mesh,
                ref.placements,
                ref.shape,
            ):
                return None
        refs.append(ref)
    return refs


@contextlib.contextmanager
def _plain_as_replicated() -> Iterator[None]:
    """Optimizer context: a plain tensor that meets a DTensor counts as ``Replicate()``.

    True of the plain tensors an optimizer makes inside its update: they are computed the same
    way on every process from constants and replicated values (e.g. the ``sqrt(numel)`` of each
    tensor that ``clip_by_block_rms`` divides the norms by). DTensor would refuse the mixed op;
    ``implicit_replication`` is its switch for this, scoped here and restored on exit."""
    from torch.distributed.tensor.experimental import implicit_replication

    dispatcher = _dtensor().DTensor._op_dispatcher
    if getattr(dispatcher, "_allow_implicit_replication", False):
        yield  # already on (the caller's own implicit_replication): leave it on
        return
    with implicit_replication():
        yield


def _laid_out_like(new: TensorDictBase, old: TensorDictBase) -> TensorDictBase:
    """``new`` with each DTensor leaf placed as the same leaf of ``old`` (a tree of the same
    structure); ``new`` itself when nothing moves.

    An optimizer's out-of-place op may return another placement than its input had: the new
    value of a statistic reduced over the shards comes back ``Replicate()`` (adafactor's
    ``v_col``). Put back, the state keeps the layout :func:`shard_state` gave it, step after
    step. ``Replicate`` to ``Shard(0)`` keeps this rank's rows (no traffic); ``Partial`` to
    ``Shard(0)`` is a reduce-scatter."""
    news, olds = tree.leaves(new), tree.leaves(old)
    moved = [
        n.redistribute(o.device_mesh, o.placements)
        if _is_dtensor(n) and _is_dtensor(o) and n.placements != o.placements
        else n
        for n, o in zip(news, olds)
    ]
    if all(m is n for m, n in zip(moved, news)):
        return new
    return tree.unflatten(new, moved)


def _on_shards(inner: GradientTransformation) -> GradientTransformation:
    """``inner`` run on DTensors: the gaps of DTensor filled (:class:`_LocalForeach`, plain
    tensors as replicated), and the updates and new state laid out as the grads and state that
    came in (:func:`_laid_out_like`)."""
    takes_inplace = _accepts_inplace(inner.update)

    def update(updates, state, params=None, *, inplace=False):
        try:
            with _LocalForeach(), _plain_as_replicated():
                if takes_inplace:
                    new_u, new_s = inner.update(updates, state, params, inplace=inplace)
                else:
                    new_u, new_s = inner.update(updates, state, params)
                return _laid_out_like(new_u, updates), _laid_out_like(new_s, state)
        except (RuntimeError, NotImplementedError) as e:
            if "DTensor" not in str(e) and "harding" not in str(e):
                raise
            raise type(e)(
                "ft.shard: the optimizer cannot run on sharded state: DTensor refused one of its "
                f"operations ({str(e).strip().splitlines()[0]}). Use strategy 'ddp' with this "
                "optimizer, or write the operation out of place (e.g. x.square() rather than "
                "x.square_() on a reduced tensor) so that DTensor can finish the reduction first."
            ) from e

    return GradientTransformation(inner.init, update)


# zero1/zero2: params and grads whole, optimizer state sharded


def _zero_optimizer(inner: GradientTransformation, mesh) -> GradientTransformation:
    """``inner`` run on this rank's rows: params and grads enter as ``Shard(0)`` DTensors (views,
    no traffic), the sharded state stays sharded, the updates are all-gathered whole."""
    inner = _on_shards(inner)

    def init(params):
        return inner.init(_shard_tree(params, mesh, copy=False))

    def update(updates, state, params=None, *, inplace=False):
        u = [_as_sharded(x, mesh, copy=False) for x in tree.leaves(updates)]
        u_td = tree.unflatten(updates, u)
        p_td = None
        if params is not None:
            p_td = tree.unflatten(
                params, [_as_sharded(x, mesh, copy=False) for x in tree.leaves(params)]
            )
        new_u, new_state = inner.update(u_td, state, p_td, inplace=inplace)
        whole = _gather_leaves([_as_sharded(x, mesh, copy=False) for x in tree.leaves(new_u)], mesh)
        return tree.unflatten(updates, whole), new_state

    return GradientTransformation(init, update)


# -- fsdp: gather one block at a time -----------------------------------------------------------


_TRACKERS: list[_Tracker] = []


class _Tracker:
    """Bytes of gathered parameter buffers alive, sampled whenever a new one is made."""

    def __init__(self) -> None:
        self.alive: list[tuple[Any, int]] = []
        self.peak = 0
        self.gathers = 0

    def add(self, t: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.gathers += 1
        self.alive = [(ref, n) for ref, n in self.alive if not ref.expired()]
        storage = t.untyped_storage()
        self.alive.append((StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.alive))


def _track(t: torch.Tensor) -> None:
    for tracker in _TRACKERS:
        tracker.add(t)


@contextlib.contextmanager
def track_gathered() -> Iterator[_Tracker]:
    """Measure the whole parameters that ``fsdp`` holds while it steps::

        with track_gathered() as t:
            state, metrics = step(state, batch)
        t.peak  # most bytes of gathered whole parameters alive at once

    ``peak`` counts the whole tensors of every gather (forward, and again in backward) for as long
    as anything holds them; add the shards (:func:`local_bytes`) for the parameter memory of the
    process. Not counted: the flat receive buffer of the gather in progress (one group's size),
    which lives only while it is cut into whole tensors (the collective backend may hold it a
    moment longer).
    """
    tracker = _Tracker()
    _TRACKERS.append(tracker)
    try:
        yield tracker
    finally:
        _TRACKERS.remove(tracker)


class _Gathered:
    """One gather of one group of parameters (a block, or the model's other params)."""

    def __init__(self, mesh, shards: list[torch.Tensor], defer: bool):
        self.mesh = mesh
        self.shards = shards  # the DTensors, in the order of the gathered outputs
        self.defer = defer  # backward leaves the grads unreduced (Partial)
        self.again: list[torch.Tensor] | None = None  # re-gathered for backward, then dropped

    def gather(self) -> list[torch.Tensor]:
        whole = _gather_leaves(self.shards, self.mesh)
        for w in whole:
            _track(w)
        return whole

    def regather(self, i: int) -> torch.Tensor:
        if self.again is None:
            with torch.no_grad():
                self.again = self.gather()
        return self.again[i]


class _GatherFn(torch.autograd.Function):
    """Forward: whole tensors from shards (all-gather). Backward: the gradients of the whole
    tensors, summed over ranks, land on the shards (reduce-scatter)."""

    @staticmethod
    def forward(ctx, gathered: _Gathered, *shards):
        ctx.gathered = gathered
        return tuple(gathered.gather())

    @staticmethod
    def backward(ctx, *grads):
        g: _Gathered = ctx.gathered
        g.again = None  # the block's backward is over: drop what it re-gathered
        grads = [
            gr if gr is not None else torch.zeros(s.shape, dtype=s.dtype, device=s.device)
            for gr, s in zip(grads, g.shards)
        ]
        if g.defer:  # each rank's own sum, reduced later by the reducer
            partial = (_dtensor().Partial(),)
            return (None, *(_wrap(x, g.mesh, partial, x.shape, x.stride()) for x in grads))
        return (None, *_reduce_scatter_leaves(grads, g.mesh))


class _Regather:
    """What a saved-for-backward view of a gathered parameter is packed into."""

    __slots__ = ("gathered", "index", "size", "stride", "offset")

    def __init__(self, gathered, index, size, stride, offset):
        self.gathered, self.index = gathered, index
        self.size, self.stride, self.offset = size, stride, offset


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _slots(module: nn.Module) -> tuple[list, list[tuple[nn.Module, list]]]:
    """``(root_slots, [(block, block_slots)])``: the ``(submodule, name)`` of every parameter,
    those inside each block apart from the rest. Computed once per template module."""
    got = _SLOTS.get(module)
    if got is None:
        blocks = find_blocks(module)
        inside = {id(m) for b in blocks for m in b.modules()}
        root = [(m, n) for m in module.modules() if id(m) not in inside for n in m._parameters]
        per_block = [(b, [(m, n) for m in b.modules() for n in m._parameters]) for b in blocks]
        got = _SLOTS[module] = (root, per_block)
    return got


def _checkpoint_call(block: nn.Module, args: tuple) -> str:
    """Which call of a block this is under ``ft.checkpoint``: ``"outer"`` (its wrapper, which
    hands the block to torch.utils.checkpoint), ``"inside"`` (the block's own forward inside the
    checkpointed region) or ``"none"`` (not checkpointed, or a recompute in backward)."""
    module = sys.modules["ftrain.transforms.checkpoint"]
    marker = getattr(module, "_INSIDE", None)
    if marker is not None and args and args[0] is marker:
        return "inside"
    wrapper = block.__dict__.get("forward")
    if isinstance(wrapper, _Checkpointed):
        return "inside" if getattr(wrapper, "inside", False) else "outer"
    return "none"


class _Session:
    """The gathering machinery of one fsdp step.

    Forward hooks on the model's blocks (and on the model, for its other params) swap whole
    tensors in right before a block runs and put the shards back right after. They are installed
    the first time ``ft.apply`` meets a module in this step and stay until the step ends, because
    ``ft.checkpoint`` runs blocks again during backward and those runs must gather too.

    With ``defer`` (fp16 loss scaling) the backward of a gather leaves each rank's gradient
    unreduced: the step backpropagates each rank's loss divided by that rank's own token count
    and multiplies the gradients by the count afterwards, so they can only be summed across ranks
    after that; the reducer does it once per step, and the gradients are held whole until then.
    """

    def __init__(self, mesh, defer: bool = False):
        self.mesh = mesh
        self.defer = defer
        self.handles: list[Any] = []
        self.installed: set[int] = set()
        self.stack: list[tuple[list, list, list[int]] | None] = []
        self.saved: dict[int, tuple[_Gathered, int, torch.dtype]] = {}  # storage ptr -> source

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.installed.clear()

    def install(self, module: nn.Module) -> None:
        if id(module) in self.installed:
            return
        self.installed.add(id(module))
        root, blocks = _slots(module)
        groups = [(module, root, True), *((b, slots, False) for b, slots in blocks)]
        for m, slots, is_root in groups:
            pre = functools.partial(self.pre, slots, is_root)
            self.handles.append(m.register_forward_pre_hook(pre))
            self.handles.append(m.register_forward_hook(self.post, always_call=True))

    @contextlib.contextmanager
    def __call__(self, module: nn.Module) -> Iterator[None]:
        """The ``module_hooks`` hook: around one ``ft.apply`` in the forward."""
        self.install(module)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pre(self, slots, is_root: bool, block: nn.Module, args) -> None:
        # ft.checkpoint wraps a block's forward (a _Checkpointed in the instance dict) and runs
        # the block's own forward, in forward and again in backward, with _INSIDE as the first
        # argument. Gather only there: then the whole params are neither kept as checkpoint
        # inputs nor saved for backward (the recompute gathers them again).
        where = "root" if is_root else _checkpoint_call(block, args)
        inside = where == "inside"
        if where == "outer":
            self.stack.append(None)
            return
        current = [m._parameters[n] for m, n in slots]
        order: dict[int, int] = {}
        shards = []
        for t in current:
            if _is_dtensor(t) and id(t) not in order:
                order[id(t)] = len(shards)
                shards.append(t)
        if not shards:
            self.stack.append(None)
            return
        gathered = _Gathered(self.mesh, shards, self.defer)
        whole = _GatherFn.apply(gathered, *shards)
        ptrs = []
        if not inside and torch.is_grad_enabled():
            # saved for backward: packed as a reference to the shard (see pack); not under
            # checkpoint, which saves nothing inside a block.
            for i, w in enumerate(whole):
                ptr = w.untyped_storage().data_ptr()
                self.saved[ptr] = (gathered, i, w.dtype)
                ptrs.append(ptr)
        for (m, n), t in zip(slots, current):
            if id(t) in order:
                m._parameters[n] = whole[order[id(t)]]
        self.stack.append((slots, current, ptrs))

    def post(self, module: nn.Module, args, output) -> None:
        entry = self.stack.pop()
        if entry is None:
            return
        slots, current, ptrs = entry
        for (m, n), t in zip(slots, current):
            m._parameters[n] = t
        for p in ptrs:  # the whole tensors die now; their addresses may be reused
            self.saved.pop(p, None)

    def pack(self, t: torch.Tensor) -> Any:
        if self.saved and type(t) is torch.Tensor and t.layout == torch.strided:
            hit = self.saved.get(t.untyped_storage().data_ptr())
            if hit is not None and hit[2] == t.dtype:
                return _Regather(hit[0], hit[1], t.size(), t.stride(), t.storage_offset())
        return t

    @staticmethod
    def unpack(x: Any) -> torch.Tensor:
        if isinstance(x, _Regather):
            whole = x.gathered.regather(x.index)
            return whole.as_strided(x.size, x.stride, x.offset)
        return x


_SESSIONS: list[_Session] = []


@contextlib.contextmanager
def _fsdp_step(mesh, state: TrainState) -> Iterator[None]:
    """Step context: one :class:`_Session` for the extent of the step (forward and backward)."""
    fp16 = state is not None and "loss_scale" in state.extra.keys()
    session = _Session(mesh, defer=fp16)
    _SESSIONS.append(session)
    try:
        yield
    finally:
        _SESSIONS.remove(session)
        session.close()


@contextlib.contextmanager
def _fsdp_forward(mesh) -> Iterator[None]:
    """Forward context: route every ``ft.apply`` through the step's session (or, when the
    forward runs outside a step call, a session of its own)."""
    with contextlib.ExitStack() as stack:
        if not _SESSIONS:
            stack.enter_context(_fsdp_step(mesh, None))
        stack.enter_context(module_hooks(_SESSIONS[-1]))
        yield


# -- randomness per rank --------------------------------------------------------------------------


@contextlib.contextmanager
def _rank_stream(rank: int, state: TrainState) -> Iterator[None]:
    """Re-seed the generators the step seeded (inside its fork_rng) with the rank folded in."""
    seed = _mix(int(state.rng), int(state.step), rank + 1)
    torch.default_generator.manual_seed(seed)
    device = tree.leaves(state.params)[0].device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    yield


# -- the transform --------------------------------------------------------------------------------


@contextlib.contextmanager
def _check_layout(strategy: str, state: TrainState) -> Iterator[None]:
    """Step context: refuse a state that :func:`shard_state` did not lay out for ``strategy``
    (an unsharded fsdp state would otherwise train each rank on its own, silently)."""
    params = tree.leaves(state.params)
    opt = [t for t in tree.leaves(state.opt_state) if t.dim() > 0]
    if (params and _is_dtensor(params[0]) != (strategy == "fsdp")) or (
        opt and _is_dtensor(opt[0]) != (strategy != "ddp")
    ):
        raise ValueError(
            f"ft.shard(step, {strategy!r}) got a state laid out for another strategy (or not "
            f"sharded). Call state = ft.shard_state(state, {strategy!r}) once, after creating or "
            "loading it."
        )
    yield


def _is_fsdp(step: Step) -> bool:
    """Whether ``ft.shard(..., "fsdp")`` is among ``step``'s transforms."""
    return isinstance(step.reducer, _CountsOnly)


def _fsdp_with_compile(where: str, found: str) -> ValueError:
    """The error for ``ft.compile`` and ``fsdp`` in one step, in either order."""
    return ValueError(
        f"{where}: {found}, and a step sharded with 'fsdp' cannot be compiled. torch.compile "
        "cannot trace fsdp's per-block gathering (module hooks installed during the step, "
        "saved-tensor hooks): it recompiles on every step and runs block by block, far slower "
        "than eager. Use ft.compile(ft.shard(step, 'zero2')) (optimizer state and gradients "
        "sharded, params whole), or leave out ft.compile and run ft.shard(step, 'fsdp') eagerly."
    )


def shard(step: Step, strategy: str = "ddp", mesh: Any = None) -> Step:
    """Data parallelism across the processes of ``mesh`` (default: all of them).

    Every process calls the step with its own share of the global batch and a state laid out by
    :func:`shard_state` with the same ``strategy``; each gets the same new state (its shards of
    it) and the same metrics (``loss`` and ``count`` over the global batch). See the module
    docstring for what each strategy shards and sends.

    Args:
        step: an ``ft.Step`` (``accumulate``, ``checkpoint`` and ``autocast`` may come before or
            after; ``compile`` after, except for ``fsdp``).
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
        mesh: a 1-D ``DeviceMesh``; default :func:`default_mesh`.

    **Invariant:** N processes each given 1/N of the batch (any split, any padding) give the same
    state as one process given the whole batch: fp32, 1e-5 relative after several steps, for every
    strategy and with ``accumulate``/``checkpoint``/``autocast`` composed (differences are the
    order of floating-point sums). The optimizer math on shards is that of ddp (see the module
    docstring for which optimizers give the same bits).

    Raises at build time: no process group (launch with torchrun and call
    ``ft.distributed.init()``), an unknown strategy, a mesh that is not 1-D, shard applied twice,
    shard after ``ft.compile`` (and ``fsdp`` with ``ft.compile`` in either order: use ``zero2``, or
    leave out compile).
    At the first call: a state that :func:`shard_state` did not lay out for ``strategy``.
    """
    step = check_step(step, "shard")
    strategy = _check_strategy(strategy, "shard")
    if strategy == "fsdp" and step.compiled is not None:
        raise _fsdp_with_compile("ft.shard(step, 'fsdp')", "step is already compiled (ft.compile)")
    _require_group("shard")
    mesh = _check_mesh(mesh, "shard")
    if step.reducer is not None:
        raise ValueError("ft.shard was applied twice; apply it once, with the strategy you want.")
    step_contexts = [
        functools.partial(_check_layout, strategy),
        functools.partial(_rank_stream, mesh.get_local_rank()),
    ]
    if strategy == "fsdp":
        step_contexts.append(functools.partial(_fsdp_step, mesh))
    changes: dict[str, Any] = {
        "step_contexts": (*step.step_contexts, *step_contexts),
    }
    if strategy in ("ddp", "zero1"):
        changes["reducer"] = _AllReduce(mesh)
    elif strategy == "zero2":
        changes["reducer"] = _ReduceScatter(mesh)
    else:
        changes["reducer"] = _CountsOnly(mesh)
        changes["forward_contexts"] = (
            *step.forward_contexts,
            lambda params: _fsdp_forward(mesh),
        )
    if strategy in ("zero1", "zero2"):
        changes["optimizer"] = _zero_optimizer(step.optimizer, mesh)
    elif strategy == "fsdp":
        changes["optimizer"] = _on_shards(step.optimizer)
    return step.replace("shard", **changes)
