"""The vocabulary-parallel cross-entropy on 2 gloo ranks equals F.cross_entropy on the whole
logits (loss, per-token losses, gradient; ignore_index and a mask; behind a column-parallel
lm_head on sequence slices), holds half of the logits' memory per rank, and refuses a vocabulary
that does not divide and a target outside it."""

import torch
import torch.nn.functional as F

from ftrain.testing import run_distributed, track_allocations

N, V = 13, 10  # tokens, vocabulary (divides by 2)
BIG_N, BIG_V = 64, 512  # for the memory measurement
B, T, C = 2, 4, 6  # the lm_head under sequence parallelism


def _head():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, C, generator=g)
    return hidden, torch.randn(V, C, generator=g), torch.randint(0, V, (B, T), generator=g)


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g) * 3
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[2, 7]] = -100
    mask = torch.ones(N, dtype=torch.bool)
    mask[[4, 11]] = False
    return logits, targets, mask


def _big():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BIG_N, BIG_V, generator=g), torch.randint(0, BIG_V, (BIG_N,), generator=g)


def _ranks():
    import torch.distributed as dist

    from ftrain.distributed.tensor_parallel.vocab_loss import (
        vocab_parallel_cross_entropy,
        vocab_parallel_token_losses,
    )
    from tests.distributed.tensor_parallel.test_vocab_loss import V, _big, _head, _inputs

    rank = dist.get_rank()
    logits, targets, mask = _inputs()
    out = {}
    piece = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(piece, targets, mask=mask)
    loss.value.backward()
    out["fp32"] = (loss.total.detach(), loss.count, loss.value.detach(), piece.grad)
    per_token = vocab_parallel_token_losses(piece.detach(), targets, ignore_index=-100)
    out["per_token"] = per_token
    # 2-D tokens and bf16 logits: the loss in fp32, the gradient in the logits' dtype
    half = logits.view(N, 1, V).bfloat16().chunk(2, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(half, targets.view(N, 1), mask=mask.view(N, 1))
    loss.value.backward()
    out["bf16"] = (loss.value.detach(), half.grad)

    errors = []
    uneven = torch.randn(N, V + 1).chunk(2, dim=-1)[rank]  # 6 and 5 entries
    outside = targets.clone()
    outside[0] = V
    for args in ((uneven, targets), (piece.detach(), outside)):
        try:
            vocab_parallel_cross_entropy(*args)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors

    big, big_targets = _big()
    big_piece = big.chunk(2, dim=-1)[rank].clone().requires_grad_()
    with track_allocations() as mem:
        vocab_parallel_cross_entropy(big_piece, big_targets).value.backward()
    out["peak"] = mem.peak

    # a column-parallel lm_head on sequence slices, its logits never gathered
    from ftrain.distributed.tensor_parallel.sequence import colwise_linear_sp

    hidden, head, targets = _head()
    h_piece = hidden.chunk(2, dim=1)[rank].clone().requires_grad_()  # (B, T / 2, C)
    w_piece = head.chunk(2, dim=0)[rank].clone().requires_grad_()  # (V / 2, C)
    logits = colwise_linear_sp(h_piece, w_piece, None, None)  # (B, T, V / 2)
    vocab_parallel_cross_entropy(logits, targets).value.backward()
    out["head"] = (h_piece.grad, w_piece.grad)
    return out


def test_vocab_parallel_cross_entropy_equals_whole_logits():
    logits, targets, mask = _inputs()
    counted = targets.masked_fill(~mask, -100)
    whole = logits.clone().requires_grad_()
    ref = F.cross_entropy(whole, counted)
    ref.backward()
    ref_tokens = F.cross_entropy(logits, targets, reduction="none")
    half = logits.bfloat16().float().requires_grad_()
    ref_bf16 = F.cross_entropy(half, counted)
    ref_bf16.backward()
    big, big_targets = _big()
    big = big.requires_grad_()
    with track_allocations() as mem:
        F.cross_entropy(big, big_targets).backward()
    whole_peak = mem.peak

    hidden, head, head_targets = (t.requires_grad_(t.is_floating_point()) for t in _head())
    F.cross_entropy(F.linear(hidden, head).view(-1, V), head_targets.view(-1)).backward()

    results = run_distributed(_ranks, 2)
    for rank, out in enumerate(results):
        total, count, value, grad = out["fp32"]
        assert int(count) == N - 4  # two ignore_index targets, two masked tokens
        torch.testing.assert_close(value, ref.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(total, ref.detach() * (N - 4), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, whole.grad.chunk(2, dim=-1)[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out["per_token"], ref_tokens, rtol=1e-6, atol=1e-6)
        value, grad = out["bf16"]
        torch.testing.assert_close(value, ref_bf16.detach(), rtol=1e-6, atol=1e-6)
        assert grad.dtype == torch.bfloat16
        expected = half.grad.view(N, 1, V).chunk(2, dim=-1)[rank].bfloat16()
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)

        h_grad, w_grad = out["head"]
        torch.testing.assert_close(h_grad, hidden.grad.chunk(2, dim=1)[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(w_grad, head.grad.chunk(2, dim=0)[rank], rtol=1e-6, atol=1e-6)

        uneven, outside = out["errors"]
        assert uneven.startswith("vocab_parallel_cross_entropy(logits_piece)")
        assert "different widths (5 to 6)" in uneven and "a multiple of 2" in uneven
        assert outside.startswith("vocab_parallel_cross_entropy(targets): targets [10]")
        assert "[0, 10)" in outside
        # the logits' fp32 softmax and gradient of half the vocabulary: at most half the memory
        # of the whole loss's (its log-softmax and gradient), with a little for per-token stats
        logits_bytes = BIG_N * BIG_V * 4
        assert whole_peak >= 2 * logits_bytes
        assert out["peak"] <= logits_bytes // 2 + 64 * BIG_N, (out["peak"], whole_peak)
