"""Checkpoints you can trust: ``save``/``load`` of a :class:`~ftrain.TrainState`.

A checkpoint is a directory::

    checkpoint-1200/
        params.safetensors   # state.params, keyed by module path ("blocks.0.attn.qkv.weight")
        state.safetensors    # "step", "rng", "opt_state.<path>", "extra.<path>"
        meta.json            # step, versions, creation time, the tree, sha256 per file, your extra

A sharded state (``ft.shard``'s zero1/zero2/fsdp layouts) is saved sharded instead: each process
writes only its own pieces, plus one index (:mod:`ftrain.io.sharded`); so is a pipelined state
(``ft.pipeline``'s stages, ``save(..., pipeline=pp)``). :func:`load` lays either kind onto any
world size and layout.

Guarantees:

* **No pickle.** Tensors are written and read with safetensors, everything else with JSON. Loading
  a checkpoint never runs code from it.
* **Exact.** :func:`load` gives back every tensor bit for bit, with its dtype (bf16, int64, bool,
  ...), its shape (0-d included) and the exact nesting of the TensorDicts, empty ones included.
* **Verified.** ``meta.json`` records a sha256 per tensor file and a checksum of itself; both are
  checked before any tensor is used, and a damaged file is refused with its name.
* **Atomic.** :func:`save` commits the directory with :func:`ftrain.io.atomic.write_dir`: written
  into a temporary sibling, fsynced, renamed into place, an old checkpoint at ``path`` renamed
  aside first and deleted last. A process killed at any moment leaves the old or the new
  checkpoint whole, and :func:`load`, ``latest_checkpoint`` and the next :func:`save` recover from
  what an interrupted save left behind. One process writes a given path (or run folder) at a
  time: under ``torchrun`` that is rank 0, or every rank together for a sharded state.

``params.safetensors`` is an ordinary state dict: ``module.load_state_dict(
safetensors.torch.load_file(path / "params.safetensors"))`` loads it into the plain module
(``ft.consolidate`` writes one from a sharded checkpoint).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from tensordict import TensorDict

from ftrain.io import atomic, reshard, sharded, tensorfile
from ftrain.io.background import SaveHandle
from ftrain.io.meta import (
    FORMAT,
    META_FILE,
    check_replaceable,
    checked_json,
    meta_checksum,
    read_meta,
    verify_file,
    versions,
)
from ftrain.io.state_files import (
    PARAMS_FILE,
    STATE_FILE,
    CheckpointError,
    differences,
    flatten,
    tree_of,
    unflatten,
)
from ftrain.state import TrainState
from ftrain.tree import SEP

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "Snapshot",
    "load",
    "load_meta",
    "meta_checksum",
    "save",
    "snapshot",
    "verify_checkpoint",
]

WHOLE_VERSION = 1  # the format_version of a whole checkpoint (a sharded one is 2)


class CheckpointWarning(UserWarning):
    """A checkpoint was passed over, or recovered from an interrupted save."""


# --- save ----------------------------------------------------------------------------------------


def save(
    state: TrainState,
    path: str | os.PathLike,
    *,
    extra: Mapping | None = None,
    blocking: bool = True,
    pipeline: Any = None,
) -> Path | SaveHandle:
    """Write ``state`` to the checkpoint directory ``path``, atomically. Returns ``Path(path)``,
    or with ``blocking=False`` a :class:`~ftrain.io.background.SaveHandle` whose ``wait()``
    returns it.

    Every tensor of ``state`` is written with safetensors from a contiguous CPU copy (tensors on an
    accelerator are copied to the host; that waits for it). ``meta.json`` records the step, the
    ftrain/torch/tensordict/safetensors versions, the creation time, the TensorDict tree, a sha256
    per tensor file, and ``extra``.

    Args:
        state: the :class:`~ftrain.TrainState` to write. Its TensorDicts must be plain
            ``TensorDict``\\ s with ``batch_size=[]`` holding tensors (as ``ft.params_of`` and the
            optimizers build them). A state laid out by ``ft.shard_state`` (DTensors) is saved
            sharded: then every process must call ``save`` with the same ``path`` (a
            collective), and each writes only the pieces it holds.
        path: the checkpoint directory. Its parent is created if needed. If it exists it must be a
            checkpoint (only ``meta.json`` and ``*.safetensors`` files); it is replaced.
        extra: JSON metadata to keep beside the tensors (config, data-loader state, ...): a dict
            with str keys of dicts, lists, tuples (read back as lists), str, int, finite float,
            bool and None. Read it back with ``load_meta(path)["extra"]``. Not to be confused with
            ``state.extra``, the tensors that transforms keep in the state.
        blocking: ``False`` copies the tensors to host memory (pinned for CUDA ones) now and
            writes them from a background thread: the caller may go on changing ``state`` at
            once. Keep the handle and ``wait()`` on it before the next save (``ft.Saver`` does
            it for you); an error of the write is raised by ``wait()``. The interpreter's exit
            waits for the thread. A sharded background save runs its collectives on a process
            group of its own (made here: every process calls ``save``).
        pipeline: the ``ft.pipeline`` transform whose ``shard_state`` laid ``state`` out (under
            ``ft.shard`` over dp and tensor parallelism too). Every process calls ``save`` with
            the same ``path``, and each writes only the pieces it holds: a tensor that several
            hold (a replica over dp, the tied embedding on the first and last stage, ``step``)
            is written once. The checkpoint is of the whole state: its tree and index cover
            every stage, so ``load(path)`` on one process gives the whole state (bitwise what
            ``pp.unshard_state`` gathers), and it loads onto any other layout.

    Atomicity: everything is written to ``<path>.tmp-<token>``, fsynced (files and directory), then
    renamed to ``path``. An existing ``path`` is first renamed to ``<path>.old-<token>`` and deleted
    after the new one is in place, so a kill at any moment leaves the old or the new checkpoint
    whole; :func:`load` falls back to the old one if the kill fell between the two renames.

    Tied parameters: ``state.params`` holds a tied tensor once, under its first name (see
    ``ft.params_of``), and so does ``params.safetensors``. Load it into a tied module with
    ``module.load_state_dict(sd, strict=False)``: the tie fills the other name (it is the only
    "missing" key reported).
    """
    if not isinstance(state, TrainState):
        raise TypeError(
            f"ft.save(state, path): state must be an ft.TrainState, got {type(state).__name__}."
        )
    snap = snapshot(state, extra, copy=not blocking, pipeline=pipeline)
    path = Path(path)
    if blocking:
        return snap.write(path)
    group = snap.new_group()
    return SaveHandle(lambda: snap.write(path, group), f"ft.save({str(path)!r})")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a save writes, taken from a state by :func:`snapshot`: its tensors on the host and
    its metadata. ``write`` may run on another thread while the state changes if the snapshot
    holds copies."""

    whole: tuple | None  # (tree, params tensors, other tensors, step) of a whole state
    plan: sharded.Plan | None  # this process's pieces of a sharded state
    extra: dict  # the JSON metadata

    def write(self, path: str | os.PathLike, group: Any = None) -> Path:
        """Write the checkpoint directory ``path`` (atomically; a collective over ``group``,
        default all processes, for a sharded snapshot)."""
        if self.plan is not None:
            return sharded.write(self.plan, Path(path), self.extra, group)
        return _write_whole(self.whole, Path(path), self.extra)

    @property
    def step(self) -> int:
        """The saved state's step (a stacked state's furthest member's)."""
        return self.plan.step if self.plan is not None else self.whole[3]

    def new_group(self) -> Any:
        """A new process group for a sharded write (None for a whole one): collectives of a
        background write must not interleave with the training step's on the default group.
        A collective: every process calls it."""
        if self.plan is None:
            return None
        return torch.distributed.new_group(backend="gloo")


