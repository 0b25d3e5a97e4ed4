"""The optimizer interface: a pair of pure functions, and how to combine them.

A :class:`GradientTransformation` is ``(init, update)``:

* ``init(params) -> state``: the optimizer state for these params, a TensorDict.
* ``update(updates, state, params=None, *, inplace=False) -> (updates, state)``: transform the
  incoming updates (gradients, at the start of a chain) and return the new state.

``update`` is pure: with ``inplace=False`` (the default) nothing passed in is modified. With
``inplace=True`` it may overwrite the tensors of ``updates`` and ``state`` in place, which is how a
step built with ``donate=True`` avoids allocating a second copy of the optimizer state.

Only the returned state carries behaviour over time; hyper-parameters that change (the learning
rate along a schedule) are computed from counters in that state as tensors, so a compiled step never
sees a new Python number and never recompiles.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain import _tree

__all__ = [
    "GradientTransformation",
    "chain",
    "identity",
    "stateless",
    "masked",
    "apply_if_finite",
    "empty_state",
    "state_bytes",
]


class GradientTransformation(NamedTuple):
    """An optimizer (or one piece of one) as two pure functions, optax-style.

    Attributes:
        init: ``init(params: TensorDict) -> TensorDict``.
        update: ``update(updates, state, params=None, *, inplace=False) -> (updates, state)``.
    """

    init: Callable[[TensorDictBase], TensorDictBase]
    update: Callable[..., tuple[TensorDictBase, TensorDictBase]]


def empty_state() -> TensorDict:
    """The state of a stateless transform: an empty TensorDict."""
    return TensorDict({}, batch_size=[])


def _accepts_inplace(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "inplace" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _call(t: GradientTransformation, updates, state, params, inplace: bool, takes_inplace: bool):
    if takes_inplace:
        return t.update(updates, state, params, inplace=inplace)
    return t.update(updates, state, params)


def identity() -> GradientTransformation:
    """Leaves updates unchanged; no state."""

    def update(updates, state, params=None, *, inplace=False):
        del params, inplace
        return updates, state

    return GradientTransformation(lambda params: empty_state(), update)


def stateless(
    fn: Callable[[list[torch.Tensor], list[torch.Tensor] | None], list],
) -> GradientTransformation:
    """A stateless transform from ``fn(update_leaves, param_leaves_or_None) -> new_update_leaves``.

    ``fn`` sees lists of leaf tensors (in key order) so it can use ``torch._foreach_*`` kernels. It
    must not modify its inputs.
    """

    def update(updates, state, params=None, *, inplace=False):
        del inplace
        p = None if params is None else _tree.leaves(params)
        return _tree.unflatten(updates, fn(_tree.leaves(updates), p)), state

    return GradientTransformation(lambda params: empty_state(), update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after another; the state is ``{"0": state0, "1": state1, ...}``.

    **Invariant:** ``chain(a, b).update(g, s, p)`` equals ``b.update(a.update(g, s0, p)[0], s1, p)``.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation. "
                "Pass transforms such as optim.scale_by_adam(), not optimizer classes."
            )
    takes_inplace = [_accepts_inplace(t.update) for t in transforms]

    def init(params):
        return TensorDict({str(i): t.init(params) for i, t in enumerate(transforms)}, batch_size=[])

    def update(updates, state, params=None, *, inplace=False):
        new_state = {}
        for i, (t, ti) in enumerate(zip(transforms, takes_inplace)):
            updates, new_state[str(i)] = _call(t, updates, state[str(i)], params, inplace, ti)
        return updates, TensorDict(new_state, batch_size=[])

    return GradientTransformation(init, update)


def _resolve_mask(mask, params: TensorDictBase) -> list[bool]:
    m = mask(params) if callable(mask) else mask
    if not isinstance(m, TensorDictBase):
        raise TypeError(
            "masked(inner, mask): mask must be a TensorDict of booleans with the params' keys, or "
            "a function params -> such a TensorDict (e.g. optim.decay_mask)."
        )
    want, got = _tree.paths(params), _tree.paths(m)
    if set(want) != set(got):
        raise KeyError(
            f"masked: mask keys differ from params keys: missing {sorted(set(want) - set(got))}, "
            f"extra {sorted(set(got) - set(want))}."
        )
    flat = _tree.to_flat(m)
    return [bool(flat[k]) for k in want]


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Apply ``inner`` only to the leaves where ``mask`` is True; pass the others through unchanged.

    ``mask`` is a TensorDict of booleans keyed like the params, or a function ``params -> mask``
    (evaluated once per structure in ``init`` and ``update``). The inner state covers only the
    selected leaves, so masked-out leaves cost no optimizer memory.
    """
    takes_inplace = _accepts_inplace(inner.update)

    def select(td, keep):
        flat = _tree.to_flat(td)
        return _tree.from_flat({k: v for (k, v), m in zip(flat.items(), keep) if m})

    def init(params):
        return inner.init(select(params, _resolve_mask(mask, params)))

    def update(updates, state, params=None, *, inplace=False):
        keep = _resolve_mask(mask, params if params is not None else updates)
        sub_u = select(updates, keep)
        sub_p = None if params is None else select(params, keep)
        new_sub, state = _call(inner, sub_u, state, sub_p, inplace, takes_inplace)
        flat = _tree.to_flat(updates)
        flat.update(_tree.to_flat(new_sub))
        return _tree.unflatten(updates, [flat[k] for k in _tree.paths(updates)]), state

    return GradientTransformation(init, update)


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor: every element of every tensor is finite. No host sync."""
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    norms = torch._foreach_norm(tensors, ord=float("inf"))
    return torch.stack(norms).isfinite().all()


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int = 10**9
) -> GradientTransformation:
    """Apply ``inner`` only when every update is finite; otherwise emit zero updates and keep state.

    The state records ``notfinite_count`` (consecutive non-finite steps), ``total_notfinite`` and
    ``last_finite`` (0-d tensors). After ``max_consecutive_errors`` bad steps in a row the bad
    update is let through, as in optax. The choice is made with tensor ops: no host sync.
    """
    takes_inplace = _accepts_inplace(inner.update)

    def init(params):
        return TensorDict(
            {
                "inner": inner.init(params),
                "notfinite_count": torch.zeros((), dtype=torch.int64),
                "total_notfinite": torch.zeros((), dtype=torch.int64),
                "last_finite": torch.ones((), dtype=torch.bool),
            },
            batch_size=[],
        )

    def update(updates, state, params=None, *, inplace=False):
        del inplace  # the old state must survive a bad step, so never overwrite it
        ok = all_finite(_tree.leaves(updates))
        new_u, new_inner = _call(inner, updates, state["inner"], params, False, takes_inplace)
        ok = ok | (state["notfinite_count"] >= max_consecutive_errors)
        keep = lambda new, old: torch.where(ok, new, old)  # noqa: E731
        u_leaves = [torch.where(ok, u, torch.zeros_like(u)) for u in _tree.leaves(new_u)]
        inner_state = _tree.unflatten(
            new_inner,
            [keep(n, o) for n, o in zip(_tree.leaves(new_inner), _tree.leaves(state["inner"]))],
        )
        bad = (~ok).long()
        new_state = TensorDict(
            {
                "inner": inner_state,
                "notfinite_count": (state["notfinite_count"] + 1) * bad,
                "total_notfinite": state["total_notfinite"] + bad,
                "last_finite": ok,
            },
            batch_size=[],
        )
        return _tree.unflatten(new_u, u_leaves), new_state

    return GradientTransformation(init, update)


def state_bytes(opt_state: TensorDictBase) -> int:
    """Bytes held by the tensors of an optimizer state (counters included)."""
    return sum(t.numel() * t.element_size() for t in _tree.leaves(opt_state))
