"""Loading any checkpoint, whole or sharded, onto any layout: :class:`Reader` and :func:`read`.

Every tensor of a checkpoint is described by its index entry (``ftrain.io.sharded``): its global
dtype and shape, and the pieces that hold it, each a box of the global tensor in some file. A whole
checkpoint (format 1) has one piece per tensor (:func:`index_of` builds its index from the tree).
To lay a tensor out for this process, :class:`Reader` reads from each piece only the part that
overlaps the box the process needs, so a rank of an fsdp run reads its rows and nothing else,
whatever number of processes, and whichever layout, wrote the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tensordict import TensorDict

from ftrain.distributed.dtensor import from_local, is_dtensor, local
from ftrain.io import tensorfile
from ftrain.io.meta import META_FILE, verify_file
from ftrain.io.sharded import boxes_of, leaves
from ftrain.io.state_files import FIELDS, PARAMS_FILE, STATE_FILE, CheckpointError, tree_of
from ftrain.state import TrainState
from ftrain.tree import SEP

__all__ = ["Reader", "dtype_shape", "index_of", "nbytes", "read", "within"]


def index_of(meta: dict) -> dict[str, dict]:
    """The index of a checkpoint's tensors (see the module docstring); a whole checkpoint's
    (format 1) is built from its tree: one piece per tensor, in params.safetensors (keyed by module
    path) or state.safetensors (keyed by the dotted path)."""
    if "index" in meta:
        return meta["index"]
    index: dict[str, dict] = {}

    def walk(node, prefix: tuple[str, ...]):
        if isinstance(node, dict):
            for k, child in node.items():
                walk(child, (*prefix, k))
            return
        dtype, shape = node.split("[", 1)
        shape = json.loads("[" + shape)
        key = SEP.join(prefix)
        in_params = prefix[0] == "params"
        piece = {
            "file": PARAMS_FILE if in_params else STATE_FILE,
            "key": SEP.join(prefix[1:]) if in_params else key,
            "offsets": [0] * len(shape),
            "shape": shape,
        }
        index[key] = {"dtype": dtype, "shape": shape, "mesh": [], "placements": [],
                      "pieces": [piece]}  # fmt: skip

    for field in FIELDS:
        walk(meta["tree"][field], (field,))
    return index


def dtype_shape(entry: dict) -> tuple[torch.dtype, list[int]]:
    """The torch dtype and the global shape of an index entry."""
    return getattr(torch, entry["dtype"]), list(entry["shape"])


def nbytes(entry: dict) -> int:
    """Bytes of the whole tensor of an index entry."""
    dtype, shape = dtype_shape(entry)
    return math.prod(shape) * dtype.itemsize


class Reader:
    """Parts of the tensors of one checkpoint (whole or sharded), read from the pieces that hold
    them. Each tensor file is verified (sha256) when first opened; ``stack`` closes them."""

    def __init__(self, path: Path, meta: dict, stack: contextlib.ExitStack):
        self.path, self.meta, self.stack = path, meta, stack
        self.index = index_of(meta)
        self.open: dict[str, Any] = {}

    def _slice(self, piece: dict, dtype: str):
        name = piece["file"]
        if name not in self.open:
            if name not in self.meta["files"]:
                raise CheckpointError(
                    f"{self.path / META_FILE}: its index names {name}, which it lists no sha256 "
                    "for; the checkpoint is inconsistent."
                )
            verify_file(self.path, name, self.meta["files"][name])
            self.open[name] = self.stack.enter_context(
                safe_open(str(self.path / name), "pt", device="cpu")
            )
        f, key, file = self.open[name], piece["key"], self.path / name
        if key not in f.keys():
            raise CheckpointError(
                f"{file} lacks {key!r}, which meta.json's index places there; the checkpoint is "
                "inconsistent."
            )
        sl = f.get_slice(key)
        got = (sl.get_dtype(), list(sl.get_shape()))
        want = (tensorfile.DTYPES[getattr(torch, dtype)], piece["shape"])
        if got != want:
            raise CheckpointError(
                f"{file}: {key!r} is {got[0]}{got[1]} in the file but {want[0]}{want[1]} in "
                "meta.json's index; the index and the shards disagree."
            )
        return sl

    def entry(self, key: str) -> dict:
        if key not in self.index:
            raise CheckpointError(
                f"{self.path / META_FILE}: the tree lists {key!r} but its index does not; the "
                "checkpoint is inconsistent."
            )
        return self.index[key]

    def whole(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (a dotted path with its field: ``"params.wte.weight"``)."""
        shape = self.entry(key)["shape"]
        return self.part(key, [0] * len(shape), shape)

    def part(self, key: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        """The box ``offsets, sizes`` of the tensor ``key``: a new CPU tensor, read from the
        parts of its pieces that overlap the box (nothing else of them is read)."""
        entry = self.entry(key)
        dtype = getattr(torch, entry["dtype"])
        if not sizes:  # 0-d: one piece holds it
            return self._slice(entry["pieces"][0], entry["dtype"])[...].reshape(())
        out = torch.empty(sizes, dtype=dtype)
        filled = 0
        for piece in entry["pieces"]:
            lo = [max(a, b) for a, b in zip(offsets, piece["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in
                  zip(offsets, sizes, piece["offsets"], piece["shape"])]  # fmt: skip
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            src = tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, piece["offsets"]))
            dst = tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, offsets))
            part = self._slice(piece, entry["dtype"])[src]
            out[dst] = part
            filled += part.numel()
        if filled != out.numel():
            raise CheckpointError(
                f"{self.path / META_FILE}: the pieces of {key!r} do not cover the part "
                f"{offsets}+{sizes} of it; the checkpoint is incomplete."
            )
        return out


