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

Inside, the built-in transforms work on *leaf lists* (see :class:`LeafContext`): ``chain`` hands
lists of tensors from one transform to the next and the TensorDicts are built once, at the end,
instead of once per transform. A transform written against the public ``update`` signature works
everywhere too; ``chain`` converts for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain import tree
from ftrain.internals import foreach
from ftrain.tree import TreeDef

__all__ = [
    "GradientTransformation",
    "chain",
    "identity",
    "stateless",
    "masked",
    "apply_if_finite",
    "empty_state",
    "state_bytes",
    "leafwise",
    "leaf_update",
    "leaf_apply",
    "LeafContext",
    "accepts_inplace",
    "all_finite",
    "mask_flags",
]

Leaves = list[torch.Tensor]


class GradientTransformation(NamedTuple):
    """An optimizer (or one piece of one) as two pure functions, optax-style.

    Attributes:
        init: ``init(params: TensorDict) -> TensorDict``.
        update: ``update(updates, state, params=None, *, inplace=False) -> (updates, state)``.
    """

    init: Callable[[TensorDictBase], TensorDictBase]
    update: Callable[..., tuple[TensorDictBase, TensorDictBase]]


class LeafContext(NamedTuple):
    """What a leaf-level update ``fn(updates, state, params, ctx) -> (updates, state)`` knows
    besides its three lists of tensors (each in key order).

    Rules for ``fn``: the returned state list has the structure ``ctx.state``; the returned update
    tensors are new tensors or the incoming update tensors themselves, never tensors of the state
    or of the params; nothing is written in place unless the flags below allow it.
    """

    tree: TreeDef  # key structure of the updates (and of the params)
    state: TreeDef  # key structure of this transform's state
    inplace: bool  # the state's tensors may be overwritten
    owned: bool  # the incoming update tensors may be overwritten


LeafUpdate = Callable[[Leaves, Leaves, "Leaves | None", LeafContext], tuple[Leaves, Leaves]]


def empty_state() -> TensorDict:
    """The state of a stateless transform: an empty TensorDict."""
    return TensorDict({}, batch_size=[])


