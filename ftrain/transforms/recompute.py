"""Activation checkpointing of the model's repeated blocks.

The step does not know the model: the model is whatever the loss function calls through
``ft.apply``. So this transform *rewrites* it (the ``rewrite`` hook): ``ft.apply`` runs a copy of
the model whose blocks each run through ``torch.utils.checkpoint`` (``ftrain.internals.blocks``),
and the user's module is never modified. Each block's parameters at the time of the forward (the
step's leaf copies) are handed to the checkpoint explicitly, so that the recompute in backward
places them again: by then ``ft.apply`` has put the template's own tensors back. The copy is built
with plain Python that dynamo traces, so ``ft.compile(ft.checkpoint(step))`` is one graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ftrain.apply import rewritten
from ftrain.internals.blocks import find_blocks, replace_forwards
from ftrain.models.onednn import MATMUL_OPS
from ftrain.step import Step, Transform
from ftrain.step.capabilities import RECOMPUTES, SAVED_TENSOR_HOOKS

__all__ = ["Checkpoint", "checkpoint", "POLICIES", "SAVE_OPS"]

POLICIES = ("blocks", "selective", "none")

_aten = torch.ops.aten
# What "selective" keeps: the outputs of matmuls and attention (expensive to recompute, and what
# the block's memory is mostly *not* made of); everything pointwise is recomputed.
SAVE_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        *(
            getattr(_aten, name).default
            for name in (
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_attention_math",
            )
            if hasattr(_aten, name)
        ),
        *MATMUL_OPS,  # ftrain.models.Linear's matmuls on the CPU
    }
)


def _selective_policy(ctx, op, *args, **kwargs):
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint(Transform):
    """Recompute each block in backward (the ``forward`` hook runs the model rewritten by
    :meth:`rewrite`); see :func:`checkpoint`."""

    policy: str = "blocks"
    modules: tuple[type[nn.Module], ...] | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"ft.checkpoint(policy={self.policy!r}): legal policies are {POLICIES}."
            )
        modules = self.modules
        if isinstance(modules, type):
            modules = (modules,)
        if modules is not None:
            modules = tuple(modules)
            bad = [m for m in modules if not (isinstance(m, type) and issubclass(m, nn.Module))]
            if bad or not modules:
                raise TypeError(
                    f"ft.checkpoint(modules=...): expected nn.Module subclasses, e.g. [Block]; "
                    f"got {bad or modules!r}."
                )
        object.__setattr__(self, "modules", modules)

    def capabilities(self):
        if self.policy == "none":
            return {RECOMPUTES: "policy='none'"}
        return {RECOMPUTES: f"policy={self.policy!r}", SAVED_TENSOR_HOOKS: ""}

    def forward(self, fn):
        return fn if self.policy == "none" else rewritten(fn, self, "ft.checkpoint")

    def rewrite(self, module: nn.Module) -> nn.Module:
        """A copy of ``module`` whose blocks run through ``torch.utils.checkpoint`` (what
        ``ft.apply`` runs in the forward; ``module`` is left as it was)."""
        blocks = find_blocks(module, self.modules)
        if not blocks:
            how = (
                f"none of {[t.__name__ for t in self.modules]} occurs in it"
                if self.modules
                else "it has no nn.ModuleList or nn.Sequential"
            )
            raise ValueError(
                f"ft.checkpoint found no blocks to checkpoint in {type(module).__name__}: {how}. "
                "Name the block class: ft.checkpoint(step, modules=[MyBlock])."
            )
        return replace_forwards(module, [(b, self._checkpointed) for b in blocks])

    def _checkpointed(self, block: nn.Module):
        """The forward of ``block``'s replacement: ``block`` run through torch.utils.checkpoint."""
        # Passed only when set: under torch.compile, dynamo refuses an explicit
        # context_fn=noop_context_fn (the default), so "blocks" leaves the argument out.
        options = {"context_fn": _selective_contexts} if self.policy == "selective" else {}

        def run(tensors, *args, **kwargs):
            # In the forward these are the tensors in place already; in an eager recompute they
            # put the step's leaf copies back in place of the template's own.
            return torch.func.functional_call(block, tensors, args, kwargs)

        def forward(*args, **kwargs):
            tensors = dict(block.named_parameters(remove_duplicate=False))
            tensors.update(block.named_buffers(remove_duplicate=False))
            return torch_checkpoint(
                run,
                tensors,
                *args,
                use_reentrant=False,
                preserve_rng_state=True,
                **options,
                **kwargs,
            )

        return forward


def checkpoint(
    step: Step,
    policy: str = "blocks",
    modules: Sequence[type[nn.Module]] | type[nn.Module] | None = None,
) -> Step:
    """Recompute activations of the model's repeated blocks in backward instead of storing them.

    Args:
        policy: ``"blocks"`` keeps only each block's inputs and recomputes the block in backward;
            ``"selective"`` also keeps the outputs of matmuls and attention (``SAVE_OPS``) and
            recomputes the cheap pointwise ops; ``"none"`` changes nothing.
        modules: block classes to checkpoint; default: the children of the model's largest
            ``nn.ModuleList``/``nn.Sequential`` (see ``ftrain.internals.blocks.find_blocks``).

    The model must be called through ``ft.apply`` inside the loss function.

    **Invariant:** the same loss and gradients as without checkpointing (dropout included: the
    recompute replays the random numbers of the forward), with fewer bytes saved for backward.
    """
    return Checkpoint(policy, modules)(step)
