"""Laying a state out across processes: what each process keeps under ``ft.shard``.

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

:func:`shard_state` lays a whole state out for a strategy (each process copies out its own rows:
no traffic); :func:`unshard_state` gathers it back whole, e.g. to save it. A whole state does not
depend on the world size, so it shards again onto any number of processes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from ftrain import tree
from ftrain.distributed.collectives import gather_leaves
from ftrain.distributed.data_parallel import dp_split
from ftrain.distributed.dtensor import is_dtensor, local, on_shards
from ftrain.distributed.launch import check_mesh, require_group
from ftrain.optim.base import GradientTransformation
from ftrain.state import TrainState

__all__ = [
    "STRATEGIES",
    "SHARDED_FIELDS",
    "check_strategy",
    "check_replicated",
    "shard_state",
    "unshard_state",
    "unshard",
    "shard_tree",
    "local_bytes",
    "zero_optimizer",
]

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
# The state fields each strategy splits over the processes (zero2's gradients live in the step).
SHARDED_FIELDS = {
    "ddp": (),
    "zero1": ("opt_state",),
    "zero2": ("opt_state",),
    "fsdp": ("params", "opt_state", "extra"),
}


def check_strategy(strategy: object, fn: str) -> str:
    """``strategy`` if it is one of :data:`STRATEGIES`, else an error naming ``fn``."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"ft.{fn}(strategy={strategy!r}): unknown strategy; legal strategies are "
            f"{', '.join(repr(s) for s in STRATEGIES)} (data parallel; ZeRO-1: optimizer state "
            "sharded; ZeRO-2: gradients too; FSDP: parameters too)."
        )
    return strategy


def unshard(td: TensorDictBase) -> TensorDictBase:
    """``td`` with every DTensor leaf replaced by its whole, plain tensor (on every rank).

    A collective: every process must call it. Plain leaves are returned as they are.
    """
    leaves = tree.leaves(td)
    sharded = [t for t in leaves if is_dtensor(t)]
    if not sharded:
        return td
    mesh = sharded[0].device_mesh
    return tree.unflatten(td, gather_leaves(leaves, mesh))


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
        if is_dtensor(t):
            t = local(t)
        total += t.numel() * t.element_size()
    return total


def shard_tree(td: TensorDictBase, mesh, *, copy: bool) -> TensorDictBase:
    """Every leaf with one or more dimensions as a ``Shard(0)`` DTensor over ``mesh`` (a
    tensor-parallel one split over ``dp`` as ``ftrain.distributed.data_parallel.dp_split`` says);
    0-d leaves stay plain."""
    leaves = tree.leaves(td)
    return tree.unflatten(
        td, [dp_split.split(t, mesh, copy=copy) if t.dim() > 0 else t for t in leaves]
    )


def check_replicated(state: TrainState, group) -> None:
    """Raise unless every rank of ``group`` holds the same plain params: a checksum per leaf is
    compared (two small all-reduces: min and max)."""
    leaves = [t for t in tree.leaves(state.params) if not is_dtensor(t)]
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

    A tensor-parallel state (``tp.shard_state(state)``) is laid out over ``mesh``, the ``dp``
    dimension of its mesh: its pieces are split again over ``dp``
    (``ftrain.distributed.data_parallel.dp_split``), the same fields as above.
    """
    strategy = check_strategy(strategy, "shard_state")
    require_group("shard_state")
    mesh = check_mesh(mesh, "shard_state")
    if not isinstance(state, TrainState):
        raise TypeError(
            f"ft.shard_state(state, ...): expected an ft.TrainState, got {type(state).__name__}."
        )
    _check_device(state, mesh)
    if any(dp_split.is_tp_laid(t) for t in tree.leaves(state.params)):
        return _shard_tp_state(state, strategy, mesh)
    if strategy != "fsdp" and any(is_dtensor(t) for t in tree.leaves(state.params)):
        state = state.replace(params=unshard(state.params), extra=unshard(state.extra))
    if strategy == "ddp" and any(is_dtensor(t) for t in tree.leaves(state.opt_state)):
        state = state.replace(opt_state=unshard(state.opt_state))
    check_replicated(state, mesh.get_group())
    if strategy == "ddp":
        return state
    fields = SHARDED_FIELDS[strategy]
    return state.replace(**{f: shard_tree(getattr(state, f), mesh, copy=True) for f in fields})


def _shard_tp_state(state: TrainState, strategy: str, mesh) -> TrainState:
    """A tensor-parallel state (``tp.shard_state``) laid out over ``mesh``, its ``dp`` dimension:
    each tensor-parallel DTensor of the fields the strategy shards is split over ``dp``
    (``ftrain.distributed.data_parallel.dp_split``), the others put back whole over ``dp``. Plain
    tensors (those tensor parallelism left whole: counters, statistics not shaped like a parameter)
    stay as they are."""
    laid = next(t for t in tree.leaves(state.params) if dp_split.is_tp_laid(t))
    dp = laid.device_mesh["dp"]
    if sorted(mesh.mesh.flatten().tolist()) != sorted(dp.mesh.flatten().tolist()):
        raise ValueError(
            f"ft.shard_state(state, {strategy!r}, mesh=...): the state is laid out for tensor "
            f"parallelism, so it is split over the 'dp' dimension of its mesh (ranks "
            f"{sorted(dp.mesh.flatten().tolist())}), not over ranks "
            f"{sorted(mesh.mesh.flatten().tolist())}. Fix: mesh=mesh['dp'] with the mesh of "
            "ft.tensor_parallel."
        )
    sharded = SHARDED_FIELDS[strategy]
    out = {}
    for field in ("params", "opt_state", "extra"):
        td = getattr(state, field)
        leaves = tree.leaves(td)
        tp = [i for i, t in enumerate(leaves) if dp_split.is_tp_laid(t)]
        whole = dp_split.unsplit([leaves[i] for i in tp], mesh)  # a no-op where not split
        for i, t in zip(tp, whole):
            leaves[i] = dp_split.split(t, mesh, copy=True) if field in sharded else t
        out[field] = tree.unflatten(td, leaves)
    return state.replace(**out)


def _check_device(state: TrainState, mesh) -> None:
    for t in tree.leaves(state.params)[:1]:
        if t.device.type != mesh.device_type:
            raise ValueError(
                f"ft.shard_state: the params are on {t.device.type} but the mesh is on "
                f"{mesh.device_type} (gloo: cpu, NCCL: cuda). Move the state first, e.g. "
                f"state = state.to_device('{mesh.device_type}') (params, optimizer state and "
                "extra; step and rng stay on the CPU)."
            )


def zero_optimizer(inner: GradientTransformation, mesh) -> GradientTransformation:
    """zero1/zero2: ``inner`` run on this rank's share: params and grads enter as DTensors split
    over ``mesh`` (``Shard(0)`` rows, or under tensor parallelism
    ``ftrain.distributed.data_parallel.dp_split``'s rule; views, no traffic), the sharded state
    stays sharded, the updates are all-gathered back to the params' layout."""
    inner = on_shards(inner)

    def split(td):
        return tree.unflatten(td, [dp_split.split(x, mesh, copy=False) for x in tree.leaves(td)])

    def init(params):
        return inner.init(shard_tree(params, mesh, copy=False))

    def update(updates, state, params=None, *, inplace=False):
        p_td = split(params) if params is not None else None
        new_u, new_state = inner.update(split(updates), state, p_td, inplace=inplace)
        u = [dp_split.split(x, mesh, copy=False) for x in tree.leaves(new_u)]
        return tree.unflatten(updates, dp_split.unsplit(u, mesh)), new_state

    return GradientTransformation(init, update)
