"""Multi-tensor helpers the optimizer transforms share: counters, in-place-when-allowed
arithmetic on leaf lists, checks of a state's structure, per-tensor norms; and torch's fused
optimizer kernels (``torch._fused_adam_``, ``torch._fused_adamw_``, ``torch._fused_sgd_``).

Those kernels are private torch names, called here and nowhere else in ftrain (as ``torch._foreach_*``
are called only in :mod:`ftrain.internals.foreach`): :func:`fused_refusal` says whether they run on
a list of leaves, :func:`fused_adam_` and :func:`fused_sgd_` call them. They exist in torch 2.4 and
later on the CPU and on every device of ``torch.optim``'s ``fused=True`` (CUDA, XPU, MPS, ...), each
with an overload that takes the learning rate as a tensor, so a schedule's value reaches them
without a host read.
"""

from __future__ import annotations

import torch

from ftrain.internals import foreach
from ftrain.optim.base import LeafContext

__all__ = [
    "zero_count",
    "writable",
    "mul",
    "add_",
    "as_update",
    "check_same_keys",
    "norms_and_roots",
    "fused_refusal",
    "is_wrapped",
    "fused_adam_",
    "fused_sgd_",
]


def zero_count() -> torch.Tensor:
    """A fresh step counter: a 0-d int64 zero."""
    return torch.zeros((), dtype=torch.int64)


def mul(u: list[torch.Tensor], factor, owned: bool) -> list[torch.Tensor]:
    """``u * factor``, in place when the update tensors are ours to overwrite."""
    if owned:
        foreach.mul_(u, factor)
        return u
    return list(foreach.mul(u, factor))


def add_(u: list[torch.Tensor], value: torch.Tensor) -> None:
    """``u += value`` for a 0-d tensor ``value``. Dynamo turns the single-tensor overload into a
    host read (a graph break), so while compiling it is given as a list."""
    if torch.compiler.is_compiling():
        foreach.add_(u, [value] * len(u))
    else:
        foreach.add_(u, value)


def writable(owned: bool, g: list[torch.Tensor], m: list[torch.Tensor]) -> bool:
    """Whether the gradient buffers ``g`` may take values computed from the state ``m`` in
    place: ``owned`` (the step's to overwrite), and at each position laid out as ``m`` (the same
    tensor type and, for DTensors, mesh and placements). Not so under ZeRO, whose gradients are
    replicated and moments sharded: writing a shard into a replicated buffer would gather it (or,
    on a torch without that rule, fail); the update is then built apart, on the shards."""
    if not owned:
        return False
    for x, y in zip(g, m):
        if type(x) is not type(y):
            return False
        placed = getattr(x, "placements", None)
        if placed is not None and (
            tuple(placed) != tuple(y.placements) or x.device_mesh != y.device_mesh
        ):
            return False
    return True


def as_update(g: list[torch.Tensor], m: list[torch.Tensor], owned: bool) -> list[torch.Tensor]:
    """The state ``m`` (e.g. a momentum) as the update, never aliasing it: copied into the
    gradient buffers ``g`` when they are ours to overwrite (and laid out alike: :func:`writable`),
    else cloned. The step adds the update to the params and may donate the state, so the two must
    not share memory."""
    if writable(owned, g, m):
        foreach.copy_(g, m)
        return g
    return [t.clone() for t in m]


def check_same_keys(ctx: LeafContext, fn: str, *names: str) -> None:
    """Check that the state's per-parameter sub-trees have the updates' keys, in their order."""
    for name in names:
        if ctx.state.child(name) != ctx.tree:
            raise KeyError(
                f"{fn}: state[{name!r}] does not have the keys of the updates (or not in the same "
                "order). Build the state with this optimizer's init(params)."
            )


