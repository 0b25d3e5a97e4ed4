"""Checkpoints you can trust: ``save``/``load`` of a :class:`~ftrain.TrainState`, and run folders.

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
* **Atomic.** :func:`save` writes into a temporary sibling directory, fsyncs every file and the
  directory, then renames it into place. When ``path`` already holds a checkpoint, the old one is
  renamed aside first and deleted last; a process killed at any moment leaves the old or the new
  checkpoint whole, and :func:`load`, :func:`latest_checkpoint` and the next :func:`save` recover
  from what an interrupted save left behind. One process writes a given path (or run folder) at a
  time: under ``torchrun`` that is rank 0.

A run keeps ``checkpoint-<step>/`` folders (:func:`save_checkpoint`, the last ``keep`` of them) and
resumes from the newest one that verifies::

    path = ft.latest_checkpoint("runs/gpt")           # None on a fresh run
    if path is not None:
        state = ft.load(path, like=state)             # refuses a checkpoint of another model
        loader.load_state_dict(ft.load_meta(path)["extra"]["loader"])
    ...
    ft.save_checkpoint("runs/gpt", state, keep=3, extra={"loader": loader.state_dict()})

``params.safetensors`` is an ordinary state dict: ``module.load_state_dict(
safetensors.torch.load_file(path / "params.safetensors"))`` loads it into the plain module.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import tensordict
import torch
from tensordict import TensorDict, TensorDictBase

from ftrain.state import TrainState
from ftrain.tree import SEP

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "save",
    "load",
    "load_meta",
    "save_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
]

PARAMS_FILE = "params.safetensors"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
FORMAT = "ftrain-checkpoint"
FORMAT_VERSION = 1

# TrainState fields, in order, and the file each one lives in. params keys carry no prefix, so the
# params file is the module's own state dict; the other fields are prefixed with their name.
_FIELDS = ("params", "opt_state", "step", "rng", "extra")
_TENSOR_FIELDS = ("step", "rng")  # 0-d tensors that always live on the CPU

_RUN_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
# Siblings that an interrupted save or prune leaves: <name>.tmp-<token> (being written),
# <name>.old-<token> (the previous version, renamed aside), <name>.del-<token> (being deleted).
_LEFTOVER = re.compile(r"(?P<name>.+)\.(?P<kind>tmp|old|del)-[0-9a-f]+")

_CHUNK = 1 << 22  # bytes read at a time when hashing


class CheckpointError(Exception):
    """A checkpoint is missing, damaged, or does not match what it is loaded into.

    ``differences`` lists every mismatch found by ``load(path, like=...)`` (the message shows the
    first 30), one line per tensor: ``"params.blocks.3.attn.weight: missing in checkpoint"``.
    """

    def __init__(self, message: str, differences: list[str] | None = None):
        super().__init__(message)
        self.differences = differences or []


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
    tree, params_tensors, state_tensors = _collect(state)
    step = int(state.step)

    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path)
    _check_replaceable(path)
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        files = {
            PARAMS_FILE: _write_tensors(params_tensors, tmp / PARAMS_FILE),
            STATE_FILE: _write_tensors(state_tensors, tmp / STATE_FILE),
        }
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "versions": _versions(),
            "files": files,
            "tree": tree,
            "extra": meta_extra,
        }
        meta["meta_sha256"] = _meta_checksum(meta)
        _write_bytes(tmp / META_FILE, json.dumps(meta, indent=2, allow_nan=False).encode())
        _fsync_dir(tmp)
        _commit(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already if the commit got that far
        raise
    return path


def _collect(state: TrainState) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The JSON tree of ``state`` and its tensors (CPU, contiguous) keyed for each file."""
    if state.step.numel() != 1 or state.step.dim() != 0:
        raise CheckpointError(
            f"ft.save: state.step must be a 0-d tensor, got shape {tuple(state.step.shape)}."
        )
    tree: dict[str, Any] = {}
    params: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for field in _FIELDS:
        value = getattr(state, field)
        if field == "params":
            tree[field] = _walk(value, (), "state.params", params, storages)
        elif isinstance(value, torch.Tensor):
            tree[field] = _spec(value)
            rest[field] = _host(value, f"state.{field}", storages)
        else:
            tree[field] = _walk(value, (field,), f"state.{field}", rest, storages)
    return tree, params, rest


