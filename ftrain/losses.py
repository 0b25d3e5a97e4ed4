"""Losses that say what they are normalized by.

A loss for ftrain is a *sum* and the *count* it will be divided by. Keeping them apart is what makes
gradient accumulation and data parallelism exact: micro-batches and ranks add their sums and their
counts, and the division happens once, over the whole batch.

A loss function may also return a plain scalar, which ftrain takes as a mean over the batch rows.
Where a step combines several pieces (``ft.accumulate``, ``ft.shard``), that weights each piece by
its rows, which is wrong for a token mean over padded rows: the step says so at its first call
(:class:`ScalarLossWarning`), and :func:`row_mean` declares a scalar that really is a mean over rows.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ftrain.internals.batch import batch_rows

__all__ = [
    "Loss",
    "TokenLoss",
    "RowMean",
    "ScalarLossWarning",
    "cross_entropy",
    "causal_lm",
    "row_mean",
    "as_loss",
    "warn_row_weighted",
]


_NO_REDUCTION = 0  # aten's reduction enum: "none"


class Loss(NamedTuple):
    """A loss declared as ``total / count``.

    Attributes:
        total: 0-d tensor, the *sum* of per-example (or per-token) losses.
        count: 0-d tensor, what ``total`` is normalized by (e.g. the number of valid tokens).
        aux: mapping of extra 0-d tensors reported as metrics (not differentiated), e.g. accuracy;
            None means none.

    The value that is minimized is ``total / count`` over the whole batch, however the batch is
    split across micro-batches or processes.
    """

    total: torch.Tensor
    count: torch.Tensor
    aux: Mapping[str, torch.Tensor] | None = None

    @property
    def value(self) -> torch.Tensor:
        """``total / count`` (a count of zero gives zero, not NaN)."""
        return self.total / torch.where(self.count != 0, self.count, torch.ones_like(self.count))


class TokenLoss(Loss):
    """A :class:`Loss` whose ``total`` is a sum of per-token cross-entropies in nats and whose
    ``count`` is the number of tokens predicted, so ``exp(value)`` is a perplexity (what
    ``ft.evaluate`` reports). :func:`cross_entropy` and :func:`causal_lm` return one."""

    __slots__ = ()


class RowMean(NamedTuple):
    """A scalar declared as a mean over the batch rows (see :func:`row_mean`)."""

    value: torch.Tensor


class ScalarLossWarning(UserWarning):
    """A loss function returned a plain scalar to a step that weights it by rows (see
    :func:`warn_row_weighted`). ``warnings.simplefilter("error", ScalarLossWarning)`` makes it
    an error."""


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, *, fp32: bool = True
) -> TokenLoss:
    """Token cross-entropy as ``TokenLoss(sum over valid tokens, number of valid tokens)``.

    ``logits`` is ``(..., V)`` and ``targets`` is ``(...)``, already aligned (``targets[i]`` is
    what ``logits[i]`` predicts); positions where ``targets == ignore_index`` contribute nothing to
    either the sum or the count. The sum is computed in fp32 whatever the logits' dtype: with
    ``fp32=True`` (the default) from fp32 log-probabilities (bf16/fp16 logits are upcast first);
    with ``fp32=False`` from log-probabilities in the logits' dtype, as ``F.cross_entropy`` on
    bf16 logits computes them under CUDA autocast (nanoGPT's loss): no fp32 copy of the logits
    and half the bytes saved for backward (batch x seq x vocab of them, a language model's
    biggest activation), at bf16's rounding of each log-probability.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be targets {tuple(targets.shape)} "
            "plus a trailing vocabulary dimension."
        )
    x, t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if fp32:
        total = F.cross_entropy(x.float(), t, ignore_index=ignore_index, reduction="sum")
    else:  # the kernel accumulates in fp32 and writes the logits' dtype; the sum in fp32
        # dtype named: CUDA autocast runs a log_softmax without one in fp32 (a copy of the
        # logits upcast, fp32 log-probabilities); with it, as F.cross_entropy calls it
        logp = F.log_softmax(x, dim=-1, dtype=x.dtype)
        # picked by nll_loss, not a gather: compilers lower its backward as one fused pass, where
        # a gather's is a scatter into a zeroed logits-sized buffer (inductor's CPU backend even
        # falls back to an fp32 scatter_reduce). The aten op itself: autocast lists F.nll_loss
        # (its fp32 list: a copy of logp upcast), not the kernel beneath it
        picked, _ = torch.ops.aten.nll_loss_forward(logp, t, None, _NO_REDUCTION, ignore_index)
        total = picked.float().sum()  # -log p of each target, exact in the logits' dtype
    count = (targets != ignore_index).sum()
    return TokenLoss(total, count)


