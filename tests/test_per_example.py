"""ft.per_example_grads: each row is the gradient of one example's loss, checked against a Python
loop of torch.autograd.grad over single examples."""

import collections

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import ftrain as ft
from ftrain import tree

from _tiny import UNEVEN, lm_batch, lm_loss, tiny_gpt


def _loop(loss_fn, params, examples):
    """The reference: for each example, autograd of ``loss_fn``'s value on it alone."""
    rows = []
    for ex in examples:
        p = params.apply(lambda t: t.detach().requires_grad_(True))
        out = loss_fn(p, ex)
        value = out.value if isinstance(out, ft.Loss) else out
        rows.append(torch.autograd.grad(value, tree.leaves(p)))
    return [torch.stack(col) for col in zip(*rows)]


def _close(got: TensorDict, want: list[torch.Tensor], n: int):
    assert got.batch_size == torch.Size([n])
    leaves = tree.leaves(got)
    assert len(leaves) == len(want)
    for a, b in zip(leaves, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_token_loss_rows_are_each_examples_token_mean():
    """A padded token loss (an ft.Loss): row i is the gradient of example i's mean over its own
    valid tokens, and the keys are the params'."""
    model = tiny_gpt()
    params, batch, n = ft.params_of(model), lm_batch(5, seed=2, lengths=UNEVEN), 5
    got = ft.per_example_grads(lm_loss(model), params, batch)
    assert tree.paths(got) == tree.paths(params)
    examples = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(n)]
    _close(got, _loop(lm_loss(model), params, examples), n)


def test_scalar_loss_and_batch_containers():
    """A plain scalar loss; the batch as a tuple, a namedtuple, a TensorDict, with a shared 0-d
    tensor and a non-tensor value given to every example."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    params = ft.params_of(model)
    x, y, w = torch.randn(4, 3), torch.randn(4, 2), torch.tensor(0.5)

    def loss_fn(p, b):
        return (w * (ft.apply(model, p, b[0]) - b[1]) ** 2).mean() * b[2]

    want = _loop(loss_fn, params, [(x[i : i + 1], y[i : i + 1], 3) for i in range(4)])
    _close(ft.per_example_grads(loss_fn, params, (x, y, 3)), want, 4)
    Pair = collections.namedtuple("Pair", "x y scale")
    _close(ft.per_example_grads(loss_fn, params, Pair(x, y, 3)), want, 4)

    def td_loss(p, b):
        assert isinstance(b, TensorDict) and b.batch_size == torch.Size([1])
        return loss_fn(p, (b["x"], b["y"], 3))

    td = TensorDict({"x": x, "y": y}, batch_size=[4])
    _close(ft.per_example_grads(td_loss, params, td), want, 4)


def test_bad_input():
    model = nn.Linear(3, 2)
    params = ft.params_of(model)

    def loss_fn(p, b):
        return ft.apply(model, p, b["x"]).sum() + b["y"].sum()

    with pytest.raises(ValueError, match=r"batch\['y'\] has 3 rows but batch\['x'\] has 4"):
        ft.per_example_grads(loss_fn, params, {"x": torch.randn(4, 3), "y": torch.randn(3)})
    with pytest.raises(ValueError, match="no tensor with a leading example dimension"):
        ft.per_example_grads(loss_fn, params, {"x": 1.0})
    with pytest.raises(TypeError, match="params must be a TensorDict"):
        ft.per_example_grads(loss_fn, dict(model.named_parameters()), torch.randn(4, 3))
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ft.per_example_grads(None, params, torch.randn(4, 3))


def test_mean_of_rows_is_the_batch_gradient_for_equal_counts():
    """Every example with the same count: the mean of the rows is the gradient of the batch's
    mean loss (what a step computes)."""
    model = tiny_gpt()
    params, batch = ft.params_of(model), lm_batch(4, seed=5)
    rows = ft.per_example_grads(lm_loss(model), params, batch)
    p = params.apply(lambda t: t.detach().requires_grad_(True))
    whole = torch.autograd.grad(lm_loss(model)(p, batch).value, tree.leaves(p))
    for a, b in zip(tree.leaves(rows), whole):
        torch.testing.assert_close(a.mean(0), b, atol=1e-6, rtol=0)
