"""The settings and counters of ``torch._dynamo`` that ftrain uses: the one module reaching into
dynamo's private namespace. Every setting is scoped to a ``with`` block and restored after.

``torch.compiler`` has no public switch for tracing ``torch.autograd.grad`` into the graph, nor a
public count of compiled frames and graph breaks; these wrap ``torch._dynamo.config`` and
``torch._dynamo.utils.counters`` until it does.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = [
    "tracing_autograd",
    "traces_whole_steps",
    "error_on_recompile",
    "unlimited_recompiles",
    "frames_compiled",
    "graph_breaks",
    "recompile_error",
    "refused_rematerialization",
]


def _config():
    return torch._dynamo.config


def tracing_autograd() -> contextlib.AbstractContextManager:
    """Dynamo traces ``torch.autograd.grad`` into the graph instead of breaking the graph at it
    (``trace_autograd_ops``), for the extent of the block. A no-op on a torch without it."""
    config = _config()
    if not hasattr(config, "trace_autograd_ops"):
        return contextlib.nullcontext()
    return config.patch(trace_autograd_ops=True)


@functools.cache  # a fact of the installed torch: probed once per process
def traces_whole_steps() -> bool:
    """Whether dynamo captures a step's gradient as one graph: leaf copies made inside the traced
    function (``p.detach().requires_grad_()``) differentiated by ``torch.autograd.grad``.

    torch 2.13 traces both (with :func:`tracing_autograd`); torch 2.11 has the setting but breaks
    the graph at ``requires_grad_``, so a compiled step runs as several graphs (same results, no
    fusion across forward, backward and update). Found by compiling a three-line function with a
    backend that only counts graphs (no code generation; about a second, the first time dynamo
    runs in a process), not by the version number."""
    graphs = []

    def count(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    def grad_of_square(x: torch.Tensor) -> torch.Tensor:
        p = x.detach().requires_grad_(True)
        return torch.autograd.grad((p * p).sum(), p)[0]

    with tracing_autograd():
        torch.compile(grad_of_square, backend=count)(torch.ones(2))
    return len(graphs) == 1


def error_on_recompile() -> contextlib.AbstractContextManager:
    """A recompile inside the block raises :func:`recompile_error` with dynamo's reason."""
    return _config().patch(error_on_recompile=True)


def unlimited_recompiles() -> contextlib.AbstractContextManager:
    """No limit on the entries dynamo compiles per function inside the block (so that many
    deliberate compiles of one function do not make it fall back to eager)."""
    return _config().patch(recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20)


def frames_compiled() -> int:
    """How many frames dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break reasons so far in this process, each with its count (a copy)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def recompile_error() -> type[Exception]:
    """The exception :func:`error_on_recompile` raises."""
    from torch._dynamo.exc import RecompileError

    return RecompileError


def refused_rematerialization(error: BaseException) -> bool:
    """Whether ``error`` is the compiler refusing to recompute checkpointed regions inside a graph
    that holds the forward, the loss and the backward (``trace_autograd_ops``). torch 2.13 refuses
    regions that hold an op tagged ``nondeterministic_seeded`` (dropout, and every
    ``scaled_dot_product_attention`` kernel, even at dropout 0) and more than one backward that
    recomputes (gradient accumulation). Recognized by its message, which names that graph."""
    return "forward-loss-backward" in str(error)
