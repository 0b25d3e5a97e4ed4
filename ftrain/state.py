"""Parameters as data: ``params_of``, ``buffers_of``, ``apply`` and ``TrainState``.

An ``nn.Module`` is used only as a *template*: its code runs, its tensors do not. The numbers live in
a nested ``TensorDict`` keyed by module path, and :func:`apply` runs the module's code on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from itertools import chain
from operator import is_

import torch
from tensordict import TensorDict, TensorDictBase, tensorclass
from torch import nn

from ftrain import tree

__all__ = ["params_of", "buffers_of", "apply", "state_dict_of", "TrainState", "module_hooks"]


def params_of(module: nn.Module) -> TensorDict:
    """A detached copy of ``module``'s parameters as a nested TensorDict keyed by module path.

    ``blocks.0.attn.qkv.weight`` becomes ``params["blocks", "0", "attn", "qkv", "weight"]``. Tied
    parameters (one tensor under two names) appear once, under their first name, as in
    ``module.named_parameters()``. The copy shares nothing with the module: training it never
    changes the module, and changing the module never changes it.
    """
    _check_module(module, "params_of")
    return tree.from_flat({k: v.detach().clone() for k, v in module.named_parameters()})


def buffers_of(module: nn.Module) -> TensorDict:
    """A detached copy of ``module``'s buffers (running statistics, masks) as a nested TensorDict."""
    _check_module(module, "buffers_of")
    return tree.from_flat({k: v.detach().clone() for k, v in module.named_buffers()})


def state_dict_of(params: TensorDictBase) -> dict[str, torch.Tensor]:
    """``{"blocks.0.attn.qkv.weight": tensor, ...}``: params as a flat dict with the module's own
    names, ready for ``module.load_state_dict(..., strict=False)`` (strict=False because tied
    duplicates appear once). The tensors are shared, not copied."""
    return tree.to_flat(params)


def _check_module(module: object, fn: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"ft.{fn}(module): expected an nn.Module, got {type(module).__name__}.")


# Hooks that transforms (e.g. activation checkpointing) install around every `apply` call made
# while they are active. Each is a callable `(module) -> context manager`.
_MODULE_HOOKS: list[Callable[[nn.Module], contextlib.AbstractContextManager]] = []


@contextlib.contextmanager
def module_hooks(
    *hooks: Callable[[nn.Module], contextlib.AbstractContextManager],
) -> Iterator[None]:
    """Run every :func:`apply` inside this block with ``hook(module)`` entered around the call.

    This is how a transform reaches the model without knowing it: ``ft.checkpoint`` uses it to wrap
    the model's blocks for the extent of the forward pass. Hooks are removed on exit, also on error.
    """
    _MODULE_HOOKS.extend(hooks)
    try:
        yield
    finally:
        del _MODULE_HOOKS[len(_MODULE_HOOKS) - len(hooks) :]


def apply(module: nn.Module, params: TensorDictBase, *args, buffers=None, **kwargs):
    """Call ``module(*args, **kwargs)`` with its parameters replaced by ``params``.

    Strict: ``params`` must hold exactly the module's parameter names (a missing or extra key is an
    error that names it) with the module's shapes. Tied parameters are given once, under their
    first name (as :func:`params_of` emits them), and that tensor is used at every place the tie
    reaches. The module's own parameters are never read or written, so the template may even live
    on the ``meta`` device. Buffers come from ``buffers`` (a TensorDict from :func:`buffers_of`,
    or a subset of it; another key is an error) when given, else from the module itself,
    read-only. Gradients flow to the tensors in ``params``.

    The module's own tensors are back in place when the call returns or raises. What the forward
    captured (e.g. activation checkpointing) keeps the tensors it was called with. Nested calls,
    of the same module or another, are fine. A parameter or submodule registered on the module
    after a call is picked up by the next one.
    """
    _check_module(module, "apply")
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            f"ft.apply(module, params): params must be a TensorDict (from ft.params_of(module)), "
            f"got {type(params).__name__}."
        )
    if torch.compiler.is_compiling():
        return _apply_traced(module, params, buffers, args, kwargs)
    plan = _plan_of(module)
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
    with contextlib.ExitStack() as stack:
        for hook in _MODULE_HOOKS:
            stack.enter_context(hook(module))
        return _call_swapped(plan, slots, tensors, module, args, kwargs)


