"""Optimizer state in host memory, the update on the CPU (ZeRO-Offload), the params on the device.

**Rule:** the step is the same step; only where the optimizer's bytes live and where its update
runs change. The optimizer state moves to the host (pinned memory where the params are on a CUDA
device); each update copies the gradients and the params to the host, runs the optimizer there
(torch's fused CPU kernel for ``adamw``/``adam``/``sgd``: ``ftrain.optim``'s ``fused=None``
picks it for host tensors) and copies the new params back to the device before the next forward.

Hooks (``ft.Transform``; ``step.explain()`` shows them):

* ``optimizer``: the optimizer run on host copies (:func:`offloaded`). Under ``ft.shard`` it is
  the innermost optimizer, so each rank's ZeRO/fsdp optimizer hands it that rank's shards: each
  rank offloads its own shards.
* ``init``: moves a state's optimizer tensors to the host (a state from
  ``ft.TrainState.create``, ``ft.load`` or ``ft.shard_state``); a state already there is kept.
* ``engine`` (``"optimizer+gradients"``): hands the gradient engine a :class:`HostCopies`, so each
  param's final gradient is copied to the host during the last micro-batch's backward, as soon as
  autograd has produced it (``ftrain.step.AutogradEngine``'s sink): the copies of the last blocks
  run while the first blocks' backward still computes, and each device gradient is freed once its
  copy is done. Only where the engine's gradients are final: in one process (plain,
  ``accumulate``: the copy of the last micro-batch's whole sum only, ``checkpoint``, ``autocast``,
  fp16 loss scaling: the engine multiplies each gradient of a reweighted micro-batch by its count
  as it hands it over); under ``ft.shard``'s fsdp, where each block's reduced shards reach the
  sink one block after their reduce-scatter (fsdp's ``overlap.Handoff``); and under ddp, zero1 and
  zero2, which reduce the gradients in buckets during backward: the sink comes after the buckets'
  reducer (``AutogradEngine.reducing``, offload inside or outside ``ft.shard``), and each bucket's
  reduced gradients reach it one bucket after their all-reduce or reduce-scatter starts
  (``ftrain.distributed.data_parallel.buckets``). Sharded gradients (fsdp's, zero2's) are copied
  in backward on a mesh whose group reduces host tensors too (gloo, or ``"cpu:gloo,cuda:nccl"``:
  :meth:`HostCopies.holds`; a state split over an NCCL-only group is refused when the step is
  first called, since the host update reduces its shards' norms). Not where something changes them
  after backward: ddp/zero1/zero2 with ``bucket_mb=None`` (they reduce after backward), tensor or
  pipeline parallelism, fsdp under fp16 loss scaling (it reduces reweighted gradients after
  backward), ``ft.compile`` (no hand-over in a compiled step), a replaced engine (``vmap``,
  ``dp_sgd``) or ``ft.memory``'s fake tensors: there the gradients hook below copies them, after
  the reduction.
* ``gradients`` (``"optimizer+gradients"``): copies the gradients to the host as soon as the
  step holds its final ones, right after the reduction across processes (so NCCL always reduces
  device tensors) and before the other ``gradients`` hooks and the update, which then read them
  on the host. Gradients the engine's sink copied are there already: nothing moves.

**Transfer buffers** (:class:`HostCopies`): one host buffer per param, allocated on the first
step, pinned where the gradients are on a CUDA device (plain memory on a machine without one: the
same code), reused by every later step of the same step object (the engine holds them, so no
global state). On CUDA each copy is issued ``non_blocking`` on a side stream that first waits for
the stream backward runs on; the update waits for that stream before it reads the buffers. The
step reads them once (the division by the count writes new host tensors), so nothing a step
returns aliases them.

**Under ft.compile** the offloaded update runs outside the compiled graph
(``torch.compiler.disable``: a graph break before it and after it): inductor would otherwise trace
the chain instead of torch's fused CPU kernel and put host work into a device graph. Forward,
backward and the reduction stay compiled.

**On a GPU** (an H200, one rank): the side stream and pinned buffers, fsdp's per-block copies (the
CUDA tests) and ddp/zero2's per-bucket copies beside NCCL's buckets (``benchmarks/gpu.py``'s
checks) run and equal the step without offload to the host AdamW's rounding. Not yet measured:
where the copies during backward pay (on a small model they cost more than they hide:
docs/memory.md) and several NCCL ranks. Not done: a host master copy of the params (they are
copied to the host each step, into pinned buffers reused by :func:`offloaded`). On a machine
without a GPU the host is the device: the copies are host-to-host, the same code runs, and the
result is bitwise that of the step without offload.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ftrain import tree
from ftrain.distributed.dtensor import from_local, is_dtensor, like, local
from ftrain.distributed.launch import reduces_host_tensors
from ftrain.optim.base import GradientTransformation, LeafContext, leaf_apply, leaf_update, leafwise
from ftrain.state import TrainState
from ftrain.step import AutogradEngine, Gradients, Step, Transform
from ftrain.step.capabilities import HOST_OPTIMIZER

__all__ = [
    "Offload",
    "OffloadGradients",
    "HostCopies",
    "offload",
    "offload_transform",
    "offloaded",
]

HOST = torch.device("cpu")
MODES = ("optimizer", "optimizer+gradients")

Leaves = list[torch.Tensor]


def _to_host(ts: Leaves, pin: bool = False) -> Leaves:
    """``ts`` on the host: the same tensors where they are there already (no copy), else copies
    (pinned when ``pin``: a device-to-host copy synchronizes, so the host may read them)."""
    out = []
    for t in ts:
        if t.device == HOST:
            out.append(t)
        else:
            h = t.to(HOST)
            out.append(_pin(h) if pin else h)
    return out


def _pinned(new: Leaves, old: Leaves) -> Leaves:
    """The ``new`` optimizer state kept in pinned memory where the ``old`` one was (``init`` pins
    it where the params are on a CUDA device): tensors an update made anew (its counters; every
    moment of a step that does not donate) are pinned, those updated in place already are."""
    if not any(_is_pinned(t) for t in old):
        return new
    return [_pin(t) if t.device == HOST and not _is_pinned(t) else t for t in new]


def _is_pinned(t: torch.Tensor) -> bool:  # a DTensor (a rank's shard): its local tensor's memory
    return (local(t) if is_dtensor(t) else t).is_pinned()


def _pin(t: torch.Tensor) -> torch.Tensor:
    return like(local(t).pin_memory(), t) if is_dtensor(t) else t.pin_memory()


def _back(host: Leaves, like: Leaves, inplace: bool) -> Leaves:
    """``host`` tensors on the devices of ``like``: written into ``like`` when ``inplace`` (a
    donated step), else new tensors. A tensor that is already where it belongs is returned."""
    out = []
    for h, d in zip(host, like):
        if h.device == d.device:
            if inplace and h is not d:
                d.copy_(h)
                h = d
            out.append(h)
        elif inplace:
            out.append(d.copy_(h, non_blocking=True))
        else:
            out.append(h.to(d.device, non_blocking=True))
    return out


def _reused(buffers: Leaves, i: int, like: torch.Tensor) -> torch.Tensor:
    """``buffers[i]``: a contiguous host tensor shaped like ``like``, the one already there when
    its shape and dtype fit, else a new one (pinned where ``like`` is on a CUDA device)."""
    while len(buffers) <= i:
        buffers.append(torch.empty(0))
    if buffers[i].shape != like.shape or buffers[i].dtype != like.dtype:
        pin = like.device.type == "cuda"  # page-locked: a copy the device runs on its own
        buffers[i] = torch.empty(like.shape, dtype=like.dtype, device=HOST, pin_memory=pin)
    return buffers[i]


def _staged(ts: Leaves, buffers: Leaves) -> Leaves:
    """``ts`` on the host: plain CUDA tensors copied into ``buffers`` (reused; the copy waits
    for the device, so an earlier copy back from a buffer is done before it is written), others
    as :func:`_to_host` gives them (a host tensor itself; a DTensor or fake tensor copied)."""
    out = []
    for i, t in enumerate(ts):
        if type(t) is torch.Tensor and t.device.type == "cuda":
            out.append(_reused(buffers, i, t).copy_(t))
        else:
            out.extend(_to_host([t]))
    return out


def offloaded(inner: GradientTransformation) -> GradientTransformation:
    """``inner`` with its state on the host and its update run there.

    ``init`` creates the state on the host (pinned where the params are on a CUDA device).
    ``update`` copies the gradients and params to the host, runs ``inner`` there and returns the
    updates on the params' devices (the gradients' where no params are given: ZeRO's and fsdp's
    optimizers add them to the params themselves); the step's apply (``params + updates``, or
    ``inner``'s fused kernel writing the params) runs on host copies of the params and writes the
    new ones back. Both run outside ``torch.compile``'s graph.

    The host copies of CUDA params are made into transfer buffers that this optimizer keeps and
    reuses (pinned, one per param: the copy back to the device from them is asynchronous); so
    one offloaded optimizer serves one step at a time. Params already on the host (a machine
    without a GPU) are used as they are.

    **Invariant:** the same updates, state values and new params as ``inner`` (the same kernels
    on the same values: bitwise where the host runs the kernel the device would run); the state
    stays on the host.
    """
    inner_update, inner_apply = leaf_update(inner), leaf_apply(inner)
    staging: list[torch.Tensor] = []  # host copies of the device params, reused across steps

    def init(params):
        leaves = tree.leaves(params)
        pin = any(t.device.type == "cuda" for t in leaves)
        state = inner.init(tree.unflatten(params, _to_host(leaves)))
        return tree.unflatten(state, _to_host(tree.leaves(state), pin))

    @torch.compiler.disable
    def update(u: Leaves, s: Leaves, p: Leaves | None, ctx: LeafContext):
        hu = _to_host(u)
        owned = ctx.owned or any(a is not b for a, b in zip(hu, u))  # copies are ours
        hp = None if p is None else _staged(p, staging)
        new_u, new_s = inner_update(hu, _to_host(s), hp, ctx._replace(owned=owned))
        # where the params are, to be added there (under "+gradients" the grads are on the host)
        return _back(new_u, u if p is None else p, False), _pinned(new_s, s)

    @torch.compiler.disable
    def apply(g: Leaves, s: Leaves, p: Leaves, ctx: LeafContext):
        hg, hp = _to_host(g), _staged(p, staging)
        owned = ctx.owned or any(a is not b for a, b in zip(hg, g))
        # host copies of the params may be overwritten; the params themselves only when donated
        new_hp, new_s = inner_apply(hg, _to_host(s), hp, ctx._replace(owned=owned))
        return _back(new_hp, p, ctx.inplace), _pinned(new_s, s)

    return leafwise(init, update, apply)


@dataclasses.dataclass(frozen=True, eq=False)
class Offload(Transform):
    """The optimizer state on the host and the update run there (see :func:`offload`); mode
    ``"optimizer"``. :class:`OffloadGradients` is the ``"optimizer+gradients"`` mode, which adds
    the ``gradients`` hook (so ``explain()`` lists offload there only when it acts there);
    :func:`offload_transform` builds the one a mode names."""

    mode: str = "optimizer"

    name = "offload"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"ft.offload(step, mode={self.mode!r}): unknown mode; legal modes are "
                f"{', '.join(repr(m) for m in MODES)} (the optimizer state and update on the "
                "host; with '+gradients' the gradients copied there as soon as they are final)."
            )
        if self.mode != type(self).mode:
            raise ValueError(
                f"{type(self).__name__}(mode={self.mode!r}): this class is mode "
                f"{type(self).mode!r}; build the transform with offload_transform(mode)."
            )

    def capabilities(self):
        return {HOST_OPTIMIZER: self.mode}  # exclusive: offloading twice means nothing more

    def optimizer(self, optimizer: GradientTransformation) -> GradientTransformation:
        return offloaded(optimizer)

    def init(self, state: TrainState) -> TrainState:
        leaves = tree.leaves(state.opt_state)
        _check_host_collectives(leaves)
        if all(t.device == HOST for t in leaves):
            return state
        pin = any(t.device.type == "cuda" for t in tree.leaves(state.params))
        return state.replace(opt_state=tree.unflatten(state.opt_state, _to_host(leaves, pin)))


def _check_host_collectives(leaves: Leaves) -> None:
    """Refuse optimizer state split over a process group that cannot reduce host tensors (NCCL
    alone): the host optimizer would send its shards' norms (clipping, lamb, adafactor) there."""
    split = next((t for t in leaves if is_dtensor(t)), None)
    if split is None:
        return
    for backend in _backends(split.device_mesh):
        if not reduces_host_tensors(backend):
            raise ValueError(
                f"ft.offload: the optimizer state is split over a {backend!r} process group, "
                "which cannot reduce host tensors, and the offloaded update reduces its shards' "
                "norms on the host (clipping). Fix: ft.distributed.init(backend='cpu:gloo,"
                "cuda:nccl') (NCCL for CUDA tensors, gloo for host ones; ftrain train does so "
                "with --offload), or offload under ft.shard(step, 'ddp')."
            )