def accepts_inplace(fn: Callable) -> bool:
    """Whether ``fn`` can be called with ``inplace=...``: it names an ``inplace`` parameter or
    takes ``**kwargs``. ``fn``'s own signature decides, not that of a function it wraps
    (``functools.wraps`` sets ``__wrapped__``; the wrapper is what gets called). False when the
    signature cannot be read (some builtins)."""
    try:
        params = inspect.signature(fn, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return False
    return "inplace" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _params_leaves(params: TensorDictBase, tdef: TreeDef, fn: str) -> Leaves:
    p, pdef = tree.flatten(params)
    if pdef != tdef:
        want, got = set(tdef.paths), set(pdef.paths)
        if want == got:
            detail = "the same keys in a different order"
        else:
            detail = f"missing {sorted(want - got)}, extra {sorted(got - want)}"
        raise KeyError(
            f"{fn}: params and updates must have the same keys in the same order; params have "
            f"{detail}. Pass the params the updates were computed for."
        )
    return p


LeafApply = Callable[[Leaves, Leaves, Leaves, LeafContext], tuple[Leaves, Leaves]]


def leafwise(
    init: Callable, fn: LeafUpdate, apply: LeafApply | None = None
) -> GradientTransformation:
    """A transformation from ``init`` and a leaf-level update ``fn(updates, state, params, ctx)``
    over lists of tensors (see :class:`LeafContext`). Its public ``update`` flattens once, runs
    ``fn`` and builds the TensorDicts once; ``chain`` and the train step call ``fn`` directly.
    How the built-in transforms are written, for multi-tensor (``torch._foreach_*``) math.

    ``fn`` is recorded on ``update`` together with ``update`` itself, and :func:`leaf_update` uses
    it only for that very function: a wrapper made with ``functools.wraps(update)`` copies the
    record too, but is not ``update``, so it is called as written."""

    def update(updates, state, params=None, *, inplace=False):
        u, tdef = tree.flatten(updates)
        s, sdef = tree.flatten(state)
        p = None if params is None else _params_leaves(params, tdef, "update")
        new_u, new_s = fn(u, s, p, LeafContext(tdef, sdef, inplace, inplace))
        return tdef.unflatten(new_u), sdef.unflatten(new_s)

    update._leaf_update = (fn, update)  # type: ignore[attr-defined]
    if apply is not None:
        update._leaf_apply = (apply, update)  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


def leaf_apply(t: GradientTransformation) -> LeafApply:
    """``apply(grads, state, params, ctx) -> (new_params, new_state)``: ``t``'s update added to
    the params, the params overwritten in place when ``ctx.inplace`` (a donated step), else new
    tensors. Equal to :func:`leaf_update` followed by ``params + updates``, which is what it runs
    unless ``t`` brings its own (``leafwise(init, fn, apply)``): torch's fused kernels write the
    new params directly, one pass fewer than updates added afterwards (``optim.adamw``'s,
    ``chain``'s ending in one, ``partition``'s and ``inject_hyperparams``'s of those). Called when
    a step is built, not per step."""
    recorded = getattr(t.update, "_leaf_apply", None)
    if isinstance(recorded, tuple) and len(recorded) == 2 and recorded[1] is t.update:
        return recorded[0]
    fn = leaf_update(t)

    def apply(g, s, p, ctx):
        u, new_s = fn(g, s, p, ctx)
        if ctx.inplace:
            foreach.add_(p, u)
            return p, new_s
        return list(foreach.add(p, u)), new_s

    return apply


def has_own_apply(t: GradientTransformation) -> bool:
    """Whether ``t`` brings its own :func:`leaf_apply` (a fused kernel writing the params)."""
    recorded = getattr(t.update, "_leaf_apply", None)
    return isinstance(recorded, tuple) and len(recorded) == 2 and recorded[1] is t.update


def leaf_update(t: GradientTransformation) -> LeafUpdate:
    """The leaf-level update of ``t`` (built-in transforms have one; for others, an adapter that
    builds TensorDicts, calls ``t.update`` and flattens the result). Called when a chain or a
    step is built, not per step."""
    recorded = getattr(t.update, "_leaf_update", None)
    if isinstance(recorded, tuple) and len(recorded) == 2 and recorded[1] is t.update:
        return recorded[0]
    takes_inplace = accepts_inplace(t.update)

    def adapted(u, s, p, ctx):
        args = (ctx.tree.unflatten(u), ctx.state.unflatten(s))
        args += (None,) if p is None else (ctx.tree.unflatten(p),)
        if takes_inplace:
            new_u, new_s = t.update(*args, inplace=ctx.inplace and ctx.owned)
        else:
            new_u, new_s = t.update(*args)
        out_u, udef = tree.flatten(new_u)
        out_s, sdef = tree.flatten(new_s)
        if udef != ctx.tree or sdef != ctx.state:
            what = "updates" if udef != ctx.tree else "state"
            raise ValueError(
                f"{getattr(t.update, '__qualname__', 't.update')} returned {what} whose keys "
                f"differ from its input's; an update must keep the structure of the updates and "
                "of its state (it is fixed at init)."
            )
        # The rules of LeafContext: an update tensor may not also be a state or param tensor
        # (later transforms may scale the updates in place). Copy the ones that are.
        held = {id(x) for x in out_s} | ({id(x) for x in p} if p is not None else set())
        return [x.clone() if id(x) in held else x for x in out_u], out_s

    return adapted


def identity() -> GradientTransformation:
    """Leaves updates unchanged; no state."""
    return leafwise(lambda params: empty_state(), lambda u, s, p, ctx: (u, s))


def stateless(
    fn: Callable[[list[torch.Tensor], list[torch.Tensor] | None], list],
) -> GradientTransformation:
    """A stateless transform from ``fn(update_leaves, param_leaves_or_None) -> new_update_leaves``.

    ``fn`` sees lists of leaf tensors (in key order) so it can use ``torch._foreach_*`` kernels. It
    must not modify its inputs.
    """

    def update(u, s, p, ctx):
        return list(fn(u, p)), s

    return leafwise(lambda params: empty_state(), update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after another; the state is ``{"0": state0, "1": state1, ...}``.

    **Invariant:** ``chain(a, b).update(g, s, p)`` equals ``b.update(a.update(g, s0, p)[0], s1, p)``.
    The updates pass from one transform to the next as lists of tensors; TensorDicts are built
    once, for the result.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation. "
                "Pass transforms such as optim.scale_by_adam(), not optimizer classes."
            )
    fns = [leaf_update(t) for t in transforms]
    names = [str(i) for i in range(len(transforms))]

    def init(params):
        return TensorDict({n: t.init(params) for n, t in zip(names, transforms)}, batch_size=[])

    def run(u, s, p, ctx, last=None):
        """The transforms in turn; with ``last`` (the final transform's leaf apply), that one
        writes the params and ``(new_params, new_state)`` is returned."""
        sdef = ctx.state
        if len(sdef.sig) != len(names):
            raise ValueError(
                f"chain of {len(names)} transforms got a state with {len(sdef.sig)} entries; "
                "build the state with this optimizer's init."
            )
        original = None if ctx.owned else u
        owned = ctx.owned
        new_s: Leaves = []
        for i, (name, fn) in enumerate(zip(names, fns)):
            lo, hi = sdef.span(name)
            sub = LeafContext(ctx.tree, sdef.child(name), ctx.inplace, owned)
            if last is not None and i == len(fns) - 1:
                new_p, s_i = last(u, s[lo:hi], p, sub)
                return new_p, new_s + list(s_i)
            u, s_i = fn(u, s[lo:hi], p, sub)
            new_s.extend(s_i)
            if not owned:  # once no caller tensor is passed through, the updates are ours
                owned = not any(a is b for a, b in zip(u, original))
        return u, new_s

    apply = None
    if transforms and has_own_apply(transforms[-1]):
        last = leaf_apply(transforms[-1])

        def apply(g, s, p, ctx):
            return run(g, s, p, ctx, last)

    return leafwise(init, run, apply)


def _bool(v) -> bool:
    return bool(v.item()) if isinstance(v, torch.Tensor) else bool(v)


def mask_flags(mask, params: TensorDictBase) -> list[bool]:
    """``mask`` (a TensorDict of booleans keyed like ``params``, or a function ``params -> such a
    TensorDict``) as one bool per leaf of ``params``, in leaf order. Reads the mask's values (a
    host read for each): call it when a structure is first seen, not at every step."""
    m = mask(params) if callable(mask) else mask
    if not isinstance(m, TensorDictBase):
        raise TypeError(
            "masked(inner, mask): mask must be a TensorDict of booleans with the params' keys, or "
            "a function params -> such a TensorDict (e.g. optim.decay_mask)."
        )
    want, got = tree.paths(params), tree.paths(m)
    if set(want) != set(got):
        raise KeyError(
            f"masked: mask keys differ from params keys: missing {sorted(set(want) - set(got))}, "
            f"extra {sorted(set(got) - set(want))}."
        )
    flat = tree.to_flat(m)
    return [_bool(flat[k]) for k in want]


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Apply ``inner`` only to the leaves where ``mask`` is True; pass the others through unchanged.

    ``mask`` is a TensorDict of booleans keyed like the params, or a function ``params -> mask``
    (evaluated once per params structure, that is keys and shapes, and remembered). The inner state
    covers only the selected leaves, so masked-out leaves cost no optimizer memory.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"masked(inner, mask): inner must be a GradientTransformation, got {type(inner).__name__}."
        )
    if not (callable(mask) or isinstance(mask, TensorDictBase)):
        raise TypeError(
            "masked(inner, mask): mask must be a TensorDict of booleans keyed like the params, or a "
            f"function params -> such a TensorDict (e.g. optim.decay_mask); got {type(mask).__name__}."
        )
    inner_fn = leaf_update(inner)
    cache: dict = {}

    def select(td, keep):
        flat = tree.to_flat(td)
        return tree.from_flat({k: v for (k, v), m in zip(flat.items(), keep) if m})

    def resolve(tdef: TreeDef, leaves: Leaves) -> tuple[list[int], TreeDef]:
        # Keyed by plain tuples, so that a step compiled after init finds what init computed.
        key = (tdef.sig, tuple(t.shape for t in leaves)) if callable(mask) else tdef.sig
        got = cache.get(key)
        if got is None:
            keep = mask_flags(mask, tdef.unflatten(leaves))
            idx = [i for i, k in enumerate(keep) if k]
            sub = tree.structure(select(tdef.unflatten(leaves), keep))
            got = (idx, sub)
            if not torch.compiler.is_compiling():
                cache[key] = got
        return got

    def init(params):
        leaves, tdef = tree.flatten(params)
        chosen = set(resolve(tdef, leaves)[0])
        return inner.init(select(params, [i in chosen for i in range(len(leaves))]))

    def update(u, s, p, ctx):
        idx, sub_tree = resolve(ctx.tree, p if p is not None else u)
        if not idx:
            return u, s
        sub_u = [u[i] for i in idx]
        sub_p = None if p is None else [p[i] for i in idx]
        sub_ctx = LeafContext(sub_tree, ctx.state, ctx.inplace, ctx.owned)
        new_sub, new_s = inner_fn(sub_u, s, sub_p, sub_ctx)
        out = list(u)
        for i, x in zip(idx, new_sub):
            out[i] = x
        return out, new_s

    return leafwise(init, update)


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor (plain, also for DTensors): every element of every tensor is finite. No
    host sync."""
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    norms = foreach.norm(tensors, ord=float("inf"))
    finite = torch.stack(norms).isfinite().all()
    # of sharded (DTensor) tensors: a replicated DTensor; the same value as a plain tensor
    return finite.full_tensor() if hasattr(finite, "full_tensor") else finite


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int = 10**9
) -> GradientTransformation:
    """Apply ``inner`` only when every update is finite; otherwise emit zero updates and keep state.

    The state records ``notfinite_count`` (consecutive non-finite updates), ``total_notfinite``
    and ``last_finite`` (0-d tensors). As in optax, once more than ``max_consecutive_errors``
    non-finite updates came in a row, the update is let through (and the inner state moves on).
    The choice is made with tensor ops: no host sync.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"apply_if_finite(inner): inner must be a GradientTransformation, got "
            f"{type(inner).__name__}."
        )
    if not isinstance(max_consecutive_errors, int) or max_consecutive_errors < 0:
        raise ValueError(
            f"apply_if_finite(max_consecutive_errors=...): must be an int >= 0, got "
            f"{max_consecutive_errors!r}."
        )
    inner_fn = leaf_update(inner)

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

    def update(u, s, p, ctx):
        sdef = ctx.state
        lo, hi = sdef.span("inner")
        i_count, i_total, i_last = (
            sdef.index("notfinite_count"),
            sdef.index("total_notfinite"),
            sdef.index("last_finite"),
        )
        finite = all_finite(u)
        # the old state must survive a bad step, so the inner update never overwrites it
        inner_ctx = LeafContext(ctx.tree, sdef.child("inner"), False, ctx.owned)
        new_u, new_inner = inner_fn(u, s[lo:hi], p, inner_ctx)
        bad = (~finite).long()
        count = (s[i_count] + 1) * bad
        ok = finite | (count > max_consecutive_errors)
        out_u = [torch.where(ok, x, torch.zeros_like(x)) for x in new_u]
        new_s = list(s)
        new_s[lo:hi] = [torch.where(ok, n, o) for n, o in zip(new_inner, s[lo:hi])]
        new_s[i_count] = count
        new_s[i_total] = s[i_total] + bad
        new_s[i_last] = finite
        return out_u, new_s

    return leafwise(init, update)


def state_bytes(opt_state: TensorDictBase) -> int:
    """Bytes held by the tensors of an optimizer state (counters included).

    Factored or masked states count what they really hold, so this is the number to compare
    optimizers by (e.g. ``adamw`` holds two fp32 copies of the params, ``adafactor`` about
    ``rows + cols`` per matrix).
    """
    if not isinstance(opt_state, TensorDictBase):
        raise TypeError(
            f"state_bytes(opt_state): expected a TensorDict (e.g. state.opt_state), got "
            f"{type(opt_state).__name__}."
        )
    return sum(t.numel() * t.element_size() for t in tree.leaves(opt_state))
