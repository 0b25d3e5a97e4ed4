"""Sharded checkpoints: every process writes only the pieces it holds; one index says where each
piece of each tensor sits, so that a load can lay the tensors out for any world size and layout.

A sharded checkpoint is a directory::

    checkpoint-1200/
        rank-00000-of-00002.safetensors   # rank 0's pieces (and the tensors every rank holds whole)
        rank-00001-of-00002.safetensors   # rank 1's pieces
        meta.json                         # as a whole checkpoint's (format_version 2), plus "index"

``meta["index"]`` maps each tensor, by its dotted path with its field (``"params.wte.weight"``,
``"opt_state.mu.wte.weight"``, ``"step"``), to::

    {"dtype": "float32", "shape": [37, 16],          # the global tensor
     "mesh": [2], "placements": [["shard", 0]],      # one placement per mesh dimension (DTensor's)
     "pieces": [{"file": "rank-00000-of-00002.safetensors", "key": "params.wte.weight",
                 "offsets": [0, 0], "shape": [19, 16]}, ...]}

Every piece is a box of the global tensor (its offset and size along every dimension), so a
layout that splits any dimension over any mesh dimension (tensor parallelism's ``Shard(1)`` on a
2-D mesh) is described without a new format; ``placements`` only records how it was split. A
tensor whose local piece is several boxes (tensor parallelism's fused ``qkv``: this process's
slice of each of q, k and v) is stored as one tensor per box, keyed ``"<key>#<block>"``; a
reader needs nothing new, since every piece is still a box.
A tensor held whole by every process (``step``, ``rng``, ddp's params) is one piece, written by
rank 0. In a pipelined state the processes hold different tensors (their stages'): they exchange
what they hold before writing, the tree and index are the whole state's, and a piece several
hold is written by the lowest rank holding it (:func:`plan` with ``pipeline``). ``meta.json``
records each file's sha256, and is written last: the directory is committed
(:func:`ftrain.io.atomic.commit_dir`) by rank 0 once every rank has written its file.

Loading (``ftrain.io.reshard``) reads, for every tensor, only the part of each piece that this
process needs: the whole tensor for a plain leaf of ``like``, or the rows of a ``Shard`` DTensor
leaf. A whole checkpoint (format 1) is read the same way, as one piece per tensor.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftrain.distributed.dtensor import is_dtensor, local, shard_dim, split_factor
from ftrain.io import atomic, tensorfile
from ftrain.io.meta import (
    FORMAT,
    META_FILE,
    check_replaceable,
    meta_checksum,
    versions,
)
from ftrain.io.state_files import FIELDS, CheckpointError, tree_of
from ftrain.state import TrainState
from ftrain.tree import SEP

__all__ = [
    "Plan",
    "box_of",
    "boxes_of",
    "agreed",
    "gathered",
    "gathered_whole_tree",
    "host_copies",
    "is_sharded",
    "leaves",
    "plan",
    "write",
]

SHARDED_VERSION = 2


def is_sharded(state: TrainState) -> bool:
    """Whether any tensor of ``state`` is a DTensor (laid out across processes)."""
    return any(is_dtensor(t) for _, t in leaves(state))


def leaves(state: TrainState) -> list[tuple[str, torch.Tensor]]:
    """``(dotted path with its field, tensor)`` for every tensor of ``state``, in tree order."""
    out = []
    for field in FIELDS:
        value = getattr(state, field)
        if isinstance(value, torch.Tensor):
            out.append((field, value))
            continue
        for key, t in value.items(include_nested=True, leaves_only=True):
            key = key if isinstance(key, tuple) else (key,)
            out.append((SEP.join((field, *key)), t))
    return out


# --- where a piece sits --------------------------------------------------------------------------


def boxes_of(t: torch.Tensor) -> tuple[list[tuple[list[int], list[int]]], int | None, bool]:
    """``(boxes, dim, first)``: the boxes ``(offsets, sizes)`` of the global tensor that this
    process holds of the DTensor ``t``, the dimension along which its local tensor is their
    concatenation (None for one box), and whether this process is the first holder (coordinate 0
    on every mesh dimension where it is replicated).

    ``Shard(d)`` placements split as DTensor splits (``torch.chunk``, in mesh dimension order).
    A strided one (k fused blocks each split on its own, a tensor-parallel ``qkv``) gives k
    boxes, one per block. A plain tensor is one whole box, first on rank 0."""
    shape = list(t.shape)
    if not is_dtensor(t):
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return [([0] * len(shape), shape)], None, rank == 0
    mesh = t.device_mesh
    coords = mesh.get_coordinate()
    offsets, sizes, first = [0] * len(shape), list(shape), True
    blocks, block_dim = 1, None
    for i, p in enumerate(t.placements):
        d = shard_dim(p)
        if d is not None:
            k, n = split_factor(p), mesh.size(i)
            if k > 1:
                if blocks > 1 or sizes[d] % (k * n) or offsets[d]:
                    raise CheckpointError(
                        f"cannot checkpoint a DTensor placed {t.placements}: one strided "
                        "placement of evenly divisible blocks is supported per tensor."
                    )
                blocks, block_dim = k, d
                sizes[d] //= k  # within the first block; the others repeat it, shifted
            per = -(-sizes[d] // n)
            start = min(coords[i] * per, sizes[d])
            offsets[d] += start
            sizes[d] = min(per, sizes[d] - start)
        elif p.is_replicate():
            first = first and coords[i] == 0
        else:
            raise CheckpointError(
                f"cannot checkpoint a DTensor placed {t.placements}: only Shard(dim) and "
                "Replicate() placements hold a tensor's values (reduce a Partial one first)."
            )
    boxes = []
    for c in range(blocks):
        o = list(offsets)
        if block_dim is not None:
            o[block_dim] += c * (shape[block_dim] // blocks)
        boxes.append((o, list(sizes)))
    want = list(sizes)
    if block_dim is not None:
        want[block_dim] *= blocks
    if list(local(t).shape) != want:
        raise CheckpointError(
            f"cannot checkpoint a DTensor placed {t.placements}: its local shape "
            f"{list(local(t).shape)} is not the torch.chunk split {want} this format records."
        )
    return boxes, block_dim, first


def box_of(t: torch.Tensor) -> tuple[list[int], list[int], bool]:
    """``(offsets, sizes, first)`` of a tensor that :func:`boxes_of` finds in one box."""
    boxes, _, first = boxes_of(t)
    if len(boxes) != 1:
        raise CheckpointError(f"box_of: a DTensor placed {t.placements} is {len(boxes)} boxes.")
    return (*boxes[0], first)


def _placements(t: torch.Tensor) -> tuple[list[int], list[list]]:
    if not is_dtensor(t):
        return [], []
    out = [
        ["replicate"] if shard_dim(p) is None
        else ["shard", p.dim] if split_factor(p) == 1
        else ["strided_shard", p.dim, split_factor(p)]
        for p in t.placements
    ]  # fmt: skip
    return list(t.device_mesh.shape), out


# --- save ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """What one process writes of a sharded save: the tree, the global description of every
    tensor, and this process's pieces (``key -> tensor``, with their boxes)."""

    tree: dict
    tensors: dict[str, dict]  # key -> {"dtype", "shape", "mesh", "placements"}
    mine: dict[str, torch.Tensor]  # stored key -> this process's piece (on the state's device)
    # stored key -> [offsets, sizes] of that piece, plus the tensor's key where they differ (a
    # tensor held as several boxes is stored as "<key>#<block>")
    boxes: dict[str, list]
    step: int

    def host_copy(self) -> Plan:
        """The same plan over private host copies of the pieces (pinned memory for CUDA ones),
        so that training may go on changing the state while they are written."""
        return dataclasses.replace(self, mine=host_copies(self.mine))


