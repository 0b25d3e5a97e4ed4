"""Record how a model built on the ``meta`` device gets its values, and replay it one tensor
at a time: the ``born`` sharded state's engine (``ftrain.distributed.sharded_init``).

:func:`record_init` builds the model under ``torch.device("meta")`` (shapes, no data) with a
``TorchDispatchMode`` that records every op writing a value into a meta tensor;
:meth:`InitRecord.replay` runs those ops on the CPU in order, allocating a tensor when an op
first writes it and dropping it after the last op that reads it, and hands each parameter, once
its last op has run, to a ``keep`` function (which cuts this process's rows) before dropping it.

**Exact.** The replay runs the recorded ops in their order on tensors of the same shape, strides
and dtype, on the CPU, from the CPU generator seeded with ``seed``; so every random op draws
what it drew when the model was built whole after ``torch.manual_seed(seed)``, and the params are
bitwise those of the whole model. An op whose value is overwritten before anything reads it
(``nn.Linear``'s kaiming init, replaced by ``GPT.reset_parameters``' normal init) still runs, on
a scratch tensor freed at once, because it moves the generator. This holds for any module whose
initializers draw from the global CPU generator through torch ops on its own meta tensors: the
built-in ``GPT`` (``nn.Embedding`` normal, ``nn.Linear`` kaiming-uniform then GPT-2's normal,
``nn.LayerNorm`` ones and zeros, MoE experts normal), every ``torch.nn.init`` function and any
module's ``reset_parameters`` written with them. Four ``torch.nn.init`` functions return at once
on a meta tensor (``trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_``): their calls are
seen as Python calls (a profile hook, scoped to the build) and replayed whole. Refused, with the
reason, before any replay: a random op on a real (non-meta) tensor that draws from the global
generator, a generator of the module's own, an op that swaps a tensor's storage (``.data =`` /
``set_``), and a parameter left uninitialised (``torch.empty`` never written). Not seen, so not
exact: an initializer of another library that itself skips meta tensors (``if t.is_meta:
return``) after drawing nothing; a meta build is then not the whole build, whatever replays it.

This module is the adapter for the private torch APIs it needs:
``torch.utils._python_dispatch.TorchDispatchMode`` (the documented extension point, from a module
named private) and an op's ``_schema`` (which arguments it writes; public replacement: none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# the extension point torch documents for __torch_dispatch__ modes, from a module named private
from torch.utils._python_dispatch import TorchDispatchMode

from ftrain.memory.tracker import tensor_leaves

__all__ = ["InitRecord", "InitRefused", "record_init"]

# In-place ops that write every element of their target without reading it: the value before is
# dead, so the replay runs them on a fresh tensor (and drops an old one nobody reads).
_OVERWRITES = frozenset(
    "normal_ uniform_ fill_ zero_ random_ bernoulli_ exponential_ geometric_ log_normal_ cauchy_ "
    "copy_".split()
)
# Ops that make a tensor without a value: a parameter whose last value came from one is refused.
_NO_VALUE = frozenset("empty empty_strided empty_like new_empty new_empty_strided".split())
# torch.nn.init functions that return at once on a meta tensor, drawing nothing there, with the
# arguments they take besides the tensor: seen as Python calls (:func:`_seen_calls`) and replayed
# whole on the real tensor.
_SKIP_META = {
    nn.init.trunc_normal_: ("mean", "std", "a", "b"),
    nn.init.orthogonal_: ("gain",),
    nn.init.sparse_: ("sparsity", "std"),
    nn.init.dirac_: ("groups",),
}


# Python functions that set the global generator's state: a build that calls one is refused (the
# replay seeds the generator once, with sharded_init's seed, and cannot see a reseeding).
_RESEEDS = {f.__code__: f.__name__ for f in (torch.random.manual_seed, torch.random.seed,
                                             torch.random.set_rng_state)}  # fmt: skip


class InitRefused(ValueError):
    """An initializer ``ftrain.distributed.sharded_init`` cannot replay exactly (the message
    says why)."""


@dataclasses.dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    touches: dict[int, str]  # storage key -> "create" | "overwrite" | "use"
    seeded: bool  # draws from the global generator
    out_keys: list[int | None]  # the storage key of each tensor the op returns (None: not meta)


def _key(t: torch.Tensor) -> int:
    return id(t.untyped_storage())  # a storage's Python object lives as long as any view of it


def _generator_of(args: tuple, kwargs: dict) -> torch.Generator | None:
    return next(
        (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)),
        None,
    )


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema's mutable arguments, ``out=`` included)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        out += tensor_leaves(value)
    return out


def _covers_storage(t: torch.Tensor) -> bool:
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


class _Recorder(TorchDispatchMode):
    """Records, in order, every op that touches a meta tensor (views and metadata ops are
    skipped: the replay rebuilds any view from its storage, offset, sizes and strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.storages: dict[int, torch.UntypedStorage] = {}  # keeps every key's storage alive
        self._skipping = {fn.__code__: (fn, names) for fn, names in _SKIP_META.items()}
        self._watched = frozenset(self._skipping) | frozenset(_RESEEDS)
        # the frame of a watched init recorded as one op: the ops it runs on meta itself (a
        # torch that does not skip meta there, e.g. 2.11's orthogonal_) are not recorded again
        self._inside = None

    def called(self, frame, event: str, arg) -> None:
        """A profile hook (``sys.setprofile``, so it runs on every call: the common case
        returns after one test): a call of one of :data:`_SKIP_META` on a meta tensor is
        recorded as one op that runs the whole function at replay; a reseeding is refused."""
        if event == "call":
            if frame.f_code not in self._watched:
                return
        elif event == "return":
            if frame is self._inside:
                self._inside = None
            return
        elif event != "c_call" or getattr(arg, "__self__", None) is not torch.default_generator:
            return
        if _reseeds(frame, event, arg):
            raise InitRefused(
                "the build sets the global generator's state itself (torch.manual_seed, "
                "set_rng_state, fork_rng): the replay seeds it once, from seed=, and cannot follow. "
                "Fix: remove the call and pass its seed as seed=."
            )
        found = self._skipping.get(frame.f_code) if event == "call" else None
        if found is None:
            return
        fn, names = found
        values = frame.f_locals
        t = values["tensor"]
        if not t.is_meta:
            return
        if values.get("generator") is not None:
            raise InitRefused(
                f"nn.init.{fn.__name__} draws from a torch.Generator of its own; only the global "
                "generator is replayed. Fix: draw from the global one."
            )
        self.storages.setdefault(_key(t), t.untyped_storage())
        how = "overwrite" if fn is not nn.init.dirac_ and _covers_storage(t) else "use"
        call = functools.partial(fn, **{n: values[n] for n in names})
        self.ops.append(_Op(call, (t,), {}, {_key(t): how}, True, []))
        if self._inside is None:
            self._inside = frame

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._inside is not None:  # inside an init recorded whole: run on meta, unrecorded
            return func(*args, **(kwargs or {}))
        hook = sys.getprofile()  # off while recording: its Python calls are not the build's
        sys.setprofile(None)
        try:
            return self._record(func, args, kwargs or {})
        finally:
            sys.setprofile(hook)

    def _record(self, func, args: tuple, kwargs: dict):
        out = func(*args, **kwargs)
        ins, outs = tensor_leaves((args, kwargs)), tensor_leaves(out)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        own = _generator_of(args, kwargs)
        name = func.overloadpacket.__name__
        if not any(t.is_meta for t in ins + outs):
            if seeded and own is None:
                raise InitRefused(
                    f"the model drew random numbers into a tensor on {outs[0].device if outs else 'the CPU'} "
                    f"({func}), not on meta: build every tensor on the meta device, or pass init=."
                )
            return out
        if own is not None:
            raise InitRefused(
                f"an initializer draws from a torch.Generator of its own ({func}); only the global "
                "generator is replayed. Fix: draw from the global one, or build whole and use "
                "ft.shard_state."
            )
        if name.startswith("set_"):
            raise InitRefused(
                f"an initializer swaps a tensor's storage ({func}, e.g. `param.data = ...`); "
                "write into it instead (`param.copy_(...)`, `nn.init.*`)."
            )
        for t in ins + outs:
            if t.is_meta:
                self.storages.setdefault(_key(t), t.untyped_storage())
        touches: dict[int, str] = {}
        input_keys = {_key(t) for t in ins if t.is_meta}
        written = [t for t in _written(func, args, kwargs) if t.is_meta]
        for t in ins:
            if t.is_meta:
                touches[_key(t)] = "use"
        for t in written:
            full = name in _OVERWRITES and len(written) == 1 and _covers_storage(t)
            reread = sum(_key(x) == _key(t) for x in ins) > 1  # e.g. copy_ from a view of itself
            touches[_key(t)] = "overwrite" if full and not reread else "use"
        created = {_key(t) for t in outs if t.is_meta} - input_keys
        for k in created:
            touches[k] = "create"
        if not written and not created:
            return out  # a view or a metadata op: no value changes
        out_keys = [_key(t) if t.is_meta else None for t in outs]
        self.ops.append(_Op(func, args, dict(kwargs), touches, seeded, out_keys))
        return out


@dataclasses.dataclass
class InitRecord:
    """What :func:`record_init` saw: the ops that give the model's meta tensors their values, in
    order, and the parameters (name -> meta tensor, tied ones once) they end in."""

    ops: list[_Op]
    params: dict[str, torch.Tensor]
    storages: dict[int, torch.UntypedStorage]

    def replay(self, keep: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the ops on the CPU, one tensor alive at a time; each parameter, once its last op
        has run, goes through ``keep(name, whole)`` (e.g. cut to this rank's rows) and the whole
        is dropped. Returns name -> what ``keep`` returned, in ``params`` order. Draws from the
        global CPU generator: seed it first (``sharded_init`` does, scoped)."""
        by_key: dict[int, list[str]] = {}
        for name, p in self.params.items():
            by_key.setdefault(_key(p), []).append(name)
        nxt = _next_touch(self.ops)
        live: dict[int, torch.UntypedStorage] = {}
        kept: dict[str, torch.Tensor] = {}

        def real(t):
            if not isinstance(t, torch.Tensor) or not t.is_meta:
                return torch.device("cpu") if t == torch.device("meta") else t
            k = _key(t)
            if k not in live:  # never written yet: uninitialised, as torch.empty would be
                live[k] = _fresh(self.storages[k].nbytes())
            view = torch.empty(0, dtype=t.dtype)
            return view.set_(live[k], t.storage_offset(), t.shape, t.stride())

        def finish(k):
            for name in by_key.get(k, ()):
                whole = real(self.params[name])
                kept[name] = keep(name, whole)
            live.pop(k, None)

        for i, op in enumerate(self.ops):
            dead = [k for k in op.touches if _dead_after(k, i, nxt, self.ops, by_key)]
            if not op.seeded and len(dead) == len(op.touches):
                for k in dead:
                    live.pop(k, None)  # its value is never read: skip the op
                continue
            for k, how in op.touches.items():
                if how == "overwrite":
                    live[k] = _fresh(self.storages[k].nbytes())
            args = _mapped(op.args, real)
            kwargs = {n: _mapped(v, real) for n, v in op.kwargs.items()}
            out = op.func(*args, **kwargs)
            for k, t in zip(op.out_keys, tensor_leaves(out)):
                if k is not None and op.touches.get(k) == "create":
                    live[k] = t.untyped_storage()
            for k in op.touches:
                if nxt[i].get(k) is None and k in by_key:
                    finish(k)
                elif k in dead:
                    live.pop(k, None)
        return {name: kept[name] for name in self.params}


def _fresh(nbytes: int) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()  # an op: byte counters see it


def _mapped(value, fn):
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(v, fn) for v in value)
    return fn(value) if isinstance(value, (torch.Tensor, torch.device)) else value


def _next_touch(ops: list[_Op]) -> list[dict[int, int | None]]:
    """For each op and storage it touches: the index of the next op touching that storage."""
    out: list[dict[int, int | None]] = [{} for _ in ops]
    last: dict[int, int] = {}
    for i in range(len(ops) - 1, -1, -1):
        out[i] = {k: last.get(k) for k in ops[i].touches}
        for k in ops[i].touches:
            last[k] = i
    return out


def _dead_after(k: int, i: int, nxt, ops: list[_Op], params: dict) -> bool:
    """Whether the value of storage ``k`` after op ``i`` is never read: overwritten next, or
    never touched again and no parameter's."""
    j = nxt[i][k]
    if j is None:
        return k not in params
    return ops[j].touches[k] == "overwrite"


def record_init(model, init: Callable[[str, torch.Tensor], None] | None = None) -> InitRecord:
    """Build ``model`` (a callable returning an ``nn.Module``) on the meta device, or take it
    (an ``nn.Module`` on meta), then run ``init(name, param)`` on each parameter (default for a
    module given: the outermost ``reset_parameters`` methods), recording every op that writes a
    value. Refuses (``ValueError`` with the reason) what a replay could not reproduce exactly."""
    recorder = _Recorder()
    with torch.no_grad(), torch.device("meta"), recorder, _seen_calls(recorder.called):
        module = model() if not isinstance(model, nn.Module) else model
        if not isinstance(module, nn.Module):
            raise TypeError(f"the builder returned {type(module).__name__}, not an nn.Module")
        not_meta = [n for n, p in module.named_parameters() if not p.is_meta]
        if not_meta:
            raise InitRefused(
                f"parameter {not_meta[0]!r} is on {module.get_parameter(not_meta[0]).device}, not "
                "meta: create it without an explicit device (the builder runs under "
                "torch.device('meta'))."
            )
        if init is not None:
            for name, p in module.named_parameters():
                init(name, p)
        elif isinstance(model, nn.Module):
            for m in _outermost_resets(module):
                m.reset_parameters()
    params = dict(module.named_parameters())
    _check_initialised(recorder.ops, params)
    return InitRecord(recorder.ops, params, recorder.storages)


def _reseeds(frame, event: str, arg) -> bool:
    """Whether this profile event is a call that sets the global CPU generator's state."""
    if event == "call":
        return frame.f_code in _RESEEDS
    return (
        event == "c_call"
        and getattr(arg, "__self__", None) is torch.default_generator
        and getattr(arg, "__name__", "") in ("manual_seed", "seed", "set_state")
    )


@contextlib.contextmanager
def _seen_calls(hook: Callable) -> Iterator[None]:
    """``hook(frame, event, arg)`` on every Python call of this thread inside the block (after
    the profile function already set, if any, which is restored on exit)."""
    before = sys.getprofile()

    def both(frame, event, arg):
        before(frame, event, arg)
        hook(frame, event, arg)

    sys.setprofile(hook if before is None else both)
    try:
        yield
    finally:
        sys.setprofile(before)


def _outermost_resets(module: nn.Module) -> list[nn.Module]:
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if callable(getattr(m, "reset_parameters", None)) and not any(
            name.startswith(f"{p}.") or p == "" for p, _ in found
        ):
            found.append((name, m))
    return [m for _, m in found]


def _check_initialised(ops: list[_Op], params: dict[str, torch.Tensor]) -> None:
    valued: dict[int, bool] = {}
    for op in ops:
        for k, how in op.touches.items():
            if how == "create":
                valued[k] = op.func.overloadpacket.__name__ not in _NO_VALUE
            elif how == "overwrite":
                valued[k] = True
    blank = [n for n, p in params.items() if not valued.get(_key(p), False)]
    if blank:
        raise InitRefused(
            f"parameter {blank[0]!r} (and {len(blank) - 1} more) is never given a value (made by "
            "torch.empty and not fully written by any initializer): the whole model would hold "
            "whatever memory held. Fix: initialise it (nn.init.*, reset_parameters) or pass init=."
        )