def _call_swapped(plan, slots, tensors, module, args, kwargs):
    """``module(*args, **kwargs)`` with ``tensors[i]`` at ``slots[i]``, each slot holding what it
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
        return module(*args, **kwargs)
    finally:
        for (table, attr), t in zip(slots, old):
            table[attr] = t
        plan.active -= 1


def _apply_traced(module, params, buffers, args, kwargs):
    """:func:`apply` under ``torch.compile``: the same checks, through ``functional_call``.

    Dynamo traces this once per compile, so its cost does not matter; the plan cache stays out of
    it, because dynamo would guard on the cache and recompile the step when a call changed it.
    """
    flat = tree.to_flat(params)
    shapes = {name: p.shape for name, p in module.named_parameters()}
    _check_keys(module, tuple(flat), shapes)
    _check_shapes(tuple(flat), list(flat.values()), shapes)
    if buffers is not None:
        given = tree.to_flat(buffers)
        _check_buffer_keys(module, given, dict(module.named_buffers(remove_duplicate=False)))
        flat.update(given)
    with contextlib.ExitStack() as stack:
        for hook in _MODULE_HOOKS:
            stack.enter_context(hook(module))
        return torch.func.functional_call(module, flat, args, kwargs, tie_weights=True)


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
            table, attr = _owner(module, name)._parameters, _leaf(name)
            places.setdefault((id(table), attr), (table, attr, first[id(p)]))
        self.slots = [(table, attr) for table, attr, _ in places.values()]
        self.slot_keys = [key for _, _, key in places.values()]
        # Buffer name -> every place its tensor lives (a buffer tied to another gets both).
        by_tensor: dict[int, list[tuple[dict, str]]] = {}
        tensor_of: dict[str, int] = {}
        for name, b in module.named_buffers(remove_duplicate=False):
            by_tensor.setdefault(id(b), []).append((_owner(module, name)._buffers, _leaf(name)))
            tensor_of[name] = id(b)
        self.buffer_slots = {name: by_tensor[i] for name, i in tensor_of.items()}
        # The tables all of the above was read from, and what they hold now. They belong to the
        # module and its submodules but do not refer to `module`: the plan does not keep it alive.
        self.tables = [t for m in module.modules() for t in (m._parameters, m._buffers, m._modules)]
        self.sizes = list(map(len, self.tables))
        self.names = list(chain.from_iterable(self.tables))
        self.objects = list(chain.from_iterable(map(dict.values, self.tables)))
        self.active = 0  # calls of the module running now; their tensors are in the tables
        self.tdef = None  # the key layout of the last params, where their leaves go, their shapes
        self.order: list[int] = []
        self.leaf_shapes: list[torch.Size] = []

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


def _owner(module: nn.Module, name: str) -> nn.Module:
    return module.get_submodule(name.rpartition(".")[0])


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


# One plan per template module, dropped with the module.
_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def _plan_of(module: nn.Module) -> _Plan:
    plan = _PLANS.get(module)
    # While a call of the module runs (a nested apply), its tables hold that call's tensors, not
    # the module's own: the plan is in use and stays.
    if plan is None or not (plan.active or plan.current()):
        plan = _PLANS[module] = _Plan(module)
    return plan


@tensorclass
class TrainState:
    """The whole training state as one tensor pytree.

    Fields:
        params: nested TensorDict of fp32 parameters, keyed by module path.
        opt_state: the optimizer's state (TensorDict), from ``optimizer.init(params)``.
        step: 0-d int64, the number of steps taken. Lives on the CPU so reading it never waits for
            an accelerator.
        rng: 0-d int64 random key. With ``step`` it determines every random number a step draws.
        extra: TensorDict of state owned by transforms (fp16 loss scale, EMA of params, ...).

    Everything needed to resume bit-for-bit is in here; ``ft.save`` writes all of it.
    """

    params: TensorDict
    opt_state: TensorDict
    step: torch.Tensor
    rng: torch.Tensor
    extra: TensorDict

    def replace(self, **fields) -> TrainState:
        """A new TrainState with the named fields replaced wholesale and the others kept.

        Unlike ``TensorDict.replace``, which merges a nested TensorDict into the old one (so keys
        only the old one has would survive), ``state.replace(params=p).params`` holds exactly the
        keys of ``p``. Nothing is copied: the result holds the given TensorDicts and tensors and
        this state's other fields, as they are.
        """
        names = _STATE_FIELDS
        unknown = sorted(fields.keys() - set(names))
        if unknown:
            raise TypeError(
                f"TrainState.replace: {unknown} are not fields of TrainState; its fields are "
                f"{names}."
            )
        values = {name: fields[name] if name in fields else getattr(self, name) for name in names}
        return type(self)(**values, batch_size=self.batch_size, device=self.device)

    @classmethod
    def create(cls, params: TensorDictBase, optimizer, *, seed: int = 0) -> TrainState:
        """A fresh state: ``params``, ``optimizer.init(params)``, step 0 and ``rng`` from ``seed``."""
        from ftrain.optim import GradientTransformation

        if not isinstance(params, TensorDictBase):
            raise TypeError(
                "TrainState.create(params, ...): params must be a TensorDict; "
                "use ft.params_of(module)."
            )
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(
                "TrainState.create(params, optimizer): optimizer must be an "
                f"ftrain.optim.GradientTransformation (e.g. ftrain.optim.adamw(3e-4)), got "
                f"{type(optimizer).__name__}."
            )
        if not isinstance(seed, int):
            raise TypeError(f"TrainState.create(seed=...): seed must be an int, got {seed!r}.")
        return cls(
            params=params,
            opt_state=optimizer.init(params),
            step=torch.zeros((), dtype=torch.int64),
            rng=torch.tensor(seed, dtype=torch.int64),
            extra=TensorDict({}, batch_size=[]),
            batch_size=[],
        )


# TrainState's field names, read once (``dataclasses.fields`` of a tensorclass is not traceable
# by dynamo, and ft.compile traces replace() inside user transforms such as ft.ema).
_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainState))
