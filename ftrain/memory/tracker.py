"""Live bytes of a computation, real or fake: the one counter both ``ft.memory`` and
``ftrain.testing.peak_bytes`` use.

:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every op, counts the storage each new
output holds (once per storage, at its allocated size) and subtracts it when the storage is freed
(a weak reference's callback on the storage object), so ``live`` and ``peak`` follow the
allocations as an allocator would, without its rounding. It works the same on real tensors and
on fake ones (``torch._subclasses.FakeTensorMode``: meta storages know their size).

This module is the adapter for torch's private APIs used by the planner; the public replacements
would be a documented ``torch.utils`` home for them:

* ``torch._subclasses.fake_tensor.FakeTensorMode`` / ``FakeTensor`` (the issue names them; no
  public alias exists in torch 2.13),
* ``torch._subclasses.fake_tensor.unset_fake_temporarily`` (run an op on real tensors while the
  fake mode is active: the step's small counters stay real, so ``int(state.step)`` still works),
* a DTensor's ``_local_tensor`` (``DTensor.to_local()`` would dispatch an op of its own),
* ``torch.utils._python_dispatch.TorchDispatchMode`` and ``torch.utils._pytree.tree_leaves``
  (public extension points from modules still named private),
* ``torch.ops.c10d._reduce_scatter_base_``, the op ``dist.reduce_scatter_tensor`` dispatches
  (:func:`reduce_scatter_input`; a public replacement would be a documented op name).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ftrain import tree

__all__ = [
    "LiveBytes",
    "fake_mode",
    "unfaked",
    "is_fake",
    "fake_like",
    "fake_tree",
    "storage_of",
    "tensor_leaves",
]

# Leaves this small stay real tensors (counters, the random key, learning rates): the step reads
# some of them as Python numbers, and their bytes do not matter.
_SMALL = 8


def fake_mode() -> FakeTensorMode:
    """A fresh fake-tensor mode that accepts real inputs (they are faked on the fly)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def unfaked():
    """A context in which new tensors are real even inside a fake mode (a step's small index and
    counter tensors, which it reads as Python numbers)."""
    return unset_fake_temporarily()


def is_fake(t: object) -> bool:
    """Whether ``t`` is a fake tensor (shapes and dtypes, no data); a DTensor: whether its local
    shard is."""
    return isinstance(getattr(t, "_local_tensor", t), FakeTensor)


def fake_like(t: torch.Tensor, mode, device: torch.device | None = None) -> torch.Tensor:
    """A fake tensor shaped like ``t`` (a DTensor: like the whole tensor) on ``device`` (default:
    ``t``'s, the CPU for ``meta``); small leaves stay real (zeros where ``t`` has no data)."""
    if t.numel() <= _SMALL and not is_fake(t):
        if t.is_meta:
            return torch.zeros(t.shape, dtype=t.dtype)
        full = getattr(t, "full_tensor", None)  # a DTensor: its whole value
        return full() if full is not None and type(t) is not torch.Tensor else t
    if device is None:
        device = torch.device("cpu") if t.is_meta else t.device
    with mode:
        return torch.empty(tuple(t.shape), dtype=t.dtype, device=device)


