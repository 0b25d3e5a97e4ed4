"""How a :class:`~ftrain.TrainState` maps onto a checkpoint's tensor files and JSON tree, and back.

``params.safetensors`` holds ``state.params`` keyed by module path with no prefix, so it is the
module's own state dict; ``state.safetensors`` holds ``step``, ``rng`` and ``opt_state.<path>``,
``extra.<path>``. The tree, recorded in ``meta.json``, has a dict per TensorDict (empty ones and key
order included) and ``"dtype[shape]"`` per tensor, so that a load rebuilds the exact nesting and can
compare against a ``like`` state before reading any tensor. Only plain dense tensors in plain
``batch_size=[]`` TensorDicts are accepted; anything else is refused with its name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain.state import TrainState
from ftrain.tree import SEP

__all__ = [
    "FIELDS",
    "PARAMS_FILE",
    "STATE_FILE",
    "CheckpointError",
    "differences",
    "flatten",
    "spec",
    "tree_of",
    "unflatten",
]

PARAMS_FILE = "params.safetensors"
STATE_FILE = "state.safetensors"
# TrainState fields, in order. params go to PARAMS_FILE, the others to STATE_FILE.
FIELDS = ("params", "opt_state", "step", "rng", "extra")


class CheckpointError(Exception):
    """A checkpoint is missing, damaged, or does not match what it is loaded into.

    ``differences`` lists every mismatch found by ``load(path, like=...)`` (the message shows the
    first 30), one line per tensor: ``"params.blocks.3.attn.weight: missing in checkpoint"``.
    """

    def __init__(self, message: str, differences: list[str] | None = None):
        super().__init__(message)
        self.differences = differences or []


def spec(t: torch.Tensor) -> str:
    """``"float32[4, 3]"``: dtype and shape of a tensor, as the tree in meta.json records it."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


# --- state -> tree and tensors -------------------------------------------------------------------


def flatten(state: TrainState) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tree of ``state`` and its tensors for each file: ``(tree, params, rest)``.

    The tensors are contiguous CPU copies (an accelerator is waited for) that share memory with no
    other one, as safetensors requires. Raises :class:`CheckpointError` naming any entry that a
    checkpoint cannot hold.
    """
    # 0-d, or one per member of a stacked state (ft.stack), as rng is
    if state.step.dim() > 1 or state.step.shape != state.rng.shape:
        raise CheckpointError(
            f"ft.save: state.step must be a 0-d tensor (or, in a state built by ft.stack, one "
            f"per member, shaped like state.rng), got shape {tuple(state.step.shape)}."
        )
    tree: dict[str, Any] = {}
    params: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for field in FIELDS:
        value = getattr(state, field)
        if field == "params":
            tree[field] = _walk(value, (), "state.params", params, storages)
        elif isinstance(value, torch.Tensor):
            tree[field] = spec(value)
            rest[field] = _host(value, f"state.{field}", storages)
        else:
            tree[field] = _walk(value, (field,), f"state.{field}", rest, storages)
    return tree, params, rest


def tree_of(state: TrainState) -> dict[str, Any]:
    """The tree :func:`flatten` would record for ``state``, without copying any tensor."""
    tree: dict[str, Any] = {}
    for field in FIELDS:
        value = getattr(state, field)
        if isinstance(value, torch.Tensor):
            tree[field] = spec(value)
        else:
            tree[field] = _walk(value, (field,), f"like.{field}", None, set())
    return tree


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
            tree[key] = spec(value)
        elif isinstance(value, torch.Tensor):
            flat_key = SEP.join((*prefix, key))
            if flat_key in out:
                raise CheckpointError(
                    f"ft.save: {name} and another entry both flatten to the key {flat_key!r}; "
                    "rename one (TensorDict keys in a checkpoint must not contain dots)."
                )
            tree[key] = spec(value)
            out[flat_key] = _host(value, name, storages)
        else:
            tree[key] = _walk(value, (*prefix, key), name, out, storages)
    return tree


def _host(t: torch.Tensor, name: str, storages: set[int]) -> torch.Tensor:
    """A contiguous CPU tensor with the values of ``t`` that shares memory with no other one."""
    t = t.detach()
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        raise CheckpointError(
            f"ft.save: {name} is a {type(t).__name__} with layout {t.layout}; only plain dense "
            "tensors (and DTensors, which are saved sharded) can be saved. Convert it, e.g. "
            "x.to_dense()."
        )
    t = t.to("cpu").resolve_conj().resolve_neg().contiguous()
    # safetensors refuses two tensors over one storage (views, or one tensor under two names).
    ptr = t.untyped_storage().data_ptr()
    if t.numel() and ptr in storages:
        t = t.clone()
        ptr = t.untyped_storage().data_ptr()
    storages.add(ptr)
    return t


# --- tree and tensors -> state -------------------------------------------------------------------


def unflatten(path: Path, tree: dict, files: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The TrainState fields that ``tree`` describes, built from the tensors of each file.

    ``files`` maps :data:`PARAMS_FILE` and :data:`STATE_FILE` to their tensors by key. Every
    TensorDict of the tree is rebuilt (key order and empty ones included). Raises
    :class:`CheckpointError` (naming ``path``) if a tensor is missing, has another dtype or shape
    than the tree says, or is not in the tree.
    """
    fields: dict[str, Any] = {}
    used: dict[str, set] = {PARAMS_FILE: set(), STATE_FILE: set()}
    params, rest = files[PARAMS_FILE], files[STATE_FILE]
    for field in FIELDS:
        if field == "params":
            fields[field] = _build(path, tree[field], (), params, used[PARAMS_FILE])
        elif isinstance(tree[field], str):
            fields[field] = _take(path, field, tree[field], rest, used[STATE_FILE])
        else:
            fields[field] = _build(path, tree[field], (field,), rest, used[STATE_FILE])
    for name, tensors in files.items():
        if tensors.keys() != used[name]:
            raise CheckpointError(
                f"{path / name} holds tensors that meta.json does not list: "
                f"{sorted(tensors.keys() - used[name])[:10]}. The checkpoint is inconsistent."
            )
    return fields


def _take(path: Path, key: str, expected: str, tensors: dict, used: set) -> torch.Tensor:
    if key not in tensors:
        raise CheckpointError(
            f"{path}: meta.json lists {key!r} but the tensor file lacks it; the checkpoint is "
            "inconsistent."
        )
    t = tensors[key]
    if spec(t) != expected:
        raise CheckpointError(
            f"{path}: {key!r} is {spec(t)} in the tensor file but {expected} in meta.json; the "
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


# --- comparing trees -----------------------------------------------------------------------------


def differences(saved: dict, like: dict) -> list[str]:
    """Every difference between two trees, one line per tensor or TensorDict, saved first:
    ``"params.wte.weight: float32[37, 16] in checkpoint, float32[37, 24] in `like`"``,
    ``"...: missing in checkpoint"``, ``"...: unexpected (in checkpoint, not in `like`)"``.
    Empty when the trees are equal."""
    out: list[str] = []
    _diff(saved, like, "", out)
    return out


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
