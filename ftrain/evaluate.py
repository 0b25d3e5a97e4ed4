"""``ft.evaluate``: the exact mean loss of your loss function over many batches, without gradients.

    val = ft.evaluate(loss_fn, state.params, val_batches)   # the loss_fn you train with
    print(f"val loss {val['loss']:.4f}  perplexity {val['perplexity']:.2f}")

The mean is the one training minimizes, over all the batches at once: loss totals summed, counts
summed, one division. Averaging per-batch means instead would weight a batch with few tokens as
much as a full one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from ftrain.apply import ApplyCache, caching, rewriting
from ftrain.internals.blocks import in_mode
from ftrain.losses import Loss, RowMean, TokenLoss, as_loss

__all__ = ["evaluate", "EvalMode"]


class EvalMode:
    """The rewrite ``ft.evaluate`` gives ``ft.apply``: run a copy of the module in which every
    submodule is in eval mode (``training`` False: dropout off, batch norm on its running
    statistics). The copy shares the module's parameter and buffer tables
    (``ftrain.internals.blocks.in_mode``), so ``ft.apply`` places its tensors as usual; the module
    itself and its ``training`` flags are never changed."""

    def rewrite(self, module: nn.Module) -> nn.Module:
        return in_mode(module, training=False)

    def rewrite_key(self) -> None:
        return None  # the copy depends on the module alone

    def __repr__(self) -> str:
        return "EvalMode()"


def evaluate(
    loss_fn: Callable[..., Any],
    params: TensorDictBase,
    batches: Iterable[Any],
    *,
    eval_mode: bool = True,
) -> dict[str, float]:
    """The mean of ``loss_fn(params, batch)`` over all of ``batches``, exactly, with no gradients.

    Args:
        loss_fn: the loss function you train with (``ft.train_step``'s): it returns an
            ``ft.Loss`` (a sum and its count), a scalar or ``ft.losses.row_mean(scalar)`` (a mean
            over the batch's rows), or ``(loss, aux)``. It calls the model through ``ft.apply``.
        params: the parameters to evaluate, e.g. ``state.params``.
        batches: any iterable of batches (a list, a loader, ``itertools.islice(loader, 50)``),
            read once.
        eval_mode: run every module that ``ft.apply`` calls in eval mode (``training`` False:
            dropout off, batch norm on its running statistics), as ``model.eval()`` would, without
            touching the module. ``False`` runs each module in its own mode.

    Returns:
        ``{"loss": sum(totals) / sum(counts), "count": sum(counts), "batches": n}``, plain
        Python numbers (one host sync, at the end), and ``"perplexity": exp(loss)`` when every
        batch's loss was a token loss (``ft.losses.TokenLoss``: ``cross_entropy``,
        ``causal_lm``). Totals and counts are summed in float64, so the result does not depend on
        how the data is cut into batches (up to the float32 rounding of each batch's total). A
        count of 0 gives a loss of NaN; no batch at all is an error. The loss's ``aux`` metrics
        are not averaged (a per-batch mean averaged over batches is not exact): evaluate another
        metric exactly with a loss function that returns it as ``ft.Loss(total, count)``.
    """
    if not callable(loss_fn):
        raise TypeError(
            f"ft.evaluate(loss_fn, params, batches): loss_fn must be callable as "
            f"loss_fn(params, batch), got {type(loss_fn).__name__}."
        )
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            f"ft.evaluate(loss_fn, params, batches): params must be a TensorDict (e.g. "
            f"state.params or ft.params_of(model)), got {type(params).__name__}."
        )
    total = count = None
    n, tokens = 0, True
    rewrites = (EvalMode(),) if eval_mode else ()
    # the cache keeps apply's placement plan and the eval-mode copy for the whole evaluation
    with torch.no_grad(), caching(ApplyCache()), rewriting(rewrites):
        for batch in batches:
            out = loss_fn(params, batch)
            raw = out[0] if isinstance(out, tuple) and not isinstance(out, (Loss, RowMean)) else out
            tokens = tokens and isinstance(raw, TokenLoss)
            loss = as_loss(out, batch)
            t, c = loss.total.detach().double(), loss.count.detach().double()
            total, count = (t, c) if total is None else (total + t, count + c)
            n += 1
    if n == 0:
        raise ValueError(
            "ft.evaluate(loss_fn, params, batches): batches held no batch. Pass a non-empty "
            "iterable (an exhausted iterator or loader gives none)."
        )
    total, count = float(total), float(count)
    mean = total / count if count else math.nan
    result = {"loss": mean, "count": int(count) if count.is_integer() else count, "batches": n}
    if tokens:
        result["perplexity"] = math.exp(mean) if mean == mean else math.nan
    return result
