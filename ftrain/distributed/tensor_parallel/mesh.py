"""Where tensor parallelism puts the state: the ``("dp", "tp")`` mesh and the DTensor layout.

A tensor-parallel state is the same tree as a whole one, each tensor a DTensor on the whole mesh:
``Replicate()`` over ``dp``, and over ``tp`` the placement of its
:class:`~ftrain.distributed.tensor_parallel.plans.Split` (``Shard(dim)``; k fused blocks each split
on their own for ``Colwise(chunks=k)``; ``Replicate()`` for a parameter no pattern names). Optimizer
moments and ``state.extra`` entries shaped like a parameter follow it, so an elementwise optimizer
runs on the pieces, and DTensor makes every reduction in it (global norms) global. Counters and
other tensors stay plain.

Because the placements are DTensor's own, a checkpoint records each piece as boxes of the global
tensor (``ftrain.io.sharded``), and ``ft.unshard_state`` gathers the whole tensors back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ftrain import tree
from ftrain.distributed.data_parallel.zero import check_replicated
from ftrain.distributed.dtensor import dtensor, from_local, full_tensor, split_placement
from ftrain.distributed.launch import group_device, require_group
from ftrain.distributed.tensor_parallel.plans import Split, local_piece
from ftrain.optim.quantized import CODE_LEAVES
from ftrain.state import TrainState

__all__ = ["tp_mesh", "check_tp_mesh", "placements", "lay_out", "lay_out_state", "follow"]


def tp_mesh(tp: int, device: str | None = None) -> Any:
    """The 2-D ``DeviceMesh`` ``("dp", "tp")`` over every process: ``tp`` processes split each
    block's matrices, ``world / tp`` groups of them split the batch. A collective (it creates
    the sub-groups). Raises when ``tp`` does not divide the number of processes."""
    require_group("tensor_parallel")
    world = dist.get_world_size()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world % tp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"tensor parallel size tp={tp!r} must be an int that divides the {world} processes "
            f"(the mesh is dp x tp = {world}). Fix: --tp / tp= one of {divisors}, or launch a "
            "multiple of tp processes (torchrun --nproc_per_node N)."
        )
    from torch.distributed.device_mesh import init_device_mesh

    device = device or group_device().type
    return init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def check_tp_mesh(mesh: Any, fn: str) -> Any:
    """``mesh`` if it is a ``DeviceMesh`` over every process with a dimension named ``"tp"``."""
    from torch.distributed.device_mesh import DeviceMesh

    names = getattr(mesh, "mesh_dim_names", None) or ()
    if not isinstance(mesh, DeviceMesh) or "tp" not in names:
        raise ValueError(
            f"ft.{fn}(mesh=...): expected a DeviceMesh with a dimension named 'tp' (e.g. "
            f"ft.distributed.tp_mesh(2), dims ('dp', 'tp')), got {mesh!r}."
        )
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"ft.{fn}(mesh=...): the mesh {dict(zip(names, mesh.shape))} has {mesh.size()} "
            f"processes but the world has {world}. Fix: a mesh over every process, e.g. "
            f"ft.distributed.tp_mesh(tp) with tp dividing {world}."
        )
    return mesh


def placements(split: Split, mesh: Any) -> tuple:
    """The DTensor placements of a tensor split as ``split`` on ``mesh``: ``Replicate()`` on every
    dimension but ``"tp"``."""
    d = dtensor()
    return tuple(
        split_placement(split.dim, split.chunks)
        if name == "tp" and split.dim is not None
        else d.Replicate()
        for name in mesh.mesh_dim_names
    )


def lay_out(t: torch.Tensor, split: Split, mesh: Any) -> torch.Tensor:
    """The DTensor of the whole plain ``t`` (the same on every process) split as ``split``: this
    process's piece, copied (no traffic). A DTensor is gathered whole first."""
    t = full_tensor(t)
    tp = mesh["tp"]
    piece = local_piece(t, split, tp.get_local_rank(), tp.size()).clone()
    return from_local(piece, mesh, placements(split, mesh), t.shape, t.stride())


def follow(splits: Mapping[str, Split], td, shapes: Mapping[str, torch.Size]) -> list[Split | None]:
    """The split of each leaf of ``td``: a parameter's own split for a leaf whose path ends with
    that parameter's path and that has its shape (a moment ``mu.blocks.0.fc.weight``), else None
    (not laid out: a counter, a statistic of another shape)."""
    out: list[Split | None] = []
    for path, t in zip(tree.paths(td), tree.leaves(td)):
        parts = path.split(".")
        found = None
        for i in range(len(parts)):
            key = ".".join(parts[i:])
            if key in splits and tuple(shapes[key]) == tuple(t.shape):
                found = splits[key]
                break
        out.append(found)
    return out


def lay_out_state(state: TrainState, splits: Mapping[str, Split], mesh: Any) -> TrainState:
    """``state`` (whole, the same on every process) laid out for tensor parallelism on ``mesh``
    (see the module docstring). Checked: every process holds the same params."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"tensor_parallel.shard_state(state): expected an ft.TrainState, got "
            f"{type(state).__name__}."
        )
    params = state.params
    missing = sorted(set(splits) - set(tree.paths(params)))
    if missing:
        raise ValueError(
            f"tensor_parallel.shard_state: the state's params lack {missing[:3]} that the "
            "model has; build the state from the same model (ft.params_of(model))."
        )
    plain = state.replace(params=_whole(params))
    check_replicated(plain, None)  # over every process
    shapes = dict(zip(tree.paths(plain.params), (t.shape for t in tree.leaves(plain.params))))
    _check_no_codes(state.opt_state, splits)
    out = {}
    for field in ("params", "opt_state", "extra"):
        td = getattr(state, field)
        leaves = tree.leaves(td)
        laid = [
            lay_out(t, s, mesh) if s is not None else _plain(t)
            for t, s in zip(leaves, follow(splits, td, shapes))
        ]
        out[field] = tree.unflatten(td, laid)
    return state.replace(**out)


def _check_no_codes(opt_state, splits: Mapping[str, Split]) -> None:
    """Refuse 8-bit moments of a split parameter: their codes quantize blocks of the whole
    flattened tensor, which a piece (a row-parallel weight's columns) does not share."""
    split = [k for k, s in splits.items() if s.dim is not None]
    for path in tree.paths(opt_state):
        head, _, last = path.rpartition(".")
        if last in CODE_LEAVES and any(head == k or head.endswith("." + k) for k in split):
            raise ValueError(
                f"tensor_parallel.shard_state: the optimizer state holds 8-bit moments "
                f"({path!r}) of a split parameter; adamw8bit quantizes blocks of each whole "
                "flattened tensor, which tensor parallelism's pieces do not share. Fix: use "
                "ft.optim.adamw (or another optimizer of ftrain.optim) under tensor parallelism."
            )


def _whole(td):
    return tree.unflatten(td, [_plain(t) for t in tree.leaves(td)])


def _plain(t: torch.Tensor) -> torch.Tensor:
    return full_tensor(t)