def _backends(mesh) -> set[str]:
    """The backends of the process groups of ``mesh``'s dimensions."""
    return {str(dist.get_backend(mesh.get_group(d))) for d in range(mesh.ndim)}


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadGradients(Offload):
    """:class:`Offload` in mode ``"optimizer+gradients"``: the gradients also copied to the host
    as soon as they are final. Its ``engine`` hook hands the engine a :class:`HostCopies`, which
    copies each one during backward where no reduction across processes changes it afterwards;
    its ``gradients`` hook copies the others, after the reduction."""

    mode: str = "optimizer+gradients"

    name = "offload"

    def engine(self, engine):
        if isinstance(engine, AutogradEngine):  # itself where its gradients are not final
            return engine.handing_over(HostCopies())
        return engine

    def gradients(self, g: Gradients, state: TrainState) -> Gradients:
        return g._replace(grads=_grads_to_host(g.grads))


class HostCopies:
    """``ft.offload``'s gradient sink (``ftrain.step.GradientSink``): each final gradient copied
    into a host transfer buffer as soon as backward hands it over, while backward goes on. A
    DTensor (an fsdp rank's shard) has its local tensor copied, and :meth:`result` gives the
    buffer laid out as it was (a DTensor over the host buffer).

    The buffers (one per param, contiguous) are allocated when first needed, pinned where the
    gradient is on a CUDA device, and reused while the params keep their shapes and dtypes. A
    CUDA gradient is copied ``non_blocking`` on a side stream of its device that first waits for
    the current stream (the one that produced it); its memory is recorded against the side
    stream, so the allocator reuses it only after the copy. :meth:`result` waits for the side
    streams. A host gradient (no GPU) is copied at once, by the same code.

    **Invariant:** :meth:`result` holds exactly the values handed over (a copy: the same bits),
    in the params' order. Mutable: one per step object (its engine's); a step must not run
    twice at the same time.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # per param, on the host: reused across steps
        self.streams: dict[torch.device, torch.cuda.Stream] = {}  # a side stream per device
        self.layouts: list[tuple | None] = []  # a DTensor's (mesh, placements, shape, stride)

    def holds(self, params) -> bool:
        """Plain tensors, and DTensors on a mesh whose process group reduces host tensors too
        (gloo, or a group made with ``"cpu:gloo,cuda:nccl"``): the step reduces the host shards
        it returns (their norm; clipping). (A state split over an NCCL-only group is refused
        by :meth:`Offload.init`; a gradient split over one is copied after the reduction.)"""
        meshes = {id(t.device_mesh): t.device_mesh for t in params if is_dtensor(t)}
        return all(
            m.ndim == 1 and all(reduces_host_tensors(b) for b in _backends(m))
            for m in meshes.values()
        )

    def take(self, i: int, grad: torch.Tensor) -> None:
        while len(self.layouts) <= i:
            self.layouts.append(None)
        self.layouts[i] = None
        if is_dtensor(grad):  # this rank's shard (fsdp): its local tensor copied, laid out again
            self.layouts[i] = (grad.device_mesh, grad.placements, grad.shape, grad.stride())
            grad = local(grad)
        buf = _reused(self.buffers, i, grad)
        if grad.device.type == "cuda":
            stream = self.streams.get(grad.device)
            if stream is None:
                stream = self.streams[grad.device] = torch.cuda.Stream(grad.device)
            stream.wait_stream(torch.cuda.current_stream(grad.device))  # grad is written
            with torch.cuda.stream(stream):
                buf.copy_(grad, non_blocking=True)  # device-to-host, beside the backward
            grad.record_stream(stream)  # its memory is reused only after the copy
        else:
            buf.copy_(grad)

    def result(self, n: int) -> list[torch.Tensor]:
        for stream in self.streams.values():
            stream.synchronize()  # a host sync: the update reads the buffers next
        return [
            b if lay is None else from_local(b, *lay)
            for b, lay in zip(self.buffers[:n], self.layouts[:n])
        ]

    def __repr__(self) -> str:
        return "HostCopies()"


def offload_transform(mode: str = "optimizer") -> Offload:
    """The transform of :func:`offload` for ``mode``: :class:`Offload` or
    :class:`OffloadGradients`; an unknown mode is a ``ValueError`` naming the legal ones."""
    return OffloadGradients() if mode == OffloadGradients.mode else Offload(mode)


@torch.compiler.disable
def _grads_to_host(grads):
    return tree.unflatten(grads, _to_host(tree.leaves(grads)))


def offload(step: Step, mode: str = "optimizer") -> Step:
    """The optimizer state in host memory and the optimizer update run on the CPU, while the
    params (and the forward and backward) stay on the device (ZeRO-Offload).

    Args:
        step: an ``ft.Step``. ``accumulate``, ``checkpoint``, ``autocast`` and ``compile`` compose
            in any order (the update runs outside the compiled graph). With ``ft.shard``, apply
            offload first, ``ft.shard(ft.offload(step), strategy)``, so that each rank's ZeRO or
            fsdp optimizer hands it that rank's shards (on a GPU the other order would give host
            tensors to NCCL).
        mode: ``"optimizer"`` (the state, and the update's work, on the host; the gradients are
            copied there by the update) or ``"optimizer+gradients"`` (also the gradients copied to
            the host as soon as they are final, before the ``gradients`` hooks: in one process
            during backward, each as soon as autograd has produced it, into pinned buffers
            reused across steps, so the copies overlap the rest of the backward and each
            device gradient is freed early; under fsdp the same, each block's shards once
            reduce-scattered; under ddp/zero1/zero2 each bucket's gradients once reduced, during
            backward).

    What moves where, per step: the gradients and the params device-to-host, the new params
    host-to-device (3x the params' bytes over PCIe); the optimizer state (2x the params' bytes
    for AdamW) never leaves the host. The state is moved to the host by the ``init`` hook on the
    first call (pinned where the params are on a CUDA device) and saves and resumes like any
    state: ``ft.load`` gives it back on the host. See docs/memory.md for when it pays.

    **Invariant:** equals ``step`` without offload (fp32: params, optimizer state and metrics to
    1e-6; bitwise where the host runs the kernels the device would, as on a machine without a
    GPU, where the host is the device).

    Raises at build time: an unknown ``mode``; offload applied twice.
    """
    return offload_transform(mode)(step)