def causal_lm(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, *, fp32: bool = True
) -> TokenLoss:
    """Hugging Face's causal language-model loss as ``TokenLoss(sum, tokens predicted)``.

    Hugging Face's convention: ``labels`` is *not* shifted (often the ``input_ids`` themselves,
    with ``ignore_index`` on padding); the logits at position ``t`` predict ``labels[..., t + 1]``.
    So ``logits`` ``(..., T, V)`` and ``labels`` ``(..., T)`` are aligned here and the last
    position predicts nothing. The count is the number of *predicted* targets,
    ``(labels[..., 1:] != ignore_index).sum()``: one fewer per row than the row's labels (the first
    label is never a target). ``fp32`` is :func:`cross_entropy`'s. ``value`` equals ``model(input_ids, labels=labels).loss``; unlike
    that mean, the sum and count stay exact under ``ft.accumulate`` and ``ft.shard``::

        def loss_fn(params, batch):
            out = ft.apply(model, params, batch["input_ids"], attention_mask=batch["attention_mask"])
            return ft.losses.causal_lm(out.logits, batch["labels"])
    """
    if logits.dim() < 2 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"causal_lm: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a "
            "trailing vocabulary dimension, with the sequence dimension last in labels (the "
            "labels are not shifted: causal_lm shifts them)."
        )
    return cross_entropy(logits[..., :-1, :], labels[..., 1:], ignore_index, fp32=fp32)


def row_mean(value: torch.Tensor) -> RowMean:
    """Declare the scalar ``value`` a mean over the rows of the batch the loss function got.

    The step turns it into ``Loss(value * rows, rows)``, which is what it assumes for a plain
    scalar, without the :class:`ScalarLossWarning`: say so when every row weighs the same (one
    example per row, or rows with equal numbers of tokens), so that weighting the micro-batches of
    ``ft.accumulate`` and the processes of ``ft.shard`` by their rows is exact. Return it, or
    ``(row_mean(value), aux)``, from the loss function. A mean over tokens of padded rows is not
    a row mean: return ``ft.Loss(total, count)`` (e.g. :func:`causal_lm`) for it.
    """
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"row_mean(value): value must be a 0-d tensor (a mean over the rows), got {shape}."
        )
    return RowMean(value)


def _rows(batch) -> int:
    rows = batch_rows(batch)
    if rows is None:
        raise TypeError(
            "a loss_fn that returns a plain scalar (or row_mean) is taken as a mean over batch "
            f"rows, but the batch ({type(batch).__name__}) holds no tensor with a leading batch "
            "dimension. Return ft.Loss(total, count) instead."
        )
    return rows


