"""Torch's fused optimizer kernels as an implementation of the ``adam``, ``adamw`` and ``sgd``
chains.

Each of those aliases is a ``chain`` of building blocks (``scale_by_adam``,
``add_decayed_weights``, ``trace``, ``scale_by_learning_rate``), whose foreach math walks the leaves
once per operation. With ``fused=None`` (their default) or ``fused=True`` the alias's update runs the
same math in torch's fused multi-tensor kernel instead (``torch._fused_adamw_``, ``_fused_adam_``,
``_fused_sgd_``: one pass over gradients and moments); ``fused=False`` is the chain itself.

**Where the choice is made, and why:** at each update, from the leaves it is given: their device,
dtype and layout, which the optimizer cannot know when it is built (a state may be created on the
CPU and moved to a GPU, ``ft.shard`` hands sharded DTensors and ``ft.vmap`` batched tensors to the
same optimizer). It is a function of the leaves: each is checked the first time a structure (keys,
and the first leaf's type, device and dtype) is seen, and the answer is remembered for it, so a
step pays one dictionary lookup. ``fused=None`` takes the kernel wherever
:func:`ftrain.optim.kernels.fused_refusal` finds one, else the chain; ``fused=True`` refuses, with
the device and dtype named, where none exists, already at ``init`` (before training starts) for the
params it is given.

**Under ``ft.compile``** the update is the chain, for ``fused=None`` and ``True`` alike: inductor
generates its own fused kernels from the chain's foreach math, and torch's fused ops that take the
learning rate as a tensor (``_fused_adamw_.tensor_lr``, ``_fused_sgd_``) have no fake (meta)
implementation that a compiler could trace (torch 2.13). Only eager steps call torch's kernels.

**What stays the same** (the invariant, ``tests/optim/test_fused.py``): the state (``init`` is the
chain's: ``mu``/``nu``/``count``, ``trace``, the learning rate's ``count``/``lr``; a checkpoint
written on one path loads on the other), the ``lr`` the step reports, decay masks (the decay is
applied per leaf as the chain's ``masked`` does), schedules (evaluated from the state's count as a
tensor, given to the kernel as a tensor: no host sync on an accelerator), ``inject_hyperparams``,
``partition``, donation (``inplace``: the moments are updated in their own buffers). Only rounding
differs: from the same params, state and gradients the two agree to 1e-6 relative at each of 50
steps; whole runs drift apart only as far as torch's own fused and foreach AdamW do (Adam amplifies
1-ulp differences).

**What it costs:** in ``torch.optim`` the kernel writes the new params. An ftrain ``update``
returns *updates*, which the caller then adds to the params, so there the kernel writes into a
fresh buffer that starts at zero (or, for AdamW's decoupled decay, at ``-lr * wd * p``) and ends
as the update: a params-sized buffer held during the update (the foreach chain, in place, reuses
the gradients' buffers instead) and one pass more than torch's fused step. Where the caller wants
the new params, :func:`ftrain.optim.update_and_apply` (``leaf_apply``) runs torch.optim's way: the
kernel decays and steps the params themselves, in place when allowed, with no extra buffer
(``benchmarks/fused.py`` measures the three).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftrain import tree
from ftrain.internals import foreach
from ftrain.optim import kernels
from ftrain.optim.base import (
    GradientTransformation,
    LeafContext,
    chain,
    leaf_apply,
    leaf_update,
    leafwise,
    mask_flags,
)
from ftrain.optim.kernels import check_same_keys
from ftrain.optim.primitives import add_decayed_weights, scale_by_adam, scale_by_learning_rate
from ftrain.optim.schedules import as_schedule

__all__ = ["adam_transform", "fused_adam", "fused_sgd", "check_fused"]

Leaves = list[torch.Tensor]


def check_fused(fn: str, fused) -> None:
    """``fused`` must be True, False or None (torch's argument, torch's values)."""
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(
            f"optim.{fn}(fused=...): expected True (torch's fused kernel, required), False (the "
            f"foreach chain) or None (fused where torch has a kernel for the leaves), got {fused!r}."
        )


def _refused(fn: str, why: str) -> ValueError:
    return ValueError(
        f"optim.{fn}(fused=True): torch has no fused kernel for {why}. Pass fused=None (the "
        "fused kernel where one exists, else the foreach chain) or fused=False."
    )


def _choosing(
    fn: str, chain_t: GradientTransformation, fused, run, flags_of
) -> GradientTransformation:
    """``chain_t``'s init, and an update that runs ``run`` (the fused math) or the chain's own,
    as the module docstring says. ``init`` also resolves the decay mask (``flags_of``) for the
    params' structure, as the chain's ``masked`` does: a compiled step then reads no mask value."""
    chain_fn = leaf_update(chain_t)
    verdicts: dict = {}  # (structure, first leaf's type, device, dtype) -> fused_refusal's answer

    def refusal(u: Leaves, s: Leaves, p: Leaves | None, tdef: tree.TreeDef) -> str | None:
        if foreach.is_looped():
            return "batched leaves under ft.vmap (its per-tensor loop)"
        if not u:
            return "an empty tree"
        first = u[0]
        key = (tdef, type(first), first.device, first.dtype, kernels.is_wrapped(first))
        if key not in verdicts:  # every tensor the kernel sees, checked once per key
            moments = [t for t in s if t.dim()]  # not the counters
            verdicts[key] = kernels.fused_refusal([*u, *moments, *(p or [])])
        return verdicts[key]

    def init(params):
        leaves, tdef = tree.flatten(params)
        if fused:
            why = kernels.fused_refusal(leaves)
            if why is not None:
                raise _refused(fn, why)
        if flags_of is not None:
            flags_of(tdef, leaves)
        return chain_t.init(params)

    def fused_here(u, s, p, ctx) -> bool:
        if tree.compiling():  # inductor fuses the chain itself; see the module docstring
            return False
        why = refusal(u, s, p, ctx.tree)
        if why is not None and fused:
            raise _refused(fn, why)
        return why is None

    def update(u, s, p, ctx):
        if fused_here(u, s, p, ctx):
            return run(u, s, p, ctx, False)
        return chain_fn(u, s, p, ctx)

    chain_apply = leaf_apply(chain_t)

    def apply(g, s, p, ctx):  # the kernel writes the params: see leaf_apply
        if fused_here(g, s, p, ctx):
            return run(g, s, p, ctx, True)
        return chain_apply(g, s, p, ctx)

    return leafwise(init, update, apply)


def _decay_flags(mask) -> Callable[[tree.TreeDef, Leaves], list[bool]]:
    """One bool per leaf: whether weight decay touches it (``mask=None``: every leaf). A mask
    function is evaluated once per params structure (keys and shapes) and remembered, as
    :func:`ftrain.optim.masked` does."""
    cache: dict = {}

    def flags(tdef: tree.TreeDef, p: Leaves) -> list[bool]:
        if mask is None:
            return [True] * len(p)
        key = (tdef.sig, tuple(t.shape for t in p)) if callable(mask) else tdef.sig
        got = cache.get(key)
        if got is None:
            got = mask_flags(mask, tdef.unflatten(p))
            if not tree.compiling():
                cache[key] = got
        return got

    return flags


def _with_l2(g: Leaves, p: Leaves, flags: list[bool], wd: float, owned: bool) -> Leaves:
    """``g + wd * p`` on the flagged leaves, as ``add_decayed_weights`` computes it (in place
    when ``g`` is ours)."""
    idx = [i for i, f in enumerate(flags) if f]
    if not idx:
        return g
    sub_g, sub_p = [g[i] for i in idx], [p[i] for i in idx]
    if owned:
        foreach.add_(sub_g, sub_p, alpha=wd)
        return g
    out = list(g)
    for i, x in zip(idx, foreach.add(sub_g, sub_p, alpha=wd)):
        out[i] = x
    return out


def _start(g: Leaves, p: Leaves | None, flags: list[bool] | None, factor) -> Leaves:
    """Fresh buffers for the kernel to write the updates into: ``factor * p`` on the flagged
    leaves (decoupled weight decay, ``factor = -lr * wd``), zeros elsewhere."""
    out = [torch.zeros_like(x) for x in g] if flags is None else [None] * len(g)
    if flags is not None:
        idx = [i for i, f in enumerate(flags) if f]
        for i, x in zip(idx, foreach.mul([p[i] for i in idx], factor) if idx else []):
            out[i] = x
        for i, f in enumerate(flags):
            if not f:
                out[i] = torch.zeros_like(g[i])
    return out


def _by_decay(flags: list[bool] | None, n: int, wd: float) -> list[tuple[list[int], float]]:
    """The leaves by the weight decay the kernel gives them: ``(positions, wd)``, one kernel
    call each (the decayed ones, then the others; empty groups left out)."""
    if flags is None:
        return [(list(range(n)), wd)]
    groups = [
        ([i for i, f in enumerate(flags) if f], wd),
        ([i for i, f in enumerate(flags) if not f], 0.0),
    ]
    return [(idx, w) for idx, w in groups if idx]


def _moments(s: Leaves, lo: int, hi: int, inplace: bool) -> Leaves:
    """The state's buffers ``s[lo:hi]``, which the kernel updates in place: themselves when the
    state may be overwritten, else copies."""
    return list(s[lo:hi]) if inplace else [t.clone() for t in s[lo:hi]]


def _learning_rate(schedule, s: Leaves, sdef: tree.TreeDef, key: str):
    """``scale_by_learning_rate``'s part: the positions of its ``count`` and ``lr`` in ``s``, and
    the rate at that count as float32 (exactly the factor the chain multiplies by)."""
    lo, _ = sdef.span(key)
    sub = sdef.child(key)
    i_count, i_lr = lo + sub.index("count"), lo + sub.index("lr")
    lr = schedule(s[i_count]).to(torch.float64).to(torch.float32)
    return i_count, i_lr, lr


def _need_params(p, fn: str) -> None:
    if p is None:
        raise ValueError(
            f"optim.{fn}: weight decay needs params: call update(updates, state, params)."
        )


def fused_adam(
    chain_t: GradientTransformation,
    *,
    fn: str,
    fused: bool | None,
    learning_rate,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    mask,
    decoupled: bool,
    adam_key: str,
    lr_key: str,
) -> GradientTransformation:
    """``chain_t`` (``adam``'s or ``adamw``'s chain; its ``scale_by_adam`` state under
    ``adam_key``, its ``scale_by_learning_rate`` state under ``lr_key``) with its update run by
    torch's fused Adam kernel where ``fused`` says so (see the module docstring).

    ``decoupled``: AdamW's decay ``-lr * wd * p`` is the buffer the kernel starts from; else
    (Adam) the decay is L2, added to the gradients first, as the chain adds it."""
    schedule = as_schedule(learning_rate)
    flags_of = _decay_flags(mask)

    def run(g, s, p, ctx, write_params: bool):
        sdef = ctx.state
        lo, _ = sdef.span(adam_key)
        adef = sdef.child(adam_key)
        check_same_keys(LeafContext(ctx.tree, adef, ctx.inplace, ctx.owned), fn, "mu", "nu")
        (m_lo, m_hi), (v_lo, v_hi) = adef.span("mu"), adef.span("nu")
        mu = _moments(s, lo + m_lo, lo + m_hi, ctx.inplace)
        nu = _moments(s, lo + v_lo, lo + v_hi, ctx.inplace)
        i_count = lo + adef.index("count")
        count = s[i_count] + 1
        i_lr_count, i_lr, lr = _learning_rate(schedule, s, sdef, lr_key)
        flags = None
        if weight_decay:
            _need_params(p, fn)
            flags = flags_of(ctx.tree, p)
        # the kernels' copies of the step and the rate, made once for every call below
        k_count, k_lr = (kernels.scalar_on(x, g[0].device) for x in (count, lr))
        if write_params:  # torch.optim's way: the kernel decays and steps the params
            out = p if ctx.inplace else [t.clone() for t in p]
            for idx, wd in _by_decay(flags, len(p), weight_decay):
                kernels.fused_adam_(
                    *([x[i] for i in idx] for x in (out, g, mu, nu)), k_count, k_lr,
                    b1=b1, b2=b2, eps=eps, weight_decay=wd, decoupled=decoupled,
                )  # fmt: skip
        else:  # the updates, which the caller adds: the decay as the chain does it
            if flags is not None and not decoupled:
                g = _with_l2(g, p, flags, weight_decay, ctx.owned)
            out = _start(g, p, flags if decoupled else None, -lr * weight_decay)
            kernels.fused_adam_(out, g, mu, nu, k_count, k_lr, b1=b1, b2=b2, eps=eps)
        new_s = list(s)
        new_s[i_count] = count
        new_s[lo + m_lo : lo + m_hi] = mu
        new_s[lo + v_lo : lo + v_hi] = nu
        new_s[i_lr_count], new_s[i_lr] = s[i_lr_count] + 1, lr
        return out, new_s

    return _choosing(fn, chain_t, fused, run, flags_of if weight_decay else None)


def fused_sgd(
    chain_t: GradientTransformation,
    *,
    fused: bool | None,
    learning_rate,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    mask,
    trace_key: str | None,
    lr_key: str,
) -> GradientTransformation:
    """``chain_t`` (``sgd``'s chain; its ``trace`` state under ``trace_key`` when it has
    momentum, its ``scale_by_learning_rate`` state under ``lr_key``) with its update run by
    torch's fused SGD kernel where ``fused`` says so (see the module docstring). The L2 decay is
    added to the gradients first, as the chain adds it."""
    schedule = as_schedule(learning_rate)
    flags_of = _decay_flags(mask)

    def run(g, s, p, ctx, write_params: bool):
        sdef = ctx.state
        bufs: Leaves = []
        if trace_key is not None:
            lo, _ = sdef.span(trace_key)
            tdef = sdef.child(trace_key)
            check_same_keys(LeafContext(ctx.tree, tdef, ctx.inplace, ctx.owned), "sgd", "trace")
            t_lo, t_hi = tdef.span("trace")
            bufs = _moments(s, lo + t_lo, lo + t_hi, ctx.inplace)
        i_lr_count, i_lr, lr = _learning_rate(schedule, s, sdef, lr_key)
        flags = None
        if weight_decay:
            _need_params(p, "sgd")
            flags = flags_of(ctx.tree, p)
        k_lr = kernels.scalar_on(lr, g[0].device)  # the kernels' copy, made once
        if write_params:  # torch.optim's way: the kernel adds the L2 term and steps the params
            out = p if ctx.inplace else [t.clone() for t in p]
            for idx, wd in _by_decay(flags, len(p), weight_decay):
                kernels.fused_sgd_(
                    *([x[i] for i in idx] for x in (out, g)), [bufs[i] for i in idx] if bufs else [],
                    k_lr, momentum=momentum, nesterov=nesterov, weight_decay=wd,
                )  # fmt: skip
        else:  # the updates, which the caller adds: the L2 term added first, as the chain does
            if flags is not None:
                g = _with_l2(g, p, flags, weight_decay, ctx.owned)
            out = _start(g, None, None, None)
            kernels.fused_sgd_(out, g, bufs, k_lr, momentum=momentum, nesterov=nesterov)
        new_s = list(s)
        if trace_key is not None:
            new_s[lo + t_lo : lo + t_hi] = bufs
        new_s[i_lr_count], new_s[i_lr] = s[i_lr_count] + 1, lr
        return out, new_s

    return _choosing("sgd", chain_t, fused, run, flags_of if weight_decay else None)


def adam_transform(
    learning_rate, b1: float, b2: float, eps: float, weight_decay: float, mask, fused, *,
    decoupled: bool,
) -> GradientTransformation:  # fmt: skip
    """``optim.adamw``'s (``decoupled``) or ``optim.adam``'s transformation, its arguments already
    checked: AdamW's chain ``scale_by_adam, add_decayed_weights, scale_by_learning_rate``, or
    Adam's with the (L2) decay first and only when ``weight_decay``; run by torch's fused kernel
    unless ``fused is False``. Also ``optim.muon_adamw``'s AdamW part, so that part equals
    ``optim.adamw`` on its params bit for bit."""
    decay = [add_decayed_weights(weight_decay, mask)]
    adam, lr = scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate)
    parts = [adam, *decay, lr] if decoupled else [*decay[: 1 if weight_decay else 0], adam, lr]
    foreach_chain = chain(*parts)
    if fused is False:
        return foreach_chain
    return fused_adam(
        foreach_chain,
        fn="adamw" if decoupled else "adam",
        fused=fused,
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        mask=mask,
        decoupled=decoupled,
        adam_key=str(parts.index(adam)),
        lr_key=str(parts.index(lr)),
    )
