"""Parameters as data: ``params_of``, ``buffers_of``, ``apply`` and ``TrainState``.

An ``nn.Module`` is used only as a *template*: its code runs, its tensors do not. The numbers live in
a nested ``TensorDict`` keyed by module path, and :func:`apply` runs the module's code on them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict, TensorDictBase, tensorclass
from torch import nn

from ftrain import _tree

__all__ = ["params_of", "buffers_of", "apply", "state_dict_of", "TrainState", "module_hooks"]


def params_of(module: nn.Module) -> TensorDict:
    """A detached copy of ``module``'s parameters as a nested TensorDict keyed by module path.

    ``blocks.0.attn.qkv.weight`` becomes ``params["blocks", "0", "attn", "qkv", "weight"]``. Tied
    parameters (one tensor under two names) appear once, under their first name, as in
    ``module.named_parameters()``. The copy shares nothing with the module: training it never
    changes the module, and changing the module never changes it.
    """
    _check_module(module, "params_of")
    return _tree.from_flat({k: v.detach().clone() for k, v in module.named_parameters()})


def buffers_of(module: nn.Module) -> TensorDict:
    """A detached copy of ``module``'s buffers (running statistics, masks) as a nested TensorDict."""
    _check_module(module, "buffers_of")
    return _tree.from_flat({k: v.detach().clone() for k, v in module.named_buffers()})


def state_dict_of(params: TensorDictBase) -> dict[str, torch.Tensor]:
    """``{"blocks.0.attn.qkv.weight": tensor, ...}``: params as a flat dict with the module's own
    names, ready for ``module.load_state_dict(..., strict=False)`` (strict=False because tied
    duplicates appear once). The tensors are shared, not copied."""
    return _tree.to_flat(params)


def _check_module(module: object, fn: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"ft.{fn}(module): expected an nn.Module, got {type(module).__name__}.")


# Shapes of each template module's parameters, computed once per module.
_SHAPES: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Size]] = weakref.WeakKeyDictionary()


def _param_shapes(module: nn.Module) -> dict[str, torch.Size]:
    if torch.compiler.is_compiling():
        # Not through the cache: dynamo would guard on the cache's contents, and the entry this
        # call adds would fail that guard and recompile the step on its next call.
        return {k: v.shape for k, v in module.named_parameters()}
    shapes = _SHAPES.get(module)
    if shapes is None:
        shapes = {k: v.shape for k, v in module.named_parameters()}
        _SHAPES[module] = shapes
    return shapes


# Hooks that transforms (e.g. activation checkpointing) install around every `apply` call made
# while they are active. Each is a callable `(module) -> context manager`.
_MODULE_HOOKS: list[Callable[[nn.Module], contextlib.AbstractContextManager]] = []


@contextlib.contextmanager
def module_hooks(
    *hooks: Callable[[nn.Module], contextlib.AbstractContextManager],
) -> Iterator[None]:
    """Run every :func:`apply` inside this block with ``hook(module)`` entered around the call.

    This is how a transform reaches the model without knowing it: ``ft.checkpoint`` uses it to wrap
    the model's blocks for the extent of the forward pass. Hooks are removed on exit, also on error.
    """
    _MODULE_HOOKS.extend(hooks)
    try:
        yield
    finally:
        del _MODULE_HOOKS[len(_MODULE_HOOKS) - len(hooks) :]


def apply(module: nn.Module, params: TensorDictBase, *args, buffers=None, **kwargs):
    """Call ``module(*args, **kwargs)`` with its parameters replaced by ``params``.

    Strict: ``params`` must hold exactly the module's parameter names (a missing or extra key is an
    error that names it) with the module's shapes. The module's own parameters are never read or
    written, so the template may even live on the ``meta`` device. Buffers come from ``buffers``
    (a TensorDict from :func:`buffers_of`) when given, else from the module itself, read-only.
    Gradients flow to the tensors in ``params``.
    """
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            f"ft.apply(module, params): params must be a TensorDict (from ft.params_of(module)), "
            f"got {type(params).__name__}."
        )
    flat = _tree.to_flat(params)
    shapes = _param_shapes(module)
    if flat.keys() != shapes.keys():
        missing = sorted(shapes.keys() - flat.keys())
        extra = sorted(flat.keys() - shapes.keys())
        parts = []
        if missing:
            parts.append(f"missing key(s) {missing}")
        if extra:
            parts.append(f"unexpected key(s) {extra}")
        raise KeyError(
            f"ft.apply: params do not match {type(module).__name__}: {'; '.join(parts)}. "
            "Build params with ft.params_of(module) from the same module class and config."
        )
    for name, t in flat.items():
        if t.shape != shapes[name]:
            raise ValueError(
                f"ft.apply: params[{name!r}] has shape {tuple(t.shape)} but the module expects "
                f"{tuple(shapes[name])}. The params were built for a different model config."
            )
    if buffers is not None:
        flat.update(_tree.to_flat(buffers))
    with contextlib.ExitStack() as stack:
        for hook in _MODULE_HOOKS:
            stack.enter_context(hook(module))
        return torch.func.functional_call(module, flat, args, kwargs, tie_weights=True)


@tensorclass
class TrainState:
    """The whole training state as one tensor pytree.

    Fields:
        params: nested TensorDict of fp32 parameters, keyed by module path.
        opt_state: the optimizer's state (TensorDict), from ``optimizer.init(params)``.
        step: 0-d int64, the number of steps taken. Lives on the CPU so reading it never waits for
            an accelerator.
        rng: 0-d int64 random key. With ``step`` it determines every random number a step draws.
        extra: TensorDict of state owned by transforms (fp16 loss scale, EMA of params, ...).

    Everything needed to resume bit-for-bit is in here; ``ft.save`` writes all of it.
    """

    params: TensorDict
    opt_state: TensorDict
    step: torch.Tensor
    rng: torch.Tensor
    extra: TensorDict

    @classmethod
    def create(cls, params: TensorDictBase, optimizer, *, seed: int = 0) -> TrainState:
        """A fresh state: ``params``, ``optimizer.init(params)``, step 0 and ``rng`` from ``seed``."""
        from ftrain.optim import GradientTransformation

        if not isinstance(params, TensorDictBase):
            raise TypeError(
                "TrainState.create(params, ...): params must be a TensorDict; "
                "use ft.params_of(module)."
            )
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(
                "TrainState.create(params, optimizer): optimizer must be an "
                f"ftrain.optim.GradientTransformation (e.g. ftrain.optim.adamw(3e-4)), got "
                f"{type(optimizer).__name__}."
            )
        if not isinstance(seed, int):
            raise TypeError(f"TrainState.create(seed=...): seed must be an int, got {seed!r}.")
        return cls(
            params=params,
            opt_state=optimizer.init(params),
            step=torch.zeros((), dtype=torch.int64),
            rng=torch.tensor(seed, dtype=torch.int64),
            extra=TensorDict({}, batch_size=[]),
            batch_size=[],
        )
