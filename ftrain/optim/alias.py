"""Ready-made optimizers, each a ``chain`` of building blocks (never a re-derivation)."""

from __future__ import annotations

import types

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain import tree
from ftrain.optim.base import GradientTransformation, chain
from ftrain.optim.checks import check_lr, check_range, checked
from ftrain.optim.factorized import scale_by_factored_rms, scale_by_param_block_rms
from ftrain.optim.fused import adam_transform, check_fused, fused_sgd
from ftrain.optim.primitives import (
    add_decayed_weights,
    clip_by_block_rms,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_schedule,
    trace,
)
from ftrain.optim.schedules import Schedule, as_schedule

__all__ = ["sgd", "adam", "adamw", "lion", "adafactor", "decay_mask", "OPTIMIZERS"]


def decay_mask(params: TensorDictBase) -> TensorDict:
    """True for the leaves that weight decay should touch: tensors with 2 or more dimensions
    (matmul weights and embeddings), False for biases and normalization weights (1-d).

    The result is keyed like ``params``; pass the function itself as ``mask=`` (it is evaluated
    once per params structure).
    """
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            f"decay_mask(params): params must be a TensorDict (ft.params_of(module)), got "
            f"{type(params).__name__}."
        )
    values, tdef = tree.flatten(params)
    return tdef.unflatten([torch.tensor(v.dim() >= 2) for v in values])


@checked
def sgd(
    learning_rate=1e-2,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mask=None,
    fused: bool | None = None,
) -> GradientTransformation:
    """Stochastic gradient descent: ``chain(add_decayed_weights, trace, scale_by_learning_rate)``.

    ``weight_decay`` is L2 added to the gradient before momentum, as in torch; ``mask`` (e.g.
    :func:`decay_mask`) limits it to some leaves (``None``: every parameter, as torch does).
    ``fused`` is torch's argument: ``None`` runs the update in torch's fused SGD kernel wherever
    one exists for the leaves' device and dtype (the CPU included), ``True`` requires it, ``False``
    keeps the foreach chain (see :mod:`ftrain.optim.fused`).

    **Invariant:** matches ``torch.optim.SGD(lr, momentum, nesterov=..., weight_decay=...)``
    (dampening 0): 50 steps of a small transformer agree to 1e-6 relative
    (``tests/optim/test_alias.py``), fused or not; the fused and the foreach update agree to 1e-6 relative
    over 50 steps, with the same state (``tests/optim/test_fused.py``).

    Conventions: torch's. ``optax.sgd`` has no weight decay (optax users chain
    ``add_decayed_weights`` themselves, as this does first, where torch adds it); the momentum
    buffer is ``momentum * buf + g`` and nesterov steps along ``g + momentum * buf``, which is both
    torch's and ``optax.trace``'s form.
    """
    check_lr("sgd", learning_rate)
    check_range("sgd", "momentum", momentum, 0.0, 1.0)
    check_range("sgd", "weight_decay", weight_decay, 0.0)
    if nesterov and momentum == 0:
        raise ValueError("optim.sgd: nesterov=True needs momentum > 0.")
    check_fused("sgd", fused)
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay, mask))
    trace_key = str(len(parts)) if momentum else None
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    foreach_chain = chain(*parts)
    if fused is False:
        return foreach_chain
    return fused_sgd(
        foreach_chain,
        fused=fused,
        learning_rate=learning_rate,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        mask=mask,
        trace_key=trace_key,
        lr_key=str(len(parts) - 1),
    )