def snapshot(
    state: TrainState, extra: Mapping | None = None, *, copy: bool = False, pipeline: Any = None
) -> Snapshot:
    """What :func:`save` writes of ``state``: checked (names anything a checkpoint cannot hold),
    with the tensors as host views, or with ``copy`` private host copies. With ``pipeline``, a
    collective (see :func:`save`)."""
    meta_extra = checked_json(extra)
    if pipeline is not None or sharded.is_sharded(state):
        p = sharded.plan(state, pipeline)
        return Snapshot(None, p.host_copy() if copy else p, meta_extra)
    if copy:  # private host copies, pinned for CUDA tensors
        tree = tree_of(state)
        leaves = dict(sharded.leaves(state))
        odd = (type(t) is not torch.Tensor or t.layout != torch.strided for t in leaves.values())
        if any(odd) or state.step.dim() > 1 or state.step.shape != state.rng.shape:
            flatten(state)  # refuses what a checkpoint cannot hold, naming it
        copies = sharded.host_copies(leaves)
        params = {
            k.removeprefix("params."): t for k, t in copies.items() if k.startswith("params.")
        }
        rest = {k: t for k, t in copies.items() if not k.startswith("params.")}
    else:
        tree, params, rest = flatten(state)
    return Snapshot((tree, params, rest, int(state.step.max())), None, meta_extra)


