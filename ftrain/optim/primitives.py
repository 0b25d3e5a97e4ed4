"""Building blocks: each a small factory returning a :class:`GradientTransformation`.

The math is multi-tensor: every update walks the leaves once per ``torch._foreach_*`` kernel, not
once per tensor per op. Counters are 0-d int64 tensors and scalar hyper-parameter math (bias
corrections, schedules) runs in float64 tensors, so nothing here is a Python number that changes.

Each transform is written as a leaf-level update ``fn(updates, state, params, ctx)`` over lists of
tensors (see :class:`ftrain.optim.base.LeafContext`); ``ctx.owned`` says the incoming update
tensors may be overwritten (inside a chain, after the first transform, they always may), and
``ctx.inplace`` says the state's may.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict

from ftrain.internals import foreach
from ftrain.internals.scoped import Scoped
from ftrain.optim.base import (
    GradientTransformation,
    empty_state,
    leafwise,
    masked,
)
from ftrain.optim.kernels import (
    add_,
    as_update,
    check_same_keys,
    mul,
    norms_and_roots,
    writable,
    zero_count,
)
from ftrain.optim.schedules import Schedule, as_schedule
from ftrain.tree import TreeDef

__all__ = [
    "scale",
    "scale_by_learning_rate",
    "recorded_learning_rate",
    "scale_by_schedule",
    "trace",
    "add_decayed_weights",
    "clip_by_global_norm",
    "clip_by_block_rms",
    "global_norm",
    "whole_model_norm",
    "with_whole_model_norm",
    "scale_by_adam",
    "scale_by_lion",
]


def _zeros(params) -> TensorDict:
    return params.apply(torch.zeros_like)


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` taken together, as a 0-d fp32 tensor (no host sync)."""
    if not tensors:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(foreach.norm(tensors)).float())


# The norm of leaves keyed like (a part of) the params, over the whole model, where a transform
# holds only part of the model on each process (ft.pipeline); None: global_norm of the leaves.
_WHOLE_NORM: Scoped[Callable[[list[torch.Tensor], TreeDef], torch.Tensor] | None] = Scoped(
    "ftrain.optim whole-model norm", None
)


def whole_model_norm(tensors: list[torch.Tensor], tdef: TreeDef) -> torch.Tensor:
    """The L2 norm of ``tensors`` (keyed by ``tdef``, like the params) over the whole model: their
    :func:`global_norm`, or inside :func:`with_whole_model_norm` the norm that gives, summed over
    the processes holding the other parts (each tensor held by several counted once)."""
    norm = _WHOLE_NORM.get()
    return global_norm(tensors) if norm is None else norm(tensors, tdef)


def with_whole_model_norm(
    inner: GradientTransformation, norm: Callable[[list[torch.Tensor], TreeDef], torch.Tensor]
) -> GradientTransformation:
    """``inner`` with every :func:`whole_model_norm` in its update computed by ``norm(tensors,
    tdef)``: what a transform that splits the params across processes without DTensor wraps the
    step's optimizer with, so that ``clip_by_global_norm`` clips by the whole model's norm."""

    def update(updates, state, params=None, *, inplace=False):
        with _WHOLE_NORM.using(norm):
            return inner.update(updates, state, params, inplace=inplace)

    return GradientTransformation(inner.init, update)


