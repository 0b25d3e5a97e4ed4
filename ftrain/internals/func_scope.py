"""Whether ftrain is running code under a ``torch.func`` transform it entered itself.

``ft.vmap`` (the members of an ensemble) and ``ft.per_example_grads`` (one example at a time) run
the model under ``torch.func.vmap``, whose tensors are wrappers. A kernel that cannot take them
(``ftrain.models.onednn``'s linear) must then take the plain path. Eager, it can ask the tensors;
while ``torch.compile`` traces, that query is not traceable, so it asks this flag instead: a
:class:`~ftrain.internals.scoped.Scoped` value, which dynamo reads and guards on like a
``threading.local``.
"""

from __future__ import annotations

import contextlib

from ftrain.internals.scoped import Scoped

__all__ = ["inside", "entered"]

_INSIDE: Scoped[bool] = Scoped("ftrain.internals.func_scope inside", False)


def inside() -> bool:
    """True while (on this thread) code runs within :func:`entered`."""
    return _INSIDE.get()


def entered() -> contextlib.AbstractContextManager:
    """A context manager for the code a ``torch.func`` transform runs: enter it around the
    transformed call (outside or inside it: the flag is read while the body runs or is traced)."""
    return _INSIDE.using(True)
