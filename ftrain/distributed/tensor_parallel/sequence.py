"""Sequence parallelism (Megatron-LM's): between tensor-parallel pairs, activations split along the
sequence over the ``tp`` group.

Plain tensor parallelism (``ftrain.distributed.tensor_parallel.linear``) leaves every activation
between a row-parallel output and the next column-parallel input whole on every process: the norms,
dropout and residual adds there are computed ``tp`` times over and their activations stored ``tp``
times. Under sequence parallelism each process keeps ``1 / tp`` of the positions instead. The
all-reduce after a row-parallel layer becomes a reduce-scatter along the sequence, and the
column-parallel layer all-gathers the sequence first (an all-reduce is a reduce-scatter then an
all-gather), so the forward moves what plain TP moves; backward adds one all-gather per
column-parallel layer (:func:`colwise_linear_sp`). A block then keeps ``1 / tp`` of one process's
activations for backward (``benchmarks/sequence_parallel.py``: 0.50 at tp=2 where plain TP keeps
0.64).

The pieces are ``torch.chunk`` slices of the sequence dimension ``dim`` (1 for ``(B, T, C)``), in
rank order, all the same length: a length that does not divide by the group size is refused.

Three autograd functions carry the traffic:

* :func:`split_sequence`: keep this rank's slice; backward all-gathers the gradient.
* :func:`gather_sequence`: all-gather the slices; backward reduce-scatters the gradient (the
  consumer is a column-parallel layer, each process holding a partial gradient of the whole) or,
  with ``sum_grad=False``, keeps this rank's slice (a consumer that every process runs whole).
* :func:`reduce_scatter_sequence`: the sum over the group, this rank's slice of it; backward
  all-gathers the gradient.

Two things change for the layers between the pairs. Dropout: every position needs its own mask,
so :func:`sequence_dropout` draws each mask entry from the key and the entry's *global* position,
the same on whichever process holds it (and the same as for the whole sequence on one process).
Parameters: the weights of norms (and the bias of a row-parallel layer, added after the
reduce-scatter) are whole on every process but see only its positions, so each process's
gradient is a partial sum: :func:`sum_partial_grads` adds them over the group after backward.

A GPT block on this rank's slice ``x`` ``(B, T / tp, C)``, with ``tp``'s pieces of the weights::

    h = colwise_linear_sp(ln_1(x), qkv_w, qkv_b, group)      # (B, T, 3C / tp): whole sequence
    y = attention(h)                                          # (B, T, C / tp): this rank's heads
    x = x + sequence_dropout(rowwise_linear_sp(y, proj_w, proj_b, group), p, key, offset=o)
    ...                                                       # o = rank * T / tp
    sum_partial_grads([ln_1.weight.grad, ln_1.bias.grad, proj_b.grad, ...], group)

``ft.tensor_parallel(model, plan, mesh, sequence_parallel=True)`` wires these into any model whose
plan marks its blocks ``SequenceParallel()``
(``ftrain.distributed.tensor_parallel.sequence_region``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftrain import rng
from ftrain.distributed.collectives import all_gather_into, all_reduce_flat, reduce_scatter_into

__all__ = [
    "split_sequence",
    "gather_sequence",
    "reduce_scatter_sequence",
    "colwise_linear_sp",
    "rowwise_linear_sp",
    "sequence_dropout",
    "sum_partial_grads",
]


def _check_divides(name: str, x: torch.Tensor, dim: int, size: int) -> None:
    length = x.shape[dim]
    if length % size:
        up = -(-length // size) * size
        raise ValueError(
            f"{name}: the sequence dimension (dim={dim}) of the input has length {length}, which "
            f"does not divide by the tp group size {size}. Fix: pad the sequence to a multiple "
            f"of {size} (e.g. {up}: a block size or PadCollate(pad_to_multiple_of={size})), or "
            f"choose a tp size that divides {length}."
        )


def _slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    return x.chunk(size, dim=dim)[dist.get_rank(group)]


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The pieces of every rank joined along ``dim`` (one all-gather)."""
    size = dist.get_world_size(group)
    send = x.movedim(dim, 0).contiguous()  # (T / tp, ...)
    out = send.new_empty((size * send.shape[0], *send.shape[1:]))  # (T, ...)
    all_gather_into(out, send, group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum over ranks of ``x`` (one reduce-scatter)."""
    size = dist.get_world_size(group)
    send = x.movedim(dim, 0).contiguous()  # (T, ...)
    out = send.new_empty((send.shape[0] // size, *send.shape[1:]))  # (T / tp, ...)
    reduce_scatter_into(out, send, group)
    return out.movedim(0, dim)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _slice(x, group, dim).clone()

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sum_grad):
        ctx.group, ctx.dim, ctx.sum_grad = group, dim, sum_grad
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grad:
            return _reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _slice(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


def split_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (``x`` whole and equal on every rank of
    ``group``; None is the default group). In backward the slices' gradients are all-gathered,
    so ``x`` gets the whole gradient on every rank. A length not divisible by the group size is
    a ``ValueError``."""
    _check_divides("split_sequence(x)", x, dim, dist.get_world_size(group))
    return _Split.apply(x, group, dim)


def gather_sequence(
    x_piece: torch.Tensor, group, dim: int = 1, *, sum_grad: bool = True
) -> torch.Tensor:
    """The whole sequence from every rank's slice ``x_piece`` (equal lengths, rank order).

    Backward with ``sum_grad=True``: the gradients of the whole that the ranks hold are summed
    and each keeps its slice (a reduce-scatter): right when each rank's gradient is a partial
    one, as behind a column-parallel layer. With ``sum_grad=False`` each rank keeps its slice of
    its own gradient: right when every rank computes the same thing from the whole sequence.
    """
    return _Gather.apply(x_piece, group, dim, sum_grad)


def reduce_scatter_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of ``x`` over ``group`` (each rank holds a
    partial sum of the whole, as a row-parallel layer gives). In backward the slices' gradients
    are all-gathered. A length not divisible by the group size is a ``ValueError``."""
    _check_divides("reduce_scatter_sequence(x)", x, dim, dist.get_world_size(group))
    return _ReduceScatter.apply(x, group, dim)


def colwise_linear_sp(x_piece, weight_piece, bias_piece, group, dim: int = 1) -> torch.Tensor:
    """Column-parallel linear on a sequence slice: the sequence is all-gathered, then multiplied by
    this rank's rows of the weight (``(out / tp, in)``); the result is whole along the sequence
    and split along the features, as ``tp.colwise_linear``'s.

    Only the slice ``x_piece`` is kept for backward, not the gathered input: backward all-gathers
    it again for the weight's gradient (one more all-gather per layer, as Megatron-LM does, so
    that no whole activation is stored between the pairs). The input's gradient is
    reduce-scattered, standing in for ``tp.copy_to_tp``'s all-reduce (which would sum it twice,
    so that function is not used here). Under autocast the matmuls run in the autocast dtype and
    each gradient comes back in its tensor's own dtype."""
    return _ColwiseSP.apply(x_piece, weight_piece, bias_piece, group, dim)