def _walk(
    td: object, prefix: tuple[str, ...], where: str, out: dict | None, storages: set[int]
) -> dict[str, Any]:
    """JSON tree of ``td`` (a dict per TensorDict, ``"dtype[shape]"`` per tensor). Unless ``out``
    is None, also fills it with host copies of the tensors keyed by dotted path."""
    if not isinstance(td, TensorDictBase):
        raise CheckpointError(
            f"cannot checkpoint {where}: it is a {type(td).__name__}; a checkpoint holds "
            "tensors and TensorDicts. Keep other values in ft.save(..., extra={...}) (JSON)."
        )
    if type(td) is not TensorDict or td.batch_size != torch.Size([]):
        raise CheckpointError(
            f"cannot checkpoint {where}: it is a {type(td).__name__} with batch_size "
            f"{list(td.batch_size)}; a checkpoint holds plain TensorDicts with batch_size=[] (as "
            "ft.params_of and the optimizers build them). Convert it: "
            "TensorDict(x.to_dict(), batch_size=[])."
        )
    tree: dict[str, Any] = {}
    for key in td.keys():
        value = td.get(key)
        name = f"{where}.{key}"
        if isinstance(value, torch.Tensor) and out is None:
            tree[key] = _spec(value)
        elif isinstance(value, torch.Tensor):
            flat_key = SEP.join((*prefix, key))
            if flat_key in out:
                raise CheckpointError(
                    f"ft.save: {name} and another entry both flatten to the key {flat_key!r}; "
                    "rename one (TensorDict keys in a checkpoint must not contain dots)."
                )
            tree[key] = _spec(value)
            out[flat_key] = _host(value, name, storages)
        else:
            tree[key] = _walk(value, (*prefix, key), name, out, storages)
    return tree


def _spec(t: torch.Tensor) -> str:
    """``"float32[4, 3]"``: dtype and shape of a tensor, as the tree in meta.json records it."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _host(t: torch.Tensor, name: str, storages: set[int]) -> torch.Tensor:
    """A contiguous CPU tensor with the values of ``t`` that shares memory with no other one."""
    t = t.detach()
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        raise CheckpointError(
            f"ft.save: {name} is a {type(t).__name__} with layout {t.layout}; only plain dense "
            "tensors can be saved. For a sharded (DTensor) state, save the full tensors, e.g. "
            "from x.full_tensor() on every rank, and write from rank 0."
        )
    t = t.to("cpu").resolve_conj().resolve_neg().contiguous()
    # safetensors refuses two tensors over one storage (views, or one tensor under two names).
    ptr = t.untyped_storage().data_ptr()
    if t.numel() and ptr in storages:
        t = t.clone()
        ptr = t.untyped_storage().data_ptr()
    storages.add(ptr)
    return t


def _write_tensors(tensors: dict[str, torch.Tensor], file: Path) -> dict[str, Any]:
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
    digest, size = _hash_file(file, fsync=True)
    return {"sha256": digest, "bytes": size}


def _hash_file(file: Path, *, fsync: bool = False) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(file, "r+b" if fsync else "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest(), size


def _write_bytes(file: Path, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable. A no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``; an existing ``path`` goes aside, deleted last."""
    if not path.exists():
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        return
    aside = path.with_name(f"{path.name}.old-{secrets.token_hex(4)}")
    os.replace(path, aside)
    _fsync_dir(path.parent)
    try:
        os.replace(tmp, path)
    except BaseException:
        # Put the old checkpoint back; if even that fails, load() finds it aside and the next
        # save() restores it.
        with contextlib.suppress(Exception):
            os.replace(aside, path)
        raise
    _fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _leftovers(path: Path) -> dict[str, list[Path]]:
    """What interrupted saves of ``path`` left beside it, by kind (tmp/old/del), newest first."""
    found: dict[str, list[Path]] = {"tmp": [], "old": [], "del": []}
    if not path.parent.is_dir():
        return found
    for entry in path.parent.iterdir():
        m = _LEFTOVER.fullmatch(entry.name)
        if m and m["name"] == path.name and entry.is_dir():
            found[m["kind"]].append(entry)
    for kind in found.values():
        kind.sort(key=_mtime, reverse=True)
    return found


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0