def _write_whole(state_or_flat, path: Path, meta_extra: dict) -> Path:
    """Write a flattened whole state (``layout.flatten``'s ``(tree, params, rest, step)``) to
    ``path`` atomically."""
    tree, params_tensors, state_tensors, step = state_or_flat
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.recover(path)
    check_replaceable(path)
    with atomic.write_dir(path) as tmp:
        files = {
            PARAMS_FILE: tensorfile.write(tmp / PARAMS_FILE, params_tensors),
            STATE_FILE: tensorfile.write(tmp / STATE_FILE, state_tensors),
        }
        meta = {
            "format": FORMAT,
            "format_version": WHOLE_VERSION,
            "step": step,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": versions(),
            "files": files,
            "tree": tree,
            "extra": meta_extra,
        }
        meta["meta_sha256"] = meta_checksum(meta)
        (tmp / META_FILE).write_bytes(json.dumps(meta, indent=2, allow_nan=False).encode())
    return path


# --- load ----------------------------------------------------------------------------------------


def load(
    path: str | os.PathLike,
    like: TrainState | None = None,
    *,
    device: str | torch.device | None = None,
    pipeline: Any = None,
) -> TrainState:
    """The :class:`~ftrain.TrainState` saved at ``path``, verified.

    Before any tensor is used, ``meta.json`` is checked against its own checksum and every tensor
    file against its sha256; a damaged or missing file raises :class:`CheckpointError` naming it.
    The result has the saved TensorDict tree exactly (key order and empty TensorDicts included) and
    every tensor bit for bit. Nothing is unpickled. The JSON metadata is :func:`load_meta`'s job.

    Args:
        path: a checkpoint directory written by :func:`save` (e.g. from ``latest_checkpoint``).
            If a save of ``path`` was interrupted between renaming the old version aside and the
            new one in, the old version is loaded, with a :class:`CheckpointWarning`.
        like: a state to check the checkpoint against before loading: names, shapes and dtypes
            must match. Every difference is listed in the error (``params.blocks.3.attn.weight:
            missing in checkpoint``). Tensors are placed on the devices of ``like``'s tensors,
            and laid out as ``like``'s: where ``like`` holds a DTensor (``ft.shard_state``), the
            result holds one with the same mesh and placements, built from only the part of the
            saved tensor that this process holds. So a checkpoint saved whole or sharded, by any
            number of processes under any strategy, loads onto any other (every process calls
            ``load``; each reads only what it keeps, no collective).
        pipeline: the ``ft.pipeline`` transform whose ``shard_state`` laid ``like`` out (this
            process's stages; under ``ft.shard`` and tensor parallelism too). ``like`` is then
            checked as the whole state its processes' parts make up, and only its own tensors
            are read (its DTensors' parts only), in its layout: bitwise ``pp.shard_state`` of
            the whole state loaded. A collective (every process calls ``load``: they exchange
            their trees, no tensor values). Any checkpoint loads so: whole, sharded, or one a
            pipeline of another size, schedule or layout saved.
        device: where to put ``params``, ``opt_state`` and ``extra`` (overrides ``like``'s
            devices). ``step`` and ``rng`` always stay on the CPU. Default: the CPU, or ``like``'s
            devices.
    """
    if pipeline is not None and like is None:
        raise ValueError(
            "ft.load(path, pipeline=pp): give like= too, the state pp.shard_state laid out for "
            "this process (its stages are what it reads)."
        )
    if pipeline is None:
        path = _resolve(Path(path))
        meta = read_meta(path)
    else:  # a collective follows: a path one process cannot read is raised on every process
        path, meta = sharded.agreed(lambda: _found(path), "ft.load")
    if like is not None:
        if not isinstance(like, TrainState):
            raise TypeError(
                f"ft.load(path, like=...): like must be an ft.TrainState, got "
                f"{type(like).__name__}."
            )
        whole = tree_of(like) if pipeline is None else sharded.gathered_whole_tree(like, pipeline)
        _check_like(path, meta["tree"], whole)
    if "index" in meta or pipeline is not None or (like is not None and sharded.is_sharded(like)):
        return reshard.read(path, meta, like, device, part=pipeline is not None)
    files = {}
    for name in (PARAMS_FILE, STATE_FILE):
        verify_file(path, name, meta["files"][name])
        files[name] = safetensors.torch.load_file(str(path / name))
    fields = unflatten(path, meta["tree"], files)
    devices = _devices(like) if like is not None and device is None else {}
    for field in ("params", "opt_state", "extra"):
        fields[field] = _place(fields[field], field, device, devices)
    return TrainState(**fields, batch_size=[])


