"""ddp, zero1 and zero2 reduce the gradients during backward: in buckets, each sent as it fills.

**Rule:** :class:`BucketReducer` (a ``ftrain.step.GradientReducer``) sends what ``ft.shard``'s
reduce phase would send after backward, the same values summed over the same ranks, cut into
buckets: the final local gradients that ``ftrain.step.AutogradEngine`` hands over during the last
micro-batch's backward are copied into a bucket's flat buffer, and each full bucket's collective
is started with ``async_op=True`` while backward goes on. ddp and zero1 all-reduce a bucket (the
whole sums); zero2 reduce-scatters it, each rank keeping its ``Shard(0)`` rows of every gradient
(a 0-d one all-reduced, ``Replicate()``), laid out as ``dp_split.reduce_scatter`` lays them out.
A sum of two ranks' values is elementwise, so on 2 ranks the result is bitwise the reduction
after backward, however the buckets fall.

**Buckets**, as torch's DDP makes them: the params in reverse order (backward produces the last
blocks' gradients first), one dtype per bucket, a bucket closed when the next gradient would take
it past ``bucket_bytes`` (a gradient bigger than that is a bucket of its own). Every rank makes the
same buckets from the same params and starts their collectives in that one order (a bucket full
before the ones ahead of it waits for them), so the ranks' collectives pair up even where
backward hands the gradients over in another order (a param the loss does not use is handed over
after backward). Nothing waits for the network during backward, unless a sink comes after the
reducer (``ft.offload``'s host copies): then each bucket is waited one bucket later (when the next
one starts) and its reduced gradients passed on to the sink, during backward. The rest are waited
when backward has returned, before the step goes on.

**What holds the overlap back:** the buckets start in one fixed order, so a param that some rank's
loss does not use (a head it skips, an expert no token of its batch was routed to) fills its
bucket only after backward, and every bucket after it waits with it: the same sums, but no
overlap from there on. (torch's DDP rebuilds its buckets in the order the first step produced the
gradients; these keep the params' reverse order.) And a step that raises during backward leaves
the ranks with different buckets started: catch it and the process group is out of step, so end
the run (as with torch's DDP), or use ``bucket_mb=None``, whose one reduction runs after backward.

Cost: each gradient is copied into its bucket as autograd hands it over (one copy; under zero2
one strided copy places every rank's row block in its segment, or one copy per rank where the
blocks are uneven), and autograd's own is freed then, so the buckets take the gradients' place
(no second gradient-sized copy, as the flat reduction after backward makes). ddp and zero1
return views of the buckets (fresh each step: the step divides them in place); zero2 returns this
rank's rows and drops the buckets once done.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ftrain.distributed.collectives import as_sharded, layout
from ftrain.distributed.dtensor import dtensor, from_local

__all__ = ["BUCKET_MB", "BucketReducer", "Reduced", "bucket_bytes", "buckets", "overlaps"]

BUCKET_MB = 25.0  # ft.shard's default bucket size, in MiB: torch DDP's bucket_cap_mb


class Reduced(list):
    """The gradients a :class:`BucketReducer` returned, already reduced over ``mesh``: the marker
    ``ft.shard``'s reduce phase reads (it then reduces only the loss total and count)."""

    def __init__(self, grads: Sequence[torch.Tensor], mesh) -> None:
        super().__init__(grads)
        self.mesh = mesh


def bucket_bytes(bucket_mb: float) -> int:
    """``ft.shard``'s ``bucket_mb`` in bytes (at least one)."""
    return max(1, int(bucket_mb * 2**20))


def buckets(params: Sequence[torch.Tensor], bucket_bytes: int, scatter: bool) -> list[list[int]]:
    """The params' positions in buckets, in the order their collectives start: reverse order, one
    dtype (and under ``scatter`` one kind: 0-d tensors are all-reduced apart) per bucket, each at
    most ``bucket_bytes`` unless one gradient alone is bigger."""
    done: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, scatter and p.dim() > 0)
        size = p.numel() * p.element_size()
        ids, used = open_.get(key, ([], 0))
        if ids and used + size > bucket_bytes:
            done.append(ids)
            ids, used = [], 0
        open_[key] = ([*ids, i], used + size)
    done.extend(ids for ids, _ in open_.values())
    return done


def overlaps(params: Sequence[torch.Tensor], bucket_bytes: int, scatter: bool) -> bool:
    """Whether ``params``' gradients fill more than one bucket: with one, its collective could
    start only once backward is done, so the step reduces after backward instead (one flat
    collective with the loss sums, no hook per gradient: the same bits, less overhead)."""
    return len(buckets(params, bucket_bytes, scatter)) > 1


