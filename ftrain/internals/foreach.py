"""The multi-tensor kernels ftrain runs (``torch._foreach_*``), with a per-tensor fallback.

``foreach.add(xs, ys)`` is ``torch._foreach_add(xs, ys)``: one kernel over every tensor of the
lists. Inside ``with foreach.looped():`` it runs instead as the per-tensor op on every list
position in turn (``[torch.add(x, y) for x, y in zip(xs, ys)]``): the same numbers, each op one
that ``torch.func.vmap`` batches. ``ft.vmap`` needs that: vmap has no batching rule for several of
the kernels (e.g. ``_foreach_div`` by a tensor). Eager, the loop costs one Python-level op per
tensor; under ``torch.compile`` it is traced into the graph.

Why a flag read by ftrain's own call sites and not a ``TorchFunctionMode`` over ``torch``: dynamo
applies no such mode to the ``torch._foreach_*`` calls it traces, so a compiled vmapped step would
call the kernels vmap cannot batch. The flag is a :class:`~ftrain.internals.scoped.Scoped`
value, which dynamo reads (and guards on) like any ``threading.local``. Outside ``looped()`` each
function costs one Python call and one thread-local read over the kernel itself.

In-place functions (``add_``, ...) return their first list, as torch's kernels do; the others a
list of new tensors.

``torch._foreach_*`` are private torch names, called here and nowhere else in ftrain; a public
multi-tensor API with vmap batching rules would replace both this module's kernels and its loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ftrain.internals.scoped import Scoped

__all__ = [
    "looped",
    "is_looped",
    "add",
    "add_",
    "addcmul_",
    "copy_",
    "div",
    "div_",
    "lerp",
    "lerp_",
    "mul",
    "mul_",
    "norm",
    "reciprocal_",
    "sign_",
    "sqrt",
    "sqrt_",
    "sub",
]

_LOOPED: Scoped[bool] = Scoped("ftrain.internals.foreach.looped", False)
_KEYWORD_SCALAR = ("addcmul",)  # per-tensor forms that take the scalar as `value=`


def looped():
    """A context manager: inside it (on this thread), every function of this module runs its
    kernel per tensor (see the module docstring). ``ft.vmap`` enters it around its vmapped call."""
    return _LOOPED.using(True)


def is_looped() -> bool:
    """Whether this thread is inside :func:`looped` (e.g. under ``ft.vmap``): other multi-tensor
    kernels (torch's fused optimizers) must not run there either. Dynamo reads it as a guard."""
    return _LOOPED.get()


def _norm(t: torch.Tensor, ord: float = 2, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.linalg.vector_norm(t, ord, dtype=dtype)


def _per_tensor(name: str) -> Callable:
    """The per-tensor op of ``torch._foreach_<name>`` (``"add_"``: ``Tensor.add_``; ``"mul"``:
    ``torch.mul``; ``"norm"``: ``torch.linalg.vector_norm``)."""
    if name == "norm":
        return _norm
    if name == "copy_":
        return lambda t, src, non_blocking=False: t.copy_(src, non_blocking)
    base = name.rstrip("_")
    if base in _KEYWORD_SCALAR:  # in place as out of place and a copy: vmap batches those
        fn = getattr(torch, base)
        if name.endswith("_"):
            return lambda t, a, b, value=1: t.copy_(fn(t, a, b, value=value))
        return lambda t, a, b, value=1: fn(t, a, b, value=value)
    return getattr(torch.Tensor, base + "_") if name.endswith("_") else getattr(torch, base)


def _at(x: Any, i: int) -> Any:
    return x[i] if isinstance(x, (list, tuple)) else x


def _kernel(name: str) -> Callable:
    """``torch._foreach_<name>``, or its per-tensor loop inside :func:`looped`."""
    fused = getattr(torch, "_foreach_" + name)
    op = _per_tensor(name)
    in_place = name.endswith("_")
    local = _LOOPED

    def kernel(*args, **kwargs):
        if not local.get():
            return fused(*args, **kwargs)
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        out = [
            op(*(_at(a, i) for a in args), **{k: _at(v, i) for k, v in kwargs.items()})
            for i in range(n)
        ]
        return args[0] if in_place else out

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"``torch._foreach_{name}``, or per tensor inside :func:`looped`."
    return kernel


add = _kernel("add")
add_ = _kernel("add_")
addcmul_ = _kernel("addcmul_")
copy_ = _kernel("copy_")
div = _kernel("div")
div_ = _kernel("div_")
lerp = _kernel("lerp")
lerp_ = _kernel("lerp_")
mul = _kernel("mul")
mul_ = _kernel("mul_")
norm = _kernel("norm")
reciprocal_ = _kernel("reciprocal_")
sign_ = _kernel("sign_")
sqrt = _kernel("sqrt")
sqrt_ = _kernel("sqrt_")
sub = _kernel("sub")
