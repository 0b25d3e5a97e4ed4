"""Sequence parallelism on 2 gloo ranks equals one process: a transformer block (norms, attention,
MLP, dropout, residuals) in outputs and in every gradient; a sequence that does not divide is
refused; sequence dropout's masks depend on global positions only."""

import pytest
import torch
import torch.nn.functional as F

from ftrain.distributed.tensor_parallel.plans import Split, join_pieces
from ftrain.distributed.tensor_parallel.sequence import sequence_dropout
from ftrain.testing import run_distributed

B, T, C, HEADS, P = 2, 6, 8, 2, 0.25
# name -> (shape, Split under tp): norms and the row-parallel biases stay whole
SPLITS = {
    "ln1.w": ((C,), Split(None)),
    "ln1.b": ((C,), Split(None)),
    "qkv.w": ((3 * C, C), Split(0, 3)),
    "qkv.b": ((3 * C,), Split(0, 3)),
    "proj.w": ((C, C), Split(1)),
    "proj.b": ((C,), Split(None)),
    "ln2.w": ((C,), Split(None)),
    "ln2.b": ((C,), Split(None)),
    "fc.w": ((4 * C, C), Split(0)),
    "fc.b": ((4 * C,), Split(0)),
    "out.w": ((C, 4 * C), Split(1)),
    "out.b": ((C,), Split(None)),
}
PARTIAL = [k for k, (_, s) in SPLITS.items() if s.dim is None]


def _inputs():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(shape, generator=g) * 0.5 for k, (shape, _) in SPLITS.items()}
    x = torch.randn(B, T, C, generator=g)
    w = torch.randn(B, T, C, generator=g)  # weights of the loss, so every output counts
    return params, x, w


def _attention(qkv):
    """Causal attention over the whole sequence for the heads in ``qkv`` ``(B, T, 3 * h * hd)``."""
    q, k, v = qkv.chunk(3, dim=-1)  # (B, T, h * hd) each
    hd = C // HEADS
    q, k, v = (t.unflatten(-1, (-1, hd)).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).flatten(2)  # (B, T, h * hd)


def _block(p, x, linear_in, linear_out, offset):
    """LayerNorm -> qkv (columns) -> attention -> proj (rows) -> dropout -> residual, then
    LayerNorm -> fc (columns) -> gelu -> out (rows) -> dropout -> residual."""
    h = F.layer_norm(x, (C,), p["ln1.w"], p["ln1.b"])
    a = linear_out(_attention(linear_in(h, p["qkv.w"], p["qkv.b"])), p["proj.w"], p["proj.b"])
    x = x + sequence_dropout(a, P, 11, offset=offset)
    h = F.layer_norm(x, (C,), p["ln2.w"], p["ln2.b"])
    m = linear_out(F.gelu(linear_in(h, p["fc.w"], p["fc.b"])), p["out.w"], p["out.b"])
    return x + sequence_dropout(m, P, 12, offset=offset)


