"""``torch._foreach_*`` kernels run one tensor at a time, where a transform cannot batch them.

ftrain's optimizers and the step's gradient math use multi-tensor kernels (``torch._foreach_add``,
``_foreach_norm``, ...). ``torch.func.vmap`` has no batching rule for several of them (e.g.
``_foreach_div`` by a tensor). Inside ``with looped_foreach():`` each such call runs as the
per-tensor op on every list position in turn (``_foreach_add(xs, ys)`` is
``[torch.add(x, y) for x, y in zip(xs, ys)]``): the same numbers, each op batched by ``vmap``.
Under ``torch.compile`` the loop is traced into one graph, so it costs nothing there; eager, it
costs one Python-level op per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["looped_foreach", "per_tensor"]

_PREFIX = "_foreach_"
_KEYWORD_SCALAR = ("addcmul", "addcdiv")  # their per-tensor forms take the scalar as `value=`


def _norm(t: torch.Tensor, ord: float = 2, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.linalg.vector_norm(t, ord, dtype=dtype)


def _scalar_or_tensor(op: Callable, by_scalar: Callable) -> Callable:
    """``op(t, other)``, or ``by_scalar(t, other)`` where ``other`` is a Python number."""

    def fn(t, other):
        return by_scalar(t, other) if isinstance(other, (int, float)) else op(t, other)

    return fn


_SPECIAL: dict[str, Callable] = {
    "norm": _norm,
    "max": torch.amax,
    "maximum": _scalar_or_tensor(torch.maximum, torch.clamp_min),
    "minimum": _scalar_or_tensor(torch.minimum, torch.clamp_max),
    "copy_": lambda t, src, non_blocking=False: t.copy_(src, non_blocking),
    "zero_": torch.Tensor.zero_,
}


def per_tensor(name: str) -> Callable:
    """The per-tensor op of the multi-tensor kernel ``torch._foreach_<name>`` (``"add_"`` is
    ``Tensor.add_``, ``"mul"`` is ``torch.mul``, ``"norm"`` is ``torch.linalg.vector_norm``)."""
    if name in _SPECIAL:
        return _SPECIAL[name]
    base = name.rstrip("_")
    if base in _KEYWORD_SCALAR:  # in place as out of place and a copy: vmap batches those
        fn = getattr(torch, base)
        if name.endswith("_"):
            return lambda t, a, b, value=1: t.copy_(fn(t, a, b, value=value))
        return lambda t, a, b, value=1: fn(t, a, b, value=value)
    return getattr(torch.Tensor, base + "_") if name.endswith("_") else getattr(torch, base)


def _at(x: Any, i: int) -> Any:
    return x[i] if isinstance(x, (list, tuple)) else x


class looped_foreach(TorchFunctionMode):  # noqa: N801 - used as a function: `with looped_foreach():`
    """A context manager: every ``torch._foreach_*`` call inside runs per tensor (see the module
    docstring). In-place kernels return None, as torch's do; the others a list."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _KERNELS.get(func)
        if name is None:
            return func(*args, **kwargs)
        op = per_tensor(name)
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        out = [
            op(*(_at(a, i) for a in args), **{k: _at(v, i) for k, v in kwargs.items()})
            for i in range(n)
        ]
        return None if name.endswith("_") else out


# torch._foreach_<name> -> name, for every multi-tensor kernel torch has (a constant table: a
# lookup by function object, which torch.compile traces)
_KERNELS: dict[Callable, str] = {
    getattr(torch, n): n[len(_PREFIX) :] for n in dir(torch) if n.startswith(_PREFIX)
}
