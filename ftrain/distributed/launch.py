"""``torch.distributed`` set-up: from torchrun's environment, or N local processes for tests;
the 1-D mesh data parallelism runs on.

Under torchrun, :func:`init` creates the process group from the environment::

    torchrun --nproc_per_node 2 -m ftrain train --shard fsdp

In tests and notebooks, :func:`run_distributed` starts N gloo processes on this machine::

    results = run_distributed(fn, world_size=2)  # [fn() on rank 0, fn() on rank 1]
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "init",
    "is_initialized",
    "rank_and_world",
    "run_distributed",
    "DistributedError",
    "dp_ranks",
    "runs_nccl",
    "reduces_host_tensors",
    "backend_for",
    "group_device",
    "require_group",
    "default_mesh",
    "check_mesh",
]


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
            "ft.distributed.run_distributed(fn, world_size=2) in tests."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if runs_nccl(backend):  # "nccl", or NCCL for CUDA tensors beside gloo ("cpu:gloo,cuda:nccl")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return rank_and_world()


def runs_nccl(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend()``'s string) runs NCCL:
    ``"nccl"``, or a per-device one such as ``"cpu:gloo,cuda:nccl"``."""
    return any(part.rsplit(":", 1)[-1] == "nccl" for part in backend.split(","))


def reduces_host_tensors(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend()``'s string) can reduce
    tensors in host memory: ``"gloo"`` (or ``"mpi"``), or a per-device one with a CPU part such
    as ``"cpu:gloo,cuda:nccl"``. NCCL alone cannot: a collective of host tensors over it fails."""
    parts = [part.split(":") for part in backend.split(",")]
    return any(p[-1] != "nccl" if len(p) == 1 else p[0] == "cpu" for p in parts)


def backend_for(device: torch.device | str, *, host_collectives: bool = False) -> str:
    """The process group's backend for training on ``device``: ``"gloo"`` on the CPU,
    ``"nccl"`` on GPUs, and ``"cpu:gloo,cuda:nccl"`` on GPUs when some collectives also reduce
    host tensors (``host_collectives``: ``ft.offload`` under a sharded strategy, whose host
    optimizer takes global norms of its host shards). CUDA tensors go through NCCL either way."""
    if torch.device(device).type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if host_collectives else "nccl"


def group_device(group: Any = None) -> torch.device:
    """Where the tensors of ``group``'s collectives (default: the default group) live: this
    process's GPU when the group runs NCCL (:func:`runs_nccl`; a CUDA tensor then goes through
    NCCL even beside gloo), else the CPU."""
    if runs_nccl(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dp_ranks(mesh: Any) -> str:
    """What a transform built on ``mesh`` declares as ``DATA_PARALLEL_OVER``: the ranks of its
    ``"dp"`` dimension (where the batch must be split), or that it has none."""
    if "dp" not in (mesh.mesh_dim_names or ()):
        return "none: its mesh has no 'dp' dimension"
    return f"ranks {sorted(mesh['dp'].mesh.flatten().tolist())}"


# -- N local processes ------------------------------------------------------------------------


class DistributedError(RuntimeError):
    """A rank of :func:`run_distributed` failed; the message holds each failing rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the ranks' server imports once, before it forks each rank: the imports that take most of
# a rank's start-up (torch, and tensordict, which imports torch's compiler). Not ftrain: a rank
# imports the ftrain of the moment, not the one of the server's start.
_PRELOAD = ["torch", "tensordict"]


