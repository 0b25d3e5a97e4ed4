"""Applying updates to params."""

from __future__ import annotations

from tensordict import TensorDictBase

from ftrain import tree
from ftrain.internals import foreach
from ftrain.optim.base import GradientTransformation, LeafContext, leaf_apply

__all__ = ["apply_updates", "update_and_apply"]


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


def update_and_apply(
    optimizer: GradientTransformation,
    grads: TensorDictBase,
    opt_state: TensorDictBase,
    params: TensorDictBase,
    *,
    inplace: bool = False,
) -> tuple[TensorDictBase, TensorDictBase]:
    """``(new_params, new_opt_state)``: ``optimizer.update`` and :func:`apply_updates` in one.

    **Invariant:** equals ``updates, s = optimizer.update(grads, opt_state, params)`` then
    ``apply_updates(params, updates)``, bit for bit for any optimizer, except one that brings its
    own :func:`ftrain.optim.base.leaf_apply`: ``adam``, ``adamw`` and ``sgd`` on torch's fused
    kernels (and a ``chain``, ``partition`` or ``inject_hyperparams`` ending in them), whose
    kernel writes the new params directly, as ``torch.optim``'s fused step does, one pass over the
    params fewer (the same numbers to 1e-6 relative, ``tests/optim/test_fused.py``).

    With ``inplace=True`` the params, the state and the gradients may all be overwritten (the
    params are, in place; what a donated step allows); the returned params are ``params``.
    """
    g, tdef = tree.flatten(grads)
    s, sdef = tree.flatten(opt_state)
    p, pdef = tree.flatten(params)
    if pdef != tdef:
        raise KeyError(
            "update_and_apply: grads and params must have the same keys in the same order "
            f"({tdef} vs {pdef}). Pass the gradients of these params."
        )
    new_p, new_s = leaf_apply(optimizer)(g, s, p, LeafContext(tdef, sdef, inplace, inplace))
    if inplace:
        return params, sdef.rebuild(new_s, opt_state)
    return tdef.unflatten(new_p), sdef.unflatten(new_s)
