"""Building blocks: each a small factory returning a :class:`GradientTransformation`.

The math is multi-tensor: every update walks the leaves once per ``torch._foreach_*`` kernel, not
once per tensor per op. Counters are 0-d int64 tensors and scalar hyper-parameter math (bias
corrections, schedules) runs in float64 tensors, so nothing here is a Python number that changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict

from ftrain import _tree
from ftrain.optim.base import (
    GradientTransformation,
    empty_state,
    masked,
)

__all__ = [
    "scale",
    "scale_by_learning_rate",
    "trace",
    "add_decayed_weights",
    "clip_by_global_norm",
    "global_norm",
    "scale_by_adam",
    "scale_by_lion",
]

Schedule = Callable[[torch.Tensor], torch.Tensor]


def _zeros(params) -> TensorDict:
    return params.apply(torch.zeros_like)


def _count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _out(updates, values):
    return _tree.unflatten(updates, values)


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` taken together, as a 0-d fp32 tensor (no host sync)."""
    if not tensors:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)).float())


def scale(factor: float) -> GradientTransformation:
    """Multiply every update by the constant ``factor``."""

    def update(updates, state, params=None, *, inplace=False):
        del params
        u = _tree.leaves(updates)
        if inplace:
            torch._foreach_mul_(u, factor)
            return updates, state
        return _out(updates, torch._foreach_mul(u, factor)), state

    return GradientTransformation(lambda params: empty_state(), update)


