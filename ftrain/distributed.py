"""``torch.distributed`` set-up from the torchrun environment."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["init", "is_initialized", "rank_and_world"]


def is_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, or ``(0, 1)`` without one."""
    if is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init(backend: str | None = None) -> tuple[int, int]:
    """Create the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``); NCCL when CUDA is available, else gloo. Idempotent.

    Returns ``(rank, world_size)``. Without torchrun's variables it is an error that says how to
    launch: ``torchrun --nproc_per_node N -m ftrain train ...``.
    """
    if is_initialized():
        return rank_and_world()
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"ft.distributed.init: {', '.join(missing)} not set. Launch with torchrun, e.g. "
            "`torchrun --nproc_per_node 2 -m ftrain train --shard ddp`, or use "
            "ft.testing.run_distributed(fn, world_size=2) in tests."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return rank_and_world()
