"""Born sharded from saved weights: each process reads only its rows of each tensor.

``load_causal_lm`` then ``ft.shard_state`` reads every weight whole on every process. Here the
model is a template whose parameters are on ``meta`` (``ftrain.models.hf.empty_causal_lm``),
and each parameter is read from the ``safetensors`` files as this process's ``Shard(0)`` rows
(``safe_open(...).get_slice``: the file is memory-mapped, only those rows are copied), in
float32, as a DTensor over the mesh: the params ``ft.shard_state(..., "fsdp")`` would make from
the whole load, bitwise, the model never whole on any process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import nn

from ftrain import tree
from ftrain.distributed.collectives import layout
from ftrain.distributed.dtensor import from_local, placements_of
from ftrain.distributed.launch import check_mesh, require_group

__all__ = ["NotLaidOut", "sharded_params_from_files"]


class NotLaidOut(ValueError):
    """The files do not hold a parameter of the template under its name and shape."""


def sharded_params_from_files(
    template: nn.Module,
    files: Sequence[str | os.PathLike],
    mesh=None,
    dtype: torch.dtype = torch.float32,
) -> TensorDict:
    """``ft.params_of(template)``'s keys, each read from the ``safetensors`` ``files`` as this
    process's fsdp shard over ``mesh`` (default: every process): the ``Shard(0)`` rows
    ``ft.shard_state`` keeps (a 0-d tensor whole), converted to ``dtype``.

    **Invariant:** bitwise ``ft.shard_state(ft.TrainState.create(params, opt), "fsdp").params``
    for ``params`` the same files loaded whole into the module (by its parameter names; a tied
    parameter under any of its names). A parameter the files lack, or hold with another shape,
    is a :class:`NotLaidOut` error naming it (load whole then: ``ft.shard_state``).
    """
    from safetensors import safe_open

    require_group("sharded_params_from_files")
    mesh = check_mesh(mesh, "sharded_params_from_files")
    where: dict[str, str] = {}  # tensor name -> file
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            where.update(dict.fromkeys(fh.keys(), str(f)))
    names: dict[int, list[str]] = {}  # a parameter's names (several when tied), first first
    for name, p in template.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    params = dict(template.named_parameters())
    rank, world = mesh.get_local_rank(), mesh.size()
    out = {}
    for name, p in params.items():
        key = next((n for n in names[id(p)] if n in where), None)
        if key is None:
            raise NotLaidOut(
                f"the weight files hold no tensor named {name!r} (or a name tied to it)"
            )
        with safe_open(where[key], framework="pt", device="cpu") as fh:
            piece = fh.get_slice(key)
            if tuple(piece.get_shape()) != tuple(p.shape):
                raise NotLaidOut(
                    f"{key!r} is {tuple(piece.get_shape())} in the files, {tuple(p.shape)} in the "
                    "module"
                )
            if p.dim() == 0:
                read = fh.get_tensor(key)
            else:
                first, count = layout((p.shape,), world).rows[rank][0]
                read = piece[first : first + count]
        # in memory torch allocates (and counts: ftrain.testing.track_allocations), not the
        # reader's buffer: converted, or copied where the dtype is already the one wanted
        mine = read.to(dtype).contiguous()
        mine = mine.clone() if mine is read else mine
        like = torch.empty(p.shape, dtype=dtype, device="meta")
        out[name] = from_local(
            mine.to(mesh.device_type), mesh, placements_of(like), p.shape, like.stride()
        )
    return tree.from_flat(out)
