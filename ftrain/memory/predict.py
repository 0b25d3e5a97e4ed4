"""``ft.memory``: the bytes a step will need, found by running it on fake tensors.

The planner does not re-derive each transform's memory from a formula. It runs the step itself,
every hook of every transform included (a user's own too), under ``FakeTensorMode``: tensors that
have shapes and dtypes but no data, so no byte of the model is allocated and a 7-billion-parameter
step plans in seconds on a laptop. A :class:`~ftrain.memory.tracker.LiveBytes` counter follows
every storage the step's ops allocate and free. A probe transform, applied outermost, marks the
phases: its ``forward`` hook measures what each micro-batch's forward leaves alive for backward,
``gradients`` the gradients the optimizer gets and where the update starts.

Under ``ft.shard`` nothing is sent to the other ranks. For ``ddp``, ``zero1`` and ``zero2`` a
stand-in with the same hooks allocates this rank's side of each collective
(:class:`~ftrain.memory.one_rank.ShardLayout`). ``fsdp`` runs the sharded step itself on fake
shards (:mod:`ftrain.memory.fake_fsdp`): its per-block gathers, the regathers of backward and of a
checkpointed block's recompute, and the reduce-scatters allocate what they allocate for real,
and its collectives go to torch's meta kernels, which send nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import TensorDictBase

from ftrain import tree
from ftrain.distributed.pipeline.runner import StageInput
from ftrain.memory.fake_fsdp import backend_transient, fake_fsdp_state
from ftrain.memory.one_rank import ShardLayout, reduces_in_buckets, rows
from ftrain.memory.pipeline_plan import planned_pipeline
from ftrain.memory.report import MemoryReport
from ftrain.memory.tracker import (
    LiveBytes,
    fake_like,
    fake_mode,
    fake_tree,
    storage_of,
    tensor_leaves,
)
from ftrain.state import TrainState
from ftrain.step import Gradients, Step, Transform
from ftrain.step.capabilities import (
    COMPILES,
    DATA_PARALLEL,
    GATHERS_PARAMS,
    PIPELINES,
    SETS_PRECISION,
)

__all__ = ["memory", "planned_step", "fake_like"]


class _Trace:
    """What the probe saw during one planned call (one object per call)."""

    def __init__(self, live: LiveBytes, pipelined: bool = False) -> None:
        self.live = live
        self.activations: list[tuple[int, int]] = []  # (device, host) bytes per micro-batch
        # a pipeline: one entry per stage forward, the last stage's loss added to its entry
        self.pipelined = pipelined
        self.gradients = (0, 0)  # (device, host)
        self.before_update = 0  # peak of forward and backward


@dataclasses.dataclass(frozen=True, eq=False)
class _Probe(Transform):
    """Marks the phases of a planned call in its :class:`_Trace` (outermost, planning only)."""

    trace: _Trace

    name = "memory_probe"

    def forward(self, fn):
        trace = self.trace

        def measured(params, batch, state):
            live = trace.live
            start, host = live.live, live.host_live
            out = fn(params, batch, state)
            kept = (live.live - start, live.host_live - host)
            if trace.pipelined and not isinstance(batch, StageInput) and trace.activations:
                device, on_host = trace.activations[-1]  # the loss of the stage's micro-batch
                kept = (device + kept[0], on_host + kept[1])
                trace.activations[-1] = kept
            else:
                trace.activations.append(kept)
            return out

        return measured

    def gradients(self, g: Gradients, state: TrainState) -> Gradients:
        self.trace.gradients = _bytes(tree.leaves(g.grads), self.trace.live.host)
        self.trace.before_update = self.trace.live.peak
        self.trace.live.mark("update")
        return g


def planned_step(step: Step) -> tuple[Step, Transform | None]:
    """``step`` as the planner runs it: without ``ft.compile`` (planned as eager) and, but for
    ``fsdp`` (run as it is, on fake shards), without ``ft.shard`` (planned by its layout); the
    ``Shard`` transform is returned beside it."""
    if not isinstance(step, Step):
        raise TypeError(f"ft.memory(step, ...): expected an ft.Step, got {type(step).__name__}.")
    caps = [(t, t.capabilities()) for t in step.transforms]
    shard = next((t for t, c in caps if DATA_PARALLEL in c), None)
    fsdp = shard is not None and GATHERS_PARAMS in shard.capabilities()
    dropped = (COMPILES,) if fsdp else (COMPILES, DATA_PARALLEL)
    kept = tuple(t for t, c in caps if not any(d in c for d in dropped))
    return dataclasses.replace(step, transforms=kept), shard


def memory(
    step: Step,
    state: TrainState | TensorDictBase,
    batch: Any,
    *,
    device: str | torch.device | None = None,
) -> MemoryReport:
    """Predict the bytes per rank that ``step(state, batch)`` needs, without running it.

    **Where the bytes live.** ``device`` (default: the device of ``state``'s params; ``meta``
    counts as the CPU) is where the params, the optimizer state and the batch are planned, e.g.
    ``device="cuda"`` to plan a GPU step from a CPU or ``meta`` state. Off the CPU, bytes on the
    host (``ft.offload``'s optimizer state and update) are counted apart from the device's: the
    report's ``host_*`` fields, and ``peak`` is the device's. On this torch build without CUDA
    (2.13 CPU) fake ``"cuda"`` tensors can be made, but autograd over them aborts the process
    ("PyTorch is not linked with support for cuda devices", from the autograd engine's device
    guard), so without a GPU the ``meta`` device stands in for it: same shapes, dtypes and
    storages, the same ops; the report still says ``"cuda"``. What the stand-in cannot plan:
    ``ft.autocast`` (``torch.autocast`` has no ``meta`` device: refused, plan fp32), and
    attention runs SDPA's math path (the ``(T, T)`` scores saved, where CUDA's flash kernel
    saves none: an over-estimate of attention's activations).

    ``state`` and ``batch`` may be real, fake (``FakeTensorMode``) or on the ``meta`` device: a
    model too big for this machine is planned from ``with torch.device("meta"): model = ...``.
    ``state`` may also be the params alone (then the optimizer's ``init`` gives the state's
    shapes). Under ``ft.shard``, pass this rank's share of the batch and the state as laid out
    (or whole: the layout is the step's); the world size and this rank are those of the step's
    mesh, and nothing is sent to the other ranks (one rank may plan alone).

    **Measured** (on fake tensors, by running the step's own code: every transform's hooks, the
    gradient engine, the optimizer update): the bytes of every storage the step's ops allocate
    and when each is freed, hence the params, gradients, optimizer state, the activations each
    micro-batch saves for backward, the update's transient and the peak; and the FLOPs
    (``torch.utils.flop_counter``'s formulas), recompute included. **Modeled:** the allocator (no rounding
    to blocks, no fragmentation, no cached free blocks: add ~5-10% on CUDA), kernels' internal
    workspaces (cuBLAS, flash attention), ``ft.compile`` (planned as eager; a compiled step frees
    earlier and usually needs less), and ``ft.shard``'s collectives: ddp/zero1/zero2 by a stand-in
    that allocates this rank's side of each; under fsdp the step's own gathers and
    reduce-scatters run on fake shards, and only the backend's internal buffers are modeled
    (gloo's copy of a reduce-scatter's input: :func:`ftrain.memory.fake_fsdp.backend_transient`).

    **Under** ``ft.pipeline`` each rank plans its own part: its stages' params, gradients and
    optimizer state, and the activations its schedule keeps alive (``in_flight`` micro-batches:
    all ``m`` under GPipe, up to ``p - s`` on stage ``s`` under 1F1B). This rank's actions of
    torch's schedule run here, on fake tensors, through the step's own stage code, loss and
    hooks, with torch's receive buffers made as its stages make them and nothing sent
    (:mod:`ftrain.memory.pipeline_plan`); pass the state as ``pp.shard_state`` laid it out and
    the batch every pipeline rank gets. Every schedule of ``ft.pipeline`` is planned.

    **Invariant:** within 10% of the peak of live bytes the real step allocates
    (``ftrain.testing.peak_bytes``), over micro-batches, checkpoint policies, precisions,
    optimizers, ``ddp``/``zero1``/``zero2``/``fsdp`` on 2 gloo ranks and on each rank of a
    pipeline (pp = 2: GPipe, 1F1B, interleaved zero-bubble; ``tests/memory/test_predict.py``,
    ``test_fake_fsdp.py``, ``test_pipeline_plan.py``; a pipeline's in its first step, when
    torch's stages make the receive buffers they keep).
    """
    plain, shard = planned_step(step)
    plain, stages_here, alive = _local_pipeline(plain, batch)
    if stages_here and shard is not None and shard.strategy == "fsdp":
        raise ValueError(
            "ft.memory: a pipelined step under ft.shard(..., 'fsdp') is not planned (its stages' "
            "params gathered once per step are not modeled); plan it under 'zero2' and add 1/dp "
            "of this rank's params (fsdp's peak during a step, docs/pipeline-parallel.md)."
        )
    kind, placed = _planned_device(state, device)
    if placed is not None and placed.type == "meta":
        autocast = [t.name for t in plain.transforms if SETS_PRECISION in t.capabilities()]
        if autocast:
            raise ValueError(
                f"ft.memory(device={device!r}): {autocast[0]} cannot be planned without a GPU "
                "(the meta device stands in for CUDA and torch.autocast has none); plan the "
                "step in fp32 (ft.fit: precisions=('fp32',)) or on a machine with a GPU."
            )
    mode = fake_mode()
    layout, transient = None, None
    if shard is not None and shard.strategy == "fsdp":  # the sharded step itself, on fake shards
        if device is not None:
            raise ValueError(
                "ft.memory(device=...): an fsdp step is planned on its state's own device; "
                "leave device out (or plan the step without ft.shard on that device)."
            )
        state = fake_fsdp_state(state, plain, shard.mesh, mode)
        transient = backend_transient(shard.mesh)
    else:
        if shard is not None:
            params = tree.leaves(state.params if isinstance(state, TrainState) else state)
            bucketed = reduces_in_buckets(step.transforms, shard, params)
            mesh = shard.mesh
            layout = ShardLayout(shard.strategy, mesh.size(), mesh.get_local_rank(), bucketed)
            plain = layout(plain)
        state = _fake_state(state, plain, mode, layout, placed)
        with mode:  # the state as the step holds it (ft.offload's optimizer state on the host)
            state = plain.init_extra(state)
    batch = _fake_batch(batch, mode, placed)
    host = None if kind == "cpu" else HOST
    live = LiveBytes(transient=transient, host=host)
    trace = _Trace(live, pipelined=stages_here > 0)
    probed = _Probe(trace)(plain)
    live.hold((tree.leaves(state.params), tree.leaves(state.opt_state), tree.leaves(state.extra)))
    live.hold(batch)
    with mode, live:
        out = probed(state, batch)
    del out
    params = _bytes(tree.leaves(state.params), host)
    optimizer = _bytes(tree.leaves(state.opt_state), host)
    activations = max(trace.activations, default=(0, 0))
    return MemoryReport(
        params=params[0],
        gradients=trace.gradients[0],
        optimizer=optimizer[0],
        activations=activations[0],
        update=live.since("update") - live.marks["update"],
        batch=_bytes(tensor_leaves(batch), host)[0],
        peak=live.peak,
        peak_phase="update" if live.since("update") > trace.before_update else "forward/backward",
        micro_batches=len(trace.activations) // max(stages_here, 1),
        in_flight=alive,
        flops=live.flops,
        transforms=step.names,
        world_size=shard.mesh.size() if shard is not None else 1,
        device=kind,
        host_params=params[1],
        host_gradients=trace.gradients[1],
        host_optimizer=optimizer[1],
        host_activations=activations[1],
        host_update=live.host_since("update") - live.host_marks["update"],
        host_peak=live.host_peak,
    )


HOST = torch.device("cpu")


def _local_pipeline(step: Step, batch: Any) -> tuple[Step, int, int]:
    """``step`` with its pipeline, if any, running this rank's actions here
    (:func:`~ftrain.memory.pipeline_plan.planned_pipeline`); the number of stages this rank runs
    (0 without a pipeline) and the most micro-batches alive at once (1 without)."""
    at = [i for i, t in enumerate(step.transforms) if PIPELINES in t.capabilities()]
    if not at:
        return step, 0, 1
    pipe = step.transforms[at[0]]
    local, alive = planned_pipeline(pipe, batch)
    transforms = (*step.transforms[: at[0]], local, *step.transforms[at[0] + 1 :])
    return dataclasses.replace(step, transforms=transforms), len(pipe.runner.stages), alive


def _planned_device(state: Any, device: Any) -> tuple[str, torch.device | None]:
    """(the device type the report names, the device fake tensors are made on: None keeps each
    tensor's own, ``meta`` stands for CUDA on a machine without it)."""
    if device is None:
        params = getattr(state, "params", state)
        first = tree.first_leaf(params) if isinstance(params, TensorDictBase) else None
        kind = "cpu" if first is None or first.is_meta else first.device.type
        return kind, None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"ft.memory(device={device!r}): not a device ({e}); use 'cuda', 'cpu' or a "
            "torch.device."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        return "cuda", torch.device("meta")  # autograd over fake CUDA aborts on a CPU build
    return device.type, device


def _bytes(tensors: list[torch.Tensor], host: torch.device | None = None) -> tuple[int, int]:
    """Bytes of the distinct storages holding ``tensors`` (a DTensor: its local shard), as
    (on the device, on ``host``); all on the device when ``host`` is None."""
    seen: dict[int, tuple[int, bool]] = {}
    for t in tensors:
        s = storage_of(t)
        if s is not None:
            seen[id(s)] = (s.nbytes(), host is not None and t.device.type == host.type)
    on_host = sum(n for n, h in seen.values() if h)
    return sum(n for n, _ in seen.values()) - on_host, on_host


def _fake_state(
    state: Any, step: Step, mode, layout: ShardLayout | None, device: torch.device | None
) -> TrainState:
    """``state`` in fake tensors, params whole. The optimizer state as given, or under a ZeRO
    ``layout`` the optimizer's ``init`` of this rank's rows (its shapes, as ft.shard_state makes
    them); from params alone, the optimizer's ``init`` (the counters it makes stay real)."""
    if isinstance(state, TensorDictBase) and not isinstance(state, TrainState):
        state = TrainState.create(fake_tree(state, mode, device), step.optimizer)
    elif isinstance(state, TrainState):
        state = state.replace(
            params=fake_tree(state.params, mode, device),
            opt_state=fake_tree(state.opt_state, mode, device),
            extra=fake_tree(state.extra, mode, device),
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


def _fake_batch(batch: Any, mode, device=None, seen: dict[int, torch.Tensor] | None = None) -> Any:
    """``batch`` in fake tensors (on ``device``, default each tensor's own); a tensor that
    appears twice (``{"input": x, "target": x}``) is one fake, counted once as the real batch is."""
    seen = {} if seen is None else seen
    if isinstance(batch, torch.Tensor):
        if id(batch) not in seen:
            seen[id(batch)] = fake_like(batch, mode, device)
        return seen[id(batch)]
    if isinstance(batch, dict):
        return {k: _fake_batch(v, mode, device, seen) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_fake_batch(v, mode, device, seen) for v in batch)
    if isinstance(batch, TensorDictBase):
        return fake_tree(batch, mode, device)
    return batch
