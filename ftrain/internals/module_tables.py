"""nn.Module's internal tables: the one module of ftrain that reads or writes them.

A module keeps its parameters, buffers and submodules in three dicts (``_parameters``,
``_buffers``, ``_modules``). ``torch.func.functional_call`` places tensors by writing into the
first two for the extent of a call, and so does ``ft.apply``, through :func:`param_slots` and
:func:`tables`. Transforms that change how a model runs (``ftrain.internals.blocks``) copy modules
instead of modifying them: :func:`copy_module` shares these tables, :func:`set_children` gives a
copy a submodule table of its own, :func:`clear_hooks` empties a copy's hook tables. torch has no
public API for either (``torch.nn.utils.swap_tensors`` swaps one tensor's contents; nothing copies a
module's structure without its tensors).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = [
    "param_slots",
    "param_slot",
    "buffer_slot",
    "tables",
    "children",
    "copy_module",
    "set_children",
    "clear_hooks",
]


def param_slots(modules: Iterable[nn.Module]) -> list[tuple[dict, str]]:
    """``(table, name)`` for every parameter owned by ``modules``: ``table[name]`` is where the
    module keeps it, where ``functional_call`` and ``ft.apply`` place tensors. For code that places
    other tensors for a while, and puts the old ones back."""
    return [(m._parameters, name) for m in modules for name in m._parameters]


def param_slot(module: nn.Module, name: str) -> tuple[dict, str]:
    """``(table, attr)`` of the parameter at dotted ``name`` under ``module``."""
    owner, _, attr = name.rpartition(".")
    return module.get_submodule(owner)._parameters, attr


def buffer_slot(module: nn.Module, name: str) -> tuple[dict, str]:
    """``(table, attr)`` of the buffer at dotted ``name`` under ``module``."""
    owner, _, attr = name.rpartition(".")
    return module.get_submodule(owner)._buffers, attr


def tables(module: nn.Module) -> list[dict]:
    """The parameter, buffer and submodule tables of ``module`` and every submodule: what must
    not change for a placement worked out once to stay valid."""
    return [t for m in module.modules() for t in (m._parameters, m._buffers, m._modules)]


def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s submodule table, by name (read only: use :func:`set_children` on a copy)."""
    return module._modules


def copy_module(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module``: a new object of its class holding the same attribute values,
    so its parameter, buffer and submodule tables are the original's own dicts."""
    new = object.__new__(type(module))
    new.__dict__.update(module.__dict__)
    return new


def set_children(copy: nn.Module, table: dict[str, nn.Module | None]) -> None:
    """Give ``copy`` (a :func:`copy_module` copy, never a user's module) its own submodule table."""
    copy.__dict__["_modules"] = table


def clear_hooks(copy: nn.Module) -> None:
    """Empty ``copy``'s forward and backward hook tables (a copy standing for a module whose own
    hooks run when the copy's new forward calls it: they must not run twice)."""
    for name, value in list(copy.__dict__.items()):
        if name.startswith(("_forward_", "_backward_")) and isinstance(value, dict):
            copy.__dict__[name] = type(value)()
