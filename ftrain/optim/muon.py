"""Muon: momentum orthogonalized by a Newton–Schulz iteration, for 2-D weight matrices.

``muon`` is a chain of small transforms, in the order of ``torch.optim.Muon``'s algorithm::

    ema_momentum(momentum, nesterov)     B = lerp(B, g, 1 - momentum); U = lerp(g, B, momentum)
    orthogonalize(ns_steps)              O = NS(U), in bfloat16, on whole matrices
    scale_by_shape(adjust_lr_fn)         O * sqrt(max(1, rows / cols))
    add_decayed_weights(weight_decay)    + weight_decay * W
    scale_by_learning_rate(lr)           * -lr

Muon suits the hidden matrices of a network only; :func:`muon_adamw` gives them Muon and the
embeddings, the output head, norms and biases AdamW.

References: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/; Liu et al., "Muon is Scalable for LLM Training"
(2025), https://arxiv.org/abs/2502.16982; ``torch.optim.Muon`` (torch 2.9+), whose conventions
this module follows.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain import tree
from ftrain.internals import foreach
from ftrain.optim.base import GradientTransformation, chain, empty_state, leafwise
from ftrain.optim.checks import check_range, checked
from ftrain.optim.fused import adam_transform, check_fused
from ftrain.optim.kernels import as_update, check_same_keys, mul, writable
from ftrain.optim.partition import partition
from ftrain.optim.primitives import add_decayed_weights, scale_by_learning_rate
from ftrain.optim.schedules import Schedule

__all__ = [
    "NS_COEFFICIENTS",
    "NOT_HIDDEN",
    "newton_schulz",
    "ema_momentum",
    "orthogonalize",
    "newton_schulz_cost",
    "scale_by_shape",
    "muon",
    "muon_labels",
    "muon_adamw",
]

# The quintic's (a, b, c), from Keller Jordan's Muon (torch uses the same): they maximize the
# slope at zero, so 5 steps bring every singular value into about [0.7, 1.2] rather than to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Dotted parameter paths that are not hidden matrices (searched with re.search): embeddings and
# output heads, in ftrain.models.GPT (wte, wpe, lm_head), HF GPT-2 (transformer.wte, lm_head),
# HF Llama/Mistral (model.embed_tokens, lm_head), GPT-NeoX (embed_in, embed_out), BERT-style
# (embeddings.word_embeddings), and top-level heads (Meta Llama's output, classifier, score).
NOT_HIDDEN = (
    r"(^|\.)(wte|wpe|lm_head)(\.|$)",
    r"embed",
    r"^(output|head|classifier|score)\.",
)

_ADJUST_LR = ("original", "match_rms_adamw")


def _is_dtensor(x: torch.Tensor) -> bool:
    # no DTensor can exist unless torch.distributed.tensor was imported: skip that heavy import
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
) -> torch.Tensor:
    """The approximate orthogonalization ``U V^T`` (of ``x = U S V^T``) of each matrix of ``x``
    (shape ``(..., rows, cols)``), in bfloat16.

    ``x / max(||x||_F, eps)`` (so every singular value is at most 1), then ``steps`` times
    ``X = a X + (b A + c A A) X`` with ``A = X X^T``, computed on the wide orientation (``X^T`` of a
    tall matrix) so that ``A`` is the smaller Gram matrix. The singular values come out near 1,
    not at 1 (the coefficients trade accuracy for speed). The same operations as
    ``torch.optim.Muon``; a batch of matrices gives the same bits as one matrix at a time on the CPU.
    """
    if x.dim() < 2:
        raise ValueError(f"newton_schulz(x): x must be a matrix or a batch of them, got {x.shape}.")
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    y = x.bfloat16()
    if tall:
        y = y.mT  # (..., cols, rows)
    batch = y.reshape(-1, *y.shape[-2:])  # (k, m, n) with m <= n
    batch = batch / batch.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = batch @ batch.mT  # (k, m, m); a step costs 2 m^2 n + m^3 multiply-adds
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A
        batch = torch.baddbmm(batch, poly, batch, beta=a)  # a X + (b A + c A A) X
    out = batch.reshape(y.shape)
    return out.mT if tall else out


def ema_momentum(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum as a moving average: ``m = decay * m + (1 - decay) * g``; the update is ``m``, or
    with nesterov ``(1 - decay) * g + decay * m``. State: ``ema``.

    torch.optim.Muon's form, written with ``lerp`` as torch writes it. It is :func:`ftrain.optim.trace` times ``1 - decay``: the same direction, which
    Newton–Schulz normalizes away, but not the same bfloat16 rounding, hence its own transform.
    """

    def init(params):
        return TensorDict({"ema": params.apply(torch.zeros_like)}, batch_size=[])

    def update(g, s, p, ctx):
        check_same_keys(ctx, "ema_momentum", "ema")
        lo, hi = ctx.state.span("ema")
        m = s[lo:hi]
        if ctx.inplace:
            foreach.lerp_(m, g, 1 - decay)
        else:
            m = list(foreach.lerp(m, g, 1 - decay))
        if nesterov and writable(ctx.owned, g, m):
            foreach.lerp_(g, m, decay)
            u = g
        elif nesterov:
            u = list(foreach.lerp(g, m, decay))
        else:
            u = as_update(g, m, ctx.owned)
        new_s = list(s)
        new_s[lo:hi] = m
        return u, new_s

    return leafwise(init, update)


