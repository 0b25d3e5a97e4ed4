"""A kit for testing steps and transforms: compare two steps, catch graph breaks and recompiles,
count memory.

Use it to test a transform of your own the way ftrain tests its built-ins::

    import ftrain as ft
    from ftrain.testing import assert_steps_close, saved_activation_bytes

    step = ft.train_step(loss_fn, ft.optim.adamw(1e-3))
    assert_steps_close(ft.accumulate(step, 4), step, state, batch, rtol=1e-5)
    assert saved_activation_bytes(ft.checkpoint(step), state, batch) < saved_activation_bytes(
        step, state, batch
    )

Every helper leaves the global random state, the state passed in, and dynamo's settings as they
were.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from ftrain import rng, tree
from ftrain.distributed import DistributedError, run_distributed
from ftrain.internals import dynamo
from ftrain.memory.tracker import LiveBytes
from ftrain.state import TrainState
from ftrain.step import Step
from ftrain.transforms.compile import Compile
from ftrain.transforms.compile import compile as ft_compile

__all__ = [
    "assert_steps_close",
    "assert_no_recompile",
    "assert_one_graph",
    "saved_activation_bytes",
    "saved_bytes",
    "track_allocations",
    "AllocationPeak",
    "peak_bytes",
    "allocator_peak",
    "max_rel_error",
    "run_distributed",
    "DistributedError",
]


# -- comparing steps --------------------------------------------------------------------------


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|`` in float64: the error relative to the tensor's
    scale (0.0 when both are zero, ``inf`` when only ``expected`` is zero or a value is not finite
    where the other is)."""
    err, scale = _error_and_scale(actual, expected)
    if err == 0.0:
        return 0.0
    return err / scale if scale > 0 else math.inf


