"""``ft.memory``: the bytes a step will need, found by running it on fake tensors.

The planner does not re-derive each transform's memory from a formula. It runs the step itself,
every hook of every transform included (a user's own too), under ``FakeTensorMode``: tensors that
have shapes and dtypes but no data, so no byte of the model is allocated and a 7-billion-parameter
step plans in seconds on a laptop. A :class:`~ftrain.memory.tracker.LiveBytes` counter follows
every storage the step's ops allocate and free. A probe transform, applied outermost, marks the
phases: ``around_forward`` measures what each micro-batch's forward leaves alive for backward,
``gradients`` the gradients the optimizer gets and where the update starts.

``ft.shard``'s collectives need real processes: for ``ddp``, ``zero1`` and ``zero2`` a stand-in
with the same hooks allocates this rank's side of each collective
(:class:`~ftrain.memory.layout.ShardLayout`); ``fsdp`` is modeled from the unsharded step's
measured phases and the blocks' sizes (:func:`_fsdp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from ftrain import tree
from ftrain.blocks import find_blocks
from ftrain.memory.layout import ShardLayout, rows
from ftrain.memory.report import MemoryReport
from ftrain.memory.tracker import LiveBytes, fake_mode, storage_of, tensor_leaves
from ftrain.state import TrainState
from ftrain.step import Gradients, Step, Transform
from ftrain.transforms.compile import Compile
from ftrain.transforms.shard import Shard

__all__ = ["memory", "planned_step", "fake_like"]

# Leaves this small stay real tensors (counters, the random key, learning rates): the step reads
# some of them as Python numbers, and their bytes do not matter.
_SMALL = 8


class _Trace:
    """What the probe saw during one planned call (one object per call)."""

    def __init__(self, live: LiveBytes) -> None:
        self.live = live
        self.activations: list[int] = []
        self.gradients = 0
        self.before_update = 0  # peak of forward and backward
        self.blocks: list[int] = []  # bytes of each block's params (fsdp gathers one at a time)
        self.outside = 0  # bytes of the params outside the blocks (gathered for the whole step)


@dataclasses.dataclass(frozen=True, eq=False)
class _Probe(Transform):
    """Marks the phases of a planned call in its :class:`_Trace` (outermost, planning only)."""

    trace: _Trace
    blocks: bool = False  # record the blocks' sizes (the rewrite hook) for fsdp

    name = "memory_probe"
    rewrite_order = -2

    def uses(self, hook: str) -> bool:
        if hook == "rewrite":
            return self.blocks
        return super().uses(hook)

    def rewrite(self, module):
        sizes = [_module_bytes(b) for b in find_blocks(module)]
        self.trace.blocks = sizes
        self.trace.outside = _module_bytes(module) - sum(sizes)
        return module

    @contextlib.contextmanager
    def around_forward(self, params) -> Iterator[None]:
        start = self.trace.live.live
        yield
        self.trace.activations.append(self.trace.live.live - start)

    def gradients(self, g: Gradients, state: TrainState) -> Gradients:
        self.trace.gradients = _bytes(tree.leaves(g.grads))
        self.trace.before_update = self.trace.live.peak
        self.trace.live.mark("update")
        return g


def planned_step(step: Step) -> tuple[Step, Shard | None]:
    """``step`` as the planner runs it: without ``ft.compile`` (planned as eager) and without
    ``ft.shard`` (planned by its layout, returned beside it)."""
    if not isinstance(step, Step):
        raise TypeError(f"ft.memory(step, ...): expected an ft.Step, got {type(step).__name__}.")
    shard = next((t for t in step.transforms if isinstance(t, Shard)), None)
    kept = tuple(t for t in step.transforms if not isinstance(t, (Compile, Shard)))
    return dataclasses.replace(step, transforms=kept), shard


def fake_like(t: torch.Tensor, mode, device: torch.device | None = None) -> torch.Tensor:
    """A fake tensor shaped like ``t`` (a DTensor: like the whole tensor) on ``device`` (default:
    ``t``'s, the CPU for ``meta``); small leaves stay real (zeros where ``t`` has no data)."""
    if t.numel() <= _SMALL and not _is_fake_tensor(t):
        if t.is_meta:
            return torch.zeros(t.shape, dtype=t.dtype)
        return _whole(t)
    if device is None:
        device = torch.device("cpu") if t.is_meta else t.device
    with mode:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device=device)


