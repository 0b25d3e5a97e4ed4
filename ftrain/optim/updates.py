"""Applying updates to params."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from ftrain import _tree

__all__ = ["apply_updates"]


def apply_updates(
    params: TensorDictBase, updates: TensorDictBase, *, inplace: bool = False
) -> TensorDictBase:
    """``params + updates`` leaf by leaf (one multi-tensor kernel).

    Returns a new TensorDict, or ``params`` itself updated in place with ``inplace=True``.
    """
    p, u = _tree.leaves(params), _tree.leaves(updates)
    if len(p) != len(u):
        raise ValueError(f"apply_updates: {len(p)} params but {len(u)} updates.")
    if inplace:
        torch._foreach_add_(p, u)
        return params
    return _tree.unflatten(params, torch._foreach_add(p, u))
