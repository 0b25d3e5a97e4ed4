"""Values that code deeper in the same call finds, set for the extent of a ``with`` block.

``ft.apply`` is called by the user's loss function, so the transforms of the step running it
cannot pass it anything: they set a :class:`Scoped` value around the call instead, and the value
is back to what it was when the block ends, also on error. This is what ``contextvars.ContextVar``
is for, and :class:`Scoped` behaves like one in synchronous code, with one difference: it is a
``threading.local``. ``torch.compile`` traces reads and writes of a ``threading.local`` (guarding
on what it read) but breaks the graph at ``ContextVar.get``, and the compiled step must find the
values inside its one graph.

Like a ContextVar, a scoped value is not seen by other threads, autograd's included: on CUDA,
backward (and the recompute of a checkpointed block) runs on autograd's worker threads. What code
needs during backward is captured in the forward (``ftrain.step.BackwardPlan``, fsdp's session).
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

__all__ = ["Scoped"]

T = TypeVar("T")


class _Local(threading.local):
    """One thread's value. Every thread starts with the default already set, so ``get`` reads an
    attribute that is always there: dynamo guards on its value, not on whether it exists (which
    changes after the first ``using`` block on a thread and would recompile the step)."""

    def __init__(self, default):
        self.value = default


class Scoped(Generic[T]):
    """A value visible to the code running inside :meth:`using` on the same thread.

    ``value.get()`` returns the innermost value set with ``with value.using(x):``, or the default.
    Blocks nest; leaving one restores the value it found.
    """

    def __init__(self, name: str, default: T):
        self.name = name
        self._local = _Local(default)

    def get(self) -> T:
        """The value set by the innermost enclosing :meth:`using` on this thread, or the default."""
        return self._local.value

    def using(self, value: T) -> _Using[T]:
        """A context manager that sets the value for its extent (nested blocks nest)."""
        return _Using(self, value)

    def __repr__(self) -> str:
        return f"Scoped({self.name!r}, {self.get()!r})"


class _Using(Generic[T]):
    """The context manager of :meth:`Scoped.using`. A class, not a generator: dynamo traces a
    plain ``__enter__``/``__exit__`` pair inside a compiled step."""

    def __init__(self, scoped: Scoped[T], value: T):
        self.scoped = scoped
        self.value = value
        self.saved: list = []

    def __enter__(self) -> T:
        self.saved.append(self.scoped.get())
        self.scoped._local.value = self.value
        return self.value

    def __exit__(self, *exc) -> None:
        self.scoped._local.value = self.saved.pop()
