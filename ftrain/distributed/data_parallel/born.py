"""Born sharded: a state whose params are created directly as this process's shards.

``ft.shard_state`` needs the whole state on every process first, so every process builds the
whole model on its host. :func:`sharded_init` never holds more than one parameter whole: the
model is built on the ``meta`` device (shapes, no data) while every op that writes a value is
recorded; the record is then replayed on the CPU one tensor at a time, and each parameter, once
its last op has run, is cut to this process's rows (fsdp) and the whole freed.

**Exact.** The replay runs the recorded ops in their order on tensors of the same shape, strides
and dtype, on the CPU, from the CPU generator seeded with ``seed``; so every random op draws
what it drew when the model was built whole after ``torch.manual_seed(seed)``, and the params are
bitwise those of the whole model. An op whose value is overwritten before anything reads it
(``nn.Linear``'s kaiming init, replaced by ``GPT.reset_parameters``' normal init) still runs, on
a scratch tensor freed at once, because it moves the generator. This holds for any module whose
initializers draw from the global CPU generator through torch ops on its own meta tensors: the
built-in ``GPT`` (``nn.Embedding`` normal, ``nn.Linear`` kaiming-uniform then GPT-2's normal,
``nn.LayerNorm`` ones and zeros, MoE experts normal), every ``torch.nn.init`` function and any
module's ``reset_parameters``. Refused, with the reason, before any replay: a random op on a real
(non-meta) tensor that draws from the global generator, a generator of the module's own, an op
that swaps a tensor's storage (``.data =`` / ``set_``), and a parameter left uninitialised
(``torch.empty`` never written).

**Memory.** The peak on a process is its shards plus the largest parameter whole (plus the
largest intermediate an initializer makes, e.g. ``orthogonal_``'s QR), never the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import nn

# the extension point torch documents for __torch_dispatch__ modes, from a module named private
from torch.utils._python_dispatch import TorchDispatchMode

from ftrain import tree
from ftrain.distributed.collectives import as_sharded
from ftrain.distributed.data_parallel.zero import SHARDED_FIELDS, check_strategy, shard_tree
from ftrain.distributed.dtensor import from_local, is_dtensor, local, placements_of
from ftrain.distributed.launch import check_mesh, require_group
from ftrain.memory.tracker import tensor_leaves
from ftrain.optim.base import GradientTransformation
from ftrain.state import TrainState

__all__ = ["sharded_init", "InitRecord", "record_init"]

# In-place ops that write every element of their target without reading it: the value before is
# dead, so the replay runs them on a fresh tensor (and drops an old one nobody reads).
_OVERWRITES = frozenset(
    "normal_ uniform_ fill_ zero_ random_ bernoulli_ exponential_ geometric_ log_normal_ cauchy_ "
    "copy_".split()
)
# Ops that make a tensor without a value: a parameter whose last value came from one is refused.
_NO_VALUE = frozenset("empty empty_strided empty_like new_empty new_empty_strided".split())


class _Refused(ValueError):
    """An initializer :func:`sharded_init` cannot replay exactly (the message says why)."""


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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins, outs = tensor_leaves((args, kwargs)), tensor_leaves(out)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        own = _generator_of(args, kwargs)
        name = func.overloadpacket.__name__
        if not any(t.is_meta for t in ins + outs):
            if seeded and own is None:
                raise _Refused(
                    f"the model drew random numbers into a tensor on {outs[0].device if outs else 'the CPU'} "
                    f"({func}), not on meta: build every tensor on the meta device, or pass init=."
                )
            return out
        if own is not None:
            raise _Refused(
                f"an initializer draws from a torch.Generator of its own ({func}); only the global "
                "generator is replayed. Fix: draw from the global one, or build whole and use "
                "ft.shard_state."
            )
        if name.startswith("set_"):
            raise _Refused(
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
        is dropped. Returns name -> what ``keep`` returned, in ``params`` order. Draws from the global CPU generator:
        seed it first (``sharded_init`` does, scoped)."""
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
    with torch.no_grad(), torch.device("meta"), recorder:
        module = model() if not isinstance(model, nn.Module) else model
        if not isinstance(module, nn.Module):
            raise TypeError(f"the builder returned {type(module).__name__}, not an nn.Module")
        not_meta = [n for n, p in module.named_parameters() if not p.is_meta]
        if not_meta:
            raise _Refused(
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
        raise _Refused(
            f"parameter {blank[0]!r} (and {len(blank) - 1} more) is never given a value (made by "
            "torch.empty and not fully written by any initializer): the whole model would hold "
            "whatever memory held. Fix: initialise it (nn.init.*, reset_parameters) or pass init=."
        )


def sharded_init(
    model: nn.Module | Callable[[], nn.Module],
    optimizer: GradientTransformation,
    strategy: str = "fsdp",
    mesh: Any = None,
    *,
    init: Callable[[str, torch.Tensor], None] | None = None,
    seed: int = 0,
) -> TrainState:
    """A fresh state laid out for ``ft.shard(step, strategy)``, its params born as this
    process's shards: the whole model never exists on any process.

    ``model`` is either a builder (``lambda: GPT(config)``, a class: called with no arguments,
    under ``torch.device("meta")``) or an ``nn.Module`` already on the meta device. The params
    get the values the module's own initializers give (the builder's constructor; for a meta
    module, the outermost ``reset_parameters`` methods), then, if given, ``init(name, param)``
    for each parameter in ``named_parameters()`` order (an ``nn.init``-style function that
    writes ``param`` in place from the global generator). The template for ``ft.apply`` is any
    meta build of the same module: ``with torch.device("meta"): model = GPT(config)``.

    **Invariant:** bitwise equal to building whole and sharding, with the same seed::

        torch.manual_seed(seed)
        module = build()              # or: meta_module.to_empty(device="cpu"); reset_parameters
        # ... init(name, p) for each parameter, if given
        state = ft.TrainState.create(ft.params_of(module), optimizer, seed=seed)
        ft.shard_state(state, strategy, mesh)

    for every module whose initializers draw from the global CPU generator through torch ops
    (the module docstring of ``ftrain.distributed.data_parallel.born`` lists what is refused).
    The global random state is left as it was. Memory on a process at any moment: its shards of
    the params and optimizer state plus one parameter whole (fsdp; the other strategies keep the
    params whole by definition, their optimizer state is born sharded). ``rng`` is ``seed``.
    Every process must pass the same ``seed`` (checked: one small collective).
    """
    strategy = check_strategy(strategy, "sharded_init")
    require_group("sharded_init")
    mesh = check_mesh(mesh, "sharded_init")
    if not (isinstance(model, nn.Module) or callable(model)):
        raise TypeError(
            "ft.distributed.sharded_init(model, ...): model must be a builder (e.g. "
            f"lambda: GPT(config)) or an nn.Module on the meta device, got {type(model).__name__}."
        )
    if isinstance(model, nn.Module) and not all(p.is_meta for p in model.parameters()):
        raise ValueError(
            "ft.distributed.sharded_init(model, ...): the module's parameters are not on the meta "
            "device, so the whole model exists already: use ft.shard_state(TrainState.create("
            "ft.params_of(model), optimizer), strategy), or pass a builder (lambda: Model(...))."
        )
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            "ft.distributed.sharded_init(model, optimizer): optimizer must be an "
            f"ftrain.optim.GradientTransformation (e.g. ftrain.optim.adamw(3e-4)), got "
            f"{type(optimizer).__name__}."
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"ft.distributed.sharded_init(seed=...): must be an int, got {seed!r}.")
    if init is not None and not callable(init):
        raise TypeError(
            "ft.distributed.sharded_init(init=...): must be a function init(name, param) that "
            f"fills param in place, or None; got {type(init).__name__}."
        )
    _check_same_seed(seed, mesh)
    try:
        record = record_init(model, init)
    except _Refused as e:
        raise ValueError(f"ft.distributed.sharded_init: {e}") from None
    fsdp = "params" in SHARDED_FIELDS[strategy]

    def keep(name: str, whole: torch.Tensor) -> torch.Tensor:
        if fsdp and whole.dim() > 0:
            return _to_device(as_sharded(whole, mesh, copy=True), mesh.device_type)
        return whole.clone().to(mesh.device_type)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.manual_seed(seed)  # the CPU generator only, as manual_seed sets it
        kept = record.replay(keep)
    params = tree.from_flat(kept)
    return TrainState.create(params, _born_optimizer(optimizer, strategy, mesh), seed=seed)


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    if t.device.type == device:
        return t
    return from_local(local(t).to(device), t.device_mesh, t.placements, t.shape, t.stride())