def _check_matrices(tensors: Sequence[torch.Tensor], paths: Sequence[str]) -> None:
    bad = [f"{k!r} {tuple(t.shape)}" for k, t in zip(paths, tensors) if t.dim() != 2]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            "optim.muon orthogonalizes 2-D weight matrices only; these params are not 2-D: "
            f"{', '.join(bad[:5])}{more}. Use optim.muon_adamw(...), which gives Muon the hidden "
            "matrices and AdamW the rest, or optim.masked(optim.muon(...), mask) with a mask "
            "that selects matrices only."
        )


def newton_schulz_cost(shape: torch.Size) -> int:
    """Multiply-adds of one Newton–Schulz step on a ``shape`` matrix: ``2 m^2 n + m^3`` with
    ``m <= n`` its sides (the owners of sharded matrices are balanced by it)."""
    m, n = sorted(shape[-2:])
    return 2 * m * m * n + m**3


def orthogonalize(
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
) -> GradientTransformation:
    """Replace each update matrix by :func:`newton_schulz` of it (cast back to its dtype).

    Every param must be 2-D (checked at ``init`` and at every update, naming the others).
    Matrices of the same shape go through Newton–Schulz together, as one batch. Sharded updates
    (DTensors, under ``ft.shard`` zero1/zero2/fsdp) go through
    :func:`ftrain.distributed.data_parallel.owners.on_owners`: each matrix has one owner rank
    (balanced by
    :func:`newton_schulz_cost`), its rows travel there in bfloat16, the owner orthogonalizes it
    and sends each rank its rows of the result. The result equals the unsharded one.
    """

    def ortho(mats: list[torch.Tensor]) -> list[torch.Tensor]:
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(mats):
            groups.setdefault((tuple(x.shape), x.dtype, x.device), []).append(i)
        out = list(mats)
        for idx in groups.values():
            batch = torch.stack([mats[i] for i in idx])  # (k, rows, cols)
            for i, o in zip(idx, newton_schulz(batch, ns_steps, ns_coefficients, eps).unbind()):
                out[i] = o
        return out

    def init(params):
        values, tdef = tree.flatten(params)
        _check_matrices(values, tdef.paths)
        return empty_state()

    def update(u, s, p, ctx):
        _check_matrices(u, ctx.tree.paths)
        if any(_is_dtensor(x) for x in u):
            # only reached with DTensors, so ftrain.distributed is loaded already
            from ftrain.distributed.data_parallel.owners import on_owners

            done = on_owners(ortho, u, cost=newton_schulz_cost, dtype=torch.bfloat16)
        else:
            done = ortho(list(u))
        return [o.to(x.dtype) for o, x in zip(done, u)], s

    return leafwise(init, update)


