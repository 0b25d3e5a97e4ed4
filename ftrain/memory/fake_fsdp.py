"""``ft.memory`` under ``ft.shard(step, "fsdp")``: the real sharded step, run on fake shards.

The planner runs the step with its ``Shard`` transform in place, so what it counts is what fsdp
allocates: the all-gather of each block's params in forward (a flat send buffer, a flat receive
buffer, the whole tensors cut from it), what backward saves of them packed as references to the
shards, the gathers again in backward (inside a checkpointed block's recompute too), the
reduce-scatter's flat buffers and shards of the gradients, and, under an engine that reweights
the gradients after backward (fp16 loss scaling), the ``Partial`` gradients reduce-scattered by
the step's reduce. Only the state is made here: :func:`fake_fsdp_state` lays it out as
``ft.shard_state(state, "fsdp")`` does, each leaf of one or more dimensions a ``Shard(0)``
DTensor on the step's mesh whose local tensor is a fake of this rank's rows.

The collectives need no stand-in: under ``FakeTensorMode`` torch sends the ops of c10d (all-gather,
reduce-scatter, all-reduce) and its functional collectives (DTensor's redistributions in the
optimizer) to their meta kernels (``torch/distributed/_meta_registrations.py``), which return at
once, send nothing and allocate nothing; the buffers around them are ftrain's own
(``ftrain.distributed.collectives.Layout``) and are counted like any other storage. So planning
needs the step's mesh (the process group ``ft.shard`` was built in: its size and this rank) and
no other process: one rank may plan alone (tests/memory/test_fake_fsdp.py checks that nothing is sent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from ftrain import tree
from ftrain.distributed.dtensor import dtensor, from_local, is_dtensor, local
from ftrain.memory.one_rank import rows
from ftrain.memory.tracker import fake_like, reduce_scatter_input
from ftrain.state import TrainState
from ftrain.step import Step

__all__ = ["fake_fsdp_state", "fake_shard", "backend_transient"]


def fake_shard(t: torch.Tensor, mesh, mode) -> torch.Tensor:
    """``t`` as ``ft.shard_state(..., "fsdp")`` places it on ``mesh``: with one or more dimensions
    a ``Shard(0)`` DTensor holding a fake of this rank's rows (real, and a copy, when it has at most
    a few elements), 0-d as :func:`~ftrain.memory.tracker.fake_like` makes it. ``t`` may be whole
    (real, fake or meta) or a DTensor already (its local rows are used: no traffic)."""
    if is_dtensor(t):
        mine = local(t)
    elif t.dim() == 0:
        return fake_like(t, mode)
    else:
        start, length = rows(t.shape[0], mesh.size(), mesh.get_local_rank())
        mine = t.narrow(0, start, length)
    piece = fake_like(mine, mode)
    if piece is mine:  # a small real leaf: its own storage, as shard_state copies it
        piece = mine.clone()
    return from_local(piece, mesh, (dtensor().Shard(0),), t.shape, t.stride())


def _whole_fake(t: torch.Tensor, mode) -> torch.Tensor:
    """A fake of ``t``'s whole value; a DTensor's made from its shape alone (no gather)."""
    if not is_dtensor(t):
        return fake_like(t, mode)
    with mode:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device=local(t).device)


def _fake_shards(td: TensorDictBase, mesh, mode) -> TensorDictBase:
    values, tdef = tree.flatten(td)
    return tdef.unflatten([fake_shard(t, mesh, mode) for t in values])


def fake_fsdp_state(state: Any, step: Step, mesh, mode) -> TrainState:
    """``state`` laid out for ``ft.shard(step, "fsdp")`` on ``mesh``, in fake shards (params,
    optimizer state and extra: :func:`fake_shard`; the counters and random key stay real).
    ``state`` may be whole or sharded already, or the params alone (then the state is the
    optimizer's ``init`` of them, sharded as ``shard_state`` shards it)."""
    if isinstance(state, TensorDictBase) and not isinstance(state, TrainState):
        values, tdef = tree.flatten(state)
        whole = tdef.unflatten([_whole_fake(t, mode) for t in values])
        state = TrainState.create(whole, step.optimizer)
    if not isinstance(state, TrainState):
        raise TypeError(
            f"ft.memory(step, state, ...): expected an ft.TrainState or the params (a "
            f"TensorDict), got {type(state).__name__}."
        )
    return state.replace(
        params=_fake_shards(state.params, mesh, mode),
        opt_state=_fake_shards(state.opt_state, mesh, mode),
        extra=_fake_shards(state.extra, mesh, mode),
        step=fake_like(state.step, mode),
        rng=fake_like(state.rng, mode),
    )


def backend_transient(mesh) -> Callable[..., int] | None:
    """What the collective backend of ``mesh`` allocates inside a collective, for
    :class:`~ftrain.memory.tracker.LiveBytes`'s ``transient``: gloo reduce-scatters a flat tensor
    by all-reducing a copy of all of it and keeping its segment, so the copy (the input's bytes)
    is alive for the extent of the call. None for other backends (NCCL reduces in place)."""
    if dist.get_backend(mesh.get_group()) != "gloo":
        return None

    def transient(func, args, kwargs) -> int:
        send = reduce_scatter_input(func, args)
        return 0 if send is None else send.numel() * send.element_size()

    return transient
