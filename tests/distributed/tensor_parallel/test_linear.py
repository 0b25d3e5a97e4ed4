"""Megatron's column/row-parallel linears on 2 gloo ranks equal one process, forward and backward."""

import torch
from torch import nn

from ftrain.testing import run_distributed


def _mlp():
    torch.manual_seed(0)
    return nn.Linear(8, 16), nn.Linear(16, 8), torch.randn(5, 8)


def _ranks():
    import torch
    import torch.distributed as dist

    from ftrain.distributed.tensor_parallel.linear import colwise_linear, rowwise_linear
    from ftrain.distributed.tensor_parallel.plans import Colwise, Rowwise, local_piece, resolve_plan
    from tests.distributed.tensor_parallel.test_linear import _mlp

    fc, proj, x = _mlp()
    splits = resolve_plan(nn.Sequential(fc, proj), {"0": Colwise(), "1": Rowwise()}, 2)
    rank = dist.get_rank()
    leaves = {
        k: local_piece(p.detach(), splits[k], rank, 2).clone().requires_grad_()
        for k, p in nn.Sequential(fc, proj).named_parameters()
    }
    x = x.clone().requires_grad_()
    h = torch.tanh(colwise_linear(x, leaves["0.weight"], leaves["0.bias"], None))
    y = rowwise_linear(h, leaves["1.weight"], leaves["1.bias"], None)
    (y.square().sum()).backward()
    return y.detach(), x.grad, {k: v.grad for k, v in leaves.items()}


def test_column_then_row_parallel_equals_one_process():
    from ftrain.distributed.tensor_parallel.plans import Colwise, Rowwise, join_pieces, resolve_plan

    fc, proj, x = _mlp()
    model = nn.Sequential(fc, proj)
    x = x.clone().requires_grad_()
    y = proj(torch.tanh(fc(x)))
    y.square().sum().backward()
    results = run_distributed(_ranks, 2)
    splits = resolve_plan(model, {"0": Colwise(), "1": Rowwise()}, 2)
    for y_r, xg_r, _ in results:
        torch.testing.assert_close(y_r, y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(xg_r, x.grad, rtol=1e-5, atol=1e-6)
    for k, p in model.named_parameters():
        got = join_pieces([r[2][k] for r in results], splits[k])
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)