def scale(factor: float) -> GradientTransformation:
    """Multiply every update by the constant ``factor``."""
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise TypeError(f"scale(factor): factor must be a number, got {factor!r}.")

    def update(u, s, p, ctx):
        return mul(u, factor, ctx.owned), s

    return leafwise(lambda params: empty_state(), update)


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (or ``+`` with ``flip_sign=False``).

    ``learning_rate`` is a number or a schedule ``count -> lr`` (see ``ftrain.optim.schedules``),
    evaluated at the number of updates applied so far (0 for the first). The state holds that
    ``count`` and the ``lr`` just used: the optimizer state's record of its learning rate, which
    the train step reports as ``metrics["lr"]`` (:func:`recorded_learning_rate`).
    """
    schedule = as_schedule(learning_rate)
    sign = -1.0 if flip_sign else 1.0

    def init(params):
        del params
        return TensorDict(
            {"count": zero_count(), "lr": torch.zeros((), dtype=torch.float32)}, batch_size=[]
        )

    def update(u, s, p, ctx):
        i_count, i_lr = ctx.state.index("count"), ctx.state.index("lr")
        count = s[i_count]
        lr = schedule(count).to(torch.float64)
        u = mul(u, (sign * lr).to(torch.float32), ctx.owned)
        new_s = list(s)
        new_s[i_count], new_s[i_lr] = count + 1, lr.to(torch.float32)
        return u, new_s

    return leafwise(init, update)


def _lr_index(sdef: TreeDef) -> int | None:
    # scale_by_learning_rate's state is {count, lr}: an `lr` leaf with a `count` sibling (a
    # parameter named `lr` also gives `lr` leaves, inside moment trees, without one)
    paths = set(sdef.paths)
    return next(
        (
            i
            for i, k in enumerate(sdef.paths)
            if k.rsplit(".", 1)[-1] == "lr" and k[: -len("lr")] + "count" in paths
        ),
        None,
    )


def recorded_learning_rate(state: list[torch.Tensor], sdef: TreeDef) -> torch.Tensor:
    """The learning rate an optimizer state records, given as its leaves and key structure: the
    ``lr`` that :func:`scale_by_learning_rate` keeps beside its ``count`` (the first, in key
    order, where a combinator holds several: ``partition``'s or ``muon_adamw``'s), or NaN when
    the optimizer records none. An optimizer written without ``scale_by_learning_rate`` reports
    its learning rate by keeping the same ``{"count", "lr"}`` pair in its state."""
    index = sdef.derived(_lr_index)
    if index is None:
        return torch.full((), float("nan"))
    return state[index]


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)``, ``count`` being the number of updates applied
    so far (0 for the first). The state holds ``count``. Unlike :func:`scale_by_learning_rate`,
    the sign is kept and nothing is reported as ``lr``."""
    if not callable(step_size_fn):
        raise TypeError(
            f"scale_by_schedule(step_size_fn): expected a function count -> factor, got "
            f"{step_size_fn!r}. For a constant use optim.scale(factor)."
        )

    def init(params):
        del params
        return TensorDict({"count": zero_count()}, batch_size=[])

    def update(u, s, p, ctx):
        i_count = ctx.state.index("count")
        count = s[i_count]
        u = mul(u, step_size_fn(count).to(torch.float32), ctx.owned)
        new_s = list(s)
        new_s[i_count] = count + 1
        return u, new_s

    return leafwise(init, update)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``m = decay * m + g``; the update is ``m`` (or ``g + decay * m`` with nesterov).

    Matches ``torch.optim.SGD(momentum=decay, dampening=0, nesterov=...)``.
    """

    def init(params):
        return TensorDict({"trace": _zeros(params)}, batch_size=[])

    def update(g, s, p, ctx):
        check_same_keys(ctx, "trace", "trace")
        lo, hi = ctx.state.span("trace")
        m = s[lo:hi]
        if ctx.inplace:
            foreach.mul_(m, decay)
            foreach.add_(m, g)
        else:
            m = foreach.mul(m, decay)
            foreach.add_(m, g)
        if nesterov:
            if writable(ctx.owned, g, m):
                foreach.add_(g, m, alpha=decay)
                u = g
            else:
                u = list(foreach.add(g, m, alpha=decay))
        else:
            u = as_update(g, m, ctx.owned)
        new_s = list(s)
        new_s[lo:hi] = m
        return u, new_s

    return leafwise(init, update)


def add_decayed_weights(weight_decay: float = 0.0, mask=None) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update (decoupled weight decay when placed after Adam).

    ``mask`` (a TensorDict of booleans or a function ``params -> mask``, e.g.
    :func:`ftrain.optim.decay_mask`) limits the decay to the leaves where it is True.
    """
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool):
        raise TypeError(
            f"add_decayed_weights(weight_decay): expected a number, got {weight_decay!r}."
        )

    def update(u, s, p, ctx):
        if p is None:
            raise ValueError(
                "add_decayed_weights needs params: call update(updates, state, params)."
            )
        if weight_decay == 0.0:
            return u, s
        if ctx.owned:
            foreach.add_(u, p, alpha=weight_decay)
            return u, s
        return list(foreach.add(u, p, alpha=weight_decay)), s

    t = leafwise(lambda params: empty_state(), update)
    return masked(t, mask) if mask is not None else t


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / global_norm)`` so their joint L2 norm is at most
    ``max_norm``. No host sync: the factor stays a tensor. The norm is the whole model's
    (:func:`whole_model_norm`): under ``ft.pipeline`` too, where each process holds a part."""
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or max_norm <= 0:
        raise ValueError(f"clip_by_global_norm(max_norm): must be a number > 0, got {max_norm!r}.")

    def update(u, s, p, ctx):
        norm = whole_model_norm(u, ctx.tree)
        factor = (max_norm / norm.clamp_min(torch.finfo(norm.dtype).tiny)).clamp(max=1.0)
        return mul(u, factor, ctx.owned), s

    return leafwise(lambda params: empty_state(), update)


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Divide each update tensor by ``max(1, rms(update) / threshold)``, so no tensor's root mean
    square exceeds ``threshold`` (Adafactor's update clipping, ``d`` in ``torch.optim.Adafactor``).
    ``rms(t) = ||t|| / sqrt(numel(t))``; the factor is a tensor (no host sync)."""
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or threshold <= 0:
        raise ValueError(f"clip_by_block_rms(threshold): must be a number > 0, got {threshold!r}.")

    def update(u, s, p, ctx):
        norms, roots = norms_and_roots(u)
        denom = (norms / (roots * threshold)).clamp_min(1.0)  # torch: max(1, ||U|| / (sqrt(n) d))
        factors = list(denom.reciprocal().to(torch.float32).unbind())
        return mul(u, factors, ctx.owned), s

    return leafwise(lambda params: empty_state(), update)


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0
) -> GradientTransformation:
    """Adam's direction: ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with bias-corrected moments.

    State: ``count`` (int64), ``mu`` and ``nu`` (fp32, like the params). The moments follow
    ``torch.optim.Adam``'s foreach path (lerp for the first moment, ``mul`` + ``addcmul`` for the
    second, bias corrections in float64); the direction is computed as
    ``mu * 1 / (sqrt(nu) * (bc1 / sqrt(bc2)) + eps * bc1)`` in a single buffer (the incoming
    updates' own when they may be overwritten), so an in-place update allocates nothing.
    """

    def init(params):
        return TensorDict(
            {"count": zero_count(), "mu": _zeros(params), "nu": _zeros(params)}, batch_size=[]
        )

    def update(g, s, p, ctx):
        sdef = ctx.state
        check_same_keys(ctx, "scale_by_adam", "mu", "nu")
        i_count = sdef.index("count")
        (m_lo, m_hi), (v_lo, v_hi) = sdef.span("mu"), sdef.span("nu")
        mu, nu = s[m_lo:m_hi], s[v_lo:v_hi]
        count = s[i_count] + 1
        if ctx.inplace:
            foreach.lerp_(mu, g, 1 - b1)
            foreach.mul_(nu, b2)
            foreach.addcmul_(nu, g, g, 1 - b2)
        else:
            mu = foreach.lerp(mu, g, 1 - b1)
            nu = foreach.mul(nu, b2)
            foreach.addcmul_(nu, g, g, 1 - b2)
        t = count.to(torch.float64)
        bc1 = 1 - b1**t
        bc2_sqrt = (1 - b2**t).sqrt()
        # u = mu / (sqrt(nu) * bc1 / sqrt(bc2) + eps * bc1), built in one buffer. When the
        # gradients are ours, that buffer is theirs (free once the moments are updated): on CPU a
        # fresh allocation of a large tensor costs several times an in-place pass over it.
        if writable(ctx.owned, g, nu):
            u = g
            foreach.copy_(u, nu)
            if eps_root:
                foreach.add_(u, eps_root)
            foreach.sqrt_(u)
        else:
            u = list(foreach.sqrt(foreach.add(nu, eps_root) if eps_root else nu))
        foreach.mul_(u, (bc1 / bc2_sqrt).to(torch.float32))
        add_(u, (eps * bc1).to(torch.float32))
        foreach.reciprocal_(u)
        foreach.mul_(u, mu)
        new_s = list(s)
        new_s[i_count] = count
        new_s[m_lo:m_hi] = mu
        new_s[v_lo:v_hi] = nu
        return u, new_s

    return leafwise(init, update)


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"):
    ``u = sign(b1 * m + (1 - b1) * g)``, then ``m = b2 * m + (1 - b2) * g``. State: ``mu``."""

    def init(params):
        return TensorDict({"mu": _zeros(params)}, batch_size=[])

    def update(g, s, p, ctx):
        check_same_keys(ctx, "scale_by_lion", "mu")
        lo, hi = ctx.state.span("mu")
        m = s[lo:hi]
        u = list(foreach.lerp(m, g, 1 - b1))
        foreach.sign_(u)
        if ctx.inplace:
            foreach.lerp_(m, g, 1 - b2)
        else:
            m = foreach.lerp(m, g, 1 - b2)
        new_s = list(s)
        new_s[lo:hi] = m
        return u, new_s

    return leafwise(init, update)
