"""``ft.fit``: the composition of a step that fits a memory budget at the best predicted speed."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ftrain import tree
from ftrain.distributed.data_parallel.zero import STRATEGIES
from ftrain.distributed.launch import is_initialized
from ftrain.internals.batch import batch_rows
from ftrain.memory.predict import memory
from ftrain.memory.report import Candidate, FitReport, MemoryReport, format_bytes, parse_bytes
from ftrain.step import Step
from ftrain.transforms.accumulate import Accumulate
from ftrain.transforms.autocast import Autocast, LossScaled
from ftrain.transforms.compile import Compile
from ftrain.transforms.offload import Offload, offload_transform
from ftrain.transforms.recompute import POLICIES, Checkpoint
from ftrain.transforms.shard import Shard

__all__ = ["fit", "OVERHEAD", "BF16_SPEEDUP"]

# The predicted cost of one more micro-batch, as a fraction of the one-micro-batch step: each
# micro-batch launches every kernel and reads every weight again, forward and backward.
OVERHEAD = 0.02
# How much faster the bf16 forward and backward run, by device type (tensor cores on a GPU; on
# the CPU bf16 matmuls are no faster than fp32 ones without AMX, so fp32 is kept there).
BF16_SPEEDUP = {"cuda": 2.0}
_RECOMPUTE = {p: i for i, p in enumerate(("none", "selective", "blocks"))}


def fit(
    step: Step,
    state: Any,
    batch: Any,
    budget: int | str,
    *,
    micro_batches: tuple[int, ...] | None = None,
    policies: tuple[str, ...] = ("none", "selective", "blocks"),
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    strategies: tuple[str, ...] | None = None,
    offloads: tuple[str, ...] = ("none", "optimizer"),
    device: str | torch.device | None = None,
) -> tuple[Step, FitReport]:
    """The composition of ``step`` that fits ``budget`` bytes per rank and is predicted fastest.

    Searched: micro-batches (``ft.accumulate``; powers of two up to the batch's rows) x activation
    checkpointing (``policies``) x precision (``"fp32"``, ``"bf16"`` autocast) x, when
    ``torch.distributed`` is initialized, the shard strategy (``ddp``, ``zero1``, ``zero2``,
    ``fsdp``). Each is planned with :func:`ftrain.memory` (fake tensors, nothing is run) on
    ``device`` (default: the state's; ``"cuda"`` plans a GPU step from a CPU or meta state). The
    step's other transforms (yours, ``ft.ema``, ``ft.compile``) are kept; ``accumulate``,
    ``checkpoint``, ``autocast``, ``shard`` and ``offload`` are replaced by the chosen ones.

    **Offload** (``offloads``, in order): ``"optimizer"`` (``ft.offload``: the optimizer state
    and the update on the host) is considered only when no composition of the step without it
    fits: it moves the state off the device (the budget counts the device's peak; the host's
    is shown beside it) but adds PCIe copies and a CPU update that the FLOPs model does not
    price, so a composition on the device is always preferred. On a CPU plan offload moves
    nothing (the host is the device), so it is not considered there.

    **Throughput model.** Predicted step time = the step's FLOPs measured on the fake run
    (recompute included: ``"blocks"`` adds a forward of the blocks' matmuls, ``"selective"``
    only pointwise ops, which are not counted) / the precision's speed-up (``BF16_SPEEDUP``:
    2x on CUDA, none on the CPU) x ``(1 + OVERHEAD * (k - 1))`` for ``k`` micro-batches. Ties go
    to fewer micro-batches, then less recompute, then the step's own precision. For each
    policy and precision the fewest micro-batches that fit are found (more only cost time).

    Returns the new step and a :class:`FitReport` (every composition planned, its predicted
    peak and time, and why the choice). With a shard strategy, lay the state out for it:
    ``ft.shard_state(state, report.chosen.strategy)``. ``budget``: bytes (an int) or a string
    such as ``"4GiB"``. Nothing fits: a ``MemoryError`` naming the smallest peak found.
    """
    budget = parse_bytes(budget, "ft.fit(budget)")
    if not isinstance(step, Step):
        raise TypeError(f"ft.fit(step, ...): expected an ft.Step, got {type(step).__name__}.")
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ValueError(f"ft.fit(policies={policies!r}): legal policies are {POLICIES}.")
    bad = [p for p in precisions if p not in ("fp32", "bf16", "fp16")]
    if bad or not precisions:
        raise ValueError(f"ft.fit(precisions={precisions!r}): use 'fp32', 'bf16' or 'fp16'.")
    shard = next((t for t in step.transforms if isinstance(t, Shard)), None)
    if strategies is None:
        strategies = STRATEGIES if (shard is not None or is_initialized()) else (None,)
    bad = [o for o in offloads if o not in ("none", "optimizer")]
    if bad or not offloads:
        raise ValueError(f"ft.fit(offloads={offloads!r}): use 'none' and/or 'optimizer'.")
    counts = micro_batches or _powers_of_two(batch_rows(batch))
    kind = _device(state) if device is None else torch.device(device).type
    own = _precision(step)
    if kind == "cuda" and not torch.cuda.is_available() and set(precisions) != {"fp32"}:
        raise ValueError(
            f"ft.fit(precisions={precisions!r}, device={device!r}): without a GPU a CUDA step "
            "is planned on the meta device, where torch.autocast does not run; pass "
            "precisions=('fp32',) or plan on a machine with a GPU."
        )
    if kind == "cpu" and "none" in offloads:
        offloads = ("none",)  # the host is the device: offload moves no byte

    def build(k: int, policy: str, precision: str, strategy: str | None, off: str) -> Step:
        return _compose(step, k, policy, precision, strategy, shard, off)

    planned: list[tuple[Candidate, MemoryReport]] = []
    for off in offloads:
        if any(c.fits for c, _ in planned):
            break  # offload only when nothing without it fits
        for strategy in strategies:
            for precision in precisions:
                for policy in policies:
                    for k in counts:
                        composed = build(k, policy, precision, strategy, off)
                        report = memory(composed, state, batch, device=device)
                        speed = BF16_SPEEDUP.get(kind, 1.0) if precision != "fp32" else 1.0
                        time = report.flops / speed * (1 + OVERHEAD * (k - 1))
                        fits = report.peak <= budget
                        c = Candidate(k, policy, precision, strategy, report.peak, time, fits)
                        c = dataclasses.replace(c, offload=off, host_peak=report.host_peak)
                        planned.append((c, report))
                        if fits:
                            break  # more micro-batches than the fewest that fit cost time
    fastest = min(c.time for c, _ in planned) or 1.0
    planned = [(dataclasses.replace(c, time=c.time / fastest), r) for c, r in planned]

    def rank(item):
        c = item[0]
        return (
            c.offload != "none",
            round(c.time, 6),
            c.micro_batches,
            _RECOMPUTE[c.policy],
            c.precision != own,
        )

    planned.sort(key=rank)
    candidates = tuple(c for c, _ in planned)
    fitting = [(c, r) for c, r in planned if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.peak)
        raise MemoryError(
            f"ft.fit: no composition fits the budget of {format_bytes(budget)} per rank; the "
            f"smallest predicted peak is {format_bytes(smallest.peak)} ({smallest.label}). Fix: a "
            "larger budget, a smaller batch, an optimizer with less state (adafactor, "
            "adamw8bit), more processes with ft.shard(step, 'zero2'/'fsdp'), or (on a GPU) "
            "offloads=('none', 'optimizer')."
        )
    chosen, report = fitting[0]
    faster = [c for c in candidates[: candidates.index(chosen)] if not c.fits]
    reason = (
        f"the fastest predicted composition that fits ({format_bytes(chosen.peak)} <= "
        f"{format_bytes(budget)})"
        + (
            f"; {len(faster)} faster ones do not fit (e.g. {faster[0].label}: "
            f"{format_bytes(faster[0].peak)})"
            if faster
            else ""
        )
        + "."
    )
    new = build(
        chosen.micro_batches, chosen.policy, chosen.precision, chosen.strategy, chosen.offload
    )
    return new, FitReport(budget, chosen, candidates, report, reason)


def _powers_of_two(rows: int | None) -> tuple[int, ...]:
    rows = rows or 1
    out, k = [], 1
    while k <= rows:
        out.append(k)
        k *= 2
    return tuple(out)


def _device(state: Any) -> str:
    params = getattr(state, "params", state)
    t = tree.first_leaf(params)
    return "cpu" if t.is_meta else t.device.type


def _precision(step: Step) -> str:
    for t in step.transforms:
        if isinstance(t, Autocast) and t.dtype is not torch.float32:
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}[t.dtype]
    return "fp32"


def _compose(
    step: Step,
    k: int,
    policy: str,
    precision: str,
    strategy: str | None,
    shard: Shard | None,
    offload: str = "none",
) -> Step:
    """``step`` with accumulate, checkpoint, autocast, shard and offload replaced: the others
    (yours included) innermost, as applied; then offload (inside shard, so each rank offloads
    its own shards), autocast, checkpoint, accumulate, shard, compile (the recipe's order,
    ``ftrain.app.recipes.gpt.build_step``)."""
    replaced = (Accumulate, Checkpoint, Autocast, Shard, Compile, Offload)
    old_ckpt = next((t for t in step.transforms if isinstance(t, Checkpoint)), None)
    old_auto = next((t for t in step.transforms if isinstance(t, Autocast)), None)
    compile_ = next((t for t in step.transforms if isinstance(t, Compile)), None)
    ts = [t for t in step.transforms if not isinstance(t, replaced)]
    if offload != "none":
        ts.append(offload_transform(offload))
    if precision != "fp32":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        same = old_auto is not None and old_auto.dtype is dtype
        scaler = _fp16_scaler(dtype)
        made = (LossScaled if scaler is not None else Autocast)(dtype, scaler)
        ts.append(old_auto if same else made)
    if policy != "none":
        ts.append(Checkpoint(policy, old_ckpt.modules if old_ckpt else None))
    if k > 1:
        ts.append(Accumulate(k))
    if strategy is not None:
        mesh, prefetch = (shard.mesh, shard.prefetch) if shard is not None else (None, True)
        ts.append(Shard(strategy, mesh, prefetch=prefetch))
    if compile_ is not None and strategy != "fsdp":
        ts.append(compile_)
    return dataclasses.replace(step, transforms=tuple(ts))


def _fp16_scaler(dtype: torch.dtype):
    if dtype is not torch.float16:
        return None
    from ftrain.transforms.autocast import DynamicLossScale

    return DynamicLossScale()
