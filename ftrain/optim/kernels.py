"""Multi-tensor helpers the optimizer transforms share: counters, in-place-when-allowed
arithmetic on leaf lists, checks of a state's structure, per-tensor norms."""

from __future__ import annotations

import torch

from ftrain import foreach
from ftrain.optim.base import LeafContext

__all__ = ["zero_count", "mul", "add_", "as_update", "check_same_keys", "norms_and_roots"]


def zero_count() -> torch.Tensor:
    """A fresh step counter: a 0-d int64 zero."""
    return torch.zeros((), dtype=torch.int64)


def mul(u: list[torch.Tensor], factor, owned: bool) -> list[torch.Tensor]:
    """``u * factor``, in place when the update tensors are ours to overwrite."""
    if owned:
        foreach.mul_(u, factor)
        return u
    return list(foreach.mul(u, factor))


def add_(u: list[torch.Tensor], value: torch.Tensor) -> None:
    """``u += value`` for a 0-d tensor ``value``. Dynamo turns the single-tensor overload into a
    host read (a graph break), so while compiling it is given as a list."""
    if torch.compiler.is_compiling():
        foreach.add_(u, [value] * len(u))
    else:
        foreach.add_(u, value)


def as_update(g: list[torch.Tensor], m: list[torch.Tensor], owned: bool) -> list[torch.Tensor]:
    """The state ``m`` (e.g. a momentum) as the update, never aliasing it: copied into the
    gradient buffers ``g`` when they are ours to overwrite, else cloned. The step adds the update
    to the params and may donate the state, so the two must not share memory."""
    if owned:
        foreach.copy_(g, m)
        return g
    return [t.clone() for t in m]


def check_same_keys(ctx: LeafContext, fn: str, *names: str) -> None:
    """Check that the state's per-parameter sub-trees have the updates' keys, in their order."""
    for name in names:
        if ctx.state.child(name) != ctx.tree:
            raise KeyError(
                f"{fn}: state[{name!r}] does not have the keys of the updates (or not in the same "
                "order). Build the state with this optimizer's init(params)."
            )


def norms_and_roots(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """1-d float64 tensors: each tensor's L2 norm (one multi-tensor kernel) and ``sqrt(numel)``."""
    norms = torch.stack(foreach.norm(tensors)).to(torch.float64)
    roots = torch.tensor([t.numel() ** 0.5 for t in tensors], dtype=torch.float64)
    return norms, roots.to(norms.device)
