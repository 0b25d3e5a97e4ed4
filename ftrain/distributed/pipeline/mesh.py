"""The ``("dp", "pp", "tp")`` mesh of a pipelined run."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ftrain.distributed.launch import group_device, require_group

__all__ = ["pp_mesh"]


def _check_size(name: str, value: Any, world: int, rest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or world % (value * rest):
        sizes = [d for d in range(1, world + 1) if world % (d * rest) == 0]
        raise ValueError(
            f"{name}={value!r} must be an int such that the {world} processes split into dp x pp "
            f"x tp groups (here one of {sizes}). Fix: --{name} / {name}= one of those, or launch "
            "another number of processes (torchrun --nproc_per_node N)."
        )


def pp_mesh(pp: int, tp: int = 1, device: str | None = None) -> Any:
    """The 3-D ``DeviceMesh`` ``("dp", "pp", "tp")`` over every process: ``pp`` pipeline stages'
    ranks, each split ``tp`` ways by tensor parallelism, and ``world / (pp * tp)`` replicas of
    that splitting the batch. Ranks vary fastest along ``tp``, then ``pp`` (a pipeline's ranks
    are neighbours when tp is 1). A collective (it creates the sub-groups)."""
    require_group("pipeline")
    world = dist.get_world_size()
    _check_size("tp", tp, world, 1)
    _check_size("pp", pp, world, tp)
    from torch.distributed.device_mesh import init_device_mesh

    device = device or group_device().type
    return init_device_mesh(device, (world // (pp * tp), pp, tp), mesh_dim_names=("dp", "pp", "tp"))