def _found(path: str | os.PathLike) -> tuple[Path, dict]:
    """The checkpoint directory ``path`` names and its verified ``meta.json``."""
    found = _resolve(Path(path))
    return found, read_meta(found)


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of the checkpoint at ``path``: the parsed ``meta.json``, checksum verified.

    Keys: ``step`` (int), ``created`` (ISO 8601, UTC), ``versions`` (ftrain, torch, tensordict,
    safetensors), ``extra`` (what was passed to ``save(extra=...)``, ``{}`` if nothing), ``files``
    (sha256 and size per tensor file), ``tree`` (TensorDict structure, ``"dtype[shape]"`` per
    tensor), ``format``, ``format_version`` (1: whole, 2: sharded); a sharded checkpoint also has
    ``world_size`` and ``index`` (every tensor's pieces: ``ftrain.io.sharded``). Tensor files are
    not read (:func:`load` verifies them).
    """
    return read_meta(_resolve(Path(path)))


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check the checkpoint directory ``path`` as :func:`load` does, without building the state.

    ``meta.json`` must match its checksum and every tensor file must be present with the size and
    sha256 that it records (every rank's file of a sharded one). Returns the metadata (as :func:`load_meta`); raises
    :class:`CheckpointError` naming the missing or damaged file. ``path`` itself is checked: no
    fallback to a version that an interrupted save left aside.
    """
    path = Path(path)
    meta = read_meta(path)
    for name, info in meta["files"].items():
        verify_file(path, name, info)
    return meta


def _resolve(path: Path) -> Path:
    """``path``, or the old version an interrupted save renamed aside if ``path`` is missing."""
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is not a directory; a checkpoint is a directory.")
    old = atomic.leftovers(path)["old"]
    if old:
        warnings.warn(
            f"{path} is missing: a save was interrupted while replacing it. Loading the previous "
            f"version from {old[0]} (the next ft.save to {path.name} puts it back in place).",
            CheckpointWarning,
            stacklevel=3,
        )
        return old[0]
    raise CheckpointError(f"no checkpoint at {path} (the directory does not exist).")


def _check_like(path: Path, saved: dict, like: dict) -> None:
    diffs = differences(saved, like)
    if not diffs:
        return
    shown = diffs[:30] + ([f"... and {len(diffs) - 30} more"] if len(diffs) > 30 else [])
    part = all(d.endswith("unexpected (in checkpoint, not in `like`)") for d in diffs)
    raise CheckpointError(
        f"{path} does not match `like` ({len(diffs)} difference(s)):\n  "
        + "\n  ".join(shown)
        + (
            "\n`like` holds a part of it: if that is this process's pipeline stages "
            "(pp.shard_state), load with ft.load(path, like=like, pipeline=pp)."
            if part
            else "\nIt was saved from a different model, optimizer or transforms. Build `like` "
            "with the same config, or call ft.load(path) without like= to inspect what it holds."
        ),
        differences=diffs,
    )


def _devices(like: TrainState) -> dict[str, torch.device]:
    """The device of every tensor of ``like``, by dotted field path."""
    out = {}
    for field in ("params", "opt_state", "extra"):
        td = getattr(like, field)
        for key, t in td.items(include_nested=True, leaves_only=True):
            key = key if isinstance(key, tuple) else (key,)
            out[SEP.join((field, *key))] = t.device
    return out


def _place(td: TensorDict, field: str, device, devices: dict[str, torch.device]) -> TensorDict:
    if device is not None:
        return td.to(device)
    if not devices:
        return td

    def move(key, t):
        key = key if isinstance(key, tuple) else (key,)
        target = devices.get(SEP.join((field, *key)))
        return t if target is None or target == t.device else t.to(target)

    return td.named_apply(move, nested_keys=True)