@checked
def adam(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask=None,
    fused: bool | None = None,
) -> GradientTransformation:
    """Adam: ``chain(add_decayed_weights, scale_by_adam, scale_by_learning_rate)``
    (``weight_decay`` is L2 added to the gradient, as in ``torch.optim.Adam``; ``mask``, e.g.
    :func:`decay_mask`, limits it to some leaves, ``None`` decays every parameter). ``fused``:
    as in :func:`adamw`.

    **Invariant:** matches ``torch.optim.Adam``: from the same params, moments and gradients each
    step agrees to 1e-6 relative; over 50 steps, ftrain stays as close to torch's foreach Adam as
    torch's fused Adam does (Adam amplifies 1-ulp differences; ``tests/optim/test_alias.py``). The fused
    and the foreach update agree to 1e-6 relative over 50 steps (``tests/optim/test_fused.py``).

    Conventions: ``eps`` is added outside the square root, ``m_hat / (sqrt(v_hat) + eps)``, as in
    torch and ``optax.adam`` (optax's ``eps_root``, inside it, is 0 here). The weight decay is
    torch's L2 (``optax.adam`` has none; for decoupled decay use :func:`adamw`).
    """
    check_lr("adam", learning_rate)
    check_range("adam", "b1", b1, 0.0, 1.0)
    check_range("adam", "b2", b2, 0.0, 1.0)
    check_range("adam", "eps", eps, 0.0)
    check_range("adam", "weight_decay", weight_decay, 0.0)
    check_fused("adam", fused)
    return adam_transform(learning_rate, b1, b2, eps, weight_decay, mask, fused, decoupled=False)


@checked
def adamw(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask=None,
    fused: bool | None = None,
) -> GradientTransformation:
    """AdamW (decoupled weight decay):
    ``chain(scale_by_adam, add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``.

    ``mask`` (e.g. :func:`decay_mask`) limits weight decay to some leaves; torch's AdamW decays
    every parameter, which is ``mask=None``.

    ``fused`` is torch's argument: ``None`` (the default) runs the update in torch's fused Adam
    kernel wherever one exists for the leaves' device and dtype (the CPU included; not for the
    sharded DTensors of ``ft.shard``'s zero/fsdp nor under ``ft.vmap``, which keep the chain),
    ``True`` requires it (an error naming the device and dtype where it is missing), ``False``
    keeps the foreach chain. Both paths have the same state, so checkpoints move between them;
    the choice is made at each update, from the leaves (:mod:`ftrain.optim.fused`).

    **Invariant:** matches ``torch.optim.AdamW``: from the same params, moments and gradients each
    step agrees to 1e-6 relative; over 50 steps, ftrain stays as close to torch's foreach AdamW as
    torch's fused AdamW does (``tests/optim/test_alias.py``). One known difference: torch multiplies
    params by ``1 - lr * weight_decay`` rounded to float32, ftrain adds ``lr * weight_decay * p``.
    The fused and the foreach update agree to 1e-6 relative over 50 steps, with masks, schedules,
    ``inject_hyperparams``, ``partition`` and donation (``tests/optim/test_fused.py``).

    Conventions: the decay is scaled by the learning rate (``p -= lr * (adam + wd * p)``), as in
    torch and ``optax.adamw`` alike; the default ``weight_decay`` is torch's 1e-2 (optax's is
    1e-4), and ``mask=None`` decays every parameter as torch does.

    >>> import torch, ftrain as ft
    >>> params = ft.params_of(torch.nn.Linear(4, 2))
    >>> opt = adamw(3e-4, weight_decay=0.1, mask=decay_mask)  # no decay on the bias
    >>> updates, state = opt.update(params.apply(torch.ones_like), opt.init(params), params)
    >>> round(float(updates["bias"][0]), 6)  # Adam's first step: lr times the gradient's sign
    -0.0003
    >>> decay = (updates["weight"] - updates["bias"][0]) / (-3e-4 * 0.1)  # weights also decay
    >>> torch.allclose(decay, params["weight"], atol=1e-3)
    True
    """
    check_lr("adamw", learning_rate)
    check_range("adamw", "b1", b1, 0.0, 1.0)
    check_range("adamw", "b2", b2, 0.0, 1.0)
    check_range("adamw", "eps", eps, 0.0)
    check_range("adamw", "weight_decay", weight_decay, 0.0)
    check_fused("adamw", fused)
    return adam_transform(learning_rate, b1, b2, eps, weight_decay, mask, fused, decoupled=True)


