"""Adafactor's pieces: second moments kept as row and column factors, and parameter-scaled steps.

For a weight of shape ``(..., R, C)`` Adafactor keeps the running mean of ``g**2`` over the last
dim (``R`` numbers per matrix) and over the second-to-last dim (``C`` numbers) instead of ``R * C``
numbers as Adam does, and rebuilds the full estimate as their outer product divided by the mean of
the row factor (Shazeer & Stern, 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost", https://arxiv.org/abs/1804.04235). Vectors and scalars keep a full second moment.

The arithmetic follows ``torch.optim.Adafactor`` operation for operation (see
``torch/optim/_adafactor.py``) except that every Python ``max``/``min`` over ``.item()`` values
there is a tensor ``clamp`` here, so nothing waits on the device.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ftrain.optim.base import GradientTransformation, leafwise
from ftrain.optim.kernels import check_same_keys, mul, norms_and_roots, zero_count

__all__ = ["scale_by_factored_rms", "scale_by_param_block_rms"]


def _factored(t: torch.Tensor) -> bool:
    return t.dim() >= 2


def _row_shape(t: torch.Tensor) -> list[int]:
    return [*t.shape[:-1], 1]  # (..., R, 1)


def _col_shape(t: torch.Tensor) -> list[int]:
    return [*t.shape[:-2], 1, t.shape[-1]]  # (..., 1, C)


def scale_by_factored_rms(
    decay_rate: float = 0.8, eps: float | None = None
) -> GradientTransformation:
    """Divide each gradient by the root of its factored second-moment estimate (Adafactor).

    With ``t`` the 1-based step and ``w = t ** -decay_rate`` (so ``beta2_t = 1 - w``):

    * tensors with 2 or more dims: ``row = lerp(row, mean(g**2, -1), w)``,
      ``col = lerp(col, mean(g**2, -2), w)``, ``v = row @ col / max(mean(row, -2), eps)``;
    * others: ``v = lerp(v, g**2, w)``;

    and the update is ``g / sqrt(max(v, eps**2))``. ``eps=None`` uses the machine epsilon of each
    tensor's dtype, as torch does.

    State: ``count`` (int64) and, keyed like the params, ``v_row`` (``(..., R, 1)``), ``v_col``
    (``(..., 1, C)``) and ``v`` (like the param). Slots a tensor does not use hold an empty tensor,
    so a matrix costs ``R + C`` numbers, not ``R * C``. The row and column statistics are new
    tensors every step, even where the update may work in place: under ``ft.shard`` a column mean
    sums over every process's rows, and DTensor can write such a result only out of place.

    **Invariant:** equals the second-moment and update lines of ``torch.optim.Adafactor``
    (``beta2_decay = -decay_rate``, ``eps = (eps, ...)``).
    """
    if not isinstance(decay_rate, (int, float)) or isinstance(decay_rate, bool) or decay_rate < 0:
        raise ValueError(
            f"scale_by_factored_rms(decay_rate): must be a number >= 0 (beta2_t = 1 - t**-decay_rate), "
            f"got {decay_rate!r}."
        )
    if eps is not None and (not isinstance(eps, (int, float)) or eps < 0):
        raise ValueError(f"scale_by_factored_rms(eps): must be None or a number >= 0, got {eps!r}.")

    def init(params):
        def slot(shape_of, use):
            def make(p):
                if use(p):
                    return torch.zeros(shape_of(p), dtype=p.dtype, device=p.device)
                return torch.zeros(0, dtype=p.dtype, device=p.device)

            return params.apply(make)

        return TensorDict(
            {
                "count": zero_count(),
                "v_row": slot(_row_shape, _factored),
                "v_col": slot(_col_shape, _factored),
                "v": slot(lambda p: p.shape, lambda p: not _factored(p)),
            },
            batch_size=[],
        )

    def update(g, s, p, ctx):
        sdef = ctx.state
        check_same_keys(ctx, "scale_by_factored_rms", "v_row", "v_col", "v")
        i_count = sdef.index("count")
        spans = [sdef.span(k) for k in ("v_row", "v_col", "v")]
        rows, cols, vs = (s[lo:hi] for lo, hi in spans)
        count = s[i_count] + 1
        weight = count.to(torch.float64) ** -decay_rate  # 1 - beta2_t
        new_rows, new_cols, new_vs, out = list(rows), list(cols), list(vs), []
        for i, grad in enumerate(g):
            w = weight.to(grad.dtype)
            eps1 = torch.finfo(grad.dtype).eps if eps is None else eps
            if _factored(grad):
                # mean of g**2 over a dim, as torch computes it: ||g||**2 / n
                # (out of place, so that DTensor can finish a reduction over shards first)
                row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square()
                row_mean = row_mean / grad.size(-1)
                col_mean = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square()
                col_mean = col_mean / grad.size(-2)
                # New tensors even when in place is allowed (R + C numbers): under ft.shard the
                # column mean sums over every process's rows, and DTensor cannot write it in
                # place into v_col, whose single row sits on one process.
                row, col = rows[i].lerp(row_mean, w), cols[i].lerp(col_mean, w)
                new_rows[i], new_cols[i] = row, col
                v_hat = row @ col  # (..., R, C): the outer product, rebuilt for this step only
                v_hat = v_hat / row.mean(dim=-2, keepdim=True).clamp(min=eps1)
            else:
                v = vs[i].lerp_(grad * grad, w) if ctx.inplace else vs[i].lerp(grad * grad, w)
                new_vs[i] = v
                v_hat = v.clone()
            # eps1 squared, because the root is taken next
            u = v_hat.clamp(min=eps1 * eps1).rsqrt() * grad
            out.append(u)
        new_s = list(s)
        new_s[i_count] = count
        for (lo, hi), new in zip(spans, (new_rows, new_cols, new_vs)):
            new_s[lo:hi] = new
        return out, new_s

    return leafwise(init, update)


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Multiply each update tensor by ``max(min_scale, rms(param))``, the param's root mean square
    (Adafactor's relative step: ``eps2`` in ``torch.optim.Adafactor``). Needs params; no state."""
    if not isinstance(min_scale, (int, float)) or isinstance(min_scale, bool) or min_scale < 0:
        raise ValueError(
            f"scale_by_param_block_rms(min_scale): must be a number >= 0, got {min_scale!r}."
        )

    def update(u, s, p, ctx):
        if p is None:
            raise ValueError(
                "scale_by_param_block_rms needs params: call update(updates, state, params)."
            )
        norms, roots = norms_and_roots(p)
        factors = (norms / roots).clamp_min(min_scale).to(torch.float32).unbind()
        return mul(u, list(factors), ctx.owned), s

    return leafwise(lambda params: TensorDict({}, batch_size=[]), update)
