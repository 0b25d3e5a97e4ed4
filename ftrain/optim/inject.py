"""Hyper-parameters in the optimizer state: :func:`inject_hyperparams` (optax's convention) and
:func:`set_hyperparams`.

An optimizer built by ``inject_hyperparams(adamw)(learning_rate=1e-3)`` keeps its learning rate as
a tensor in ``opt_state["hyperparams", "learning_rate"]``: a new value set between two steps is
used by the next one, without rebuilding the step and without recompiling it (the value is a
tensor the compiled step reads, not a constant of its graph). Under ``ft.vmap`` each member may hold
its own value; ``ft.save`` and ``ft.load`` keep it with the rest of the state.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterable

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain import tree
from ftrain.internals.scoped import Scoped
from ftrain.optim.base import (
    GradientTransformation,
    LeafContext,
    has_own_apply,
    leaf_apply,
    leaf_update,
    leafwise,
)
from ftrain.optim.kernels import zero_count

__all__ = ["inject_hyperparams", "set_hyperparams", "HYPERPARAM_DTYPE"]

# The dtype of the schedules' values: an injected value reaches the transforms exactly as the
# same number or schedule passed to the factory would (a float32 value would round 1e-3).
HYPERPARAM_DTYPE = torch.float64

_NUMBER_TYPES = {float, int, type(None), "float", "int", "None"}


def _declared_number(param: inspect.Parameter) -> bool:
    """Whether the factory declares ``param`` a plain number (``b1: float``, ``eps: float |
    None``): ftrain's building blocks use such values as Python numbers inside their kernels, so
    only the arguments that take a schedule (undeclared, or declared with ``Schedule``) can be
    read from the state at each step."""
    ann = param.annotation
    if ann is inspect.Parameter.empty:
        return False
    if isinstance(ann, str):
        return {a.strip() for a in ann.split("|")} <= _NUMBER_TYPES
    return set(typing.get_args(ann) or (ann,)) <= _NUMBER_TYPES


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _injected(param: inspect.Parameter, value, static: set[str]) -> bool:
    """Whether the argument ``param=value`` becomes a tensor in the state (see
    :func:`inject_hyperparams` for the rule)."""
    if param.name in static or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        return False
    if _declared_number(param):
        return False
    if _is_number(value):  # an int where the default is an int (a number of steps) shapes
        return not (type(value) is int and type(param.default) is int)  # the optimizer: static
    if callable(value):  # a schedule, where a number is expected or nothing is said
        return param.default is param.empty or _is_number(param.default)
    return False


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], *, static_args: Iterable[str] = ()
) -> Callable[..., GradientTransformation]:
    """``inject_hyperparams(factory)(*args, **kwargs)``: the optimizer ``factory(*args, **kwargs)``
    with its numeric hyper-parameters held as tensors in its state, changeable between steps.

    The state is ``{"count", "hyperparams": {name: value}, "inner_state"}`` as in optax: ``count``
    (int64) numbers the updates, each ``hyperparams`` entry is a 0-d float64 tensor
    (:data:`HYPERPARAM_DTYPE`), ``inner_state`` is the factory's optimizer's own state. A number
    is stored as it is and used until it is set anew (:func:`set_hyperparams`, or
    ``opt_state["hyperparams", name] = ...``); a schedule is evaluated at ``count`` before each
    update, and its entry holds the value last used (setting it has no effect: the schedule
    overwrites it, as in optax).

    **Invariant:** with the same arguments, the updates and the inner state are bit for bit those
    of ``factory(*args, **kwargs)``, numbers and schedules alike; after a value is set to ``x``,
    they are those of the factory given ``x``.

    Which arguments are injected (the rest reach the factory unchanged): the ones given as a
    number or as a schedule (defaults included, as in optax), except

    * those named in ``static_args``, booleans, and anything else (masks, ``None``, strings);
    * a callable where the factory's default is not a number (``mask=None`` takes a function
      ``params -> mask``, not a schedule);
    * an ``int`` where the factory's default is an ``int`` (a number of steps: it shapes the
      optimizer, as optax also keeps it static);
    * those the factory declares as plain numbers (``b1: float``). Here ftrain departs from
      optax, which passes every injected value to the factory as an array: ftrain's building
      blocks take such arguments as Python numbers inside their multi-tensor kernels (a tensor
      there would cost a host sync per step), and read per-step values only through schedules.
      So ``inject_hyperparams(adamw)`` injects ``learning_rate``; ``b1``, ``eps`` and
      ``weight_decay`` stay fixed when it is built.

    The factory is called once, with each injected hyper-parameter replaced by a schedule that
    returns the state's current value, so it must take a schedule there (every ftrain optimizer
    takes one for ``learning_rate``). A factory of your own can combine it:
    ``inject_hyperparams(lambda learning_rate: adamw(lambda n: learning_rate(n) * shape(n)))``
    injects a peak learning rate under a fixed schedule shape (as ``ftrain train`` does).

    >>> import torch, ftrain as ft
    >>> from ftrain import optim
    >>> opt = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, weight_decay=0.1)
    >>> state = ft.TrainState.create(ft.params_of(torch.nn.Linear(3, 2)), opt)
    >>> list(state.opt_state["hyperparams"].keys())
    ['learning_rate']
    >>> state = optim.set_hyperparams(state, learning_rate=3e-4)  # used from the next step on
    >>> float(state.opt_state["hyperparams", "learning_rate"])
    0.0003
    """
    if not callable(factory):
        raise TypeError(
            f"inject_hyperparams(factory): factory must be a function returning a "
            f"GradientTransformation (e.g. optim.adamw), got {factory!r}."
        )
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    sig = inspect.signature(factory)
    name = getattr(factory, "__name__", "factory")
    unknown = static - set(sig.parameters)
    if unknown:
        raise ValueError(
            f"inject_hyperparams({name}, static_args=...): {sorted(unknown)} are not arguments "
            f"of {name}; its arguments are {list(sig.parameters)}."
        )

    @functools.wraps(factory)
    def build(*args, **kwargs) -> GradientTransformation:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        chosen = [n for n, v in given.items() if _injected(sig.parameters[n], v, static)]
        numbers = {n: float(given[n]) for n in chosen if _is_number(given[n])}
        schedules = {n: given[n] for n in chosen if n not in numbers}
        current: Scoped[dict | None] = Scoped(f"inject_hyperparams({name})", None)

        def reader(hp: str):
            def injected(count):
                del count  # the value is the state's, whatever the inner transform's count
                values = current.get()
                if values is None:
                    raise RuntimeError(
                        f"inject_hyperparams({name}): the injected {hp!r} is a value of the "
                        "optimizer state, readable only inside this optimizer's update; "
                        f"{name} evaluated it elsewhere (at build or init)."
                    )
                return values[hp]

            return injected

        for n in chosen:
            bound.arguments[n] = reader(n)
        try:
            inner = factory(*bound.args, **bound.kwargs)
        except (TypeError, ValueError) as e:
            raise type(e)(
                f"inject_hyperparams({name}): {name} refused a schedule in place of {chosen} "
                f"({e}). Each injected hyper-parameter reaches the factory as a schedule that "
                "reads the state; name those that must stay fixed numbers in "
                f"static_args={tuple(chosen)!r}."
            ) from e
        if not isinstance(inner, GradientTransformation):
            raise TypeError(
                f"inject_hyperparams({name}): {name}(...) returned {type(inner).__name__}, not a "
                "GradientTransformation."
            )
        return _wrap(inner, numbers, schedules, current, name)

    return build


def _wrap(inner, numbers: dict, schedules: dict, current: Scoped, name: str):
    inner_fn = leaf_update(inner)
    names = [*numbers, *schedules]

    def values_at(count: torch.Tensor, stored: dict) -> dict:
        out = {n: stored[n].to(HYPERPARAM_DTYPE) for n in numbers}
        for n, schedule in schedules.items():
            out[n] = torch.as_tensor(schedule(count)).to(HYPERPARAM_DTYPE)
        return out

    def init(params):
        count = zero_count()
        stored = {n: torch.tensor(v, dtype=HYPERPARAM_DTYPE) for n, v in numbers.items()}
        values = values_at(count, stored)
        return TensorDict(
            {
                "count": count,
                "hyperparams": TensorDict({n: values[n] for n in names}, batch_size=[]),
                "inner_state": inner.init(params),
            },
            batch_size=[],
        )

    def update(u, s, p, ctx, inner_fn=inner_fn):
        sdef = ctx.state
        hdef = sdef.child("hyperparams")
        if list(hdef.paths) != names:
            raise KeyError(
                f"inject_hyperparams({name}): the state holds the hyper-parameters "
                f"{list(hdef.paths)}, this optimizer injects {names}. Build the state with this "
                "optimizer's init(params)."
            )
        i_count = sdef.index("count")
        lo, hi = sdef.span("hyperparams")
        values = values_at(s[i_count], dict(zip(names, s[lo:hi])))
        i_lo, i_hi = sdef.span("inner_state")
        inner_ctx = LeafContext(ctx.tree, sdef.child("inner_state"), ctx.inplace, ctx.owned)
        with current.using(values):
            new_u, new_inner = inner_fn(u, s[i_lo:i_hi], p, inner_ctx)
        new_s = list(s)
        new_s[i_count] = s[i_count] + 1
        new_s[lo:hi] = [values[n] for n in names]
        new_s[i_lo:i_hi] = new_inner
        return new_u, new_s

    apply = None
    if has_own_apply(inner):  # the inner optimizer writes the params itself (a fused kernel)
        inner_apply = leaf_apply(inner)

        def apply(g, s, p, ctx):
            return update(g, s, p, ctx, inner_apply)

    return leafwise(init, update, apply)


def set_hyperparams(state, **values):
    """``state`` with injected hyper-parameters set: ``set_hyperparams(state, learning_rate=1e-4)``.

    ``state`` is an ``ft.TrainState`` or an optimizer state (TensorDict); the result is a new one
    of the same kind, and ``state`` is left as it was. Each name must be injected once in the state
    (``hyperparams.<name>`` at any depth, e.g. under a ``chain``); the value (a number, or a tensor
    of the entry's shape: one value per member under ``ft.vmap``) is stored with the entry's dtype
    and device, so a compiled step runs on without recompiling. Setting a scheduled entry has no
    effect: the schedule sets it again at the next update.
    """
    whole = not isinstance(state, TensorDictBase)  # a TrainState (not imported: it imports optim)
    opt_state = getattr(state, "opt_state", None) if whole else state
    if not isinstance(opt_state, TensorDictBase):
        raise TypeError(
            "set_hyperparams(state, **values): state must be an ft.TrainState or an optimizer "
            f"state (a TensorDict), got {type(state).__name__}."
        )
    leaves, tdef = tree.flatten(opt_state)
    injected = [p for p in tdef.paths if p.rsplit(tree.SEP, 2)[-2:-1] == ["hyperparams"]]
    leaves = list(leaves)
    for hp, value in values.items():
        where = [p for p in injected if p.rsplit(tree.SEP, 1)[-1] == hp]
        if len(where) != 1:
            found = sorted({p.rsplit(tree.SEP, 1)[-1] for p in injected})
            raise KeyError(
                f"set_hyperparams: {hp!r} is injected {len(where)} times in this state "
                f"({where}); it must be exactly once. The injected hyper-parameters are {found}; "
                "only those a factory takes as schedules are injected (see inject_hyperparams). "
                "To set one of several, assign it by its path: opt_state[path] = tensor."
            )
        i = tdef.index(where[0])
        old = leaves[i]
        new = torch.as_tensor(value, dtype=old.dtype, device=old.device)
        if new.shape != old.shape:
            if new.dim():
                raise ValueError(
                    f"set_hyperparams: {hp} has shape {tuple(old.shape)}; got a value of shape "
                    f"{tuple(new.shape)}. Pass a number or a tensor of that shape."
                )
            new = new.expand(old.shape).clone()
        leaves[i] = new
    new_opt = tdef.unflatten(leaves)
    return state.replace(opt_state=new_opt) if whole else new_opt