def read(
    path: Path, meta: dict, like: TrainState | None, device=None, part: bool = False
) -> TrainState:
    """The state saved at ``path`` (whole or sharded), laid out as ``like``: each tensor whose
    ``like`` is a DTensor is built from the part this process holds of it (same mesh and
    placements), every other one whole. ``like`` must have been checked against the tree. Tensors
    go to ``device``, else to ``like``'s (its local shard's) device, else the CPU; ``step`` and
    ``rng`` stay on the CPU. With ``part``, ``like`` holds a part of the saved state (a pipeline
    stage's): only its tensors are read, in the saved order (:func:`within`)."""
    targets = dict(leaves(like)) if like is not None else {}
    tree = within(meta["tree"], tree_of(like)) if part else meta["tree"]
    with contextlib.ExitStack() as stack:
        reader = Reader(path, meta, stack)

        def make(key: str) -> torch.Tensor:
            target = targets.get(key)
            if target is None or not is_dtensor(target):
                t = reader.whole(key)
                where = device if device is not None else getattr(target, "device", None)
                if key in ("step", "rng") or where is None:
                    return t
                return t.to(where)
            found, dim, _ = boxes_of(target)
            parts = [reader.part(key, offsets, sizes) for offsets, sizes in found]
            mine = parts[0] if dim is None else torch.cat(parts, dim=dim)
            mine = mine.to(device if device is not None else local(target).device)
            return from_local(mine, target.device_mesh, target.placements, target.shape,
                              target.stride())  # fmt: skip

        fields: dict[str, Any] = {}
        for field in FIELDS:
            node = tree[field]
            fields[field] = make(field) if isinstance(node, str) else _build(node, (field,), make)
    return TrainState(**fields, batch_size=[])


def within(saved: dict, mine: dict) -> dict:
    """The checkpoint tree ``saved`` cut down to the entries that the tree ``mine`` (of a part of
    the state) has, in ``saved``'s order."""
    return {
        k: within(v, mine[k]) if isinstance(v, dict) and v else v
        for k, v in saved.items()
        if k in mine
    }


def _build(node: dict, prefix: tuple[str, ...], make) -> TensorDict:
    entries = {
        k: _build(child, (*prefix, k), make) if isinstance(child, dict)
        else make(SEP.join((*prefix, k)))
        for k, child in node.items()
    }  # fmt: skip
    return TensorDict(entries, batch_size=[])
