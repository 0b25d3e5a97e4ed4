"""Cross-entropy over logits split along the vocabulary (Megatron's vocab-parallel loss, torch's
``loss_parallel``), without gathering them.

A column-parallel ``lm_head`` leaves each process of the ``tp`` group with its slice of every
token's logits: rank ``r`` of ``W`` holds vocabulary entries ``[r * V / W, (r + 1) * V / W)``.
Gathering them whole would cost ``V`` floats per token on every process (for GPT-2's vocabulary
and 4,096 tokens, 800 MB of fp32 logits and as much again for their gradient). Instead:

1. each process takes the max of its slice; one all-reduce (max) gives the max over the vocabulary;
2. each sums ``exp(logit - max)`` over its slice and picks the target's logit if it owns the
   target (0 otherwise); one all-reduce (sum) of both gives the softmax denominator and the
   target logit;
3. ``loss = log(sum exp) - (target logit - max)``, the same on every process.

Backward is local: the gradient of the slice is ``softmax - onehot(target)`` on that slice, times
the token's incoming gradient. So a process holds ``1 / W`` of the logits and of their gradient
(the fp32 softmax kept for backward becomes the gradient, in place), and the traffic is four
floats per token in two all-reduces. ``benchmarks/vocab_parallel.py``: the loss's forward and
backward allocate 0.17 of what ``ft.losses.cross_entropy`` on the whole fp32 logits does at
tp=2, 0.08 at tp=4.

Conventions are ``ftrain.losses.cross_entropy``'s: targets equal to ``ignore_index`` (and, here,
tokens where ``mask`` is False, e.g. ``PadCollate``'s mask) count in neither the sum nor the count;
the loss is computed in fp32; the result is a ``TokenLoss(total, count)`` that ``ft.accumulate``
and ``ft.shard`` combine exactly. Targets are aligned with the logits (shift them first for a
causal LM, as ``ft.losses.causal_lm`` does)::

    logits = colwise_linear(h, lm_head_w_piece, None, group)  # (B, T, V / tp)
    loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], group)  # TokenLoss
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ftrain.losses import TokenLoss

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_token_losses"]


def _global_max(logits: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The max over the whole vocabulary of every token (fp32, ``(...)``), and ``(max width,
    -min width)`` of the slices over the group, from one all-reduce (max)."""
    width = logits.shape[-1]
    local_max = logits.detach().amax(dim=-1).float()  # (...)
    packed = torch.cat([local_max.reshape(-1), local_max.new_tensor([width, -width])])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return packed[:-2].view(local_max.shape), packed[-2:]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, valid, group, check, name):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        vmax, widths = _global_max(logits, group)
        width = logits.shape[-1]
        start = rank * width
        local = targets - start
        owned = valid & (local >= 0) & (local < width)  # (...), this rank holds the target
        index = torch.where(owned, local, 0).long().unsqueeze(-1)  # (..., 1)

        exp = logits.to(torch.float32, copy=True)  # (..., V / W): the one fp32 buffer
        exp.sub_(vmax.unsqueeze(-1))  # shifted by the global max
        target_logit = exp.gather(-1, index).squeeze(-1) * owned  # (...)
        exp.exp_()
        sums = torch.stack([exp.sum(dim=-1), target_logit, owned.float()])  # (3, ...)
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit, owners = sums.unbind(0)
        if check:
            _check(name, widths, targets, valid & (owners != 1), size)
        losses = torch.where(valid, sum_exp.log() - target_logit, 0.0)  # (...) fp32
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax of the slice, kept for backward
        ctx.save_for_backward(exp, index, owned, valid)
        ctx.dtype = logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad):
        softmax, index, owned, valid = ctx.saved_tensors
        grad_logits = softmax  # the saved buffer is reused: backward runs once
        grad_logits.scatter_add_(-1, index, -owned.float().unsqueeze(-1))  # softmax - onehot
        grad_logits.mul_(torch.where(valid, grad, 0.0).unsqueeze(-1))
        return grad_logits.to(ctx.dtype), None, None, None, None, None


