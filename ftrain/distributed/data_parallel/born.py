"""Born sharded: a state whose params are created directly as this process's shards.

``ft.shard_state`` needs the whole state on every process first, so every process builds the
whole model on its host. :func:`sharded_init` never holds more than one parameter whole: the
model is built on the ``meta`` device while the ops that give it values are recorded
(``ftrain.distributed.data_parallel.init_record``); the record is replayed on the CPU one tensor
at a time from the CPU generator seeded with ``seed``, and each parameter, once its last op has
run, is cut to this process's rows (fsdp) and the whole freed. So the params are bitwise those
of the model built whole after ``torch.manual_seed(seed)`` (``init_record`` says for which
modules, and what it refuses).

**Memory.** The peak on a process is its shards plus the largest parameter whole (plus the
largest intermediate an initializer makes, e.g. ``orthogonal_``'s QR), never the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import nn

from ftrain import tree
from ftrain.distributed.data_parallel import dp_split
from ftrain.distributed.data_parallel.init_record import InitRefused, record_init
from ftrain.distributed.data_parallel.zero import SHARDED_FIELDS, check_strategy, shard_tree
from ftrain.distributed.dtensor import from_local, is_dtensor, local, placements_of
from ftrain.distributed.launch import check_mesh, require_group
from ftrain.optim.base import GradientTransformation
from ftrain.state import TrainState

__all__ = ["sharded_init"]


def sharded_init(
    model: nn.Module | Callable[[], nn.Module],
    optimizer: GradientTransformation,
    strategy: str = "fsdp",
    mesh: Any = None,
    *,
    init: Callable[[str, torch.Tensor], None] | None = None,
    seed: int = 0,
    layout: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> TrainState:
    """A fresh state laid out for ``ft.shard(step, strategy)``, its params born as this
    process's shards: the whole model never exists on any process.

    ``model`` is either a builder (``lambda: GPT(config)``, a class: called with no arguments,
    under ``torch.device("meta")``) or an ``nn.Module`` already on the meta device. The params
    get the values the module's own initializers give (a builder: its constructor, then
    ``init`` if given; a meta module: ``init`` if given, else its outermost
    ``reset_parameters`` methods). ``init(name, param)`` is called for each parameter in
    ``named_parameters()`` order: an ``nn.init``-style function that writes ``param`` in place
    from the global generator. The template for ``ft.apply`` is any
    meta build of the same module: ``with torch.device("meta"): model = GPT(config)``.

    **Invariant:** bitwise equal to building whole and sharding, with the same seed::

        torch.manual_seed(seed)
        module = build()  # then init(name, p) for each parameter, if given
        # (a meta module: module.to_empty(device="cpu"), then init or reset_parameters)
        state = ft.TrainState.create(ft.params_of(module), optimizer, seed=seed)
        ft.shard_state(state, strategy, mesh)

    for every module whose initializers draw from the global CPU generator through torch ops
    (``ftrain.distributed.data_parallel.init_record`` lists what is refused).
    The global random state is left as it was. Memory on a process at any moment: its shards of
    the params and optimizer state plus one parameter whole (fsdp; the other strategies keep the
    params whole by definition, their optimizer state is born sharded). ``rng`` is ``seed``.
    Every process must pass the same ``seed`` (checked: one small collective).

    **Tensor parallelism.** ``layout(name, whole)`` lays each whole parameter out before the
    data-parallel split: pass ``tp.lay_out_param`` of an ``ft.tensor_parallel`` transform and
    ``mesh=tp.mesh["dp"]``, and the state is bitwise ``ft.shard_state(tp.shard_state(whole),
    strategy, mesh=tp.mesh["dp"])``, the model never whole on any process (each process keeps
    its tensor-parallel piece of each parameter, split again over ``dp`` under fsdp).
    """
    strategy = check_strategy(strategy, "sharded_init")
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
    if layout is not None and not callable(layout):
        raise TypeError(
            "ft.distributed.sharded_init(layout=...): must be a function layout(name, whole) -> "
            f"tensor (e.g. tp.lay_out_param), or None; got {type(layout).__name__}."
        )
    if init is not None and not callable(init):
        raise TypeError(
            "ft.distributed.sharded_init(init=...): must be a function init(name, param) that "
            f"fills param in place, or None; got {type(init).__name__}."
        )
    require_group("sharded_init")
    mesh = check_mesh(mesh, "sharded_init")
    _check_same_seed(seed, mesh)
    try:
        record = record_init(model, init)
    except InitRefused as e:
        raise ValueError(f"ft.distributed.sharded_init: {e}") from None
    fsdp = "params" in SHARDED_FIELDS[strategy]

    def keep(name: str, whole: torch.Tensor) -> torch.Tensor:
        t = whole if layout is None else layout(name, whole)
        if fsdp and t.dim() > 0:  # this process's rows (a tensor-parallel piece: dp_split's rule)
            return _to_device(dp_split.split(t, mesh, copy=True), mesh.device_type)
        if t is whole:
            return whole.clone().to(mesh.device_type)
        return _to_device(t, mesh.device_type) if is_dtensor(t) else t.to(mesh.device_type)

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
        # where shard_state puts a leaf: Shard(0) rows over mesh, or a parameter's own layout
        # (a moment shaped like a tensor-parallel parameter)
        laid = {_where(p) for p in tree.leaves(shares) if is_dtensor(p)}
        for path, t in zip(tree.paths(state), tree.leaves(state)):
            rows = is_dtensor(t) and tuple(t.placements) == placements_of(t)
            if t.dim() > 0 and not (
                (rows and t.device_mesh == mesh) or (is_dtensor(t) and _where(t) in laid)
            ):
                raise ValueError(
                    f"ft.distributed.sharded_init: the optimizer's init made {path!r} "
                    f"{'a plain tensor' if not is_dtensor(t) else tuple(t.placements)} from sharded "
                    "params, not Shard(0) rows as ft.shard_state lays it out. Build whole and use "
                    "ft.shard_state with this optimizer."
                )
        return state

    return GradientTransformation(init, inner.update)


def _where(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.device_mesh, tuple(t.placements)


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