def _child(
    rank: int,
    world_size: int,
    store_file: str,
    payload: bytes,
    out: str,
    parent: tuple[dict[str, str], str, list[str]],
) -> None:
    """Entry point of one rank: the parent's environment, working directory and import path (a
    forked rank has its server's), then join the group through a file store, run, write the
    result."""
    env, cwd, path = parent
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        os.chdir(cwd)
        sys.path[:] = path
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        fn, args, kwargs = pickle.loads(payload)
        dist.init_process_group(
            "gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size
        )
        try:
            result = ("ok", fn(*args, **kwargs))
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        data = pickle.dumps(result)
    except Exception as e:  # noqa: BLE001
        data = pickle.dumps(("error", f"rank {rank}: its return value cannot be pickled: {e}"))
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new CPU processes joined in a gloo group.

    Each process sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` as torchrun would and creates
    the default process group before calling ``fn`` (so ``ft.shard`` works inside it and
    ``ft.distributed.init()`` returns at once). Returns the list of each rank's return value, in
    rank order; values travel by pickle, so return tensors or plain data.

    ``fn`` may be a function defined in a notebook or a test (it is sent with ``cloudpickle``).
    If any rank raises, the others are stopped and :class:`DistributedError` carries the
    traceback of every rank that failed; a run longer than ``timeout`` seconds is stopped too.

    The processes are forked from a server process (multiprocessing's ``forkserver``, started at
    the first call and kept for the life of this process) that has imported torch and tensordict
    once, so a rank starts in a fraction of a second instead of an interpreter start with those
    imports (seconds each); ftrain itself is imported fresh in each rank. Each rank gets this
    process's environment, working directory and ``sys.path`` as of the call, as a spawned
    process would. Where the platform has no forkserver (Windows), each rank is spawned.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_distributed(world_size={world_size!r}): must be an int >= 1.")
    if not callable(fn):
        raise TypeError(f"run_distributed(fn, ...): fn must be callable, got {type(fn).__name__}.")
    import cloudpickle

    payload = cloudpickle.dumps((fn, args, kwargs))
    ctx = _context()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    parent = (env, os.getcwd(), list(sys.path))
    with tempfile.TemporaryDirectory(prefix="ftrain-dist-") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_child, args=(r, world_size, store, payload, outs[r], parent), daemon=True
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results = _collect(procs, outs, timeout)
    errors = [(r, res[1]) for r, res in enumerate(results) if res[0] != "ok"]
    if errors:
        detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in errors)
        raise DistributedError(
            f"run_distributed: {len(errors)} of {world_size} ranks failed.\n{detail}"
        )
    return [res[1] for res in results]


def _context():
    """The multiprocessing context the ranks start from (see :func:`run_distributed`)."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call)
    return ctx


def _collect(procs: list, outs: list[str], timeout: float) -> list[tuple[str, Any]]:
    """Wait for every rank; once one fails, give the others a moment, then stop them."""
    deadline = time.monotonic() + timeout
    results: dict[int, tuple[str, Any]] = {}
    failed_at = None
    while len(results) < len(procs):
        for r, p in enumerate(procs):
            if r in results or p.is_alive():
                continue
            p.join()
            if os.path.exists(outs[r]):
                results[r] = pickle.loads(Path(outs[r]).read_bytes())
            else:
                results[r] = ("crashed", f"the process exited with code {p.exitcode}")
            if results[r][0] != "ok" and failed_at is None:
                failed_at = time.monotonic()
        now = time.monotonic()
        late = now > deadline
        if late or (failed_at is not None and now - failed_at > 10.0):
            why = (
                ("timeout", f"still running after {timeout:.0f} s; stopped")
                if late
                else ("stopped", "stopped after another rank failed")
            )
            for r, p in enumerate(procs):
                if r not in results:
                    p.terminate()
                    p.join(5)
                    if p.is_alive():
                        p.kill()
                        p.join()
                    results[r] = why
            break
        time.sleep(0.02)
    return [results[r] for r in range(len(procs))]


# -- the mesh -----------------------------------------------------------------------------------


def require_group(fn: str) -> None:
    """An error naming ``fn`` and how to launch, unless a default process group exists."""
    if not is_initialized():
        raise RuntimeError(
            f"ft.{fn}: no torch.distributed process group. Launch with torchrun (e.g. "
            "`torchrun --nproc_per_node 2 train.py`) and call ft.distributed.init() before "
            "building the step; in tests and notebooks use "
            "ft.distributed.run_distributed(fn, world_size=2)."
        )


def default_mesh() -> Any:
    """The 1-D ``DeviceMesh`` over the processes of the default group (``cuda`` under NCCL,
    ``cpu`` otherwise), wrapping that group (no new process group is created)."""
    require_group("default_mesh")
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, group_device().type)


def check_mesh(mesh: Any, fn: str) -> Any:
    """``mesh`` if it is a 1-D ``DeviceMesh``, :func:`default_mesh` if None, else an error."""
    if mesh is None:
        return default_mesh()
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"ft.{fn}(mesh=...): expected a 1-D torch.distributed.device_mesh.DeviceMesh (data "
            f"parallel over its processes), got {mesh!r}. Leave it None for all processes."
        )
    return mesh