def host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Private host copies of ``tensors``: CUDA ones copied asynchronously into pinned memory
    (then waited for, once), CPU ones cloned."""
    out = {}
    for key, t in tensors.items():
        pin = t.device.type == "cuda"
        out[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        out[key].copy_(t.detach(), non_blocking=pin)
    if any(t.device.type == "cuda" for t in tensors.values()):
        torch.cuda.synchronize()  # the copies have landed before anyone reads them
    return out


def plan(state: TrainState, pipeline: Any = None, group=None) -> Plan:
    """The :class:`Plan` of ``state`` for this process. Its pieces are views of the state's local
    tensors (no copy, on their device): :func:`write` copies an accelerator's pieces to the host
    one at a time, :meth:`Plan.host_copy` all at once (into pinned memory).

    With ``pipeline`` (the ``ft.pipeline`` that laid ``state`` out), a collective over ``group``
    (default: all processes): they hold different tensors (their stages'), so they exchange what
    they hold (trees and boxes, no tensor values). The plan's tree is then the whole state's
    (``pipeline.whole_tree``), its index every tensor of it, and a box that several processes
    hold (a replica over dp or tp, the tied embedding on two stages, ``step``) is written once,
    by the lowest rank holding it. A refusal on any process (a state a checkpoint cannot hold)
    is then raised on every process, naming it, before anything is written."""
    if pipeline is None:
        return _plan_here(state, every_box=False)
    # the processes hold different tensors: a refusal on some of them is raised on all
    here = agreed(lambda: _plan_here(state, every_box=True), "ft.save", group)
    return _of_the_whole(here, pipeline, group)


def _plan_here(state: TrainState, every_box: bool) -> Plan:
    """:func:`plan` of this process's tensors; with ``every_box``, also the boxes that another
    process writes in a checkpoint of the same layout (a pipeline then picks one writer each)."""
    tree = tree_of(state)  # refuses what a checkpoint cannot hold, naming it
    tensors, mine, boxes = {}, {}, {}
    for key, t in leaves(state):
        mesh, placements = _placements(t)
        tensors[key] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "mesh": mesh,
            "placements": placements,
        }
        found, dim, first = boxes_of(t)
        if not first and not every_box:
            continue
        piece = (local(t) if is_dtensor(t) else t).detach()
        if dim is None:
            mine[key] = piece
            boxes[key] = [*found[0]]
            continue
        # several boxes (fused blocks): one stored tensor each, keyed "<key>#<block>"
        parts = piece.split(found[0][1][dim], dim=dim)
        for c, (part, (offsets, sizes)) in enumerate(zip(parts, found)):
            mine[f"{key}#{c}"] = part
            boxes[f"{key}#{c}"] = [offsets, sizes, key]
    return Plan(tree, tensors, mine, boxes, int(state.step.max()))


def gathered(value: Any, group=None) -> list:
    """``value`` from every process of ``group`` (default: all), in rank order (a collective)."""
    group = group or dist.group.WORLD
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agreed(work: Callable[[], Any], who: str, group=None) -> Any:
    """``work()`` on this process, once every process of ``group`` has run its own (a collective
    of one status each, no values): where it raised on any process, every process raises one
    :class:`CheckpointError` naming the ranks and their errors, so none waits in a later
    collective for a process that has stopped."""
    try:
        result, mine = work(), ("ok", None)
    except Exception as e:  # noqa: BLE001 - every rank raises it below
        result, mine = None, ("error", _error(e))
    everyone = gathered(mine, group)
    failed = [f"rank {r}: {v}" for r, (status, v) in enumerate(everyone) if status != "ok"]
    if failed:
        raise CheckpointError(f"{who}: " + "; ".join(failed))
    return result


def gathered_whole_tree(state: TrainState, pipeline: Any, group=None) -> dict:
    """The tree of the whole state that the processes' parts ``state`` make up (each its
    ``pipeline``'s stages): ``pipeline.whole_tree`` of every process's tree (a collective; a
    state a checkpoint cannot hold, on any process, raised on every process)."""
    return pipeline.whole_tree(gathered(agreed(lambda: tree_of(state), "ft.load", group), group))


def _of_the_whole(p: Plan, pipeline: Any, group) -> Plan:
    """``p`` of one process's part, made the whole state's plan (see :func:`plan`)."""
    everyone = gathered((p.tree, p.tensors, p.boxes), group)
    tree = pipeline.whole_tree([t for t, _, _ in everyone])
    tensors: dict[str, dict] = {}
    writer: dict[tuple, int] = {}
    for r, (_, listed, boxes) in enumerate(everyone):
        for key, info in listed.items():
            had = tensors.setdefault(key, info)
            if (had["dtype"], had["shape"]) != (info["dtype"], info["shape"]):
                raise CheckpointError(
                    f"ft.save: {key!r} is {had['dtype']}{had['shape']} on one process and "
                    f"{info['dtype']}{info['shape']} on rank {r}; the processes' states are "
                    "not parts of one state. Fix: on every process, pass ft.save(..., pipeline=pp) the "
                    "state pp.shard_state laid out (the same model, optimizer and pp)."
                )
        for stored, box in boxes.items():
            writer.setdefault(_box_id(stored, box), r)
    order = [key for key, _ in _tree_leaves(tree)]
    if sorted(order) != sorted(tensors):
        odd = sorted(set(order) ^ set(tensors))[:3]
        raise CheckpointError(
            f"ft.save(..., pipeline=...): the processes' tensors are not the whole state's "
            f"(e.g. {odd}); save the state that pipeline.shard_state laid out."
        )
    me = dist.get_rank(group or dist.group.WORLD)
    keep = [stored for stored, box in p.boxes.items() if writer[_box_id(stored, box)] == me]
    return Plan(tree, {k: tensors[k] for k in order}, {s: p.mine[s] for s in keep},
                {s: p.boxes[s] for s in keep}, p.step)  # fmt: skip


def _box_id(stored: str, box: list) -> tuple[str, str, str]:
    """Which tensor a stored piece (``Plan.boxes``' entry) is of, and where in it."""
    offsets, sizes, *tensor = box
    return tensor[0] if tensor else stored, str(offsets), str(sizes)


def _tree_leaves(node: Any, path: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """``(dotted path, "dtype[shape]")`` of every tensor of a checkpoint tree, in order."""
    if not isinstance(node, dict):
        return [(SEP.join(path), node)]
    return [x for k, v in node.items() for x in _tree_leaves(v, (*path, k))]


def _file_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def _broadcast(value: Any, group) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def write(p: Plan, path: Path, extra: dict, group=None) -> Path:
    """Write a sharded checkpoint of ``p`` to ``path``: a collective over ``group`` (default: all
    processes), each process writing its own file. Atomic: rank 0 makes the temporary directory,
    every rank writes and fsyncs its file, rank 0 writes ``meta.json`` once all have written and
    renames the directory into place. A failure on any rank is raised on every rank, naming it,
    and leaves ``path`` as it was."""
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prepared = None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.recover(path)
            check_replaceable(path)
            prepared = ("ok", str(atomic.temporary_dir(path)))
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            prepared = ("error", _error(e))
    status, value = _broadcast(prepared, group)
    if status != "ok":
        raise CheckpointError(f"ft.save: rank 0 could not prepare {path}: {value}")
    tmp = Path(value)
    name = _file_name(rank, world)
    try:
        specs = {k: (t.dtype, list(t.shape)) for k, t in p.mine.items()}
        on_host = tensorfile.write_lazy(tmp / name, specs, lambda k: p.mine[k].to("cpu"))
        written = ("ok", on_host, p.boxes)
    except Exception as e:  # noqa: BLE001
        written = ("error", _error(e), None)
    everyone = gathered(written, group)
    committed = None
    if rank == 0:
        try:
            failed = [f"rank {r}: {w[1]}" for r, w in enumerate(everyone) if w[0] != "ok"]
            if failed:
                raise CheckpointError(f"ft.save: writing {path} failed on " + "; ".join(failed))
            meta = _meta(p, extra, {_file_name(r, world): w[1] for r, w in enumerate(everyone)},
                         [w[2] for w in everyone], world)  # fmt: skip
            with atomic.write_file(tmp / META_FILE) as f:
                f.write(json.dumps(meta, indent=1, allow_nan=False).encode())
            atomic.commit_dir(tmp, path)
            committed = ("ok", "")
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            committed = ("error", str(e) if isinstance(e, CheckpointError) else _error(e))
    status, value = _broadcast(committed, group)
    if status != "ok":
        raise CheckpointError(value)
    return path


def _meta(p: Plan, extra: dict, files: dict, boxes: list[dict], world: int) -> dict:
    index = {key: {**info, "pieces": []} for key, info in p.tensors.items()}
    for r, mine in enumerate(boxes):
        for key, (offsets, sizes, *tensor) in mine.items():
            piece = {"file": _file_name(r, world), "key": key, "offsets": offsets, "shape": sizes}
            name = tensor[0] if tensor else key
            if name not in index:  # e.g. a pipelined state saved without pipeline=
                raise CheckpointError(
                    f"ft.save: rank {r} holds {name!r}, which rank 0 does not: the processes "
                    "hold different tensors. A pipelined state: ft.save(state, path, pipeline=pp)."
                )
            index[name]["pieces"].append(piece)
    for key, entry in index.items():  # the pieces of every tensor fill it exactly once
        if sum(math.prod(q["shape"]) for q in entry["pieces"]) != math.prod(entry["shape"]):
            raise CheckpointError(f"ft.save: the pieces of {key!r} do not cover it once.")
    meta = {
        "format": FORMAT,
        "format_version": SHARDED_VERSION,
        "step": p.step,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "versions": versions(),
        "world_size": world,
        "files": files,
        "tree": p.tree,
        "index": index,
        "extra": extra,
    }
    meta["meta_sha256"] = meta_checksum(meta)
    return meta