def _recover(path: Path) -> None:
    """Undo what an interrupted save of ``path`` left: restore the old version if ``path`` is
    missing, delete partial writes and stale copies."""
    found = _leftovers(path)
    if not path.exists() and found["old"]:
        os.replace(found["old"].pop(0), path)
        _fsync_dir(path.parent)
    for leftover in found["tmp"] + found["old"] + found["del"]:
        shutil.rmtree(leftover, ignore_errors=True)


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
    import ftrain

    return {
        "ftrain": ftrain.__version__,
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


def _meta_checksum(meta: dict) -> str:
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
        path: a checkpoint directory written by :func:`save` (e.g. from :func:`latest_checkpoint`).
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
    like_tree = None
    if like is not None:
        if not isinstance(like, TrainState):
            raise TypeError(
                f"ft.load(path, like=...): like must be an ft.TrainState, got "
                f"{type(like).__name__}."
            )
        like_tree = _collect_tree(like)
        _check_like(path, meta["tree"], like_tree)
    flat = {}
    for name in (PARAMS_FILE, STATE_FILE):
        _verify_file(path, name, meta["files"][name])
        flat[name] = safetensors.torch.load_file(str(path / name))

    tree = meta["tree"]
    devices = _devices(like) if like is not None and device is None else {}
    fields: dict[str, Any] = {}
    used = {PARAMS_FILE: set(), STATE_FILE: set()}
    for field in _FIELDS:
        if field == "params":
            fields[field] = _build(path, tree[field], (), flat[PARAMS_FILE], used[PARAMS_FILE])
        elif isinstance(tree[field], str):
            fields[field] = _take(path, field, tree[field], flat[STATE_FILE], used[STATE_FILE])
        else:
            fields[field] = _build(path, tree[field], (field,), flat[STATE_FILE], used[STATE_FILE])
    for name, tensors in flat.items():
        if tensors.keys() != used[name]:
            raise CheckpointError(
                f"{path / name} holds tensors that meta.json does not list: "
                f"{sorted(tensors.keys() - used[name])[:10]}. The checkpoint is inconsistent."
            )
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


def _resolve(path: Path) -> Path:
    """``path``, or the old version an interrupted save renamed aside if ``path`` is missing."""
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is not a directory; a checkpoint is a directory.")
    old = _leftovers(path)["old"]
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
    if meta.get("meta_sha256") != _meta_checksum(meta):
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


def _take(path: Path, key: str, spec: str, tensors: dict, used: set) -> torch.Tensor:
    if key not in tensors:
        raise CheckpointError(
            f"{path}: meta.json lists {key!r} but the tensor file lacks it; the checkpoint is "
            "inconsistent."
        )
    t = tensors[key]
    if _spec(t) != spec:
        raise CheckpointError(
            f"{path}: {key!r} is {_spec(t)} in the tensor file but {spec} in meta.json; the "
            "checkpoint is inconsistent."
        )
    used.add(key)
    return t


def _build(path: Path, tree: dict, prefix: tuple, tensors: dict, used: set) -> TensorDict:
    entries: dict[str, Any] = {}
    for key, node in tree.items():
        if isinstance(node, dict):
            entries[key] = _build(path, node, (*prefix, key), tensors, used)
        else:
            entries[key] = _take(path, SEP.join((*prefix, key)), node, tensors, used)
    return TensorDict(entries, batch_size=[])


def _collect_tree(state: TrainState) -> dict[str, Any]:
    """The tree ``save(state)`` would record, without copying any tensor."""
    tree: dict[str, Any] = {}
    for field in _FIELDS:
        value = getattr(state, field)
        if isinstance(value, torch.Tensor):
            tree[field] = _spec(value)
        else:
            tree[field] = _walk(value, (field,), f"like.{field}", None, set())
    return tree


def _check_like(path: Path, saved: dict, like: dict) -> None:
    diffs: list[str] = []
    _diff(saved, like, "", diffs)
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


def _diff(saved: dict, like: dict, where: str, out: list[str]) -> None:
    for key, node in like.items():
        name = f"{where}{key}"
        if key not in saved:
            out.extend(f"{n}: missing in checkpoint" for n in _names(node, name))
        elif isinstance(node, dict) != isinstance(saved[key], dict):
            kinds = [
                "a TensorDict" if isinstance(x, dict) else "a tensor" for x in (saved[key], node)
            ]
            out.append(f"{name}: {kinds[0]} in checkpoint, {kinds[1]} in `like`")
        elif isinstance(node, dict):
            _diff(saved[key], node, f"{name}.", out)
        elif node != saved[key]:
            out.append(f"{name}: {saved[key]} in checkpoint, {node} in `like`")
    for key, node in saved.items():
        if key not in like:
            out.extend(
                f"{n}: unexpected (in checkpoint, not in `like`)"
                for n in _names(node, f"{where}{key}")
            )


def _names(node: Any, name: str) -> list[str]:
    if not isinstance(node, dict):
        return [name]
    if not node:
        return [f"{name} (empty TensorDict)"]
    return [n for key, child in node.items() for n in _names(child, f"{name}.{key}")]


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


# --- runs ----------------------------------------------------------------------------------------


def save_checkpoint(
    run_dir: str | os.PathLike,
    state: TrainState,
    *,
    keep: int | None = 3,
    extra: Mapping | None = None,
) -> Path:
    """Save ``state`` to ``run_dir/checkpoint-<step>/`` and keep the newest ``keep`` checkpoints.

    Same guarantees as :func:`save` (atomic, verified, no pickle). Before writing, what interrupted
    saves left in ``run_dir`` is cleaned up. After writing, the checkpoints beyond the ``keep``
    with the highest steps are deleted (each renamed away first, so a kill mid-delete leaves no
    half checkpoint under a checkpoint name); the one just written is always kept. ``keep=None``
    keeps all. Returns the path written.
    """
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(
            f"ft.save_checkpoint(keep=...): keep must be an int >= 1 or None, got {keep!r}."
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in {m["name"] for m in _run_leftovers(run_dir)}:
        _recover(run_dir / name)
    path = save(state, run_dir / f"checkpoint-{int(state.step)}", extra=extra)
    if keep is not None:
        older = [p for p in list_checkpoints(run_dir) if p != path]
        for stale in older[: max(0, len(older) + 1 - keep)]:
            doomed = stale.with_name(f"{stale.name}.del-{secrets.token_hex(4)}")
            os.replace(stale, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    return path


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-<step>`` directories in ``run_dir`` by step, oldest first (unverified)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [
        (int(m[1]), entry)
        for entry in run_dir.iterdir()
        if (m := _RUN_CHECKPOINT.fullmatch(entry.name)) and entry.is_dir()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint in ``run_dir`` that verifies, or None if there is none.

    Each candidate, newest step first, is verified as :func:`load` would (meta.json checksum,
    every file present with its sha256). A broken one is passed over with a
    :class:`CheckpointWarning` naming it and why; so is what an interrupted save left (a
    ``.tmp-``/``.del-`` directory). If a save was interrupted while replacing ``checkpoint-<step>``,
    the previous version (``checkpoint-<step>.old-<token>``) is a candidate in its place.
    """
    run_dir = Path(run_dir)
    candidates = {int(p.name.split("-")[1]): p for p in list_checkpoints(run_dir)}
    for m in _run_leftovers(run_dir):
        entry = run_dir / m.string
        step = int(_RUN_CHECKPOINT.fullmatch(m["name"])[1])
        if m["kind"] == "old" and step not in candidates:
            candidates[step] = entry
            continue
        warnings.warn(
            f"{entry} was left by an interrupted checkpoint save or delete; ignoring it (the next "
            "ft.save_checkpoint removes it).",
            CheckpointWarning,
            stacklevel=2,
        )
    for step in sorted(candidates, reverse=True):
        path = candidates[step]
        try:
            meta = _read_meta(path)
            for name in (PARAMS_FILE, STATE_FILE):
                _verify_file(path, name, meta["files"][name])
        except (CheckpointError, KeyError, TypeError, OSError) as e:
            warnings.warn(f"skipping checkpoint {path}: {e}", CheckpointWarning, stacklevel=2)
            continue
        return path
    return None


def _run_leftovers(run_dir: Path) -> list[re.Match]:
    if not run_dir.is_dir():
        return []
    out = []
    for entry in run_dir.iterdir():
        m = _LEFTOVER.fullmatch(entry.name)
        if m and _RUN_CHECKPOINT.fullmatch(m["name"]) and entry.is_dir():
            out.append(m)
    return sorted(out, key=lambda m: m.string)
