"""Schedule-free optimization (Defazio et al., 2024, "The Road Less Scheduled"): no decay
schedule; the point to evaluate is an average of the iterates, kept in closed form.

Three sequences share one set of numbers. ``z`` takes the base optimizer's steps; ``x`` is a
weighted average of the ``z``\\ s (the params to evaluate and save for inference); ``y``, between
them, is where the gradient is taken::

    y_t     = (1 - b1) * z_t + b1 * x_t                 # the params the step trains
    z_{t+1} = z_t + base_update(grad at y_t)            # e.g. -lr * (g / rms + wd * y_t)
    x_{t+1} = (1 - c_t) * x_t + c_t * z_{t+1}           # c_t = w_t / (w_0 + ... + w_t)

with ``w_t = (t + 1)**r * max_lr**p`` (``t`` from 0, ``max_lr`` the largest learning rate so far).

ftrain's params are ``y`` and the optimizer state holds ``z`` (and ``b1``); ``x`` is a pure
function of the two, :func:`schedule_free_eval_params`. The ``schedulefree`` package stores the
same two sequences and swaps the tensors of the model between ``y`` and ``x`` with
``optimizer.train()`` / ``optimizer.eval()``; here nothing is swapped, so evaluating, sampling and
saving need no mode switch and a checkpoint (train params and state) resumes exactly.
The method is written as a wrapper around a base optimizer (the form optax's contrib uses too);
:func:`schedule_free_adamw` wraps AdamW without a first moment, as the package's
``AdamWScheduleFree`` does.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from ftrain import tree
from ftrain.internals import foreach
from ftrain.optim.base import GradientTransformation, LeafContext, chain, leaf_update, leafwise
from ftrain.optim.checks import check_range, checked
from ftrain.optim.kernels import check_same_keys, mul, zero_count
from ftrain.optim.primitives import add_decayed_weights, scale_by_learning_rate
from ftrain.optim.schedules import Schedule, as_schedule

__all__ = ["schedule_free_adamw", "schedule_free_eval_params"]

# The keys that mark a schedule-free state (schedule_free_eval_params looks for them).
_MARK = ("b1", "weight_sum", "z")


def _warmed_up(learning_rate: float | Schedule, warmup_steps: int) -> Schedule:
    """``learning_rate(count) * min(1, (count + 1) / warmup_steps)``: the package's linear
    warmup, whose first step already has ``lr / warmup_steps`` (not 0)."""
    schedule = as_schedule(learning_rate)
    if warmup_steps == 0:
        return schedule

    def warmed(count):
        ramp = ((count + 1).to(torch.float64) / warmup_steps).clamp(max=1.0)
        return schedule(count).to(torch.float64) * ramp

    return warmed


def _scale_by_rms(b2: float, eps: float) -> GradientTransformation:
    """Adam's direction without momentum: ``g / (sqrt(nu / (1 - b2**t)) + eps)``, ``nu`` the
    moving average of ``g**2``. State: ``count``, ``nu``. The operations follow the package's
    foreach path (divide by the bias correction, square root, add ``eps``, divide)."""

    def init(params):
        return TensorDict({"count": zero_count(), "nu": params.apply(torch.zeros_like)}, [])

    def update(g, s, p, ctx):
        check_same_keys(ctx, "schedule_free_adamw", "nu")
        i_count, (lo, hi) = ctx.state.index("count"), ctx.state.span("nu")
        nu = s[lo:hi]
        count = s[i_count] + 1
        if ctx.inplace:
            foreach.mul_(nu, b2)
        else:
            nu = list(foreach.mul(nu, b2))
        foreach.addcmul_(nu, g, g, 1 - b2)
        bc2 = 1 - b2 ** count.to(torch.float64)
        denom = list(foreach.div(nu, bc2.to(torch.float32)))
        foreach.sqrt_(denom)
        foreach.add_(denom, eps)
        if ctx.owned:
            foreach.div_(g, denom)
        else:
            g = list(foreach.div(g, denom))
        new_s = list(s)
        new_s[i_count], new_s[lo:hi] = count, nu
        return g, new_s

    return leafwise(init, update)


def _schedule_free(
    base: GradientTransformation,
    learning_rate: float | Schedule,
    b1: float = 0.9,
    weight_lr_power: float = 2.0,
    r: float = 0.0,
) -> GradientTransformation:
    """Make ``base`` schedule-free: its updates move ``z``, the params follow ``y``.

    Each step, with ``u`` the update ``base`` makes at ``y`` (``-lr * direction``)::

        c = w_t / sum(w)     w_t = (t + 1)**r * max_lr**weight_lr_power
        y <- y + c * (z - y) + (1 - b1 * (1 - c)) * u
        z <- z + u

    which keeps ``y = (1 - b1) * z + b1 * x`` with ``x`` the ``w``-weighted average of the
    ``z``\\ s. ``learning_rate`` is the schedule ``base`` scales by (warmup included): ``max_lr``
    is the largest value it has had, so a warmup's small steps weigh little in the average.

    Args:
        base: the transformation whose updates ``z`` takes; it ends with the learning rate
            (e.g. ``chain(..., scale_by_learning_rate(learning_rate))``).
        learning_rate: a number or a schedule ``count -> lr``, the same as ``base``'s.
        b1: interpolation between ``z`` and ``x``, in ``(0, 1)`` (the momentum of the method).
        weight_lr_power: ``p`` above; 0 weighs every step alike.
        r: ``r`` above; a polynomial weighting of later steps.

    State: ``count``, ``lr_max`` and ``weight_sum`` (0-d float64), ``b1`` (0-d float64, for
    :func:`schedule_free_eval_params`), ``z`` (like the params) and ``base``.
    """
    check_range("schedule_free_adamw", "b1", b1, 0.0, 1.0, open_lo=True)
    check_range("schedule_free_adamw", "weight_lr_power", weight_lr_power, 0.0)
    check_range("schedule_free_adamw", "r", r, 0.0)
    schedule = as_schedule(learning_rate)
    base_fn = leaf_update(base)

    def init(params):
        f64 = dict(dtype=torch.float64)
        return TensorDict(
            {
                "base": base.init(params),
                "count": zero_count(),
                "lr_max": torch.full((), -1.0, **f64),
                "weight_sum": torch.zeros((), **f64),
                "b1": torch.full((), float(b1), **f64),
                "z": params.apply(lambda t: t.detach().clone()),
            },
            batch_size=[],
        )

    def update(g, s, p, ctx):
        if p is None:
            raise ValueError(
                "schedule_free_adamw needs params: call update(updates, state, params)."
            )
        sdef = ctx.state
        check_same_keys(ctx, "schedule_free_adamw", "z")
        (b_lo, b_hi), (z_lo, z_hi) = sdef.span("base"), sdef.span("z")
        i_count, i_max, i_sum = (sdef.index(k) for k in ("count", "lr_max", "weight_sum"))
        base_ctx = LeafContext(ctx.tree, sdef.child("base"), ctx.inplace, ctx.owned)
        u, new_base = base_fn(g, s[b_lo:b_hi], p, base_ctx)
        u_owned = ctx.owned or not any(a is b for a, b in zip(u, g))
        # The average's weight, in float64 as the package's Python floats.
        count = s[i_count]
        lr_max = torch.maximum(s[i_max], schedule(count).to(torch.float64))
        weight = (count + 1).to(torch.float64) ** r * lr_max**weight_lr_power
        weight_sum = s[i_sum] + weight
        c = torch.where(weight_sum > 0, weight / weight_sum, 0.0)  # the package: 0 on 0 / 0
        z = s[z_lo:z_hi]
        out = list(foreach.sub(z, p))  # y_new - y = c * (z - y) + (1 - b1 (1 - c)) * u
        foreach.mul_(out, c.to(torch.float32))
        if ctx.inplace:
            foreach.add_(z, u)
        else:
            z = list(foreach.add(z, u))
        foreach.add_(out, mul(u, (1 - b1 * (1 - c)).to(torch.float32), u_owned))
        new_s = list(s)
        new_s[b_lo:b_hi], new_s[z_lo:z_hi] = new_base, z
        new_s[i_count], new_s[i_max], new_s[i_sum] = count + 1, lr_max, weight_sum
        return out, new_s

    return leafwise(init, update)


@checked
def schedule_free_adamw(
    learning_rate: float | Schedule = 0.0025,
    warmup_steps: int = 0,
    b1: float = 0.9,
    b2: float = 0.999,
    weight_decay: float = 0.0,
    eps: float = 1e-8,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
    mask=None,
) -> GradientTransformation:
    """Schedule-free AdamW: the schedule-free form of
    ``chain(rms scaling, add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``.

    **Invariant:** matches ``schedulefree.AdamWScheduleFree(lr, betas=(b1, b2), eps,
    weight_decay, warmup_steps, r, weight_lr_power)`` in train mode: over 50 steps the params
    (``y``) agree to 1e-5 relative, and :func:`schedule_free_eval_params` agrees with the
    package's params after ``.eval()`` (``x``); ``tests/optim/test_schedule_free.py``.

    As the package (and the paper's Algorithm 1): no first moment (``b1`` interpolates instead);
    the second moment is bias-corrected inside the square root, ``eps`` added outside it; weight
    decay is taken at ``y`` and added to the normalized gradient, so it moves ``z`` (and through
    it ``x``) by ``lr * weight_decay * y``; warmup multiplies the learning rate by
    ``min(1, (t + 1) / warmup_steps)`` (``t`` from 0), and the average weighs step ``t`` by
    ``(t + 1)**r * max_lr**weight_lr_power``. Where ftrain adds to it: ``learning_rate`` may be
    a schedule (the package's ``group["lr"]`` changed between steps), ``mask`` (e.g.
    :func:`ftrain.optim.decay_mask`) limits weight decay to some leaves (``None``: every leaf,
    as the package), and no ``train()``/``eval()`` switch: the eval params are a pure function.
    One numerical difference: ftrain's optimizers return updates, so the step adds
    ``y_new - y`` to the params where the package moves them in place, one float32 rounding
    more per step (5e-7 relative after 50 steps in the test). Optimizer memory: ``z`` and ``nu``,
    two fp32 copies of the params, as AdamW's two moments.

    Args:
        learning_rate: the peak learning rate, or a schedule ``count -> lr`` (no decay needed).
        warmup_steps: linear warmup over this many steps (0: none).
        b1: interpolation between ``z`` and ``x``, in ``(0, 1)``; the method's momentum.
        b2, eps: the second moment's decay and the denominator's epsilon.
        weight_decay: decoupled, at ``y``; ``mask`` limits it to some leaves.
        r, weight_lr_power: step ``t`` weighs ``(t + 1)**r * max_lr**weight_lr_power`` in ``x``.

    The state holds ``z`` and the numbers that weigh the average; the step's params are ``y``.

    >>> import torch, ftrain as ft
    >>> from ftrain import optim
    >>> params = ft.params_of(torch.nn.Linear(3, 2))
    >>> opt = optim.schedule_free_adamw(1e-2, warmup_steps=10)
    >>> state = opt.init(params)
    >>> for _ in range(3):
    ...     updates, state = opt.update(params.apply(torch.ones_like), state, params)
    ...     params = optim.apply_updates(params, updates)  # y: train, take gradients here
    >>> x = optim.schedule_free_eval_params(state, params)  # x: evaluate, sample, export
    >>> y, z = params["bias"], state["z", "bias"]
    >>> torch.allclose(x["bias"], (y - 0.1 * z) / 0.9), torch.allclose(x["bias"], y)
    (True, False)
    """
    fn = "schedule_free_adamw"
    if not callable(learning_rate):
        check_range(fn, "learning_rate", learning_rate, 0.0)
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(
            f"optim.{fn}: warmup_steps must be an integer >= 0 (a number of steps), got "
            f"{warmup_steps!r}."
        )
    check_range(fn, "b2", b2, 0.0, 1.0)
    check_range(fn, "weight_decay", weight_decay, 0.0)
    check_range(fn, "eps", eps, 0.0)
    lr = _warmed_up(learning_rate, warmup_steps)
    parts = [_scale_by_rms(b2, eps)]
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay, mask))
    parts.append(scale_by_learning_rate(lr))
    return _schedule_free(chain(*parts), lr, b1, weight_lr_power, r)


def _schedule_free_states(opt_state: TensorDictBase) -> list[TensorDictBase]:
    if all(k in opt_state.keys() for k in _MARK):
        return [opt_state]
    found = []
    for key in opt_state.keys():
        sub = opt_state.get(key)
        if isinstance(sub, TensorDictBase):
            found += _schedule_free_states(sub)
    return found


def schedule_free_eval_params(opt_state: TensorDictBase, params: TensorDictBase) -> TensorDict:
    """The params to evaluate at: ``x = (y - (1 - b1) * z) / b1`` from the train params ``y``
    (``params``) and the ``z`` that ``opt_state`` holds; pure (nothing is modified).

    ``opt_state`` is the whole optimizer state (``state.opt_state``): the schedule-free parts are
    found in it wherever a ``chain`` or ``masked`` put them, and each replaces the leaves it
    covers; the other leaves are returned as they are. Computed as the package's ``.eval()``
    computes it, ``torch.lerp(y, z, 1 - 1 / b1)``. Sharded states: pass whole tensors
    (``ft.unshard_state``).
    """
    if not isinstance(opt_state, TensorDictBase) or not isinstance(params, TensorDictBase):
        raise TypeError(
            "schedule_free_eval_params(opt_state, params): both must be TensorDicts, e.g. "
            f"(state.opt_state, state.params); got {type(opt_state).__name__}, "
            f"{type(params).__name__}."
        )
    states = _schedule_free_states(opt_state)
    if not states:
        raise ValueError(
            "schedule_free_eval_params: opt_state holds no schedule-free state (keys "
            f"{list(_MARK)}); pass the state of an optimizer built with "
            "optim.schedule_free_adamw."
        )
    flat = tree.to_flat(params)
    out = dict(flat)
    for sf in states:
        b1 = sf["b1"]
        for path, z in tree.to_flat(sf["z"]).items():
            y = flat.get(path)
            if y is None or y.shape != z.shape:
                raise KeyError(
                    f"schedule_free_eval_params: the state's z[{path!r}] has no param of its "
                    f"shape {tuple(z.shape)} in params; pass the params this state was trained "
                    "with (state.params)."
                )
            w = (1 - 1 / b1).to(torch.float32)
            w = w.reshape(w.shape + (1,) * (y.dim() - w.dim()))  # under ft.vmap, one per member
            out[path] = torch.lerp(y, z.to(y.dtype), w.to(y.device, y.dtype))
    return tree.unflatten(params, list(out.values()))
