"""A gradient engine built on ``torch.func.grad``, for steps run under ``torch.func`` transforms.

``torch.autograd.grad`` (what :class:`~ftrain.step.AutogradEngine` runs) cannot differentiate
inside ``torch.func.vmap``; ``torch.func.grad`` can, and composes with it. ``ft.vmap`` swaps this
engine in with its ``engine`` hook. Its price: ``torch.func`` refuses saved-tensor hooks, so
activation checkpointing (``ft.checkpoint``) and fsdp's gathering cannot run under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from ftrain import tree
from ftrain.internals import foreach
from ftrain.step.engine import Forward, Grads, add_aux, nonzero

__all__ = ["FuncEngine"]


class FuncEngine:
    """``torch.func.grad`` of each micro-batch's loss with respect to the params, summed.

    The same contract as :class:`~ftrain.step.AutogradEngine` (the ``GradEngine`` protocol), with
    the same choice of what is differentiated: each micro-batch's ``total``, or its mean times
    its count where a loss ``scale`` is given or the loss function returned a bf16/fp16 scalar
    mean (see ``AutogradEngine``). A parameter the loss does not use gets a zero gradient.
    ``ftrain.step.backward_plan()`` is None during its forward: nothing reduces during backward.
    """

    def __call__(
        self,
        forward: Forward,
        params: TensorDict,
        pieces: Sequence[Any],
        scale: torch.Tensor | None,
    ) -> Grads:
        values, tdef = tree.flatten(params)
        grads: list[torch.Tensor] | None = None
        total = count = None
        aux: dict[str, torch.Tensor] = {}
        for piece in pieces:
            reweighted: list[bool] = []  # decided in the forward, read after it

            def objective(leaves, piece=piece, reweighted=reweighted):
                loss, low_mean = forward(tdef.unflatten(leaves), piece)
                n = nonzero(loss.count.detach().to(torch.float32))
                reweighted.append(scale is not None or low_mean)
                out = loss.total
                if reweighted[0]:  # the mean (times the scale) is differentiated, then times n
                    out = loss.total * ((1.0 if scale is None else scale) / n)
                sums = (loss.total.detach().float(), loss.count.detach(), n)
                return out, (sums, {k: v.detach().float() for k, v in loss.aux.items()})

            g, ((t, c, n), piece_aux) = torch.func.grad(objective, has_aux=True)(values)
            g = list(g)
            if reweighted[0]:
                g = list(foreach.mul(g, n))
            grads = g if grads is None else list(foreach.add(grads, g))
            total, count = (t, c) if total is None else (total + t, count + c)
            add_aux(aux, piece_aux, len(pieces))
        # torch.func.grad's results may share memory (as autograd's do): not owned, so the step
        # divides them out of place
        return Grads(grads, total, count, aux, False)

    def __repr__(self) -> str:
        return "FuncEngine()"
