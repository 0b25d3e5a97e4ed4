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

So the parameter memory of a process is its shard plus about one block at a time, two with
**prefetch** (``ft.shard(step, "fsdp", prefetch=True)``: the collectives start one group early,
as ``ftrain.distributed.data_parallel.overlap`` says); :func:`track_gathered` measures it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ftrain.distributed.data_parallel import dp_split, overlap
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

    def __init__(self, session: _Session, shards: list[torch.Tensor], ahead=None, box=None):
        self.session = session  # captured: backward may run on a thread that sees no scope
        self.box: overlap.Box | None = box  # its handoff's (prefetch): for its reduce-scatter
        self.mesh = session.mesh
        self.plan = session.plan  # the engine's plan for this micro-batch's backward
        self.trackers = session.trackers
        self.shards = shards  # the DTensors, in the order of the gathered outputs
        self.ahead: overlap.Pending | None = ahead  # a gather started early (prefetch)
        self.again: list[torch.Tensor] | None = None  # re-gathered for backward, then dropped
        self.packed = False  # backward needs it again (a saved tensor refers to it)
        self.done = False  # its backward has run

    def gather(self) -> list[torch.Tensor]:
        if self.ahead is not None:
            whole, self.ahead = self.ahead.wait(), None
        else:
            whole = dp_split.gather_pieces(self.shards, self.mesh)
        for tracker in self.trackers:
            for w in whole:
                tracker.add(w)
        return whole

    def regather(self, i: int) -> torch.Tensor:
        if self.again is None:
            with torch.no_grad():
                self.again = self.gather()
            self.session.regather_next(self)
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
        g.again, g.done = None, True  # the block's backward is over: drop what it re-gathered
        g.session.finish_reductions()  # the previous block's, which ran during this backward
        grads = [
            gr
            if gr is not None
            else torch.zeros(dp_split.piece_shape(s), dtype=s.dtype, device=s.device)
            for gr, s in zip(grads, g.shards)
        ]
        if g.plan is not None and g.plan.reweight:  # reduced by the step, after reweighting
            return (None, *(dp_split.unreduced(x, s, g.mesh) for x, s in zip(grads, g.shards)))
        if g.box is not None and not g.session.gathered_twice(g):
            return (None, *g.session.reduce_scatter_ahead(grads, g))
        return (None, *dp_split.reduce_scatter(grads, g.shards, g.mesh))


class _Regather:
    """What a saved-for-backward view of a gathered parameter is packed into."""

    __slots__ = ("gathered", "index", "size", "stride", "offset")

    def __init__(self, gathered, index, size, stride, offset):
        self.gathered, self.index = gathered, index
        self.size, self.stride, self.offset = size, stride, offset