def norms_and_roots(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-d float64 tensors: each tensor's L2 norm (one multi-tensor kernel) and ``sqrt(numel)``."""
    norms = torch.stack(foreach.norm(tensors)).to(torch.float64)
    roots = torch.tensor([t.numel() ** 0.5 for t in tensors], dtype=torch.float64)
    return norms, roots.to(norms.device)


# -- torch's fused optimizer kernels ------------------------------------------------------------

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_devices() -> tuple[str, ...]:
    """The device types torch's own ``fused=True`` optimizers accept."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # a torch without the helper: the two devices ftrain is tested on
        return ("cpu", "cuda")


def is_wrapped(t: torch.Tensor) -> bool:
    """A tensor under a functorch transform (``torch.func.vmap``'s batched tensors)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def fused_refusal(tensors: list[torch.Tensor]) -> str | None:
    """``None`` when torch's fused optimizer kernels run on every tensor of ``tensors`` (plain,
    dense and contiguous, floating point, on a device they exist for); otherwise the reason, one
    phrase naming the first tensor's device and dtype (or layout) where they do not.

    Sharded DTensors (``ft.shard``'s zero/fsdp state), other tensor subclasses (``ft.memory``'s
    fake tensors) and ``torch.func.vmap``'s batched tensors are refused: the kernels have no rule
    for them here, and those steps keep the foreach chain."""
    devices = _fused_devices()
    for t in tensors:
        if hasattr(t, "placements"):
            return f"sharded DTensor leaves on {t.device} (ft.shard with zero1/zero2/fsdp)"
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            # e.g. ft.memory's fake tensors: torch has no fake kernel for the tensor-lr ops, and
            # its fallback would run them on real tensors of the params' size
            return f"{type(t).__name__} leaves"
        if not torch.compiler.is_compiling() and is_wrapped(t):  # dynamo cannot read it:
            return "batched leaves under torch.func.vmap"  # ft.vmap is told by foreach.is_looped
        if t.device.type not in devices:
            return f"{t.device.type} tensors (torch has fused optimizer kernels on {devices})"
        if t.dtype not in _FUSED_DTYPES or (t.device.type == "mps" and t.dtype == torch.float64):
            return f"{t.dtype} tensors on {t.device.type}"
        if t.layout != torch.strided or not t.is_contiguous():
            return f"non-contiguous or sparse tensors (shape {tuple(t.shape)} on {t.device.type})"
    return None


def scalar_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``, a 0-d number the host computed (a step count, a learning rate), as a float32 tensor
    on ``device`` for a fused kernel to read, without making the host wait for the device: a
    number on the CPU is staged in pinned memory and copied asynchronously (a plain copy from
    pageable memory waits for every kernel queued before it: a host sync per copy). Already
    there, it is returned as it is."""
    t = t if t.dtype == torch.float32 else t.to(torch.float32)
    if t.device == device or device.type == "cpu":
        return t.to(device)
    if t.device.type == "cpu":
        try:
            t = t.pin_memory()
        except RuntimeError:  # an accelerator without pinned host memory: a plain copy
            return t.to(device)
    return t.to(device, non_blocking=True)


def _groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by (device, dtype): one kernel call each, as torch does."""
    by: dict = {}
    for i, t in enumerate(tensors):
        by.setdefault((t.device, t.dtype), []).append(i)
    return list(by.values())


def fused_adam_(
    out: list[torch.Tensor],
    grads: list[torch.Tensor],
    mu: list[torch.Tensor],
    nu: list[torch.Tensor],
    count: torch.Tensor,
    lr: torch.Tensor,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = True,
) -> None:
    """One Adam step in torch's fused kernel, in place: ``mu`` and ``nu`` move to their new
    moments and each ``out[i]`` becomes ``out[i] - lr / bc1 * mu / (sqrt(nu) / sqrt(bc2) + eps)``
    (with ``count`` the step number, 1 for the first, and ``bc = 1 - b**count``), after
    ``weight_decay`` (decoupled: ``out *= 1 - lr * wd``; else L2: ``g += wd * out``). ``out`` is
    the params in torch.optim; ftrain passes buffers that hold ``-lr * wd * p`` or zeros, so that
    ``out`` ends as the update. ``grads`` are read, not written (no ``grad_scale`` is given).
    ``count`` (an integer tensor) and ``lr`` (a 0-d tensor) are read by the kernel: no host sync
    on an accelerator (on the CPU, the kernel reads them as numbers itself)."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for idx in _groups(out):
        device = out[idx[0]].device
        step = scalar_on(count, device)  # the kernels read a float32 step
        kernel(
            [out[i] for i in idx],
            [grads[i] for i in idx],
            [mu[i] for i in idx],
            [nu[i] for i in idx],
            [],
            [step] * len(idx),
            lr=scalar_on(lr, device),
            beta1=b1,
            beta2=b2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )


def fused_sgd_(
    out: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    lr: torch.Tensor,
    *,
    momentum: float,
    nesterov: bool,
    weight_decay: float = 0.0,
) -> None:
    """One SGD step in torch's fused kernel, in place: each buffer becomes ``momentum * buf + g``
    (none without momentum) and ``out[i] -= lr * d`` with ``d`` the buffer (``g + momentum *
    buf`` with nesterov; ``g`` without momentum), after the L2 term ``g += weight_decay * out``.
    ``out`` is the params in torch.optim (and in ftrain's ``leaf_apply``); for an update ftrain
    passes zeros, so that ``out`` ends as the update. ``grads`` are read, not written."""
    for idx in _groups(out):
        device = out[idx[0]].device
        torch._fused_sgd_(
            [out[i] for i in idx],
            [grads[i] for i in idx],
            [momentum_buffers[i] for i in idx] if momentum else [],
            weight_decay=weight_decay,
            momentum=momentum,
            lr=scalar_on(lr, device),
            dampening=0.0,
            nesterov=nesterov,
            maximize=False,
            is_first_step=False,  # the buffers start at zero: momentum * 0 + g is g, exactly
        )
