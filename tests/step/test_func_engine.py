"""ftrain.step.FuncEngine: the same gradients, sums and aux as AutogradEngine (torch.func.grad
instead of torch.autograd.grad), with a loss scale and for a low-precision mean too."""

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain.step import AutogradEngine, FuncEngine


def _forward(low_mean=False):
    def forward(params, piece):
        x, weight = piece
        per_row = (x @ params["w"] + params["b"]).pow(2).sum(-1) * weight
        aux = {"rows": torch.tensor(float(len(x)))}
        return ft.Loss(per_row.sum(), torch.tensor(len(x)), aux), low_mean

    return forward


def _setup():
    g = torch.Generator().manual_seed(0)
    params = TensorDict(
        {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g), "u": torch.ones(4)},
        [],
    )
    pieces = [(torch.randn(n, 3, generator=g), w) for n, w in ((2, 1.0), (5, 0.5))]
    return params, pieces


@pytest.mark.parametrize(
    "scale, low_mean", [(None, False), (torch.tensor(8.0), False), (None, True)]
)
def test_func_engine_equals_autograd_engine(scale, low_mean):
    params, pieces = _setup()
    want = AutogradEngine()(_forward(low_mean), params, pieces, scale)
    got = FuncEngine()(_forward(low_mean), params, pieces, scale)
    for a, b in zip(got.grads, want.grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.grads[2], torch.zeros(4))  # "u" is unused: a zero gradient
    assert torch.allclose(got.total, want.total) and torch.equal(got.count, want.count)
    assert got.aux.keys() == want.aux.keys() and torch.allclose(got.aux["rows"], want.aux["rows"])