class _Session:
    """The gathering of one fsdp step: which whole tensors alive now were gathered from which
    shards, so that what backward saves of them is packed as a reference to the shard; and, with
    ``prefetch``, the collectives started early (the module docstring's **Prefetch**)."""

    def __init__(self, mesh, prefetch: bool = False):
        self.mesh = mesh
        self.prefetch = prefetch
        # the storage of each whole tensor alive now -> its source; keyed by the storage itself
        # (a weak reference), not its address: fake tensors (ft.memory's plan) all have address 0
        self.saved: dict[Any, tuple[_Gathered, int, torch.dtype]] = {}
        self.trackers = _TRACKERS.get()  # read here, on the thread that runs the step
        self.plan: BackwardPlan | None = None  # of the micro-batch whose forward ran last
        self.forwarding = 0  # > 0 inside a micro-batch's forward (saved_as_shards' extent)
        self.order: list[_Gathered] = []  # this micro-batch's differentiable gathers, in order
        self.uses: dict[int, int] = {}  # id(shard) -> its gathers in this micro-batch's forward
        self.handed: dict[int, tuple[torch.Tensor, overlap.Box]] = {}  # id(shard) -> its handoff
        self.known: dict[int, list] = {}  # id(slots) -> the shards its forward gathered (for a
        # recompute in backward, when the tables hold the template's own tensors again)
        self.ahead: tuple[list, list, overlap.Pending] | None = None  # (slots, shards, gather)
        self.in_flight: list[overlap.Pending] = []  # reduce-scatters not waited yet
        self.callback = False  # a drain is queued at the end of the backward running now

    def shards_at(self, slots: list[tuple[dict, str]]) -> tuple[list, dict[int, int], list]:
        """The tensors at ``slots`` now, where each one fsdp gathers sits among the shards, and
        the shards (each once, in slot order)."""
        current = [table[name] for table, name in slots]
        order: dict[int, int] = {}
        shards = []
        for t in current:
            if dp_split.fsdp_gathers(t, self.mesh) and id(t) not in order:
                order[id(t)] = len(shards)
                shards.append(t)
        return current, order, shards

    @contextlib.contextmanager
    def gathered(self, slots, after=None, before=None) -> Iterator[None]:
        """The parameters at ``slots`` (``ftrain.internals.module_tables.param_slots``) whole for
        the extent of the block. ``after``/``before``: the slots of the block that runs next in
        forward (prefetched, its handoff made here), and in a recompute during backward."""
        plan = backward_plan()
        if plan is not None:  # in an engine's forward: read its decision during backward
            self.plan = plan
        current, order, shards = self.shards_at(slots)
        if not shards:
            yield
            return
        # in a selective checkpoint's region a gather must be the same ops in forward and in
        # recompute: blocking, with nothing started early
        early = self.prefetch and not overlap.recording_for_recompute()
        ahead = self._take_ahead(slots, shards) if early else self._drop_ahead()
        inputs, box = self._handed(shards) if early and self.forwarding else (shards, None)
        grad = torch.is_grad_enabled()
        if early and grad and self.forwarding and after is not None:
            self._hand_off(after)  # before this gather's node: its backward runs after it
        gathered = _Gathered(self, inputs, ahead, box)
        whole = _GatherFn.apply(gathered, *inputs)
        if early:  # the next block's gather runs while this one computes
            self._start(after if self.forwarding else before if grad else None)
        keys = []
        if grad:  # saved for backward: packed as a reference (see pack)
            if self.forwarding:
                self.order.append(gathered)
                self.known[id(slots)] = shards
                for t in inputs:
                    self.uses[id(t)] = self.uses.get(id(t), 0) + 1
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

    # -- prefetch ---------------------------------------------------------------------------
    def _start(self, slots) -> None:
        if slots is None or self.ahead is not None:
            return
        shards = self.shards_at(slots)[2] if self.forwarding else self.known.get(id(slots))
        if shards:
            self.ahead = (slots, shards, self._gather_ahead(shards))

    def _gather_ahead(self, shards: list) -> overlap.Pending:
        pending = overlap.gather_ahead(shards, self.mesh)
        for tracker in self.trackers:  # its receive buffers are alive from now on
            for buffer in pending.buffers:
                tracker.add(buffer)
        return pending

    def _take_ahead(self, slots, shards) -> overlap.Pending | None:
        """The gather started early for ``slots``, if it gathers exactly ``shards``; a guess
        that missed is finished and dropped."""
        if self.ahead is None:
            return None
        want, got, pending = self.ahead
        self.ahead = None
        if want is slots and len(got) == len(shards) and all(a is b for a, b in zip(got, shards)):
            return pending
        pending.discard()
        return None

    def _hand_off(self, slots) -> None:
        """The shards of the block at ``slots`` (the next one to run) through a
        :class:`overlap.Handoff` of their own, made now: before the gather of the block that runs
        before it, so that in backward it runs right after that gather's backward."""
        shards = [t for t in self.shards_at(slots)[2] if t.requires_grad]
        if shards and not any(id(t) in self.handed for t in shards):
            box = overlap.Box()
            for t, out in zip(shards, overlap.Handoff.apply(box, *shards)):
                self.handed[id(t)] = (out, box)

    def _handed(self, shards: list) -> tuple[list, overlap.Box | None]:
        """``shards`` with those that went through one block's handoff replaced by its outputs,
        and that handoff's box; or ``shards`` and None (their reduce-scatter will block)."""
        hits = [self.handed.get(id(t)) for t in shards]
        boxes = {id(h[1]): h[1] for h in hits if h is not None}
        if len(boxes) != 1 or any(h is None and t.requires_grad for h, t in zip(hits, shards)):
            return shards, None
        return [t if h is None else h[0] for h, t in zip(hits, shards)], next(iter(boxes.values()))

    def _drop_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead[2].discard()
            self.ahead = None

    def regather_next(self, g: _Gathered) -> None:
        """After ``g`` regathered: start the latest-gathered one still waiting for backward."""
        if not self.prefetch:
            return
        for h in reversed(self.order):
            if h is not g and h.packed and not h.done and h.again is None and h.ahead is None:
                h.ahead = self._gather_ahead(h.shards)
                return

    def gathered_twice(self, g: _Gathered) -> bool:
        """Whether a shard of ``g`` was gathered more than once in this forward (autograd adds
        its gradients as soon as the second exists, so they cannot be left in flight)."""
        return any(self.uses.get(id(t), 0) > 1 for t in g.shards)

    def reduce_scatter_ahead(self, grads: list, g: _Gathered) -> list:
        """Start ``g``'s reduce-scatter; it is waited by the next block's (or the end of this
        backward, whichever comes first)."""
        out, pending = overlap.reduce_scatter_ahead(grads, g.shards, g.mesh)
        self.in_flight.append(pending)
        g.box.pending = pending
        if not self.callback:
            self.callback = True
            overlap.at_backward_end(self._backward_ended)
        return out

    def finish_reductions(self) -> None:
        """Wait for every reduce-scatter in flight (their gradients are complete after)."""
        while self.in_flight:
            self.in_flight.pop(0).wait()

    def _backward_ended(self) -> None:
        self.callback = False
        self.finish_reductions()

    def start_forward(self) -> None:
        if self.forwarding == 0:  # a new micro-batch: the last one's backward has run
            self.order, self.uses, self.known, self.handed = [], {}, {}, {}
        self.forwarding += 1

    def close(self) -> None:
        """Finish every collective still in flight (a guess never used, a forward whose
        backward never ran): none outlives the step."""
        self.finish_reductions()
        self._drop_ahead()
        for g in self.order:
            if g.ahead is not None:
                g.ahead.discard()
                g.ahead = None

    # -- saved-tensor hooks -------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        # plain tensors, and the fake ones ft.memory plans with; never a DTensor (a shard)
        if self.saved and t.layout == torch.strided and not is_dtensor(t):
            try:
                hit = self.saved.get(_storage_key(t))
            except (RuntimeError, NotImplementedError, TypeError):  # a subclass without a storage
                return t
            if hit is not None and hit[2] == t.dtype:
                hit[0].packed = True
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
def session(mesh, prefetch: bool = False) -> Iterator[None]:
    """One gathering session for the extent of a step (its forward and its backward); with
    ``prefetch``, its collectives start one group early (the module docstring's **Prefetch**)."""
    s = _Session(mesh, prefetch)
    try:
        with _SESSION.using(s):
            yield
    finally:
        s.close()


