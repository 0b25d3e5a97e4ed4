"""Ready-made optimizers, each a ``chain`` of building blocks (never a re-derivation)."""

from __future__ import annotations

import difflib
import functools
import inspect

from tensordict import TensorDict, TensorDictBase

from ftrain import _tree
from ftrain.optim.base import GradientTransformation, chain
from ftrain.optim.transforms import (
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    trace,
)

__all__ = ["sgd", "adam", "adamw", "lion", "decay_mask", "OPTIMIZERS"]


def _checked(fn):
    """Turn an unknown keyword into an error that lists the legal ones and the closest match."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        unknown = [k for k in kwargs if k not in sig.parameters]
        if unknown:
            k = unknown[0]
            close = difflib.get_close_matches(k, list(sig.parameters), n=2)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            if k == "betas":
                hint = " ftrain takes the betas separately: b1=..., b2=...."
            raise TypeError(
                f"optim.{fn.__name__}: unknown option {k!r}.{hint} "
                f"Options: {', '.join(sig.parameters)}."
            )
        return fn(*args, **kwargs)

    return wrapper


def _check_range(fn: str, name: str, value: float, lo: float, hi: float | None = None) -> None:
    if not isinstance(value, (int, float)) or value < lo or (hi is not None and value >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"optim.{fn}: {name} must be in {rng}, got {value!r}.")


def _check_lr(fn: str, lr) -> None:
    if not callable(lr):
        _check_range(fn, "learning_rate", lr, 0.0)


def decay_mask(params: TensorDictBase) -> TensorDict:
    """True for the leaves that weight decay should touch: tensors with 2 or more dimensions
    (matmul weights and embeddings), False for biases and normalization weights (1-d)."""
    flat = _tree.to_flat(params)
    import torch

    return _tree.from_flat({k: torch.tensor(v.dim() >= 2) for k, v in flat.items()})


@_checked
def sgd(
    learning_rate=1e-2,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent; matches ``torch.optim.SGD`` (dampening 0).

    ``weight_decay`` is L2 added to the gradient before momentum, as in torch.
    """
    _check_lr("sgd", learning_rate)
    _check_range("sgd", "momentum", momentum, 0.0, 1.0)
    _check_range("sgd", "weight_decay", weight_decay, 0.0)
    if nesterov and momentum == 0:
        raise ValueError("optim.sgd: nesterov=True needs momentum > 0.")
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay))
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)


@_checked
def adam(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam; matches ``torch.optim.Adam`` (``weight_decay`` is L2 added to the gradient)."""
    _check_lr("adam", learning_rate)
    _check_range("adam", "b1", b1, 0.0, 1.0)
    _check_range("adam", "b2", b2, 0.0, 1.0)
    _check_range("adam", "eps", eps, 0.0)
    parts = [add_decayed_weights(weight_decay)] if weight_decay else []
    return chain(*parts, scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate))


@_checked
def adamw(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask=None,
) -> GradientTransformation:
    """AdamW (decoupled weight decay); matches ``torch.optim.AdamW``.

    ``mask`` (e.g. :func:`decay_mask`) limits weight decay to some leaves; torch's AdamW decays
    every parameter, which is ``mask=None``.
    """
    _check_lr("adamw", learning_rate)
    _check_range("adamw", "b1", b1, 0.0, 1.0)
    _check_range("adamw", "b2", b2, 0.0, 1.0)
    _check_range("adamw", "eps", eps, 0.0)
    _check_range("adamw", "weight_decay", weight_decay, 0.0)
    return chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


@_checked
def lion(
    learning_rate=1e-4,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mask=None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023): sign of an interpolated momentum, decoupled weight decay.

    Use a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger.
    """
    _check_lr("lion", learning_rate)
    _check_range("lion", "b1", b1, 0.0, 1.0)
    _check_range("lion", "b2", b2, 0.0, 1.0)
    _check_range("lion", "weight_decay", weight_decay, 0.0)
    return chain(
        scale_by_lion(b1, b2),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


OPTIMIZERS = {"sgd": sgd, "adam": adam, "adamw": adamw, "lion": lion}
