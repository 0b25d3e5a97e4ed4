"""Applying updates to params."""

from __future__ import annotations

from tensordict import TensorDictBase

from ftrain import foreach, tree

__all__ = ["apply_updates"]


def apply_updates(
    params: TensorDictBase, updates: TensorDictBase, *, inplace: bool = False
) -> TensorDictBase:
    """``params + updates`` leaf by leaf (one multi-tensor kernel).

    Returns a new TensorDict, or ``params`` itself updated in place with ``inplace=True``. The two
    trees must have the same keys in the same order (an error names the difference).
    """
    p, pdef = tree.flatten(params)
    u, udef = tree.flatten(updates)
    if pdef != udef:
        want, got = set(pdef.paths), set(udef.paths)
        raise KeyError(
            f"apply_updates: updates do not have the params' keys: missing {sorted(want - got)}, "
            f"extra {sorted(got - want)}"
            + (" (same keys, different order)" if want == got else "")
            + ". Pass the updates the optimizer returned for these params."
        )
    if not p:
        return params if inplace else pdef.unflatten([])
    if inplace:
        foreach.add_(p, u)
        return params
    return pdef.unflatten(foreach.add(p, u))
