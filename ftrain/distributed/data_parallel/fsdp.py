"""FSDP: each block's parameters are whole only while the block runs.

The params are ``Shard(0)`` DTensors. ``ft.shard(step, "fsdp")`` rewrites the model ``ft.apply``
runs (:func:`gathering_copy`, a copy: the user's module is never modified) so that right before a
block runs its parameters are all-gathered into whole tensors, and right after they are dropped;
the parameters outside the blocks (embeddings, final norm) are gathered for the whole forward.
Tensors that backward needs from a gathered parameter are not kept: they are saved as a reference
to the shard and gathered again when backward reaches the block (under ``ft.checkpoint`` the
recompute gathers them, since the gathering runs inside the recomputed block). The gradient of a
gathered tensor is reduce-scattered straight back to its shard, so no process holds whole
gradients; except when the gradient engine reweights them after backward (its
``ftrain.step.BackwardPlan``, fp16 loss scaling): then they stay local (``Partial``) and the
step's reduce phase reduce-scatters them once.

Everything a gather needs during backward (the session, the plan, the trackers) is captured in
the forward: backward, and the recompute of a checkpointed block, may run on autograd's worker
threads, which see no scoped value.

Under tensor parallelism the params are DTensors on the ``("dp", "tp")`` mesh, split over ``dp``
as ``ftrain.distributed.data_parallel.dp_split`` says; a gather then gives this process's ``tp``
piece (what the tensor-parallel forward computes with), and its gradient is reduce-scattered back
over ``dp``.

So the parameter memory of a process is its shard plus about one block at a time
(:func:`track_gathered` measures it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ftrain.distributed.data_parallel import dp_split
from ftrain.distributed.dtensor import is_dtensor
from ftrain.internals.blocks import find_blocks, replace_forwards
from ftrain.internals.module_tables import param_slots
from ftrain.internals.scoped import Scoped
from ftrain.step.engine import BackwardPlan, backward_plan

__all__ = [
    "Tracker",
    "track_gathered",
    "session",
    "current_session",
    "saved_as_shards",
    "gathering_copy",
]


class Tracker:
    """Bytes of gathered parameter buffers alive, sampled whenever a new one is made."""

    def __init__(self) -> None:
        self.alive: list[tuple[Any, int]] = []
        self.peak = 0
        self.gathers = 0

    def add(self, t: torch.Tensor) -> None:
        """Count a newly gathered whole tensor (alive for as long as anything holds it)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        self.gathers += 1
        self.alive = [(ref, n) for ref, n in self.alive if not ref.expired()]
        storage = t.untyped_storage()
        self.alive.append((StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(n for _, n in self.alive))


_TRACKERS: Scoped[tuple[Tracker, ...]] = Scoped("ftrain fsdp trackers", ())


@contextlib.contextmanager
def track_gathered() -> Iterator[Tracker]:
    """Measure the whole parameters that ``fsdp`` holds while it steps::

        with track_gathered() as t:
            state, metrics = step(state, batch)
        t.peak  # most bytes of gathered whole parameters alive at once

    ``peak`` counts the whole tensors of every gather (forward, and again in backward) for as long
    as anything holds them; add the shards (``local_bytes``) for the parameter memory of the
    process. Not counted: the flat receive buffer of the gather in progress (one group's size),
    which lives only while it is cut into whole tensors (the collective backend may hold it a
    moment longer).
    """
    tracker = Tracker()
    with _TRACKERS.using((*_TRACKERS.get(), tracker)):
        yield tracker


class _Gathered:
    """One gather of one group of parameters (a block, or the model's other params)."""

    def __init__(self, session: _Session, shards: list[torch.Tensor]):
        self.mesh = session.mesh
        self.plan = session.plan  # the engine's plan for this micro-batch's backward
        self.trackers = session.trackers
        self.shards = shards  # the DTensors, in the order of the gathered outputs
        self.again: list[torch.Tensor] | None = None  # re-gathered for backward, then dropped

    def gather(self) -> list[torch.Tensor]:
        whole = dp_split.gather_pieces(self.shards, self.mesh)
        for tracker in self.trackers:
            for w in whole:
                tracker.add(w)
        return whole

    def regather(self, i: int) -> torch.Tensor:
        if self.again is None:
            with torch.no_grad():
                self.again = self.gather()
        return self.again[i]


class _GatherFn(torch.autograd.Function):
    """Forward: whole tensors from shards (all-gather). Backward: the gradients of the whole
    tensors, summed over ranks, land on the shards (reduce-scatter), or stay local (``Partial``)
    when the engine reweights them after backward."""

    @staticmethod
    def forward(ctx, gathered: _Gathered, *shards):
        ctx.gathered = gathered
        return tuple(gathered.gather())

    @staticmethod
    def backward(ctx, *grads):
        g: _Gathered = ctx.gathered
        g.again = None  # the block's backward is over: drop what it re-gathered
        grads = [
            gr
            if gr is not None
            else torch.zeros(dp_split.piece_shape(s), dtype=s.dtype, device=s.device)
            for gr, s in zip(grads, g.shards)
        ]
        if g.plan is not None and g.plan.reweight:  # reduced by the step, after reweighting
            return (None, *(dp_split.unreduced(x, s, g.mesh) for x, s in zip(grads, g.shards)))
        return (None, *dp_split.reduce_scatter(grads, g.shards, g.mesh))


class _Regather:
    """What a saved-for-backward view of a gathered parameter is packed into."""

    __slots__ = ("gathered", "index", "size", "stride", "offset")

    def __init__(self, gathered, index, size, stride, offset):
        self.gathered, self.index = gathered, index
        self.size, self.stride, self.offset = size, stride, offset


class _Session:
    """The gathering of one fsdp step: which whole tensors alive now were gathered from which
    shards, so that what backward saves of them is packed as a reference to the shard."""

    def __init__(self, mesh):
        self.mesh = mesh
        # the storage of each whole tensor alive now -> its source; keyed by the storage itself
        # (a weak reference), not its address: fake tensors (ft.memory's plan) all have address 0
        self.saved: dict[Any, tuple[_Gathered, int, torch.dtype]] = {}
        self.trackers = _TRACKERS.get()  # read here, on the thread that runs the step
        self.plan: BackwardPlan | None = None  # of the micro-batch whose forward ran last

    @contextlib.contextmanager
    def gathered(self, slots: list[tuple[dict, str]]) -> Iterator[None]:
        """The parameters at ``slots`` (``ftrain.internals.module_tables.param_slots``) whole for
        the extent of the block."""
        plan = backward_plan()
        if plan is not None:  # in an engine's forward: read its decision during backward
            self.plan = plan
        current = [table[name] for table, name in slots]
        order: dict[int, int] = {}
        shards = []
        for t in current:
            if dp_split.fsdp_gathers(t, self.mesh) and id(t) not in order:
                order[id(t)] = len(shards)
                shards.append(t)
        if not shards:
            yield
            return
        gathered = _Gathered(self, shards)
        whole = _GatherFn.apply(gathered, *shards)
        keys = []
        if torch.is_grad_enabled():  # saved for backward: packed as a reference (see pack)
            for i, w in enumerate(whole):
                key = _storage_key(w)
                self.saved[key] = (gathered, i, w.dtype)
                keys.append(key)
        for (table, name), t in zip(slots, current):
            if id(t) in order:
                table[name] = whole[order[id(t)]]
        try:
            yield
        finally:
            for (table, name), t in zip(slots, current):
                table[name] = t
            for key in keys:  # the whole tensors die now
                self.saved.pop(key, None)

    def pack(self, t: torch.Tensor) -> Any:
        # plain tensors, and the fake ones ft.memory plans with; never a DTensor (a shard)
        if self.saved and t.layout == torch.strided and not is_dtensor(t):
            try:
                hit = self.saved.get(_storage_key(t))
            except (RuntimeError, NotImplementedError, TypeError):  # a subclass without a storage
                return t
            if hit is not None and hit[2] == t.dtype:
                return _Regather(hit[0], hit[1], t.size(), t.stride(), t.storage_offset())
        return t

    @staticmethod
    def unpack(x: Any) -> torch.Tensor:
        if isinstance(x, _Regather):
            whole = x.gathered.regather(x.index)
            return whole.as_strided(x.size, x.stride, x.offset)
        return x


def _storage_key(t: torch.Tensor) -> Any:
    """A dictionary key for the storage holding ``t``, equal for every view of it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


_SESSION: Scoped[_Session | None] = Scoped("ftrain fsdp session", None)


@contextlib.contextmanager
def session(mesh) -> Iterator[None]:
    """One gathering session for the extent of a step (its forward and its backward)."""
    with _SESSION.using(_Session(mesh)):
        yield


def current_session(mesh) -> _Session:
    """The session of the step running now (a new one for a forward outside any step)."""
    s = _SESSION.get()
    return s if s is not None else _Session(mesh)


@contextlib.contextmanager
def saved_as_shards(mesh) -> Iterator[None]:
    """Around a forward: what autograd saves of a gathered parameter is packed as a reference to
    its shard. Opens a session of its own when the forward runs outside a step call."""
    with contextlib.ExitStack() as stack:
        if _SESSION.get() is None:
            stack.enter_context(session(mesh))
        s = _SESSION.get()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(s.pack, s.unpack))
        yield


def _gathering(session: _Session, slots: list[tuple[dict, str]]):
    """The forward maker of :func:`ftrain.internals.blocks.replace_forwards`: run the module with
    the parameters at ``slots`` gathered, in ``session`` (captured: a checkpointed block recomputed
    on an autograd worker thread gathers in the same session)."""

    def make(current: nn.Module):
        def forward(*args, **kwargs):
            with session.gathered(slots):
                return current(*args, **kwargs)

        return forward

    return make


def gathering_copy(module: nn.Module, session: _Session) -> nn.Module:
    """A copy of ``module`` whose blocks (``ftrain.internals.blocks.find_blocks``) each gather their
    own parameters while they run, and whose other parameters are gathered for the whole call, in
    ``session`` (one step's: the copy is made again for the next)."""
    blocks = find_blocks(module)
    inside = {id(m) for b in blocks for m in b.modules()}
    root = param_slots(m for m in module.modules() if id(m) not in inside)
    replacements = [(b, _gathering(session, param_slots(b.modules()))) for b in blocks]
    return replace_forwards(module, [*replacements, (module, _gathering(session, root))])
