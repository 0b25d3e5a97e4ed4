"""Checkpoints you can trust: ``save``/``load`` of a :class:`~ftrain.TrainState`.

A checkpoint is a directory::

    checkpoint-1200/
        params.safetensors   # state.params, keyed by module path ("blocks.0.attn.qkv.weight")
        state.safetensors    # "step", "rng", "opt_state.<path>", "extra.<path>"
        meta.json            # step, versions, creation time, the tree, sha256 per file, your extra

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
  time: under ``torchrun`` that is rank 0.

``params.safetensors`` is an ordinary state dict: ``module.load_state_dict(
safetensors.torch.load_file(path / "params.safetensors"))`` loads it into the plain module.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import tensordict
import torch
from tensordict import TensorDict

from ftrain.io import atomic
from ftrain.io.layout import (
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
from ftrain.version import __version__

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "load",
    "load_meta",
    "meta_checksum",
    "save",
    "verify_checkpoint",
]

META_FILE = "meta.json"
FORMAT = "ftrain-checkpoint"
FORMAT_VERSION = 1

_CHUNK = 1 << 22  # bytes read at a time when hashing


class CheckpointWarning(UserWarning):
    """A checkpoint was passed over, or recovered from an interrupted save."""


# --- save ----------------------------------------------------------------------------------------


def save(state: TrainState, path: str | os.PathLike, *, extra: Mapping | None = None) -> Path:
    """Write ``state`` to the checkpoint directory ``path``, atomically. Returns ``Path(path)``.

    Every tensor of ``state`` is written with safetensors from a contiguous CPU copy (tensors on an
    accelerator are copied to the host; that waits for it). ``meta.json`` records the step, the
    ftrain/torch/tensordict/safetensors versions, the creation time, the TensorDict tree, a sha256
    per tensor file, and ``extra``.

    Args:
        state: the :class:`~ftrain.TrainState` to write. Its TensorDicts must be plain
            ``TensorDict``\\ s with ``batch_size=[]`` holding tensors (as ``ft.params_of`` and the
            optimizers build them).
        path: the checkpoint directory. Its parent is created if needed. If it exists it must be a
            checkpoint (only ``meta.json`` and ``*.safetensors`` files); it is replaced.
        extra: JSON metadata to keep beside the tensors (config, data-loader state, ...): a dict
            with str keys of dicts, lists, tuples (read back as lists), str, int, finite float,
            bool and None. Read it back with ``load_meta(path)["extra"]``. Not to be confused with
            ``state.extra``, the tensors that transforms keep in the state.

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
    path = Path(path)
    meta_extra = _checked_json(extra)
    tree, params_tensors, state_tensors = flatten(state)

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.recover(path)
    _check_replaceable(path)
    with atomic.write_dir(path) as tmp:
        files = {
            PARAMS_FILE: _write_tensors(params_tensors, tmp / PARAMS_FILE),
            STATE_FILE: _write_tensors(state_tensors, tmp / STATE_FILE),
        }
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": int(state.step.max()),  # a stacked state's: its furthest member's
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": _versions(),
            "files": files,
            "tree": tree,
            "extra": meta_extra,
        }
        meta["meta_sha256"] = meta_checksum(meta)
        (tmp / META_FILE).write_bytes(json.dumps(meta, indent=2, allow_nan=False).encode())
    return path


def _write_tensors(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, Any]:
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    digest, size = _hash_file(file)
    return {"sha256": digest, "bytes": size}


def _hash_file(file: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def _check_replaceable(path: Path) -> None:
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(
            f"ft.save: {path} exists and is not a directory; a checkpoint is a directory. "
            "Choose another path."
        )
    foreign = sorted(
        e.name for e in path.iterdir() if not (e.name == META_FILE or e.suffix == ".safetensors")
    )
    if foreign:
        raise CheckpointError(
            f"ft.save: refusing to replace {path}: it holds {foreign[:5]}, which ft.save did not "
            "write. Choose a new path, or delete it yourself."
        )


def _versions() -> dict[str, str]:
    return {
        "ftrain": __version__,
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "safetensors": safetensors.__version__,
    }


def _checked_json(extra: Mapping | None) -> dict:
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"ft.save(extra=...): extra must be a dict of JSON values, got {type(extra).__name__}."
        )
    _check_json_value(extra, "extra")
    return json.loads(json.dumps(extra, allow_nan=False))  # a copy; tuples become lists


def _check_json_value(value: object, where: str) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if math.isfinite(value):
            return
        problem = f"is {value}, which JSON cannot hold"
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"ft.save(extra=...): {where} has the key {k!r} of type {type(k).__name__}; "
                    "JSON keys are strings (it would come back as a different key). Use str keys."
                )
            _check_json_value(v, f"{where}[{k!r}]")
        return
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json_value(v, f"{where}[{i}]")
        return
    else:
        problem = f"is a {type(value).__name__}, which JSON cannot hold"
    raise TypeError(
        f"ft.save(extra=...): {where} {problem}. extra holds JSON: dicts with str keys, lists, "
        "str, int, finite float, bool, None. Convert it (tensor.tolist(), "
        "dataclasses.asdict(config)), or keep tensors in state.extra."
    )


