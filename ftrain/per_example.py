"""Per-example gradients: the gradient of each example's own loss, in one vectorized call.

``torch.func.vmap`` over ``torch.func.grad``: the loss function runs once, on a batch whose
examples are each a batch of one (so a model that expects a batch dimension works unchanged), and
the gradients come back with a leading example dimension. The basis of ``ft.dp_sgd``.

Costs: memory for one copy of the params per example (``[n, *shape]`` for every leaf); split a
large batch (``ft.accumulate`` does, under ``ft.dp_sgd``) to bound it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain import tree
from ftrain.internals import func_scope
from ftrain.losses import Loss, as_loss

__all__ = ["per_example_grads", "ExampleGrads", "example_grads", "examples_of"]


class ExampleGrads(NamedTuple):
    """What :func:`example_grads` returns, each with a leading dimension of ``n`` examples."""

    grads: list[torch.Tensor]  # in the params' leaf order, each [n, *leaf shape]
    values: torch.Tensor  # [n] fp32: each example's loss value (total / count), detached
    aux: dict[str, torch.Tensor]  # [n] fp32 each: the loss's aux metrics, detached


def examples_of(batch: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any], int]:
    """``(leaves, rebuild, n)``: the tensors of ``batch`` with a leading dimension (all of ``n``
    rows), and ``rebuild(leaves)`` putting tensors back in their places in a batch of the same
    kind. 0-d tensors and non-tensor values stay as they are. A batch is a tensor, or a dict,
    TensorDict, list, tuple or namedtuple of them (nested)."""
    leaves: list[torch.Tensor] = []
    paths: list[str] = []
    build = _flatten(batch, "batch", leaves, paths)
    if not leaves:
        raise ValueError(
            f"per-example gradients: the batch ({type(batch).__name__}) holds no tensor with a "
            "leading example dimension; give a tensor, or a dict/TensorDict/tuple of tensors."
        )
    n = leaves[0].shape[0]
    for path, x in zip(paths, leaves):
        if x.shape[0] != n:
            raise ValueError(
                f"per-example gradients: {path} has {x.shape[0]} rows but {paths[0]} has {n}; "
                "every tensor of the batch is split along dim 0, so their first dimensions must "
                "agree (pass shared values as 0-d tensors or non-tensors)."
            )
    return leaves, lambda values: build(iter(values)), n


def _flatten(batch: Any, path: str, leaves: list, paths: list) -> Callable[[Any], Any]:
    """Record the batched tensors of ``batch`` and return how to put new ones in their place."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return lambda it: batch
        leaves.append(batch)
        paths.append(path)
        return lambda it: next(it)
    if isinstance(batch, TensorDictBase):
        inner = _flatten(batch.to_dict(), path, leaves, paths)
        rest = batch.batch_size[1:]
        return lambda it: TensorDict(inner(it), batch_size=[1, *rest] if batch.batch_dims else [])
    if isinstance(batch, Mapping):
        parts = {k: _flatten(v, f"{path}[{k!r}]", leaves, paths) for k, v in batch.items()}
        return lambda it: type(batch)({k: f(it) for k, f in parts.items()})
    if isinstance(batch, (tuple, list)):
        parts = [_flatten(v, f"{path}[{i}]", leaves, paths) for i, v in enumerate(batch)]
        if hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
            return lambda it: type(batch)(*(f(it) for f in parts))
        return lambda it: type(batch)(f(it) for f in parts)
    return lambda it: batch


def example_grads(
    loss: Callable[[TensorDict, Any], Loss],
    params: TensorDict,
    batch: Any,
    scale: torch.Tensor | None = None,
) -> ExampleGrads:
    """The gradient of ``loss(params, example).value`` for each example of ``batch``.

    ``loss`` returns an ``ft.Loss``; each example is given to it as a batch of one row. With
    ``scale`` (a 0-d tensor, e.g. an fp16 loss scale) the value is multiplied by it before the
    backward and the gradients are *not* divided by it. Dropout draws different numbers for each
    example (``randomness="different"``), from torch's generators as the batch would.
    """
    values, tdef = tree.flatten(params)
    leaves, rebuild, _ = examples_of(batch)

    def one(p: list[torch.Tensor], example: list[torch.Tensor]):
        out = loss(tdef.unflatten(p), rebuild([x.unsqueeze(0) for x in example]))
        value = out.value
        aux = {k: v.detach().float() for k, v in (out.aux or {}).items()}
        scaled = value if scale is None else value * scale
        return scaled, (value.detach().float(), aux)

    each = torch.func.vmap(
        torch.func.grad(one, has_aux=True), in_dims=(None, 0), randomness="different"
    )
    with func_scope.entered():
        grads, (losses, aux) = each([v.detach() for v in values], leaves)
    return ExampleGrads(list(grads), losses, aux)


def per_example_grads(loss_fn: Callable[..., Any], params: TensorDict, batch: Any) -> TensorDict:
    """The gradient of each example's loss: a TensorDict keyed like ``params``, every leaf with a
    leading dimension of the batch's ``n`` rows.

    Row ``i`` is the gradient with respect to ``params`` of the loss of example ``i`` alone:
    ``loss_fn(params, example_i)`` where ``example_i`` is row ``i`` of every tensor of ``batch``
    kept as a batch of one (``x[i:i+1]``), and its loss is what the step minimizes for that batch:
    ``total / count`` of an ``ft.Loss`` (a token loss: the mean over the example's tokens; a
    count of 0 gives 0), a plain scalar as it is, the first item of a ``(loss, aux)`` pair. The
    mean of the rows is therefore the step's gradient only when every example has the same count.

    Args:
        loss_fn: ``loss_fn(params, batch)``, as for ``ft.train_step``; it calls the model through
            ``ft.apply``. It must be traceable by ``torch.func``: no ``.item()`` or data-dependent
            Python control flow, no in-place updates of buffers (BatchNorm in training mode: use
            GroupNorm or LayerNorm), no activation checkpointing (saved-tensor hooks).
        params: a TensorDict (``ft.params_of(model)``).
        batch: a tensor, or a dict, TensorDict, list, tuple or namedtuple of tensors (nested),
            all split along dim 0; 0-d tensors and non-tensors are given to every example.

    **Invariant:** equals a Python loop of ``torch.autograd.grad`` over single examples (fp32,
    1e-6), dropout aside: each example draws its own masks from torch's generators.
    """
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            "ft.per_example_grads(loss_fn, params, batch): params must be a TensorDict (from "
            f"ft.params_of(model)), got {type(params).__name__}."
        )
    if not callable(loss_fn):
        raise TypeError(
            "ft.per_example_grads(loss_fn, ...): loss_fn must be callable as "
            f"loss_fn(params, batch), got {type(loss_fn).__name__}."
        )
    out = example_grads(lambda p, b: as_loss(loss_fn(p, b), b), params, batch)
    grads = tree.structure(params).unflatten(out.grads)
    return TensorDict(grads.to_dict(), batch_size=[out.values.shape[0]])
