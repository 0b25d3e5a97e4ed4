"""``torch.compile`` of the whole step, optimizer update included."""

from __future__ import annotations

import torch

from ftrain.step import Step, StepFn
from ftrain.transforms._common import already, check_step
from ftrain.transforms.shard import _fsdp_with_compile, _is_fsdp

__all__ = ["compile"]


def compile(step: Step, **torch_compile_kwargs) -> Step:  # noqa: A001 - mirrors torch.compile
    """Compile the step's phases (forward, backward, reduction, optimizer update) with
    ``torch.compile(**torch_compile_kwargs)``, as one graph.

    The gradient is ``torch.autograd.grad`` inside the step; dynamo traces it (its
    ``trace_autograd_ops`` setting, switched on for the compiled calls only), so forward, backward
    and update are one graph that inductor fuses across: the optimizer's pointwise math lands in
    the kernels that produce the gradients, and there is no graph break between the phases.
    ``ft.checkpoint`` is the exception: it wraps the model's blocks eagerly around the forward, so
    the forward is a graph of its own, whose backward AOT autograd builds with the recompute, and
    the update another.

    Seeding from ``state.rng`` and the wrappers added *after* compile run eagerly around the
    compiled function. Learning rates and other changing hyper-parameters are tensors computed
    inside, so a schedule never triggers a recompile. Compile must be the last ftrain transform
    (others applied after it are refused); compiling twice is an error, and so is compiling a step
    sharded with ``ft.shard(step, "fsdp")`` (dynamo cannot trace its per-block gathering; use
    ``"zero2"``, or run fsdp eagerly).

    **Invariant:** the same result as the eager step within floating-point tolerance; one graph
    (``ftrain.testing.assert_one_graph``); no recompiles across steps once the first call has
    compiled (``ftrain.testing.assert_no_recompile``).
    """
    step = check_step(step, "compile")
    if already(step, "compile"):
        raise ValueError(
            "ft.compile was applied twice; the step is already compiled. Apply it once, last."
        )
    if _is_fsdp(step):
        raise _fsdp_with_compile("ft.compile(step)", "step is sharded with ft.shard(step, 'fsdp')")
    fn = torch.compile(step._inner(), **torch_compile_kwargs)
    return step.replace("compile", compiled=_tracing_autograd(fn), wrappers=())


def _tracing_autograd(fn: StepFn) -> StepFn:
    """``fn`` called with dynamo tracing ``torch.autograd.grad`` into the graph instead of breaking
    the graph at it. The setting is read while dynamo traces (first call, recompiles), so it is set
    around every call and restored after; other compiled code in the process is left as it was."""
    config = torch._dynamo.config
    if not hasattr(config, "trace_autograd_ops"):  # older torch: the step breaks at the backward
        return fn

    def compiled_step(state, batch):
        with config.patch(trace_autograd_ops=True):
            return fn(state, batch)

    return compiled_step