def meta_checksum(meta: Mapping[str, Any]) -> str:
    """The checksum that ``meta.json`` records of itself under ``"meta_sha256"``.

    It is the sha256 of the canonical JSON (sorted keys, no spaces) of every other key, so it does
    not depend on how the file is formatted. A tool that edits ``meta.json`` must store
    ``meta["meta_sha256"] = meta_checksum(meta)``, or loading refuses the file as damaged.
    """
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# --- load ----------------------------------------------------------------------------------------


def load(
    path: str | os.PathLike,
    like: TrainState | None = None,
    *,
    device: str | torch.device | None = None,
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
            missing in checkpoint``). Tensors are placed on the devices of ``like``'s tensors.
        device: where to put ``params``, ``opt_state`` and ``extra`` (overrides ``like``'s
            devices). ``step`` and ``rng`` always stay on the CPU. Default: the CPU, or ``like``'s
            devices.
    """
    path = _resolve(Path(path))
    meta = _read_meta(path)
    if like is not None:
        if not isinstance(like, TrainState):
            raise TypeError(
                f"ft.load(path, like=...): like must be an ft.TrainState, got "
                f"{type(like).__name__}."
            )
        _check_like(path, meta["tree"], tree_of(like))
    files = {}
    for name in (PARAMS_FILE, STATE_FILE):
        _verify_file(path, name, meta["files"][name])
        files[name] = safetensors.torch.load_file(str(path / name))
    fields = unflatten(path, meta["tree"], files)
    devices = _devices(like) if like is not None and device is None else {}
    for field in ("params", "opt_state", "extra"):
        fields[field] = _place(fields[field], field, device, devices)
    return TrainState(**fields, batch_size=[])


def load_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of the checkpoint at ``path``: the parsed ``meta.json``, checksum verified.

    Keys: ``step`` (int), ``created`` (ISO 8601, UTC), ``versions`` (ftrain, torch, tensordict,
    safetensors), ``extra`` (what was passed to ``save(extra=...)``, ``{}`` if nothing), ``files``
    (sha256 and size per tensor file), ``tree`` (TensorDict structure, ``"dtype[shape]"`` per
    tensor), ``format``, ``format_version``. Tensor files are not read (:func:`load` verifies them).
    """
    return _read_meta(_resolve(Path(path)))


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check the checkpoint directory ``path`` as :func:`load` does, without building the state.

    ``meta.json`` must match its checksum and every tensor file must be present with the size and
    sha256 that it records. Returns the metadata (as :func:`load_meta`); raises
    :class:`CheckpointError` naming the missing or damaged file. ``path`` itself is checked: no
    fallback to a version that an interrupted save left aside.
    """
    path = Path(path)
    meta = _read_meta(path)
    for name in (PARAMS_FILE, STATE_FILE):
        _verify_file(path, name, meta["files"][name])
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


def _read_meta(path: Path) -> dict[str, Any]:
    file = path / META_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing: {path} is not an ftrain checkpoint, or an incomplete one."
        )
    try:
        meta = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} is damaged (not valid JSON: {e}).") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not ftrain checkpoint metadata (no format {FORMAT!r}).")
    if meta.get("format_version", FORMAT_VERSION + 1) > FORMAT_VERSION:
        raise CheckpointError(
            f"{file} has format_version {meta.get('format_version')!r}; this ftrain reads up to "
            f"{FORMAT_VERSION}. It was written by a newer ftrain: upgrade to load it."
        )
    if meta.get("meta_sha256") != meta_checksum(meta):
        raise CheckpointError(f"{file} is damaged (checksum mismatch).")
    return meta


def _verify_file(path: Path, name: str, info: dict) -> None:
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the checkpoint is incomplete.")
    size = file.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(
            f"{file} is damaged (size {size} bytes, meta.json says {info['bytes']})."
        )
    if _hash_file(file)[0] != info["sha256"]:
        raise CheckpointError(f"{file} is damaged (sha256 mismatch).")


def _check_like(path: Path, saved: dict, like: dict) -> None:
    diffs = differences(saved, like)
    if not diffs:
        return
    shown = diffs[:30] + ([f"... and {len(diffs) - 30} more"] if len(diffs) > 30 else [])
    raise CheckpointError(
        f"{path} does not match `like` ({len(diffs)} difference(s)):\n  "
        + "\n  ".join(shown)
        + "\nIt was saved from a different model, optimizer or transforms. Build `like` with the "
        "same config, or call ft.load(path) without like= to inspect what it holds.",
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