def memory(step: Step, state: TrainState | TensorDictBase, batch: Any) -> MemoryReport:
    """Predict the bytes per rank that ``step(state, batch)`` needs, without running it.

    ``state`` and ``batch`` may be real, fake (``FakeTensorMode``) or on the ``meta`` device: a
    model too big for this machine is planned from ``with torch.device("meta"): model = ...``.
    ``state`` may also be the params alone (then the optimizer's ``init`` gives the state's
    shapes). Under ``ft.shard``, pass this rank's share of the batch and the state as laid out
    (or whole: the layout is the step's).

    **Measured** (on fake tensors, by running the step's own code: every transform's hooks, the
    gradient engine, the optimizer update): the bytes of every storage the step's ops allocate
    and when each is freed, hence the params, gradients, optimizer state, the activations each
    micro-batch saves for backward, the update's transient and the peak; and the FLOPs
    (``torch.utils.flop_counter``'s formulas), recompute included. **Modeled:** the allocator (no rounding
    to blocks, no fragmentation, no cached free blocks: add ~5-10% on CUDA), kernels' internal
    workspaces (cuBLAS, flash attention), ``ft.compile`` (planned as eager; a compiled step frees
    earlier and usually needs less), and ``ft.shard``'s collectives: ddp/zero1/zero2 by a stand-in
    that allocates this rank's side of each, fsdp from the phases and block sizes (see the module
    docstring).

    **Invariant:** within 10% of the peak of live bytes the real step allocates
    (``ftrain.testing.peak_bytes``), over micro-batches, checkpoint policies, precisions,
    optimizers and ``ddp``/``zero1``/``zero2`` (``tests/test_memory_plan.py``); ``fsdp`` is within
    10% on most compositions measured, not all (up to 22% off with one micro-batch: docs/memory.md).
    """
    plain, shard = planned_step(step)
    mode = fake_mode()
    layout = None
    if shard is not None and shard.strategy != "fsdp":
        layout = ShardLayout(shard.strategy, shard.mesh.size(), shard.mesh.get_local_rank())
        plain = layout(plain)
    state = _fake_state(state, plain, mode, layout)
    batch = _fake_batch(batch, mode)
    live = LiveBytes()
    trace = _Trace(live)
    probed = _Probe(trace, blocks=shard is not None and shard.strategy == "fsdp")(plain)
    live.hold((tree.leaves(state.params), tree.leaves(state.opt_state), tree.leaves(state.extra)))
    live.hold(batch)
    with mode, live:
        out = probed(state, batch)
    del out
    params = _bytes(tree.leaves(state.params))
    optimizer = _bytes(tree.leaves(state.opt_state))
    update = live.since("update") - live.marks["update"]
    report = MemoryReport(
        params=params,
        gradients=trace.gradients,
        optimizer=optimizer,
        activations=max(trace.activations, default=0),
        update=update,
        batch=_bytes(tensor_leaves(batch)),
        peak=live.peak,
        peak_phase="update" if live.since("update") > trace.before_update else "forward/backward",
        micro_batches=len(trace.activations),
        flops=live.flops,
        transforms=step.names,
    )
    if shard is None:
        return report
    if layout is not None:
        return dataclasses.replace(report, world_size=layout.world)
    return _fsdp(report, trace, shard.mesh.size())


def _fsdp(report: MemoryReport, trace: _Trace, world: int) -> MemoryReport:
    """The unsharded step's measured phases as one rank's bytes under fsdp. Forward and
    backward: what was alive at their peak divided by W (params, optimizer state, the gradient
    buffers: fsdp reduce-scatters each block's gradients as they come), except the activations
    and the batch, which are this rank's own (tensors backward needs from gathered params are saved
    as references to the shards); plus the params outside the blocks, gathered throughout, and
    one block's params and gradients gathered whole while it runs. The update runs on shards.
    Modeled, not run: measured within 10% on some compositions, not all (tests/test_memory_plan.py)."""

    def part(n: int) -> int:
        return math.ceil(n / world)

    whole = report.params + report.gradients + report.optimizer
    own = report.activations + report.batch
    gathered = trace.outside + 2 * max(trace.blocks, default=0)
    fwd_bwd = part(trace.before_update - own) + own + gathered
    update = part(report.update)
    after = part(whole) + report.batch + update
    return dataclasses.replace(
        report,
        params=part(report.params),
        gradients=part(report.gradients),
        optimizer=part(report.optimizer),
        update=update,
        peak=max(fwd_bwd, after),
        peak_phase="forward/backward" if fwd_bwd >= after else "update",
        world_size=world,
    )


def _module_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages holding ``tensors`` (a DTensor: its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = storage_of(t)
        if s is not None:
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


def _is_fake_tensor(t: torch.Tensor) -> bool:
    from ftrain.memory.tracker import is_fake

    return is_fake(t)


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if full is not None and type(t) is not torch.Tensor else t


def _fake_tree(td: TensorDictBase, mode) -> TensorDictBase:
    values, tdef = tree.flatten(td)
    return tdef.unflatten([fake_like(t, mode) for t in values])


def _fake_state(state: Any, step: Step, mode, layout: ShardLayout | None) -> TrainState:
    """``state`` in fake tensors, params whole. The optimizer state as given, or under a ZeRO
    ``layout`` the optimizer's ``init`` of this rank's rows (its shapes, as ft.shard_state makes
    them); from params alone, the optimizer's ``init`` (the counters it makes stay real)."""
    if isinstance(state, TensorDictBase) and not isinstance(state, TrainState):
        state = TrainState.create(_fake_tree(state, mode), step.optimizer)
    elif isinstance(state, TrainState):
        state = state.replace(
            params=_fake_tree(state.params, mode),
            opt_state=_fake_tree(state.opt_state, mode),
            extra=_fake_tree(state.extra, mode),
            step=fake_like(state.step, mode),
            rng=fake_like(state.rng, mode),
        )
    else:
        raise TypeError(
            f"ft.memory(step, state, ...): expected an ft.TrainState or the params (a "
            f"TensorDict), got {type(state).__name__}."
        )
    if layout is None or layout.strategy == "ddp":
        return state
    mine = [local_rows(t, layout) for t in tree.leaves(state.params)]
    return state.replace(opt_state=step.optimizer.init(tree.unflatten(state.params, mine)))


def local_rows(t: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's ``Shard(0)`` rows of ``t`` under ``layout`` (a view)."""
    if t.dim() == 0:
        return t
    start, length = rows(t.shape[0], layout.world, layout.rank)
    return t.narrow(0, start, length)


def _fake_batch(batch: Any, mode) -> Any:
    if isinstance(batch, torch.Tensor):
        return fake_like(batch, mode)
    if isinstance(batch, dict):
        return {k: _fake_batch(v, mode) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_fake_batch(v, mode) for v in batch)
    if isinstance(batch, TensorDictBase):
        return _fake_tree(batch, mode)
    return batch