def _as_schedule(lr: float | Schedule) -> Schedule:
    if callable(lr):
        return lr
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"learning rate must be a number or a schedule function, got {lr!r}.")
    if lr < 0:
        raise ValueError(f"learning rate must be >= 0, got {lr}.")
    value = float(lr)
    return lambda count: torch.full((), value, dtype=torch.float64)


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (or ``+`` with ``flip_sign=False``).

    ``learning_rate`` is a number or a schedule ``count -> lr`` (see ``ftrain.optim.schedules``),
    evaluated at the number of updates applied so far (0 for the first). The state holds that
    ``count`` and the ``lr`` just used, which the train step reports as ``metrics["lr"]``.
    """
    schedule = _as_schedule(learning_rate)
    sign = -1.0 if flip_sign else 1.0

    def init(params):
        del params
        return TensorDict(
            {"count": _count(), "lr": torch.zeros((), dtype=torch.float32)}, batch_size=[]
        )

    def update(updates, state, params=None, *, inplace=False):
        del params
        count = state["count"]
        lr = schedule(count).to(torch.float64)
        u = _tree.leaves(updates)
        factor = (sign * lr).to(torch.float32)
        if inplace:
            torch._foreach_mul_(u, factor)
            out = updates
        else:
            out = _out(updates, torch._foreach_mul(u, factor))
        return out, TensorDict({"count": count + 1, "lr": lr.to(torch.float32)}, batch_size=[])

    return GradientTransformation(init, update)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``m = decay * m + g``; the update is ``m`` (or ``g + decay * m`` with nesterov).

    Matches ``torch.optim.SGD(momentum=decay, dampening=0, nesterov=...)``.
    """

    def init(params):
        return TensorDict({"trace": _zeros(params)}, batch_size=[])

    def update(updates, state, params=None, *, inplace=False):
        del params
        g = _tree.leaves(updates)
        m = _tree.leaves(state["trace"])
        if inplace:
            torch._foreach_mul_(m, decay)
            torch._foreach_add_(m, g)
            new_m = m
        else:
            new_m = torch._foreach_add(torch._foreach_mul(m, decay), g)
        if nesterov:
            u = torch._foreach_add(g, new_m, alpha=decay)
        else:
            u = new_m if not inplace else [t.clone() for t in new_m]
        new_state = (
            state
            if inplace
            else TensorDict({"trace": _tree.unflatten(state["trace"], new_m)}, batch_size=[])
        )
        return _out(updates, u), new_state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float = 0.0, mask=None) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update (decoupled weight decay when placed after Adam).

    ``mask`` (a TensorDict of booleans or a function ``params -> mask``, e.g.
    :func:`ftrain.optim.decay_mask`) limits the decay to the leaves where it is True.
    """

    def update(updates, state, params=None, *, inplace=False):
        if params is None:
            raise ValueError(
                "add_decayed_weights needs params: call update(updates, state, params)."
            )
        if weight_decay == 0.0:
            return updates, state
        u, p = _tree.leaves(updates), _tree.leaves(params)
        if inplace:
            torch._foreach_add_(u, p, alpha=weight_decay)
            return updates, state
        return _out(updates, torch._foreach_add(u, p, alpha=weight_decay)), state

    t = GradientTransformation(lambda params: empty_state(), update)
    return masked(t, mask) if mask is not None else t


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / global_norm)`` so their joint L2 norm is at most
    ``max_norm``. No host sync: the factor stays a tensor."""
    if max_norm <= 0:
        raise ValueError(f"clip_by_global_norm(max_norm): must be > 0, got {max_norm}.")

    def update(updates, state, params=None, *, inplace=False):
        del params
        u = _tree.leaves(updates)
        norm = global_norm(u)
        factor = (max_norm / norm.clamp_min(torch.finfo(norm.dtype).tiny)).clamp(max=1.0)
        if inplace:
            torch._foreach_mul_(u, factor)
            return updates, state
        return _out(updates, torch._foreach_mul(u, factor)), state

    return GradientTransformation(lambda params: empty_state(), update)


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0
) -> GradientTransformation:
    """Adam's direction: ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with bias-corrected moments.

    State: ``count`` (int64), ``mu`` and ``nu`` (fp32, like the params). Arithmetic follows
    ``torch.optim.Adam``'s foreach path (lerp for the first moment, bias corrections in float64).
    """

    def init(params):
        return TensorDict(
            {"count": _count(), "mu": _zeros(params), "nu": _zeros(params)}, batch_size=[]
        )

    def update(updates, state, params=None, *, inplace=False):
        del params
        g = _tree.leaves(updates)
        mu, nu = _tree.leaves(state["mu"]), _tree.leaves(state["nu"])
        count = state["count"] + 1
        if inplace:
            torch._foreach_lerp_(mu, g, 1 - b1)
            torch._foreach_mul_(nu, b2)
            torch._foreach_addcmul_(nu, g, g, 1 - b2)
        else:
            mu = torch._foreach_lerp(mu, g, 1 - b1)
            nu = torch._foreach_addcmul(torch._foreach_mul(nu, b2), g, g, 1 - b2)
        t = count.to(torch.float64)
        bc1 = (1 - b1**t).to(torch.float32)
        bc2_sqrt = (1 - b2**t).sqrt().to(torch.float32)
        if eps_root:
            denom = torch._foreach_sqrt(torch._foreach_add(nu, eps_root))
        else:
            denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(mu, denom)
        torch._foreach_div_(u, bc1)
        if inplace:
            state["count"] = count
            return _out(updates, u), state
        new_state = TensorDict(
            {
                "count": count,
                "mu": _tree.unflatten(state["mu"], mu),
                "nu": _tree.unflatten(state["nu"], nu),
            },
            batch_size=[],
        )
        return _out(updates, u), new_state

    return GradientTransformation(init, update)


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"):
    ``u = sign(b1 * m + (1 - b1) * g)``, then ``m = b2 * m + (1 - b2) * g``. State: ``mu``."""

    def init(params):
        return TensorDict({"mu": _zeros(params)}, batch_size=[])

    def update(updates, state, params=None, *, inplace=False):
        del params
        g = _tree.leaves(updates)
        m = _tree.leaves(state["mu"])
        u = torch._foreach_sign(torch._foreach_lerp(m, g, 1 - b1))
        if inplace:
            torch._foreach_lerp_(m, g, 1 - b2)
            return _out(updates, u), state
        new_m = torch._foreach_lerp(m, g, 1 - b2)
        return _out(updates, u), TensorDict(
            {"mu": _tree.unflatten(state["mu"], new_m)}, batch_size=[]
        )

    return GradientTransformation(init, update)