def _error_and_scale(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """``(max|actual - expected|, max|expected|)`` in float64; equal non-finite values count as
    no error, a non-finite value where the other differs as ``inf``; non-finite values of
    ``expected`` do not count toward its scale."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.numel() == 0:
        return 0.0, 0.0
    same_nonfinite = (~torch.isfinite(a) | ~torch.isfinite(e)) & (a == e)
    diff = torch.where(same_nonfinite, torch.zeros_like(a), (a - e).abs())
    err = diff.nan_to_num(nan=math.inf, posinf=math.inf).max().item()
    scale = torch.where(torch.isfinite(e), e.abs(), torch.zeros_like(e)).max().item()
    return err, scale


def _leaves_by_key(td: TensorDictBase, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in tree.to_flat(td).items()}


def _compared(state: TrainState, metrics: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = _leaves_by_key(state.params, "params")
    out.update(_leaves_by_key(state.opt_state, "opt_state"))
    out["metrics.loss"] = metrics["loss"]
    return out


def assert_steps_close(
    step_a: Callable,
    step_b: Callable,
    state: TrainState,
    batch: Any,
    steps: int = 3,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-8,
) -> tuple[TrainState, TrainState]:
    """Run ``step_a`` and ``step_b`` ``steps`` times each from ``state`` on ``batch`` and assert
    that they agree after every step.

    Compared after each step: every tensor of ``params`` and ``opt_state`` (same keys, shapes and
    dtypes required) and ``metrics["loss"]``. A tensor agrees when
    ``max|a - b| <= atol + rtol * max|b|``, i.e. the error is measured relative to the scale of the
    tensor (see :func:`max_rel_error`), not element by element. ``state.extra`` is not compared
    (transforms legitimately add different entries there).

    On failure the message names the step, the worst key and its relative error, and how many
    keys failed. ``state`` is not modified: each step sequence starts from its own clone, so steps
    built with ``donate=True`` are fine.

    Returns the two final states ``(state_a, state_b)``.
    """
    if not isinstance(state, TrainState):
        raise TypeError(
            f"assert_steps_close(..., state, ...): expected an ft.TrainState, got "
            f"{type(state).__name__}."
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"assert_steps_close(steps={steps!r}): must be an integer >= 1.")
    sa, sb = state.clone(), state.clone()
    for i in range(steps):
        sa, ma = step_a(sa, batch)
        sb, mb = step_b(sb, batch)
        ta, tb = _compared(sa, ma), _compared(sb, mb)
        if ta.keys() != tb.keys():
            raise AssertionError(
                f"assert_steps_close: after step {i + 1} the states hold different keys: only in "
                f"step_a {sorted(ta.keys() - tb.keys())}, only in step_b "
                f"{sorted(tb.keys() - ta.keys())}."
            )
        failures = []
        for key, a in ta.items():
            b = tb[key]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise AssertionError(
                    f"assert_steps_close: after step {i + 1}, {key} is {a.dtype}{list(a.shape)} "
                    f"in step_a but {b.dtype}{list(b.shape)} in step_b."
                )
            err, scale = _error_and_scale(a, b)  # an all-zero b: err is judged against atol
            allowed = atol + rtol * scale
            if not err <= allowed:
                rel = err / scale if scale > 0 else math.inf
                failures.append((err / allowed if allowed > 0 else math.inf, rel, err, key))
        if failures:
            _, rel, err, key = max(failures)
            raise AssertionError(
                f"assert_steps_close: the steps differ after step {i + 1} of {steps}: worst key "
                f"{key!r} has relative error {rel:.3g} (max|a-b| / max|b|; max|a-b| = {err:.3g}; "
                f"allowed: atol + rtol * max|b| with rtol={rtol:g}, atol={atol:g}); "
                f"{len(failures)} of {len(ta)} tensors out of tolerance."
            )
    return sa, sb


# -- recompiles -------------------------------------------------------------------------------


def assert_no_recompile(
    step: Step, state: TrainState, batches: Iterable[Any]
) -> tuple[TrainState, list[dict[str, torch.Tensor]]]:
    """Run a compiled ``step`` over ``batches`` (threading the state) and assert that nothing was
    compiled after the first call.

    The first call is the warm-up: it may compile (or find the step already compiled). Every later
    call runs with ``torch._dynamo.config.error_on_recompile`` set (so a guard failure raises with
    dynamo's reason, re-raised here as an AssertionError), and dynamo's frame counter must not
    grow (which also catches a frame compiled for the first time after a graph break). Both
    settings are scoped to this call.

    Returns the final state and the metrics of every call.
    """
    if not isinstance(step, Step) or not _compiled(step):
        raise TypeError(
            "assert_no_recompile(step, ...): step must be compiled; pass ft.compile(step)."
        )
    batches = list(batches)
    if len(batches) < 2:
        raise ValueError(
            "assert_no_recompile(..., batches): give at least 2 batches (the first call compiles; "
            "the rest must not)."
        )
    history = []
    state, metrics = step(state, batches[0])
    history.append(metrics)
    frames = dynamo.frames_compiled()
    for i, batch in enumerate(batches[1:], start=2):
        try:
            with dynamo.error_on_recompile():
                state, metrics = step(state, batch)
        except dynamo.recompile_error() as e:
            raise AssertionError(f"assert_no_recompile: call {i} recompiled the step: {e}") from e
        history.append(metrics)
        if dynamo.frames_compiled() != frames:
            raise AssertionError(
                f"assert_no_recompile: call {i} compiled {dynamo.frames_compiled() - frames} "
                "new frame(s) after the warm-up call. Run with TORCH_LOGS=recompiles,graph_breaks "
                "to see which."
            )
    return state, history


def assert_one_graph(step: Step, state: TrainState, batch: Any) -> torch.fx.GraphModule:
    """Trace ``ft.compile(step)`` once and assert that dynamo captured the whole step, forward,
    backward and optimizer update, as one graph with no graph break.

    ``step`` is the step *before* ``ft.compile``: this helper compiles it itself with a backend
    that records the graphs dynamo hands over and runs them as they are (tracing only, no code
    generation: seconds, not minutes). A break fails with dynamo's reasons for it. ``state`` is
    not modified. Returns the graph, e.g. to look at the ops it holds (``graph.print_readable()``).
    On a torch whose dynamo cannot trace the step's ``requires_grad_`` (2.11) it raises a
    RuntimeError that says so, before compiling anything.
    """
    if not isinstance(step, Step) or _compiled(step):
        raise TypeError(
            "assert_one_graph(step, ...): pass the step before ft.compile (an ft.Step); the "
            "helper compiles it with a recording backend."
        )
    if not dynamo.traces_whole_steps():
        raise RuntimeError(
            f"assert_one_graph: torch {torch.__version__}'s dynamo cannot capture a step as one "
            "graph: it breaks the graph at the requires_grad_ that makes the leaf copies "
            "torch.autograd.grad differentiates (torch 2.13 traces it). ft.compile still "
            "compiles the step, as several graphs with the same results; check that with "
            "assert_no_recompile, or skip the one-graph check where "
            "ftrain.internals.dynamo.traces_whole_steps() is False."
        )
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        graphs.append(gm)
        return gm.forward

    breaks_before = dynamo.graph_breaks()
    # Each call compiles anew (a new backend); a raised limit keeps earlier calls from using up
    # the entries dynamo allows per function, which would make it run the step eagerly.
    with dynamo.unlimited_recompiles():
        ft_compile(step, backend=record)(state.clone(), batch)
    breaks = [r for r, n in dynamo.graph_breaks().items() if n > breaks_before.get(r, 0)]
    if len(graphs) != 1 or breaks:
        listed = "; ".join(r.strip().splitlines()[0] for r in breaks) or "none recorded"
        raise AssertionError(
            f"assert_one_graph: dynamo captured the step as {len(graphs)} graphs, not 1. "
            f"Graph breaks: {listed}. Run with TORCH_LOGS=graph_breaks to see where."
        )
    return graphs[0]


# -- memory kept for backward -----------------------------------------------------------------


def saved_bytes(fn: Callable[..., Any], *args, **kwargs) -> int:
    """Bytes of the storages allocated by the ops of ``fn(*args, **kwargs)`` that are still alive
    after it returns, while its result is held.

    For a forward pass that returns the loss, that is exactly what autograd keeps for backward
    (saved activations, dropout masks, autocast's low-precision weight copies, checkpointing's
    saved inputs and selectively saved outputs) plus the returned tensors themselves. Tensors that
    existed before the call (params, inputs) are never counted, nor views of them. Counted per
    storage, once, at its allocated size. Works whatever saved-tensor hooks are active (e.g.
    non-reentrant ``torch.utils.checkpoint``), because it looks at allocations, not at hooks.

    Runs ``fn`` under a ``TorchDispatchMode``, so ops run eagerly and a bit slower.
    """
    recorder = LiveBytes(fresh_only=True)
    with recorder:
        result = fn(*args, **kwargs)
    gc.collect()
    total = recorder.live
    del result
    return total


def saved_activation_bytes(step: Step, state: TrainState, batch: Any) -> int:
    """Bytes the ``step`` keeps alive for backward after the forward of its first micro-batch.

    Runs only the forward phase (``step.forward``: the loss function inside the step's ``forward``
    hooks, e.g. autocast and activation checkpointing) on the first of the pieces
    ``step.split(batch)`` gives, with the global random state restored afterwards (the
    ``"eager"`` wraps, e.g. TF32, are not run: they change no byte). It returns :func:`saved_bytes` of that forward:
    the total size of the tensors allocated during the forward that are still alive once it
    returns while the loss is held — the activations autograd saved, dropout masks, autocast's
    low-precision weight copies, the inputs (and, for ``"selective"``, the matmul outputs) that
    checkpointing keeps, and the 0-d loss itself. Params, optimizer state and the batch are not
    counted. The forward runs eagerly even for a compiled step; ``wrap`` hooks (``ft.wrap``) are not run.
    """
    if not isinstance(step, Step):
        raise TypeError(
            f"saved_activation_bytes(step, ...): expected an ft.Step, got {type(step).__name__}."
        )
    if not isinstance(state, TrainState):
        raise TypeError(
            f"saved_activation_bytes(step, state, ...): expected an ft.TrainState, got "
            f"{type(state).__name__}."
        )
    state = step.init_extra(state)
    micro = step.split(batch)[0]
    device = tree.first_leaf(state.params).device

    def forward():
        leaves = [p.detach().requires_grad_(True) for p in tree.leaves(state.params)]
        return step.forward(tree.unflatten(state.params, leaves), micro, state)

    with rng.seeded(rng.step_seed(state), device):
        return saved_bytes(forward)


def _compiled(step: Step) -> bool:
    return any(isinstance(t, Compile) for t in step.transforms)


class AllocationPeak(LiveBytes):
    """What :func:`track_allocations` yields: ``peak``, the most bytes of storages allocated
    inside the block that were alive at once; ``alive_bytes()``, those alive now. The counter of
    ``peak_bytes`` and ``ft.memory`` (:class:`~ftrain.memory.tracker.LiveBytes`), counting only
    storages made inside the block. A meta tensor (a shape without data, e.g. a model template
    built under ``torch.device("meta")``) holds no memory and counts nothing."""

    def __init__(self) -> None:
        super().__init__(fresh_only=True, skip_meta=True)

    def alive_bytes(self) -> int:
        """Bytes of the storages allocated inside the block and alive now."""
        return self.live


@contextlib.contextmanager
def track_allocations() -> Iterator[AllocationPeak]:
    """Measure the memory that torch ops allocate on this thread inside the block::

        with track_allocations() as mem:
            ft.save(state, path)
        mem.peak  # the most bytes of tensors made in the block that were alive at once

    Counts every new storage an op makes (copies, gathers, results), for as long as anything
    holds it; views, in-place ops and tensors made before the block count nothing. Memory that is
    not a torch tensor (a Python ``bytes``, a file's pages) is not counted, nor are ops of other
    threads.
    """
    recorder = AllocationPeak()
    with recorder:
        yield recorder


# -- peak memory of a step --------------------------------------------------------------------


def allocator_peak(fn: Callable[[], Any], *, buffers: list[int] | None = None) -> int:
    """The most bytes torch's CPU allocator held at once while ``fn()`` ran, above
    what it held when ``fn`` started. Given a list as ``buffers``, fills it with the sizes of
    the allocations alive at that moment, largest first (those made before ``fn`` left out).

    Read from the profiler's allocation events, so it counts what the op-level counters
    (:func:`track_allocations`, :func:`peak_bytes`) cannot see: a kernel's own scratch buffers
    and the buffers of compiled code (``torch.compile``'s generated kernels allocate below the
    dispatcher). Every thread's allocations count. For CUDA, ``torch.cuda.max_memory_allocated``
    says the same more cheaply; this is the CPU's equivalent, which torch lacks.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        fn()
    allocation = torch._C._profiler._EventType.Allocation  # the event tree has no public names
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        fields = event.extra_fields
        if event.tag == allocation and fields.device.type == "cpu":
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    alive: dict[int, int] = {}
    at_peak: list[int] = []
    held = peak = 0
    for _, ptr, size in sorted(events):  # a free is a negative size
        held += size
        if size > 0:
            alive[ptr] = size
        else:
            alive.pop(ptr, None)
        if held > peak:
            peak = held
            if buffers is not None:
                at_peak = list(alive.values())
    if buffers is not None:
        buffers[:] = sorted(at_peak, reverse=True)
    return peak


def peak_bytes(step: Step, state: TrainState, batch: Any) -> int:
    """The most bytes alive at once while ``step(state, batch)`` runs for real, eagerly.

    Counted by :class:`ftrain.memory.tracker.LiveBytes`: the storages of ``state`` and ``batch``
    (a DTensor: its local shard) from the start, plus every storage the step's ops allocate, from
    its allocation until it is freed, at its allocated size (no allocator rounding or caching:
    compare with ``torch.cuda.max_memory_allocated`` minus what was allocated before, which
    rounds each block up to 512 bytes). This is what ``ft.memory(step, state, batch).peak``
    predicts. ``ft.compile`` is left out (the step runs eagerly); ``state`` is not modified (a
    donating step gets a copy, counted in its place).
    """
    from ftrain.memory.predict import planned_step

    if not isinstance(state, TrainState):
        raise TypeError(
            f"peak_bytes(step, state, ...): expected an ft.TrainState, got {type(state).__name__}."
        )
    planned_step(step)  # checks the step
    eager = Step(
        step.loss_fn,
        step.optimizer,
        tuple(t for t in step.transforms if not isinstance(t, Compile)),
        step.donate,
    )
    if step.donate:
        state = state.clone()
    live = LiveBytes()
    live.hold((tree.leaves(state.params), tree.leaves(state.opt_state), tree.leaves(state.extra)))
    live.hold(batch)
    with live:
        out = eager(state, batch)
    del out
    gc.collect()
    return live.peak
