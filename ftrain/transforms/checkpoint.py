"""Activation checkpointing of the model's repeated blocks.

The step does not know the model: the model is whatever the loss function calls through
``ft.apply``. So this transform installs a hook (``ftrain.state.module_hooks``) for the extent of
each forward; every ``ft.apply(module, ...)`` then finds that module's blocks and routes each
block's forward through ``torch.utils.checkpoint``. The block's parameters at that moment are the
step's leaf copies; they are captured and passed to the recompute explicitly, because by the time
backward recomputes the block, ``functional_call`` has already put the template's tensors back.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import (
    checkpoint as torch_checkpoint,
)

from ftrain.models.onednn import ONEDNN_MATMUL_OPS
from ftrain.state import module_hooks
from ftrain.step import Step
from ftrain.transforms._common import already, check_step

__all__ = ["checkpoint", "find_blocks", "POLICIES", "SAVE_OPS"]

POLICIES = ("blocks", "selective", "none")

_aten = torch.ops.aten
# What "selective" keeps: the outputs of matmuls and attention (expensive to recompute, and what
# the block's memory is mostly *not* made of); everything pointwise is recomputed.
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
for _name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math"):
    if hasattr(_aten, _name):
        SAVE_OPS.add(getattr(_aten, _name).default)
SAVE_OPS.update(ONEDNN_MATMUL_OPS)  # ftrain.models.Linear's matmuls on the CPU


def _selective_policy(ctx, op, *args, **kwargs):
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def find_blocks(
    module: nn.Module, modules: Sequence[type[nn.Module]] | None = None
) -> list[nn.Module]:
    """The blocks ``ft.checkpoint`` wraps in ``module``.

    With ``modules`` (module classes): every submodule that is an instance of one of them and is
    not inside another match. Without: the children of the ``nn.ModuleList`` or ``nn.Sequential``
    that holds the most parameters among those whose children are themselves composite modules
    (transformer layers, not a list of Linear heads or embedding tables); ties go to the one found
    first, so an outer list of layers wins over a Sequential inside one layer. If no container has
    composite children, the one with the most children. This is where transformers keep their
    layers.
    """
    if modules is not None:
        types = tuple(modules)
        found: list[nn.Module] = []

        def visit(m: nn.Module) -> None:
            for child in m.children():
                if isinstance(child, types):
                    found.append(child)
                else:
                    visit(child)

        if isinstance(module, types):
            return [module]
        visit(module)
        return found
    containers = [m for m in module.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    composite = [
        m
        for m in containers
        if len(m) and all(next(c.children(), None) is not None for c in m.children())
    ]
    if composite:
        # max keeps the first of equal keys: the outer list of layers before any list inside one
        return list(max(composite, key=lambda m: sum(p.numel() for p in m.parameters())))
    return list(max(containers, key=len, default=[]))


# Marks the call that ``_Checkpointed._run`` makes through ``functional_call``: the block's own
# forward is wanted there. An argument rather than a flag on the object, because torch.compile
# refuses (graph-breaks on) any mutation of outside state inside a checkpointed region.
_INSIDE = object()


class _Checkpointed:
    """A block's forward routed through ``torch.utils.checkpoint``."""

    def __init__(self, block: nn.Module, context_fn):
        self.block = block
        # Passed only when set: under torch.compile, dynamo refuses an explicit
        # context_fn=noop_context_fn (the default), so "blocks" must leave the argument out.
        self.options = {} if context_fn is None else {"context_fn": context_fn}

    def __call__(self, *args, **kwargs):
        if args and args[0] is _INSIDE:  # the call _run makes below: the block's own forward
            return type(self.block).forward(self.block, *args[1:], **kwargs)
        block = self.block
        # The tensors functional_call has swapped in right now: the step's leaf copies.
        tensors = dict(block.named_parameters(remove_duplicate=False))
        tensors.update(block.named_buffers(remove_duplicate=False))
        return torch_checkpoint(
            self._run,
            tensors,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            **self.options,
            **kwargs,
        )

    def _run(self, tensors, *args, **kwargs):
        # In the forward, ``tensors`` are those already in place and this wrapper is installed:
        # the marker sends functional_call's call of the block to the block's own forward. In an
        # eager recompute (backward) the wrapper is gone and ``tensors`` put the step's leaf
        # copies back in place of the template's own.
        if self.block.__dict__.get("forward") is self:
            args = (_INSIDE, *args)
        return torch.func.functional_call(self.block, tensors, args, kwargs)