def current_session(mesh) -> _Session:
    """The session of the step running now (a new one for a forward outside any step)."""
    s = _SESSION.get()
    return s if s is not None else _Session(mesh)


@contextlib.contextmanager
def saved_as_shards(mesh, prefetch: bool = False) -> Iterator[None]:
    """Around a micro-batch's forward: what autograd saves of a gathered parameter is packed as
    a reference to its shard. Opens a session of its own (with ``prefetch``) when the forward
    runs outside a step call."""
    with contextlib.ExitStack() as stack:
        if _SESSION.get() is None:
            stack.enter_context(session(mesh, prefetch))
        s = _SESSION.get()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(s.pack, s.unpack))
        s.start_forward()
        try:
            yield
        finally:
            s.forwarding -= 1


def _gathering(session: _Session, slots: list[tuple[dict, str]], after=None, before=None):
    """The forward maker of :func:`ftrain.internals.blocks.replace_forwards`: run the module with
    the parameters at ``slots`` gathered, in ``session`` (captured: a checkpointed block recomputed
    on an autograd worker thread gathers in the same session). ``after``/``before``: the slots of
    the blocks next to it, for the session's prefetch and handoffs."""

    def make(current: nn.Module):
        def forward(*args, **kwargs):
            with session.gathered(slots, after, before):
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
    slots = [param_slots(b.modules()) for b in blocks]
    near = [None, *slots, None]  # block i runs between slots[i - 1] and slots[i + 1]
    replacements = [
        (b, _gathering(session, s, after=near[i + 2], before=near[i]))
        for i, (b, s) in enumerate(zip(blocks, slots))
    ]
    first = near[1]  # the root's gather starts the first block's
    everything = _gathering(session, root, first)
    return replace_forwards(module, [*replacements, (module, everything)])
