"""``ft.apply``: run a module's code on parameters given as data.

An ``nn.Module`` is used only as a *template*: its code runs, its tensors do not. ``apply`` places
the given tensors where the module keeps its parameters for the extent of one call, as
``torch.func.functional_call`` does, and puts the module's own tensors back afterwards (where a
module keeps them comes from ``ftrain.internals.module_tables``).

Transforms reach the model through two scoped values (:mod:`ftrain.internals.scoped`) that the step
sets around its forward and its call: the *rewrites* (objects with ``rewrite(module) -> module``,
e.g. activation checkpointing, which returns a copy whose blocks run through
``torch.utils.checkpoint``; ``apply`` runs the rewritten copy) and an :class:`ApplyCache`, where
``apply`` keeps what it works out about a module (where each parameter goes, the rewritten copies)
for as long as the step that owns the cache lives. Outside a step, or while ``torch.compile``
traces, nothing is cached: ``apply`` goes through ``functional_call``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from itertools import chain
from operator import is_
from typing import Protocol

import torch
from tensordict import TensorDictBase
from torch import nn

from ftrain import tree
from ftrain.internals.module_tables import buffer_slot, param_slot, tables
from ftrain.internals.scoped import Scoped

__all__ = ["apply", "Rewrite", "rewriting", "rewritten", "ApplyCache", "caching"]


class Rewrite(Protocol):
    """What a step hands ``apply``: ``rewrite(module)`` returns the module to run in its place,
    which must keep the module's parameter and buffer tables
    (``ftrain.internals.blocks.replace_forwards`` copies do); the copy is kept and used again while
    the optional ``rewrite_key()`` returns the same object (``ft.Transform``'s hooks of these
    names)."""

    def rewrite(self, module: nn.Module) -> nn.Module: ...

    def rewrite_key(self) -> object: ...


class Calls:
    """How many ``apply`` calls ran inside one :func:`rewriting` block."""

    def __init__(self) -> None:
        self.count = 0


_REWRITES: Scoped[tuple[tuple[Rewrite, ...], tuple[Calls, ...]]] = Scoped(
    "ftrain.apply rewrites", ((), ())
)
_CACHE: Scoped[ApplyCache | None] = Scoped("ftrain.apply cache", None)


class rewriting:  # noqa: N801 - used as a function: `with rewriting(r) as calls:`
    """A context manager: every :func:`apply` inside runs ``module`` rewritten by ``rewrites``, in
    order (each gets the previous one's result), and then by those of any enclosing
    ``rewriting`` block (an inner block's rewrites act closer to the module's own code).
    ``with rewriting(r) as calls:`` gives a :class:`Calls` that counts the ``apply`` calls made
    inside. (A class, as dynamo traces it.)"""

    def __init__(self, rewrites: Sequence[Rewrite]):
        self.calls = Calls()
        outer, counters = _REWRITES.get()
        self.using = _REWRITES.using(((*rewrites, *outer), (self.calls, *counters)))

    def __enter__(self) -> Calls:
        self.using.__enter__()
        return self.calls

    def __exit__(self, *exc) -> None:
        self.using.__exit__(*exc)


def rewritten(fn: Callable, rewrite: Rewrite, who: str) -> Callable:
    """``fn`` (a step's call of its loss function, ``fn(params, batch, state)``) with every
    :func:`apply` inside running the module rewritten by ``rewrite``: what a transform's
    ``forward`` hook returns to act on the model (``ft.checkpoint``, fsdp's gathering). A call in
    which the loss function never called ``apply`` is an error naming ``who``."""

    def call(params, batch, state):
        with rewriting([rewrite]) as calls:
            out = fn(params, batch, state)
        if not calls.count:
            raise RuntimeError(
                f"{who} acts on the model that the loss function calls through "
                "ft.apply(model, params, ...), but the loss function never called ft.apply. "
                "Call the model through ft.apply."
            )
        return out

    return call


class ApplyCache:
    """What :func:`apply` remembers about the modules it runs inside :func:`caching`: where each
    parameter goes and the rewritten copies, per module, rechecked on every call (a parameter or
    submodule registered, replaced or deleted since means it is worked out again). Modules are held
    weakly. A step owns one for its lifetime."""

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()

    def plan(self, module: nn.Module) -> _Plan:
        """Where ``module``'s parameters go, worked out once and again after it changed."""
        plan = self._plans.get(module)
        # While a call of the module runs (a nested apply), its tables hold that call's tensors,
        # not the module's own: the plan is in use and stays.
        if plan is None or not (plan.active or plan.current()):
            plan = self._plans[module] = _Plan(module)
        return plan


def caching(cache: ApplyCache | None):
    """A context manager: :func:`apply` inside keeps what it works out in ``cache``."""
    return _CACHE.using(cache)


def apply(module: nn.Module, params: TensorDictBase, *args, buffers=None, **kwargs):
    """Call ``module(*args, **kwargs)`` with its parameters replaced by ``params``.

    Strict: ``params`` must hold exactly the module's parameter names (a missing or extra key is an
    error that names it) with the module's shapes. Tied parameters are given once, under their
    first name (as ``ft.params_of`` emits them), and that tensor is used at every place the tie
    reaches. The module's own parameters are never read or written, so the template may even live
    on the ``meta`` device. Buffers come from ``buffers`` (a TensorDict from ``ft.buffers_of``,
    or a subset of it; another key is an error) when given, else from the module itself,
    read-only. Gradients flow to the tensors in ``params``.

    The module's own tensors are back in place when the call returns or raises, and nothing is
    written onto it. What the forward captured (e.g. activation checkpointing) keeps the tensors it
    was called with. Nested calls, of the same module or another, are fine. A parameter or
    submodule registered on the module after a call is picked up by the next one. Calls of one
    module from two threads at once are not: the tensors are placed in the module's own tables
    for the extent of a call (as ``functional_call`` places them), so use one template per thread.
    """
    _check_module(module)
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            f"ft.apply(module, params): params must be a TensorDict (from ft.params_of(module)), "
            f"got {type(params).__name__}."
        )
    rewrites, counters = _REWRITES.get()
    for calls in counters:
        calls.count += 1
    cache = None if torch.compiler.is_compiling() else _CACHE.get()
    if cache is None:
        return _apply_functional(
            module, _rewritten(module, rewrites), params, buffers, args, kwargs
        )
    plan = cache.plan(module)
    values, tdef = tree.flatten(params)
    if tdef is not plan.tdef:  # params of a new key layout: check the keys, then place them
        _check_keys(module, tdef.paths, plan.shapes)
        index = {path: i for i, path in enumerate(tdef.paths)}
        plan.order = [index[key] for key in plan.slot_keys]
        plan.leaf_shapes = [plan.shapes[path] for path in tdef.paths]
        plan.tdef = tdef
    if [t.shape for t in values] != plan.leaf_shapes:
        _check_shapes(tdef.paths, values, plan.shapes)
    slots, tensors = plan.slots, [values[i] for i in plan.order]
    if buffers is not None:
        more_slots, more_tensors = plan.buffer_places(module, buffers)
        slots, tensors = slots + more_slots, tensors + more_tensors
    target = module
    if rewrites:
        key = tuple(map(id, rewrites))  # the step owning the cache keeps them alive
        depends = tuple(_depends(r) for r in rewrites)
        kept = plan.rewritten.get(key)
        if kept is None or any(a is not b for a, b in zip(kept[0], depends)):
            kept = plan.rewritten[key] = (depends, _rewritten(module, rewrites))
        target = kept[1]
    return _call_swapped(plan, slots, tensors, target, args, kwargs)


def _depends(rewrite: Rewrite) -> object:
    key = getattr(rewrite, "rewrite_key", None)  # optional
    return key() if key is not None else None


def _rewritten(module: nn.Module, rewrites: tuple[Rewrite, ...]) -> nn.Module:
    for r in rewrites:
        module = r.rewrite(module)
    return module


def _check_module(module: object) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"ft.apply(module, ...): expected an nn.Module, got {type(module).__name__}."
        )


def _call_swapped(plan, slots, tensors, target, args, kwargs):
    """``target(*args, **kwargs)`` with ``tensors[i]`` at ``slots[i]``, each slot holding what it
    held before once the call returns or raises.

    The tensors go straight into the owners' ``_parameters``/``_buffers`` dicts, as
    ``functional_call`` puts them: the forward sees them through every attribute and
    ``named_parameters()``, and what it captures (a checkpointed block) keeps them.
    """
    old = [table[attr] for table, attr in slots]
    plan.active += 1
    try:
        for (table, attr), t in zip(slots, tensors):
            table[attr] = t
        return target(*args, **kwargs)
    finally:
        for (table, attr), t in zip(slots, old):
            table[attr] = t
        plan.active -= 1


def _apply_functional(module, target, params, buffers, args, kwargs):
    """:func:`apply` through ``functional_call``: the same checks, nothing remembered. What a
    compiled step traces (once per compile, so its cost does not matter, and dynamo never guards
    on a cache) and what a call outside any step runs."""
    flat = tree.to_flat(params)
    shapes = {name: p.shape for name, p in module.named_parameters()}
    _check_keys(module, tuple(flat), shapes)
    _check_shapes(tuple(flat), list(flat.values()), shapes)
    if buffers is not None:
        given = tree.to_flat(buffers)
        _check_buffer_keys(module, given, dict(module.named_buffers(remove_duplicate=False)))
        flat.update(given)
    return torch.func.functional_call(target, flat, args, kwargs, tie_weights=True)


def _check_keys(module: nn.Module, paths: tuple[str, ...], shapes: dict[str, torch.Size]) -> None:
    if shapes.keys() == set(paths):
        return
    missing = sorted(shapes.keys() - set(paths))
    extra = sorted(set(paths) - shapes.keys())
    parts = []
    if missing:
        parts.append(f"missing key(s) {missing}")
    if extra:
        parts.append(f"unexpected key(s) {extra}")
    raise KeyError(
        f"ft.apply: params do not match {type(module).__name__}: {'; '.join(parts)}. "
        "Build params with ft.params_of(module) from the same module class and config."
    )


def _check_shapes(paths, values, shapes: dict[str, torch.Size]) -> None:
    for name, t in zip(paths, values):
        if t.shape != shapes[name]:
            raise ValueError(
                f"ft.apply: params[{name!r}] has shape {tuple(t.shape)} but the module expects "
                f"{tuple(shapes[name])}. The params were built for a different model config."
            )


def _check_buffer_keys(module: nn.Module, given, known) -> None:
    extra = sorted(k for k in given if k not in known)
    if extra:
        raise KeyError(
            f"ft.apply: buffers do not match {type(module).__name__}: unexpected key(s) {extra}. "
            "Build buffers with ft.buffers_of(module) from the same module class and config."
        )


class _Plan:
    """What :func:`apply` needs to know about one template module, worked out once.

    ``functional_call`` rediscovers all of this on every call (two walks of the module tree for
    the tied-weight map, a ``getattr`` per path component): most of ftrain's per-step overhead in
    eager mode. A plan is made the first time a module is applied and reused for as long as the
    module's structure is unchanged (:meth:`current`).
    """

    __slots__ = (
        "shapes",
        "slots",
        "slot_keys",
        "buffer_slots",
        "tables",
        "sizes",
        "names",
        "objects",
        "active",
        "tdef",
        "order",
        "leaf_shapes",
        "rewritten",
    )

    def __init__(self, module: nn.Module):
        # The params keys, as params_of emits them: a tied parameter once, under its first name.
        first: dict[int, str] = {}  # id(tensor) -> key; `module` holds the tensors, ids are unique
        self.shapes: dict[str, torch.Size] = {}
        for name, p in module.named_parameters():
            first[id(p)] = name
            self.shapes[name] = p.shape
        # Every place a parameter lives, tied ones included: (its owner's `_parameters`, attribute
        # name), once each (a submodule shared by two parents is one place), with the key whose
        # tensor goes there. In GPT-2, `lm_head.weight` gets `transformer.wte.weight`'s tensor.
        places: dict[tuple[int, str], tuple[dict, str, str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            table, attr = param_slot(module, name)
            places.setdefault((id(table), attr), (table, attr, first[id(p)]))
        self.slots = [(table, attr) for table, attr, _ in places.values()]
        self.slot_keys = [key for _, _, key in places.values()]
        # Buffer name -> every place its tensor lives (a buffer tied to another gets both).
        by_tensor: dict[int, list[tuple[dict, str]]] = {}
        tensor_of: dict[str, int] = {}
        for name, b in module.named_buffers(remove_duplicate=False):
            by_tensor.setdefault(id(b), []).append(buffer_slot(module, name))
            tensor_of[name] = id(b)
        self.buffer_slots = {name: by_tensor[i] for name, i in tensor_of.items()}
        # The tables all of the above was read from, and what they hold now. They belong to the
        # module and its submodules but do not refer to `module`: the plan does not keep it alive.
        self.tables = tables(module)
        self.sizes = list(map(len, self.tables))
        self.names = list(chain.from_iterable(self.tables))
        self.objects = list(chain.from_iterable(map(dict.values, self.tables)))
        self.active = 0  # calls of the module running now; their tensors are in the tables
        self.tdef = None  # the key layout of the last params, where their leaves go, their shapes
        self.order: list[int] = []
        self.leaf_shapes: list[torch.Size] = []
        self.rewritten: dict[tuple, tuple] = {}  # rewrites -> (what they depend on, the copy)

    def current(self) -> bool:
        """Whether every table still binds the same names to the same objects (a parameter or
        buffer registered, replaced, deleted or re-tied, or a submodule swapped since the plan
        was made, means no). Identity only: tensors are never compared by value. About 10 us for
        a 28-module model (the loops run in C)."""
        tables = self.tables
        return (
            list(map(len, tables)) == self.sizes
            and all(map(is_, chain.from_iterable(tables), self.names))
            and all(map(is_, chain.from_iterable(map(dict.values, tables)), self.objects))
        )

    def buffer_places(self, module: nn.Module, buffers: TensorDictBase):
        """``(slots, tensors)`` for the given buffers: each at every place its buffer lives."""
        given = tree.to_flat(buffers)
        _check_buffer_keys(module, given, self.buffer_slots)
        slots, tensors, given_as = [], [], {}
        for name, t in given.items():
            for table, attr in self.buffer_slots[name]:
                other, was = given_as.setdefault((id(table), attr), (name, t))
                if was is not t:  # two names of one tied buffer, with different tensors
                    raise ValueError(
                        f"ft.apply: buffers {other!r} and {name!r} are one tensor in "
                        f"{type(module).__name__} but were given different values; give one."
                    )
                slots.append((table, attr))
                tensors.append(t)
        return slots, tensors
