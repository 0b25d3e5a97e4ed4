"""A checkpoint's ``meta.json``: what it holds, its checksum of itself, and checking tensor files
against the sha256 it records. Shared by whole (:mod:`ftrain.io.checkpoint`) and sharded
(:mod:`ftrain.io.sharded`) checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import tensordict
import torch

from ftrain.internals.version import __version__
from ftrain.io.state_files import CheckpointError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "checked_json",
    "check_replaceable",
    "hash_file",
    "meta_checksum",
    "read_meta",
    "verify_file",
    "versions",
]

META_FILE = "meta.json"
FORMAT = "ftrain-checkpoint"
# 1: whole tensors in params.safetensors + state.safetensors; 2: sharded (an index of pieces)
FORMAT_VERSION = 2

_CHUNK = 1 << 22  # bytes read at a time when hashing


def hash_file(file: Path) -> tuple[str, int]:
    """``(sha256 hex digest, size in bytes)`` of ``file``, read in 4 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def check_replaceable(path: Path) -> None:
    """Refuse to replace ``path`` unless it is missing or a checkpoint directory."""
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


def versions() -> dict[str, str]:
    """The versions of the libraries that wrote a checkpoint."""
    return {
        "ftrain": __version__,
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "safetensors": safetensors.__version__,
    }


def checked_json(extra: Mapping | None) -> dict:
    """A JSON copy of ``save(extra=...)`` (tuples become lists); a TypeError names what JSON
    cannot hold."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise TypeError(
            f"ft.save(extra=...): extra must be a dict of JSON values, got {type(extra).__name__}."
        )
    _check_json_value(extra, "extra")
    return json.loads(json.dumps(extra, allow_nan=False))


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


def read_meta(path: Path) -> dict[str, Any]:
    """The parsed ``meta.json`` of the checkpoint directory ``path``, its checksum verified."""
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


def verify_file(path: Path, name: str, info: dict) -> None:
    """Refuse the tensor file ``path / name`` if it is missing or its size or sha256 differs
    from ``info`` (its ``meta.json`` record)."""
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the checkpoint is incomplete.")
    size = file.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(
            f"{file} is damaged (size {size} bytes, meta.json says {info['bytes']})."
        )
    if hash_file(file)[0] != info["sha256"]:
        raise CheckpointError(f"{file} is damaged (sha256 mismatch).")