def _check(name, widths, targets, unowned, size) -> None:
    """Refuse slices of different widths and valid targets no rank holds (one host sync)."""
    wide, narrow = int(widths[0]), -int(widths[1])
    if wide != narrow:
        raise ValueError(
            f"{name}(logits_piece): the vocabulary slices over the tp group of {size} have "
            f"different widths ({narrow} to {wide}); the vocabulary must divide by the tp size. "
            f"Fix: pad the vocabulary (the lm_head's output features and the embedding's rows) "
            f"to a multiple of {size}, as GPT-2's 50257 is padded to 50304, and never use the "
            "padding entries as targets."
        )
    if bool(unowned.any()):
        bad = targets[unowned][:5].tolist()
        raise ValueError(
            f"{name}(targets): targets {bad} are outside the vocabulary [0, {wide * size}) and "
            "are not ignore_index. Fix the targets, or set their mask False."
        )


def _valid(targets, ignore_index, mask, logits_piece, name):
    if logits_piece.shape[:-1] != targets.shape:
        raise ValueError(
            f"{name}: logits_piece {tuple(logits_piece.shape)} must be targets "
            f"{tuple(targets.shape)} plus a trailing (vocabulary slice) dimension."
        )
    valid = targets != ignore_index
    if mask is not None:
        if mask.shape != targets.shape:
            raise ValueError(
                f"{name}: mask {tuple(mask.shape)} must have the shape of targets "
                f"{tuple(targets.shape)} (True where the token counts)."
            )
        valid = valid & mask.bool()
    return valid


def vocab_parallel_token_losses(
    logits_piece: torch.Tensor,
    targets: torch.Tensor,
    group=None,
    *,
    ignore_index: int = -100,
    mask: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, ``targets``' shape) from this rank's vocabulary slice.

    ``logits_piece`` is ``(..., V / W)``: rank ``r`` of ``group`` (None: the default group)
    holds vocabulary entries ``[r * V / W, (r + 1) * V / W)``, every slice the same width (a
    vocabulary that does not divide is a ``ValueError``). ``targets`` ``(...)`` are whole and the
    same on every rank. Equals ``F.cross_entropy(whole_logits, targets, reduction="none")``, 0 at
    tokens whose target is ``ignore_index`` or whose ``mask`` is False, on every rank; the
    gradient reaching ``logits_piece`` is this rank's slice of the whole logits' gradient.

    ``check=True`` refuses slices of different widths and a counted target outside ``[0, V)``
    (``F.cross_entropy`` refuses the latter too), at the cost of one host sync; with ``False``
    (e.g. under ``torch.compile``) neither is checked and such a token's loss is wrong.
    """
    name = "vocab_parallel_token_losses"
    valid = _valid(targets, ignore_index, mask, logits_piece, name)
    return _VocabParallelCE.apply(logits_piece, targets, valid, group, check, name)


def vocab_parallel_cross_entropy(
    logits_piece: torch.Tensor,
    targets: torch.Tensor,
    group=None,
    *,
    ignore_index: int = -100,
    mask: torch.Tensor | None = None,
    check: bool = True,
) -> TokenLoss:
    """``ftrain.losses.cross_entropy`` of the whole logits, from this rank's vocabulary slice:
    ``TokenLoss(sum of the per-token losses, number of counted tokens)``, the same on every rank
    of ``group``, where a token counts when its target is not ``ignore_index`` and its ``mask``
    (if given) is True. ``value`` is the mean ``F.cross_entropy(whole_logits, targets,
    ignore_index=ignore_index)``. Arguments as :func:`vocab_parallel_token_losses`.

    Under a tp step the loss is replicated over the group, so its gradient must not be summed
    over it: each rank's backward gives exactly its slice of the logits' gradient."""
    name = "vocab_parallel_cross_entropy"
    valid = _valid(targets, ignore_index, mask, logits_piece, name)
    losses = _VocabParallelCE.apply(logits_piece, targets, valid, group, check, name)
    return TokenLoss(losses.sum(), valid.sum())