def _ranks():
    import torch.distributed as dist

    from ftrain.distributed.tensor_parallel.plans import local_piece
    from ftrain.distributed.tensor_parallel.sequence import (
        colwise_linear_sp,
        gather_sequence,
        rowwise_linear_sp,
        split_sequence,
        sum_partial_grads,
    )
    from tests.distributed.tensor_parallel.test_sequence import SPLITS, T, _block, _inputs

    rank, tp = dist.get_rank(), dist.get_world_size()
    params, x, w = _inputs()
    p = {
        k: local_piece(v, SPLITS[k][1], rank, tp).clone().requires_grad_()
        for k, v in params.items()
    }
    x = x.requires_grad_()
    x_piece = split_sequence(x, None)  # (B, T / tp, C)
    y_piece = _block(
        p,
        x_piece,
        lambda h, wt, b: colwise_linear_sp(h, wt, b, None),
        lambda h, wt, b: rowwise_linear_sp(h, wt, b, None),
        offset=rank * (T // tp),
    )
    y = gather_sequence(y_piece, None, sum_grad=False)  # whole, the same on every rank
    (y * w).sum().backward()
    sum_partial_grads([p[k].grad for k in SPLITS if SPLITS[k][1].dim is None], None)

    errors = []
    for fn in (split_sequence, lambda t, g: rowwise_linear_sp(t, p["out.w"], None, g)):
        try:
            fn(torch.randn(B, T + 1, 4 * C // tp), None)
        except ValueError as e:
            errors.append(str(e))
    return (
        y.detach(),
        y_piece.detach(),
        x.grad,
        {k: v.grad for k, v in p.items()},
        errors,
        _autocast(p["fc.w"].detach(), p["fc.b"].detach(), tp),
    )


def _autocast(w, b, tp):
    """colwise_linear_sp under bf16 autocast: bf16 output, fp32 gradients near the fp32 ones."""
    from ftrain.distributed.tensor_parallel.sequence import colwise_linear_sp
    from ftrain.testing import max_rel_error

    x = torch.randn(B, T // tp, C)
    runs = []
    for enabled in (False, True):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            y = colwise_linear_sp(*leaves, None)
        y.float().square().sum().backward()
        runs.append((y, *(t.grad for t in leaves)))
    (_, *grads32), (bf16, *grads16) = runs
    dtypes = [t.dtype for t in (bf16, *grads16)]
    return dtypes, max(max_rel_error(a, e) for a, e in zip(grads16, grads32))


def test_sequence_parallel_block_equals_one_process():
    params, x, w = _inputs()
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    x = x.clone().requires_grad_()
    y = _block(p, x, F.linear, F.linear, offset=0)
    (y * w).sum().backward()

    results = run_distributed(_ranks, 2)
    for rank, (y_r, piece_r, xg_r, _, errors, (dtypes, bf16_error)) in enumerate(results):
        assert dtypes == [torch.bfloat16] + [torch.float32] * 3
        assert bf16_error < 2e-2
        torch.testing.assert_close(y_r, y.detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(piece_r, y_r.chunk(2, dim=1)[rank])  # gathered in rank order
        torch.testing.assert_close(xg_r, x.grad, rtol=1e-5, atol=1e-5)
        assert len(errors) == 2
        for msg, name in zip(errors, ("split_sequence(x)", "reduce_scatter_sequence(x)")):
            assert msg.startswith(name) and "length 7" in msg and "tp group size 2" in msg
            assert "pad the sequence to a multiple of 2 (e.g. 8" in msg
    for k, (_, split) in SPLITS.items():
        got = join_pieces([r[3][k] for r in results], split)
        torch.testing.assert_close(got, p[k].grad, rtol=1e-5, atol=1e-5, msg=k)
        if k in PARTIAL:  # summed over the group: the same whole gradient on both ranks
            torch.testing.assert_close(results[1][3][k], p[k].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 3])
def test_sequence_dropout_masks_follow_global_positions(tp):
    x = torch.ones(3, 12, 5)
    whole = sequence_dropout(x, 0.5, 7)
    pieces = [
        sequence_dropout(piece, 0.5, 7, offset=r * 12 // tp)
        for r, piece in enumerate(x.chunk(tp, dim=1))
    ]
    assert torch.equal(torch.cat(pieces, dim=1), whole)
    halves = (whole[:, :6] == 0, whole[:, 6:] == 0)
    assert not torch.equal(*halves)  # slices do not repeat one mask
    assert 0.35 < (whole == 0).float().mean() < 0.65
    assert set(whole.unique().tolist()) == {0.0, 2.0}
    assert not torch.equal(whole, sequence_dropout(x, 0.5, 8))
    seq_first = sequence_dropout(x.transpose(0, 1).contiguous(), 0.5, 7, dim=0)
    assert torch.equal(seq_first.transpose(0, 1), whole)


def test_sequence_dropout_p_bounds():
    x = torch.randn(2, 4, 3)
    assert sequence_dropout(x, 0.0, 1) is x
    assert torch.equal(sequence_dropout(x, 1.0, 1), torch.zeros_like(x))
    with pytest.raises(ValueError, match=r"sequence_dropout\(p=1.5\)"):
        sequence_dropout(x, 1.5, 1)