def fake_tree(td: TensorDictBase, mode, device: torch.device | None = None) -> TensorDictBase:
    """``td`` with every leaf replaced by :func:`fake_like` of it (on ``device``, if given)."""
    values, tdef = tree.flatten(td)
    return tdef.unflatten([fake_like(t, mode, device) for t in values])


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nest of tuples, lists and dicts."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def reduce_scatter_input(func, args: tuple) -> torch.Tensor | None:
    """The input of a flat reduce-scatter (the op ``torch.distributed.reduce_scatter_tensor``
    dispatches, seen by a ``TorchDispatchMode``); None for any other op."""
    if func is torch.ops.c10d._reduce_scatter_base_.default:
        return args[1]  # (output, input, group, op, async, timeout)
    return None


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage that holds ``t``'s data: a DTensor's local shard's, a plain tensor's own; None
    for tensors without one (sparse, nested, other wrapper subclasses)."""
    local = getattr(t, "_local_tensor", None)  # DTensor: ``to_local()`` without autograd
    if local is not None:
        t = local
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages alive while it is active, and their peak.

    ``hold(tensors)`` counts tensors that exist already (the state and the batch: the baseline);
    every op's new outputs are counted as they appear and dropped when freed. An output whose
    storage is already counted (a view, an in-place or ``out=`` op) adds nothing. ``mark(name)``
    records the live bytes at a point of the run (``marks``), and ``since(name)`` the peak after
    it. Ops whose tensor arguments are all real run for real even under a fake mode, so the step's
    counters keep their values. ``flops`` adds up the FLOPs of the ops that
    ``torch.utils.flop_counter`` has a formula for (matmuls, convolutions, attention); its
    ``FlopCounterMode`` is not stacked instead because its module tracker keeps tensors alive.

    ``fresh_only=True`` counts only storages allocated while it is active: an output whose storage
    is one of the op's inputs' (a view or an in-place result of a tensor made before) is skipped
    rather than counted as alive (``ftrain.testing.track_allocations`` and ``saved_bytes``).

    ``transient(func, args, kwargs)``: bytes an op allocates and frees within itself that a fake
    run does not allocate (a collective backend's own buffer); they count toward the peaks for
    the extent of the op, never toward ``live``.

    ``skip_meta=True`` counts no tensor on the ``meta`` device (a shape without data, e.g. a
    model template built under ``torch.device("meta")``): measured memory, not planned.

    ``host=torch.device("cpu")`` counts the storages of tensors on that device apart, in
    ``host_live``, ``host_peak``, ``host_marks`` and :meth:`host_since` (``ft.memory`` of a step
    whose params are on an accelerator: the host's bytes are not the device's); ``live``,
    ``peak``, ``marks`` and :meth:`since` then count every other device. Without it (default)
    every storage is counted in ``live``.
    """

    def __init__(
        self,
        fresh_only: bool = False,
        transient: Callable[..., int] | None = None,
        *,
        skip_meta: bool = False,
        host: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.fresh_only = fresh_only
        self.skip_meta = skip_meta
        self.transient = transient
        self.live = 0
        self.peak = 0
        self.flops = 0
        self.marks: dict[str, int] = {}
        self._peak_since: dict[str, int] = {}
        self.host = None if host is None else torch.device(host)
        self.host_live = 0
        self.host_peak = 0
        self.host_marks: dict[str, int] = {}
        self._host_peak_since: dict[str, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def hold(self, tensors: Any) -> None:
        """Count these existing tensors (a nest of them) as alive."""
        for t in tensor_leaves(tensors):
            self._count(t)

    def mark(self, name: str) -> int:
        """Record the live bytes now under ``name`` (and start its peak); returns them."""
        self.marks[name] = self._peak_since[name] = self.live
        self.host_marks[name] = self._host_peak_since[name] = self.host_live
        return self.live

    def since(self, name: str) -> int:
        """The peak of live bytes since :meth:`mark` ``(name)``."""
        return self._peak_since[name]

    def host_since(self, name: str) -> int:
        """The peak of the host's live bytes since :meth:`mark` ``(name)`` (0 without ``host``)."""
        return self._host_peak_since[name]

    def _on_host(self, t: torch.Tensor) -> bool:
        return self.host is not None and t.device.type == self.host.type

    def _count(self, t: torch.Tensor) -> None:
        if self.skip_meta and t.device.type == "meta":
            return
        storage = storage_of(t)
        if storage is None:
            return
        key = id(storage)
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            return
        n = storage.nbytes()
        host = self._on_host(t)
        self._refs[key] = weakref.ref(storage, self._freed(key, n, host))
        if host:
            self.host_live += n
            self._reach_host(self.host_live)
        else:
            self.live += n
            self._reach(self.live)

    def _reach(self, level: int) -> None:
        """Raise the peaks to ``level`` bytes (alive now, or for the extent of one op)."""
        if level > self.peak:
            self.peak = level
        for name, p in self._peak_since.items():
            if level > p:
                self._peak_since[name] = level

    def _reach_host(self, level: int) -> None:
        self.host_peak = max(self.host_peak, level)
        for name, p in self._host_peak_since.items():
            self._host_peak_since[name] = max(p, level)

    def _freed(self, key: int, n: int, host: bool) -> Callable[[weakref.ref], None]:
        def gone(ref: weakref.ref) -> None:
            if self._refs.get(key) is ref:
                del self._refs[key]
            if host:
                self.host_live -= n
            else:
                self.live -= n

        return gone

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensor_leaves((args, kwargs))
        if inputs and not any(is_fake(t) for t in inputs):
            with unset_fake_temporarily():  # real in, real out (a no-op without a fake mode)
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        formula = flop_registry.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        taken = {id(s) for s in map(storage_of, inputs) if s is not None} if self.fresh_only else ()
        for t in tensor_leaves(out):
            if taken and id(storage_of(t)) in taken:
                continue
            self._count(t)
        if self.transient is not None:  # beside its outputs, for the extent of the op
            self._reach(self.live + self.transient(func, args, kwargs))
        return out