def scale_by_shape(adjust_lr_fn: str = "original") -> GradientTransformation:
    """Multiply each ``(rows, cols)`` update by a factor of its shape, so that the steps of
    differently shaped matrices compare: ``"original"`` (Keller Jordan's): ``sqrt(max(1, rows /
    cols))``; ``"match_rms_adamw"`` (Moonshot's): ``0.2 * sqrt(max(rows, cols))``, which gives an
    orthogonalized update about AdamW's root mean square, so AdamW's learning rate and weight decay
    carry over. The names and factors of ``torch.optim.Muon``'s ``adjust_lr_fn``."""
    if adjust_lr_fn not in _ADJUST_LR:
        raise ValueError(
            f"scale_by_shape(adjust_lr_fn): must be one of {', '.join(map(repr, _ADJUST_LR))}, "
            f"got {adjust_lr_fn!r}."
        )

    def factor(shape) -> float:
        rows, cols = shape[0], shape[1]
        if adjust_lr_fn == "original":
            return math.sqrt(max(1.0, rows / cols))
        return 0.2 * math.sqrt(max(rows, cols))

    def update(u, s, p, ctx):
        return mul(u, [factor(x.shape) for x in u], ctx.owned), s

    return leafwise(lambda params: empty_state(), update)


@checked
def muon(
    learning_rate: float | Schedule,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: float = 0.0,
    mask=None,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    adjust_lr_fn: str = "original",
) -> GradientTransformation:
    """Muon for 2-D weight matrices: ``chain(ema_momentum, orthogonalize, scale_by_shape,
    add_decayed_weights, scale_by_learning_rate)``. Every param must be 2-D (an error names the
    others and points at :func:`muon_adamw`).

    Each step, for a matrix ``W`` with gradient ``g``::

        B = momentum * B + (1 - momentum) * g                    (ema_momentum)
        U = (1 - momentum) * g + momentum * B   if nesterov else B
        W -= lr * (scale(shape) * NS(U) + weight_decay * W)

    **Invariant:** matches ``torch.optim.Muon(lr, weight_decay, momentum, nesterov,
    ns_coefficients, eps, ns_steps, adjust_lr_fn)`` to 1e-5 relative over 50 steps
    (``tests/optim/test_muon.py``); ``mask`` (e.g. :func:`ftrain.optim.decay_mask`) limits the
    decay, which torch expresses with param groups.

    Conventions (torch's, where the references differ):

    * momentum is a moving average, ``lerp`` as torch and Keller Jordan's current code write it,
      not ftrain's :func:`~ftrain.optim.trace` (``B = momentum * B + g``): the same direction
      after Newton–Schulz, but not the same bfloat16 rounding.
    * Newton–Schulz runs in bfloat16 and divides by ``max(||U||_F, eps)`` with ``eps = 1e-7``
      (torch); Keller Jordan's code divides by ``||U||_F + 1e-7``, optax's by ``||U||_F + 1e-8``.
    * weight decay is decoupled and scaled by the unadjusted ``learning_rate``
      (``W *= 1 - lr * weight_decay``, torch); the shape factor scales the orthogonalized update
      only. torch's default ``weight_decay`` is 0.1; here it is 0.0, as for ``optim.sgd``.
    * ``adjust_lr_fn="original"`` is Keller Jordan's ``sqrt(max(1, rows / cols))`` for torch's
      ``(out, in)`` weights; Moonshot's ``"match_rms_adamw"`` is ``0.2 * sqrt(max(rows, cols))``
      (:func:`scale_by_shape`).
    """
    if not callable(learning_rate):
        check_range("muon", "learning_rate", learning_rate, 0.0)
    check_range("muon", "momentum", momentum, 0.0, 1.0)
    check_range("muon", "weight_decay", weight_decay, 0.0)
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or not 0 <= ns_steps < 100:
        raise ValueError(f"optim.muon: ns_steps must be an int in [0, 100), got {ns_steps!r}.")
    if len(ns_coefficients) != 3:
        raise ValueError(
            f"optim.muon: ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}."
        )
    parts = [
        ema_momentum(momentum, nesterov),
        orthogonalize(ns_steps, tuple(ns_coefficients), eps),
        scale_by_shape(adjust_lr_fn),
    ]
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay, mask))
    return chain(*parts, scale_by_learning_rate(learning_rate))


