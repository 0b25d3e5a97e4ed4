"""fsdp's collectives issued ahead: an all-gather or reduce-scatter started now, waited later.

**Rule:** :func:`gather_ahead` and :func:`reduce_scatter_ahead` send exactly what
``dp_split.gather_pieces`` and ``dp_split.reduce_scatter`` send (the same flat buffers, built the
same way, one collective per dtype), only with ``async_op=True``: the results are the same bits,
and the caller's compute runs while the backend moves them; rows along dimension 0, or under
tensor parallelism along the dimension ``dp`` splits in each tensor-parallel piece. Groups these
cannot start early (plain and tensor-parallel tensors mixed, 0-d tensors) run the blocking
functions at once, so every group works.

**When** (fsdp's session with ``prefetch``). In forward, a block's gather starts the next
block's (the root's starts the first block's); in backward, a group's regather starts the one
backward needs next (the latest-gathered group still waiting for its backward), and a block
recomputed under ``ft.checkpoint`` starts the previous block's gather; a block's reduce-scatter
runs during the next block's backward and is waited when that block's is started, so its
:class:`Handoff` passes on complete sums right after (and it is waited before
``torch.autograd.grad`` returns; the root's, the params outside the blocks, blocks: it ends the
backward). The same collectives on the same buffers: the same bits as without prefetch. The
cost: the whole params of two blocks at a time instead of one.
A shard gathered twice in one forward (a block run twice) has its gradient reduced at once
(autograd adds its two gradients as soon as the second exists). Inside the blocks of
``ft.checkpoint(step, "selective")`` the gathers and reduce-scatters block (torch's selective checkpointing demands
the same ops in a block's forward and its recompute); the root's early gather of the first block
is then dropped unused.

A collective in flight owns its buffers: nothing may read a result before :meth:`Pending.wait`
returns. Under ``FakeTensorMode`` (``ft.memory``'s plan) torch's meta kernels answer at once with
a ``FakeWork``, so the plan counts the same buffers, alive as long as here.

The private torch APIs fsdp's prefetch needs live here: :func:`at_backward_end` (the autograd
engine's final callback, as FSDP uses it: a reduce-scatter issued in backward is waited before
``torch.autograd.grad`` returns its gradients) and :func:`recording_for_recompute` (selective
activation checkpointing's dispatch modes, which demand that a recompute run the ops its forward
ran, in the same numbers: a gather started in one block and finished in the next would not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ftrain.distributed.collectives import by_dtype, layout
from ftrain.distributed.data_parallel import dp_split
from ftrain.distributed.dtensor import dtensor, from_local, is_dtensor, local

__all__ = [
    "Pending",
    "Box",
    "Handoff",
    "gather_ahead",
    "reduce_scatter_ahead",
    "at_backward_end",
    "recording_for_recompute",
]


class Pending:
    """Collectives in flight; :meth:`wait` finishes them (once) and returns their result."""

    def __init__(self, works: list, finish: Callable[[], list], keep=(), buffers=()):
        self.works, self.finish = works, finish
        self.keep = keep  # the send buffers, alive until the collectives are done
        self.buffers = buffers  # the receive buffers (an all-gather's), alive until waited
        self.result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        """The results; blocks until the backend is done with every buffer."""
        if self.result is None:
            for work in self.works:
                work.wait()
            self.result = self.finish()
            self.works, self.finish, self.keep, self.buffers = [], None, (), ()
        return self.result

    def discard(self) -> None:
        """Let the collectives finish and drop their results (a prefetch nobody will use)."""
        for work in self.works:
            work.wait()
        self.works, self.finish, self.keep, self.buffers = [], None, (), ()


class Box:
    """The reduce-scatter of one block's gradients, from its ``fsdp's gather`` to its ``_Handoff``."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: Pending | None = None


class Handoff(torch.autograd.Function):
    """Identity on a block's shards, applied when the block before it (or the root, for the
    first block) starts its gather, before that gather's node. Its backward waits for the
    block's reduce-scatter, so no node reads the gradient shards before the sums are in them
    (autograd adds them into a leaf's other gradients, or a transform differentiates through
    the shards: ``ft.lora``'s merged weights). Autograd runs the nodes made later first, so this
    one runs right after the previous block's gather's backward, which has waited for this
    block's reduce-scatter (issued before the previous block's backward: the overlap), and
    before the previous block's other nodes: each block's reduced gradient shards reach their
    leaves (a gradient sink, ``ftrain.step.GradientSink``) one block after their
    reduce-scatter, while backward goes on."""

    @staticmethod
    def forward(ctx, box: Box, *shards):
        ctx.box = box
        return tuple(t.view_as(t) for t in shards)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.box.pending is not None:
            ctx.box.pending.wait()
            ctx.box.pending = None
        return (None, *grads)


def _rows_on(ts: Sequence[torch.Tensor], mesh) -> bool:
    """Whether every tensor is a ``Shard(0)`` DTensor of one or more dimensions on ``mesh``."""
    row = dtensor().Shard(0)
    return all(
        is_dtensor(t) and t.dim() > 0 and t.device_mesh == mesh and tuple(t.placements) == (row,)
        for t in ts
    )