class _ColwiseSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_piece, weight, bias, group, dim):
        ctx.group, ctx.dim, ctx.bias_dtype = group, dim, None if bias is None else bias.dtype
        ctx.save_for_backward(x_piece, weight)
        return F.linear(_gather(x_piece, group, dim), weight, bias)  # (..., T, ..., out / tp)

    @staticmethod
    def backward(ctx, grad):
        x_piece, weight = ctx.saved_tensors
        whole = _gather(x_piece, ctx.group, ctx.dim).to(grad.dtype)  # (..., T, ..., in)
        grad_x = _reduce_scatter(grad @ weight.to(grad.dtype), ctx.group, ctx.dim)
        rows = grad.reshape(-1, grad.shape[-1])  # (tokens, out / tp)
        grad_w = rows.t() @ whole.reshape(-1, whole.shape[-1])  # (out / tp, in)
        grad_b = None if ctx.bias_dtype is None else rows.sum(0).to(ctx.bias_dtype)
        return grad_x.to(x_piece.dtype), grad_w.to(weight.dtype), grad_b, None, None


def rowwise_linear_sp(x_piece, weight_piece, bias, group, dim: int = 1) -> torch.Tensor:
    """Row-parallel linear that ends on a sequence slice: this rank's share of the input features
    times its columns of the weight (``(out, in / tp)``), summed over ``group`` and split along
    the sequence (a reduce-scatter where ``tp.rowwise_linear`` all-reduces). The whole ``bias``
    is added to the slice, so its gradient is partial: sum it with :func:`sum_partial_grads`."""
    out = reduce_scatter_sequence(F.linear(x_piece, weight_piece), group, dim)
    return out if bias is None else out + bias


def sequence_dropout(
    x: torch.Tensor, p: float, key: torch.Tensor | int, *, dim: int = 1, offset: int = 0
) -> torch.Tensor:
    """Dropout whose mask at each entry is a function of ``key`` and the entry's global index.

    ``x`` holds the positions ``offset .. offset + x.shape[dim] - 1`` of a sequence along
    ``dim`` (``offset = rank * x.shape[dim]`` for a slice from :func:`split_sequence`; 0 for a
    whole sequence). Entry ``(t, j)`` (``t`` the global position, ``j`` the flat index over the
    other dimensions) is kept, scaled by ``1 / (1 - p)``, when the 32-bit hash
    ``rng.fold_in(key, t * J + j)`` (``J`` the size of the other dimensions) is at least
    ``p * 2**32``.

    Guarantees: the slices of the ranks together equal ``sequence_dropout`` of the whole
    sequence with the same key, whatever the tp size, so no two positions share a mask (the
    failure of one shared generator seed, which would repeat a rank's mask on every slice) and a
    run keeps its masks when the tp size changes. Pass the same key on every rank of the group.
    On a whole activation that every rank holds (plain TP, ``offset=0``) the ranks draw the same
    mask, which keeps the replicas equal. Not for a tensor split along another dimension (heads
    or features inside a column/row pair): ranks holding the same positions would share masks;
    give those ``rng.fold_in(key, rank)``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"sequence_dropout(p={p!r}): p must be in [0, 1].")
    if p == 0.0:
        return x
    if p == 1.0:
        return torch.zeros_like(x)
    moved = x.movedim(dim, 0)  # (T_local, ...)
    per = moved[0].numel()  # J: entries per position
    first = offset * per
    counter = torch.arange(first, first + moved.numel(), dtype=torch.int64, device=x.device)
    bits = rng.fold_in(torch.as_tensor(key, dtype=torch.int64, device=x.device), counter)
    keep = (bits >= int(p * 2**32)).view(moved.shape).movedim(0, dim)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros_like(x))


def sum_partial_grads(grads: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Sum over ``group``, in place, the gradients of parameters that are whole on every rank but
    were used on sequence slices (norm weights and biases, the bias of :func:`rowwise_linear_sp`):
    each rank's gradient covers its positions only. One flat all-reduce per dtype. Returns the
    tensors. (The alternative, ``tp.copy_to_tp(weight, group)`` at each use, gives the same sum
    with one all-reduce per use.)"""
    grads = list(grads)
    if grads:
        all_reduce_flat(grads, group)
    return grads
