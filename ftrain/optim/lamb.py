"""LAMB: Adam with a layer-wise trust ratio (You et al., 2020, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes")."""

from __future__ import annotations

import torch

from ftrain import tree
from ftrain.internals import foreach
from ftrain.optim.base import GradientTransformation, chain, empty_state
from ftrain.optim.checks import check_lr, check_range, checked
from ftrain.optim.primitives import add_decayed_weights, scale_by_adam, scale_by_learning_rate

__all__ = ["scale_by_trust_ratio", "lamb"]


def scale_by_trust_ratio(min_norm: float = 0.0) -> GradientTransformation:
    """Scale each leaf's update by ``||param|| / ||update||`` (1 where either norm is
    ``<= min_norm``), so every layer moves by the same fraction of its own size."""

    def update(updates, state, params=None, *, inplace=False):
        if params is None:
            raise ValueError("scale_by_trust_ratio needs params: update(updates, state, params).")
        u = tree.leaves(updates)
        p_norm = torch.stack(foreach.norm(tree.leaves(params)))
        u_norm = torch.stack(foreach.norm(u))
        ok = (p_norm > min_norm) & (u_norm > min_norm)
        ratio = torch.where(ok, p_norm / u_norm.clamp_min(torch.finfo(u_norm.dtype).tiny), 1.0)
        factors = list(ratio.unbind())
        if inplace:
            foreach.mul_(u, factors)
            return updates, state
        return tree.unflatten(updates, foreach.mul(u, factors)), state

    return GradientTransformation(lambda params: empty_state(), update)


@checked
def lamb(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    mask=None,
) -> GradientTransformation:
    """LAMB = ``chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio,
    scale_by_learning_rate)``: AdamW's direction, rescaled per layer by the trust ratio."""
    check_lr("lamb", learning_rate)
    check_range("lamb", "b1", b1, 0.0, 1.0)
    check_range("lamb", "b2", b2, 0.0, 1.0)
    check_range("lamb", "eps", eps, 0.0)
    check_range("lamb", "weight_decay", weight_decay, 0.0)
    return chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(),
        scale_by_learning_rate(learning_rate),
    )