@checked
def lion(
    learning_rate=1e-4,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask=None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023): sign of an interpolated momentum, decoupled weight decay.

    Use a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger. Conventions:
    ``optax.lion``'s (torch has no Lion): the same defaults (``b1=0.9``, ``b2=0.99``), and the
    decay scaled by the learning rate, as in AdamW.
    """
    check_lr("lion", learning_rate)
    check_range("lion", "b1", b1, 0.0, 1.0)
    check_range("lion", "b2", b2, 0.0, 1.0)
    check_range("lion", "weight_decay", weight_decay, 0.0)
    return chain(
        scale_by_lion(b1, b2),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def _relative_step(learning_rate: Schedule) -> Schedule:
    """``min(1, 1 / (lr * sqrt(t)))`` with ``t = count + 1``: times ``lr`` it is Adafactor's
    relative step size ``rho_t = min(lr, 1 / sqrt(t))``."""

    def schedule(count):
        lr = learning_rate(count).to(torch.float64)
        return (1.0 / (lr * (count.to(torch.float64) + 1).sqrt())).clamp(max=1.0)

    return schedule


@checked
def adafactor(
    learning_rate=1e-2,
    decay_rate: float = 0.8,
    eps1: float | None = None,
    eps2: float = 1e-3,
    clipping_threshold: float = 1.0,
    weight_decay: float = 0.0,
    mask=None,
) -> GradientTransformation:
    """Adafactor with factored second moments; matches ``torch.optim.Adafactor`` step for step.

    The reference is ``torch.optim.Adafactor(lr, beta2_decay=-decay_rate, eps=(eps1, eps2),
    d=clipping_threshold, weight_decay)`` (torch 2.5+): the step of a param ``p`` with gradient
    ``g`` at step ``t`` is::

        U   = g / sqrt(max(v_hat, eps1**2))          # scale_by_factored_rms (row/col for >= 2-d)
        U  /= max(1, rms(U) / clipping_threshold)     # clip_by_block_rms
        p  -= min(lr, 1/sqrt(t)) * max(eps2, rms(p)) * U + lr * weight_decay * p

    as a chain of those building blocks, ``add_decayed_weights`` and ``scale_by_learning_rate``.
    Like torch (and unlike the paper), ``learning_rate`` caps the relative step and scales the
    decoupled weight decay; it may be a schedule, which torch would express by changing the
    group's ``lr``. ``eps1=None`` is the dtype's machine epsilon. Optimizer memory for a
    ``(R, C)`` matrix is ``R + C`` numbers.
    """
    check_lr("adafactor", learning_rate)
    check_range("adafactor", "decay_rate", decay_rate, 0.0)
    if eps1 is not None:
        check_range("adafactor", "eps1", eps1, 0.0)
    check_range("adafactor", "eps2", eps2, 0.0)
    check_range("adafactor", "clipping_threshold", clipping_threshold, 1.0)
    check_range("adafactor", "weight_decay", weight_decay, 0.0)
    schedule = as_schedule(learning_rate)
    return chain(
        scale_by_factored_rms(decay_rate, eps1),
        clip_by_block_rms(clipping_threshold),
        scale_by_param_block_rms(eps2),
        scale_by_schedule(_relative_step(schedule)),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(schedule),
    )


def _optimizers() -> types.MappingProxyType:
    from ftrain.optim.lamb import lamb
    from ftrain.optim.muon import muon_adamw
    from ftrain.optim.quantized import adamw8bit
    from ftrain.optim.schedule_free import schedule_free_adamw

    return types.MappingProxyType(
        {
            "sgd": sgd,
            "adam": adam,
            "adamw": adamw,
            "lion": lion,
            "adafactor": adafactor,
            "adamw8bit": adamw8bit,
            "lamb": lamb,
            "schedule_free_adamw": schedule_free_adamw,
            "muon": muon_adamw,  # Muon for hidden matrices needs AdamW for the rest
        }
    )


# Every alias by name (what ``ftrain train --optimizer`` accepts); each takes the learning rate
# (a number or a schedule) first. Read-only: what the process accepts cannot change under it.
OPTIMIZERS = _optimizers()