def muon_labels(params: TensorDictBase, exclude: Sequence[str] = NOT_HIDDEN) -> TensorDict:
    """``"muon"`` for the hidden matrices of ``params``, ``"adamw"`` for everything else: a
    TensorDict of strings keyed like ``params`` (the labels of :func:`muon_adamw`).

    A hidden matrix is a 2-D param whose dotted path matches none of the regular expressions
    ``exclude`` (``re.search``; default :data:`NOT_HIDDEN`: embeddings and output heads in
    ftrain's GPT, HF GPT-2 and Llama-style names). 1-D params (norms, biases) and tensors of 3 or
    more dims (e.g. ``ftrain.models.moe``'s stacked experts) are ``"adamw"``. For other names pass
    ``functools.partial(muon_labels, exclude=...)`` or a function of your own.

    >>> import ftrain as ft
    >>> from ftrain.models import GPT, GPTConfig
    >>> labels = muon_labels(ft.params_of(GPT(GPTConfig(d_model=16, n_layer=1, n_head=2))))
    >>> labels["blocks", "0", "mlp", "fc", "weight"], labels["wte", "weight"]
    ('muon', 'adamw')
    """
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            f"muon_labels(params): params must be a TensorDict (ft.params_of(module)), got "
            f"{type(params).__name__}."
        )
    patterns = [re.compile(p) for p in exclude]
    values, tdef = tree.flatten(params)
    labels = {
        k: "muon" if v.dim() == 2 and not any(p.search(k) for p in patterns) else "adamw"
        for k, v in zip(tdef.paths, values)
    }
    return tree.from_flat(labels)


def _within(mask):
    """``mask`` for a sub-tree of the params (a TensorDict mask is keyed like all of them)."""
    if mask is None or callable(mask):
        return mask
    flat = tree.to_flat(mask)
    return lambda sub: tree.from_flat({k: flat[k] for k in tree.paths(sub)})


@checked
def muon_adamw(
    learning_rate: float | Schedule,
    adamw_learning_rate: float | Schedule | None = None,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask=None,
    labels=None,
    adjust_lr_fn: str = "match_rms_adamw",
    fused: bool | None = None,
) -> GradientTransformation:
    """Muon for the hidden matrices, AdamW for the embeddings, the output head, norms and biases.

    ``labels`` says which is which, in any form :func:`ftrain.optim.partition` takes (a
    TensorDict or dict of ``"muon"`` / ``"adamw"`` keyed like the params, or a function
    ``params -> labels``); the default :func:`muon_labels` gives Muon every
    2-D param whose path is not an embedding's or a head's (ftrain's GPT, HF GPT-2 and Llama-style
    names; :data:`NOT_HIDDEN`). ``weight_decay`` (decoupled, limited by ``mask``, e.g.
    :func:`ftrain.optim.decay_mask`) applies to both parts.

    ``adjust_lr_fn`` defaults to ``"match_rms_adamw"`` (``torch.optim.Muon`` and :func:`muon`
    default to ``"original"``): the orthogonalized updates then have about AdamW's size, so one
    learning rate serves both parts, and ``adamw_learning_rate=None`` means ``learning_rate``.
    With ``"original"``, Muon wants a learning rate near 0.02 and AdamW one near 3e-4: pass both.
    ``fused`` is :func:`ftrain.optim.adamw`'s, for the AdamW part.

    **Invariant:** the hidden matrices get exactly :func:`muon`'s updates and state, the other
    params exactly :func:`ftrain.optim.adamw`'s with the same ``fused`` (each part sees only its
    own params): it is ``partition({"muon": muon(...), "adamw": adamw(...)}, labels)``. The state is
    ``{"muon": muon's state, "adamw": adamw's}``; the step's ``metrics["lr"]`` is Muon's.
    """
    labels = muon_labels if labels is None else labels
    hidden = muon(
        learning_rate,
        momentum,
        nesterov,
        ns_steps,
        weight_decay,
        _within(mask),
        adjust_lr_fn=adjust_lr_fn,
    )
    lr = learning_rate if adamw_learning_rate is None else adamw_learning_rate
    check_fused("muon_adamw", fused)
    rest = adam_transform(
        lr, b1, b2, eps, weight_decay, _within(mask), fused, decoupled=True
    )  # optim.adamw's
    return partition({"muon": hidden, "adamw": rest}, labels)