class BucketReducer:
    """``ft.shard``'s gradient reducer for ``strategy`` (``"ddp"``, ``"zero1"`` or ``"zero2"``) over
    the 1-D ``mesh`` (see the module docstring). One per step object (its engine's): it remembers
    the buckets of the params it last saw.

    **Invariant:** the gradients it returns are those the reduce phase gives after backward
    (``collectives.all_reduce_flat``, or ``dp_split.reduce_scatter`` for zero2), the same sums of
    the same values, in fresh buffers; each collective is started during backward, as soon as its
    bucket is full and the buckets ahead of it are started.
    """

    def __init__(self, strategy: str, mesh, bucket_bytes: int) -> None:
        self.strategy, self.mesh, self.bucket_bytes = strategy, mesh, bucket_bytes
        self.plan: tuple[tuple, list[list[int]]] | None = None  # (the params' shapes, buckets)

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        """Plain tensors (a tensor-parallel DTensor's gradient is reduced after backward) whose
        gradients fill more than one bucket (:func:`overlaps`)."""
        return all(type(p) is torch.Tensor for p in params) and len(self._plan(params)) > 1

    def laid_out(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` laid out as their reduced gradients will be (views, no traffic)."""
        if self.strategy != "zero2":
            return list(params)
        return [as_sharded(p.detach(), self.mesh, copy=False) for p in params]

    def start(self, params: Sequence[torch.Tensor], then=None) -> _Backward:
        """A ``GradientSink`` for one backward over ``params``, passing each reduced gradient on
        to ``then`` (a ``GradientSink``) once its bucket is waited."""
        return _Backward(self, params, self._plan(params), then)

    def _plan(self, params: Sequence[torch.Tensor]) -> list[list[int]]:
        key = tuple((p.shape, p.dtype) for p in params)
        if self.plan is None or self.plan[0] != key:
            self.plan = (key, buckets(params, self.bucket_bytes, self.strategy == "zero2"))
        return self.plan[1]

    def __repr__(self) -> str:
        return f"BucketReducer({self.strategy!r}, {self.bucket_bytes / 2**20:g} MiB)"


class _Bucket:
    """One bucket of one backward: its flat send buffer, its collective, its reduced gradients."""

    def __init__(self, ids: list[int], params: Sequence[torch.Tensor], scatter: bool, mesh):
        self.ids, self.missing = ids, len(ids)
        first = params[ids[0]]
        self.shapes = tuple(params[i].shape for i in ids)
        self.scatter = scatter and first.dim() > 0
        world = mesh.size()
        if self.scatter:  # each rank's rows of every gradient, one segment per rank, padded
            self.lay = layout(self.shapes, world)
            numel = world * self.lay.segment
        else:
            numel = sum(math.prod(s) for s in self.shapes)
        self.send = torch.empty(numel, dtype=first.dtype, device=first.device)
        self.work = None
        self.out: list[torch.Tensor] | None = None

    def put(self, j: int, grad: torch.Tensor, offsets: list) -> None:
        """Copy the ``j``-th gradient of the bucket into the send buffer (on the current stream):
        one copy, or one per rank where its row blocks are not alike (see :func:`_offsets`)."""
        spec = offsets[j]
        if isinstance(spec, _EveryRank):  # rank r's rows at the same place of each segment
            w, rest = self.lay.world, grad.shape[1:]
            width = spec.rows * math.prod(rest)
            dst = self.send.view(w, -1).narrow(1, spec.at, width).view(w, spec.rows, *rest)
            dst.copy_(grad.reshape(w, spec.rows, *rest))
        else:
            for start, rows, at in spec:
                piece = grad if rows is None else grad.narrow(0, start, rows)
                self.send[at : at + piece.numel()].view(piece.shape).copy_(piece)
        self.missing -= 1


class _Backward:
    """The ``GradientSink`` :meth:`BucketReducer.start` gives for one backward."""

    def __init__(self, reducer: BucketReducer, params, plan: list[list[int]], then) -> None:
        self.reducer, self.params, self.plan, self.then = reducer, params, plan, then
        self.scatter = reducer.strategy == "zero2"
        self.where = {i: (b, j) for b, ids in enumerate(plan) for j, i in enumerate(ids)}
        self.buckets: list[_Bucket | None] = [None] * len(plan)
        self.offsets: list[list | None] = [None] * len(plan)
        self.started = 0  # buckets whose collective is started, in plan order
        self.passed = 0  # buckets waited and passed on to ``then``
        self.out: list[torch.Tensor | None] = [None] * len(params)

    def holds(self, params) -> bool:
        return True

    def take(self, i: int, grad: torch.Tensor) -> None:
        b, j = self.where[i]
        if self.buckets[b] is None:
            bucket = self.buckets[b] = _Bucket(self.plan[b], self.params, self.scatter, self.mesh)
            self.offsets[b] = _offsets(bucket)
        self.buckets[b].put(j, grad, self.offsets[b])
        while self.started < len(self.plan) and self._full(self.started):
            self._start(self.started)
            self.started += 1
            if self.then is not None and self.started >= 2:  # one bucket later
                self._pass(self.started - 2)

    @property
    def mesh(self):
        return self.reducer.mesh

    def _full(self, b: int) -> bool:
        return self.buckets[b] is not None and self.buckets[b].missing == 0

    def _start(self, b: int) -> None:
        bucket, group = self.buckets[b], self.mesh.get_group()
        if not bucket.scatter:  # all-reduce: the sums in place, every param's whole
            bucket.work = dist.all_reduce(bucket.send, group=group, async_op=True)
            parts = bucket.send.split([math.prod(s) for s in bucket.shapes])
            bucket.out = [p.view(s) for p, s in zip(parts, bucket.shapes)]
            return
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        out = bucket.send.new_empty(bucket.lay.segment)  # (segment,): this rank's sums
        bucket.work = reduce_scatter(out, bucket.send, group=group, async_op=True)
        bucket.out = bucket.lay.scattered(out, self.mesh.get_local_rank())

    def _pass(self, b: int) -> None:
        """Wait bucket ``b`` and lay out its reduced gradients (and pass them on to ``then``)."""
        bucket = self.buckets[b]
        bucket.work.wait()
        bucket.work = None  # the backend's hold on the buffers ends
        bucket.send = None if bucket.scatter else bucket.send  # the scatter's input is done
        d = dtensor()
        for i, g, shape in zip(bucket.ids, bucket.out, bucket.shapes):
            if self.scatter:  # zero2: this rank's rows (a 0-d gradient whole), as dp_split's
                placement = (d.Shard(0),) if bucket.scatter else (d.Replicate(),)
                g = from_local(g, self.mesh, placement, shape, _contiguous_stride(shape))
            if self.then is None:
                self.out[i] = g
            else:  # handed on: the sink's copy is the step's (its stream keeps the memory)
                self.then.take(i, g)
        if self.then is not None:
            self.buckets[b] = None  # the device's reduced gradients freed, bucket by bucket
        self.passed = b + 1

    def result(self, n: int) -> list[torch.Tensor]:
        while self.started < len(self.plan):  # every bucket is full once backward has returned
            self._start(self.started)
            self.started += 1
        for b in range(self.passed, len(self.plan)):
            self._pass(b)
        grads = self.out if self.then is None else self.then.result(n)
        return Reduced(grads, self.mesh)


class _EveryRank(NamedTuple):
    """A gradient whose row blocks are alike (``rows`` each, rank ``r``'s the ``r``-th) and sit at
    the same offset ``at`` of every rank's segment: copied into the send buffer at once."""

    rows: int
    at: int


def _offsets(bucket: _Bucket) -> list:
    """Per gradient of ``bucket``: ``(first row, rows, offset in the send buffer)`` for each
    piece it sends (all-reduce: the whole gradient, ``rows`` None; reduce-scatter: one piece per
    rank, at that rank's segment, as ``Layout.scatter_send`` places it), or an
    :class:`_EveryRank` where those pieces form one strided copy."""
    out: list = []
    if not bucket.scatter:
        at = 0
        for shape in bucket.shapes:
            out.append([(0, None, at)])
            at += math.prod(shape)
        return out
    lay = bucket.lay
    starts = [r * lay.segment for r in range(lay.world)]
    for i in range(len(bucket.shapes)):
        pieces = []
        for r in range(lay.world):
            first, rows = lay.rows[r][i]
            pieces.append((first, rows, starts[r]))
            starts[r] += lay.sizes[r][i]
        rows, at = pieces[0][1], pieces[0][2]
        alike = all(p == (r * rows, rows, r * lay.segment + at) for r, p in enumerate(pieces))
        out.append(_EveryRank(rows, at) if alike and rows > 0 else pieces)
    for r in range(lay.world):  # the pads: zeros, as scatter_send sends them
        bucket.send[starts[r] : (r + 1) * lay.segment].zero_()
    return out


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