# Per template module and (block classes, context_fn): its blocks, each with its checkpointed
# forward. Built once, so the objects a compiled step finds are the same on every call. Values
# refer to the blocks (children), never to the template itself, so entries die with it.
_WRAPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch._dynamo.disable  # runs eagerly, also under torch.compile: see _Hook
def _install(module: nn.Module, modules, context_fn) -> tuple[int, list[nn.Module]]:
    """Route the forward of each block of ``module`` through checkpoint; returns the number of
    blocks and those this call wrapped (a nested ``apply`` of the same model finds them done)."""
    key = (modules, context_fn)
    cache = _WRAPPERS.setdefault(module, {})
    if key not in cache:
        cache[key] = [(b, _Checkpointed(b, context_fn)) for b in find_blocks(module, modules)]
    patched = []
    for block, wrapper in cache[key]:
        if "forward" not in block.__dict__:
            block.forward = wrapper
            patched.append(block)
    return len(cache[key]), patched


@torch._dynamo.disable
def _uninstall(patched: list[nn.Module]) -> None:
    for block in patched:
        del block.forward


class _Hook:
    """Installed for one forward; wraps the blocks of each module that ``ft.apply`` calls.

    Wrapping and unwrapping run eagerly even inside a compiled step (``torch._dynamo.disable``):
    dynamo then traces the model with the wrappers already in place, guards on their identity
    (stable, see ``_WRAPPERS``) and never replays the attribute changes itself.
    """

    def __init__(self, policy: str, modules):
        self.context_fn = _selective_contexts if policy == "selective" else None
        self.modules = modules
        self.calls = 0

    @contextlib.contextmanager
    def __call__(self, module: nn.Module) -> Iterator[None]:
        self.calls += 1
        n_blocks, patched = _install(module, self.modules, self.context_fn)
        if not n_blocks:
            how = (
                f"none of {[t.__name__ for t in self.modules]} occurs in it"
                if self.modules
                else "it has no nn.ModuleList or nn.Sequential"
            )
            raise ValueError(
                f"ft.checkpoint found no blocks to checkpoint in {type(module).__name__}: {how}. "
                "Name the block class: ft.checkpoint(step, modules=[MyBlock])."
            )
        try:
            yield
        finally:
            _uninstall(patched)


@contextlib.contextmanager
def _checkpoint_forward(policy: str, modules) -> Iterator[None]:
    hook = _Hook(policy, modules)
    with module_hooks(hook):
        yield
    if hook.calls == 0:
        raise RuntimeError(
            "ft.checkpoint: the loss function never called ft.apply(model, params, ...), so there "
            "was no model to checkpoint. Call the model through ft.apply."
        )


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
            ``nn.ModuleList``/``nn.Sequential`` (see :func:`find_blocks`).

    The model must be called through ``ft.apply`` inside the loss function.

    **Invariant:** the same loss and gradients as without checkpointing (dropout included: the
    recompute replays the random numbers of the forward), with fewer bytes saved for backward.
    """
    step = check_step(step, "checkpoint")
    if policy not in POLICIES:
        raise ValueError(f"ft.checkpoint(policy={policy!r}): legal policies are {POLICIES}.")
    if already(step, "checkpoint"):
        raise ValueError("ft.checkpoint was applied twice; apply it once with the policy you want.")
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
    if policy == "none":
        return step.replace("checkpoint")
    ctx = functools.partial(_checkpoint_forward, policy, modules)
    return step.replace("checkpoint", forward_contexts=(*step.forward_contexts, lambda p: ctx()))
