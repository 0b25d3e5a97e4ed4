"""Dropout drawn from a key: :class:`keyed_dropout` makes every dropout mask a function of a key.

torch's dropout draws from a stateful generator. Under ``torch.func.vmap`` that generator is shared
by the whole batch of models, so a member's masks would depend on how many members there are and
where it sits. Inside ``with keyed_dropout(key):`` the dropout calls are computed instead from
``ftrain.rng``'s counter-based streams: the n-th dropout call draws ``rng.uniform(fold_in(key,
n), shape)``. Those are plain tensor ops, so ``vmap`` over a batch of keys gives each member
masks that depend on its own key only, and ``torch.compile`` puts them in its graph.

Replaced (a ``TorchFunctionMode``, scoped to the block):

* ``F.dropout`` (and so ``nn.Dropout``): keep ``x / (1 - p)`` where ``u >= p``, zero elsewhere.
* ``F.scaled_dot_product_attention`` with ``dropout_p > 0``: the attention written out (scores,
  masks, softmax, keyed dropout of the weights, weighted sum of the values), as in the reference
  implementation of torch's documentation. With ``dropout_p == 0`` torch's kernel runs unchanged.

Other random functions (``torch.rand``, ``F.dropout2d``, ``F.alpha_dropout``, ...) are left to
torch's generators.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ftrain import rng

__all__ = ["keyed_dropout", "dropout", "attention"]


def dropout(x: torch.Tensor, p: float, key: torch.Tensor) -> torch.Tensor:
    """``x`` with each entry zeroed with probability ``p`` and the others scaled by ``1/(1-p)``;
    the mask is ``rng.uniform(key, x.shape) < p``, a pure function of ``key``. A ``p`` outside
    [0, 1] raises ``ValueError``, as ``F.dropout`` does."""
    _check_p(p)
    if p == 0.0:
        return x
    if p == 1.0:
        return torch.zeros_like(x)
    keep = rng.uniform(key, x.shape, device=x.device) >= p
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros_like(x))


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:  # torch's own check and message, kept under the mode
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    key: torch.Tensor,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with its attention weights dropped out by
    :func:`dropout` under ``key``. Costs the (L, S) score matrix per head in memory."""
    length, source = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa:  # each group of query heads shares one key/value head
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., L, S)
    if is_causal:
        allowed = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = dropout(torch.softmax(scores, dim=-1), dropout_p, key)
    return weights @ v  # (..., L, Ev)


_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = (None, 0.0, False, None, False)
_DROPOUT_ARGS = ("p", "training", "inplace")
_DROPOUT_DEFAULTS = (0.5, True, False)


def _bound(args: tuple, kwargs: dict, names: tuple, defaults: tuple, skip: int) -> list:
    """The values of the optional arguments ``names`` after the first ``skip`` positional ones."""
    given = list(args[skip:])
    rest = given + list(defaults[len(given) :])
    return [kwargs.get(n, rest[i]) for i, n in enumerate(names)]


def _leading(args: tuple, kwargs: dict, names: tuple) -> list:
    """The leading arguments ``names``, given by position or by name."""
    return [args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names)]


class keyed_dropout(TorchFunctionMode):  # noqa: N801 - used as a function: `with keyed_dropout(k):`
    """A context manager: inside, dropout masks come from ``key`` (a 0-d int64 tensor, batched
    under ``vmap``) and a count of the dropout calls made inside the block, not from torch's
    generators (see the module docstring). The same key and the same sequence of calls give the
    same masks, whatever else runs beside them."""

    def __init__(self, key: torch.Tensor):
        super().__init__()
        self.key = key
        self.calls = 0  # dropout calls so far: the n-th draws from fold_in(key, n)

    def _next_key(self) -> torch.Tensor:
        key = rng.fold_in(self.key, self.calls)
        self.calls += 1
        return key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            p, training, inplace = _bound(args, kwargs, _DROPOUT_ARGS, _DROPOUT_DEFAULTS, 1)
            (x,) = _leading(args, kwargs, ("input",))
            _check_p(p)
            if not training or p == 0.0:
                return x
            out = dropout(x, p, self._next_key())
            return x.copy_(out) if inplace else out
        if func is F.scaled_dot_product_attention:
            mask, p, causal, scale, gqa = _bound(args, kwargs, _SDPA_ARGS, _SDPA_DEFAULTS, 3)
            if p > 0.0:
                q, k, v = _leading(args, kwargs, ("query", "key", "value"))
                return attention(q, k, v, mask, p, causal, scale, gqa, self._next_key())
        return func(*args, **kwargs)