def _born_optimizer(inner: GradientTransformation, strategy: str, mesh) -> GradientTransformation:
    """``inner`` whose init makes the optimizer state already laid out as ``shard_state`` lays
    it out (from sharded params, never whole), checked leaf by leaf."""
    sharded = "opt_state" in SHARDED_FIELDS[strategy]

    def init(params: TensorDictBase) -> TensorDictBase:
        if not sharded:
            return inner.init(params)
        shares = (
            params if "params" in SHARDED_FIELDS[strategy] else shard_tree(params, mesh, copy=False)
        )
        state = inner.init(shares)
        for path, t in zip(tree.paths(state), tree.leaves(state)):
            if t.dim() > 0 and not (
                is_dtensor(t) and tuple(t.placements) == placements_of(t) and t.device_mesh == mesh
            ):
                raise ValueError(
                    f"ft.distributed.sharded_init: the optimizer's init made {path!r} "
                    f"{'a plain tensor' if not is_dtensor(t) else tuple(t.placements)} from sharded "
                    "params, not Shard(0) rows as ft.shard_state lays it out. Build whole and use "
                    "ft.shard_state with this optimizer."
                )
        return state

    return GradientTransformation(init, inner.update)


def _check_same_seed(seed: int, mesh) -> None:
    group = mesh.get_group()
    if dist.get_world_size(group) == 1:
        return
    device = "cuda" if mesh.device_type == "cuda" else "cpu"
    low = torch.tensor([seed], dtype=torch.int64, device=device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if int(low) != int(high):
        raise ValueError(
            f"ft.distributed.sharded_init(seed={seed}): the processes were given different seeds "
            f"({int(low)} to {int(high)}); every process must build the same model: pass one seed."
        )
