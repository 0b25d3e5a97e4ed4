"""``torch.compile`` of the whole step, optimizer update included."""

from __future__ import annotations

import torch

from ftrain.step import Step
from ftrain.transforms._common import already, check_step
from ftrain.transforms.shard import _fsdp_with_compile, _is_fsdp

__all__ = ["compile"]


def compile(step: Step, **torch_compile_kwargs) -> Step:  # noqa: A001 - mirrors torch.compile
    """Compile the step's phases (forward, backward, reduction, optimizer update) with
    ``torch.compile(**torch_compile_kwargs)``.

    Seeding from ``state.rng`` and the wrappers added *after* compile run eagerly around the
    compiled function. Learning rates and other changing hyper-parameters are tensors computed
    inside, so a schedule never triggers a recompile. Compile must be the last ftrain transform
    (others applied after it are refused); compiling twice is an error, and so is compiling a step
    sharded with ``ft.shard(step, "fsdp")`` (dynamo cannot trace its per-block gathering; use
    ``"zero2"``, or run fsdp eagerly).

    **Invariant:** the same result as the eager step within floating-point tolerance; no
    recompiles across steps once the first call has compiled.
    """
    step = check_step(step, "compile")
    if already(step, "compile"):
        raise ValueError(
            "ft.compile was applied twice; the step is already compiled. Apply it once, last."
        )
    if _is_fsdp(step):
        raise _fsdp_with_compile("ft.compile(step)", "step is sharded with ft.shard(step, 'fsdp')")
    fn = torch.compile(step._inner(), **torch_compile_kwargs)
    return step.replace("compile", compiled=fn, wrappers=())