def _collective(name: str, fallback):
    return getattr(dist, name, None) or fallback


def _tp_split_on(ts: Sequence[torch.Tensor], mesh) -> bool:
    """Whether every tensor is a tensor-parallel DTensor split over ``mesh`` (its ``dp``
    dimension): fsdp's params under ``ft.tensor_parallel``."""
    return bool(ts) and all(dp_split.is_tp_laid(t) and dp_split.is_split(t, mesh) for t in ts)


def gather_ahead(shards: Sequence[torch.Tensor], mesh) -> Pending:
    """Start ``dp_split.gather_pieces(shards, mesh)``; ``wait()`` gives its whole tensors (a
    tensor-parallel DTensor's: its ``tp`` piece, whole over ``dp``)."""
    tp = _tp_split_on(shards, mesh)
    if not (tp or _rows_on(shards, mesh)):  # not startable early: gathered now
        whole = dp_split.gather_pieces(shards, mesh)
        return Pending([], lambda: whole)
    rank, group = mesh.get_local_rank(), mesh.get_group()
    all_gather = _collective("all_gather_single", dist.all_gather_into_tensor)
    works, cuts, sends = [], [], []
    for idx in by_dtype(shards).values():
        # rows along dimension 0, or along the dimension dp splits (moved first), as dp_split
        dims = [dp_split.dp_dim(shards[i]) if tp else 0 for i in idx]
        pieces = [local(shards[i]).movedim(k, 0) for i, k in zip(idx, dims)]
        shapes = tuple(
            torch.Size(dp_split.moved_shape(dp_split.piece_shape(shards[i]), k))
            if tp
            else shards[i].shape
            for i, k in zip(idx, dims)
        )
        lay = layout(shapes, mesh.size())
        send = lay.gather_send(pieces, rank)  # (segment,)
        out = send.new_empty(lay.world * lay.segment)  # (W * segment,)
        works.append(all_gather(out, send, group=group, async_op=True))
        cuts.append((idx, dims, lay, out))
        sends.append(send)

    def finish() -> list[torch.Tensor]:
        whole: list = [None] * len(shards)
        for idx, dims, lay, out in cuts:
            for i, k, w in zip(idx, dims, lay.gathered(out)):
                whole[i] = w.movedim(0, k).contiguous() if tp else w
        return whole

    return Pending(works, finish, sends, [out for *_, out in cuts])


def reduce_scatter_ahead(
    grads: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], mesh
) -> tuple[list[torch.Tensor], Pending]:
    """Start ``dp_split.reduce_scatter(grads, refs, mesh)``: its shards now, as DTensors over
    buffers that hold the sums only once the returned :class:`Pending` is waited."""
    tp = _tp_split_on(refs, mesh)
    if not (tp or _rows_on(refs, mesh)):  # not startable early: reduced now
        out = dp_split.reduce_scatter(grads, refs, mesh)
        return out, Pending([], lambda: out)
    rank, group = mesh.get_local_rank(), mesh.get_group()
    reduce_scatter = _collective("reduce_scatter_single", dist.reduce_scatter_tensor)
    row = (dtensor().Shard(0),)
    shards: list = [None] * len(grads)
    works, sends = [], []
    for idx in by_dtype(grads).values():
        dims = [dp_split.dp_dim(refs[i]) if tp else 0 for i in idx]
        chosen = [grads[i].movedim(k, 0).contiguous() for i, k in zip(idx, dims)]
        lay = layout(tuple(t.shape for t in chosen), mesh.size())
        send = lay.scatter_send(chosen)  # (W * segment,)
        out = send.new_empty(lay.segment)  # (segment,): filled when the work is done
        works.append(reduce_scatter(out, send, group=group, async_op=True))
        sends.append(send)
        for i, k, t, p in zip(idx, dims, chosen, lay.scattered(out, rank)):
            if not tp:
                shards[i] = from_local(p, mesh, row, t.shape, t.stride())
                continue
            r = refs[i]  # a view of the buffer, laid out as dp_split.reduce_scatter lays it
            shards[i] = from_local(
                p.movedim(0, k), r.device_mesh, dp_split.split_placements(r), r.shape, r.stride()
            )
    return shards, Pending(works, lambda: shards, sends)


def at_backward_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward running now ends, before ``torch.autograd.grad`` (or
    ``backward``) returns. Call it only from inside a backward function."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def recording_for_recompute() -> bool:
    """Whether the code running now is inside a region of ``torch.utils.checkpoint`` with a
    selective policy (its forward, or its recompute): there every op is recorded and must recur
    when the region is recomputed, so nothing may be started here for another region."""
    from torch.utils import _python_dispatch
    from torch.utils import checkpoint as torch_checkpoint

    kinds = tuple(
        getattr(torch_checkpoint, name)
        for name in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
        if hasattr(torch_checkpoint, name)
    )
    stack = getattr(_python_dispatch, "_get_current_dispatch_mode_stack", lambda: [])()
    return any(isinstance(mode, kinds) for mode in stack)