def as_loss(out, batch) -> Loss:
    """Normalize what a ``loss_fn`` returned into a :class:`Loss`.

    Accepted: a :class:`Loss`; a 0-d tensor or a :class:`RowMean` (a mean over the batch rows, so
    ``count`` is the number of rows); a ``(loss, aux)`` pair where ``loss`` is any of those.
    """
    aux = {}
    if isinstance(out, tuple) and not isinstance(out, (Loss, RowMean)):
        if len(out) != 2:
            raise TypeError(
                f"loss_fn returned a tuple of {len(out)} items; return a Loss, a scalar tensor, "
                "or a (loss, aux_dict) pair."
            )
        out, aux = out
    if isinstance(out, RowMean):
        out = out.value
    if isinstance(out, Loss):
        total, count = out.total, out.count
        aux = {**(out.aux or {}), **aux}
    elif isinstance(out, torch.Tensor):
        if out.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar loss, got a tensor of shape {tuple(out.shape)}. "
                "Reduce it (e.g. .mean()), or return ft.Loss(total=losses.sum(), count=n)."
            )
        rows = _rows(batch)
        # in fp32: a bf16 `rows` would round (257 -> 256) and bias every gradient; fp16 overflows
        total, count = out.float() * rows, torch.tensor(rows, device=out.device)
    else:
        raise TypeError(
            f"loss_fn returned {type(out).__name__}; return ft.Loss(total, count), a scalar "
            "tensor (a mean over batch rows), or a (loss, aux_dict) pair."
        )
    if not isinstance(total, torch.Tensor) or total.dim() != 0:
        got = f"shape {tuple(total.shape)}" if isinstance(total, torch.Tensor) else repr(total)
        raise ValueError(
            f"loss_fn returned a Loss whose total is {got}; it must be a 0-d tensor, the sum of "
            "the losses: ft.Loss(total=losses.sum(), count=n)."
        )
    if not torch.is_floating_point(total):
        raise TypeError(
            f"loss_fn returned a Loss whose total is {total.dtype}; it must be floating point "
            "(e.g. losses.float().sum())."
        )
    if not isinstance(count, torch.Tensor):
        count = torch.tensor(count, device=total.device)
    if count.dim() != 0:
        raise ValueError(
            f"loss_fn returned a Loss whose count has shape {tuple(count.shape)}; it must be a "
            "0-d tensor or a number, what the total is divided by: ft.Loss(total, count=n)."
        )
    return Loss(total, count, aux)


def warn_row_weighted(
    loss_fn: Callable[..., Any], pieces: int, split_by: Sequence[str], reduced_by: Sequence[str]
) -> None:
    """Issue the :class:`ScalarLossWarning`: ``loss_fn`` returned a plain scalar to a step that
    splits each batch into ``pieces`` (by the transforms named ``split_by``) and sums across
    processes (``reduced_by``). The warning points at ``loss_fn``'s own code where it can."""
    how = []
    if pieces > 1:
        how.append(f"splits each batch into {pieces} pieces ({', '.join(split_by)})")
    if reduced_by:
        how.append(f"sums across processes ({', '.join(reduced_by)})")
    message = (
        f"loss_fn returned a plain scalar, and this step {' and '.join(how)}. ftrain takes a "
        "plain scalar as a mean over the rows of the piece it was computed on, and weights each "
        "piece by its number of rows. That is exact when every row weighs the same (one example "
        "per row, or rows of equal length). It is wrong for a mean over tokens with padded rows, "
        "such as a Hugging Face model's out.loss with labels -100 on padding: a piece with few "
        "real tokens then weighs as much as a full one, and the update differs from the one the "
        "whole batch gives (the gradient-accumulation bug). Fix it one of two ways: return the "
        "sum and its count, ft.Loss(total, count), e.g. ft.losses.causal_lm(out.logits, labels) "
        "for a Hugging Face causal LM or ft.losses.cross_entropy(logits, targets) for shifted "
        "targets; or, if the scalar is a mean over rows, say so: return "
        "ft.losses.row_mean(loss), which also silences this warning. (Shown once per step; "
        'warnings.simplefilter("error", ft.losses.ScalarLossWarning) makes it an error.)'
    )
    code = _code_of(loss_fn)
    if code is None:
        warnings.warn(message, ScalarLossWarning, stacklevel=3)
        return
    module = getattr(loss_fn, "__module__", None) or "ftrain"
    warnings.warn_explicit(
        message, ScalarLossWarning, code.co_filename, code.co_firstlineno, module
    )


def _code_of(fn: Callable[..., Any]):
    """The code object of ``fn`` (through decorators and ``functools.partial``), or of its class's
    ``__call__``; None for a builtin."""
    fn = inspect.unwrap(fn)
    fn = getattr(fn, "func", fn)  # functools.partial
    code = getattr(fn, "__code__", None)
    if code is None and not inspect.isfunction(fn):
        code = getattr(type(fn).__call__, "__code__", None)  # a callable object's method
    return code
