"""Parameters as data: params_of, buffers_of, apply (strict) and TrainState."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import ftrain as ft


class Net(nn.Module):
    def __init__(self, d: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])
        self.norm = nn.BatchNorm1d(d)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.norm(x)


def test_params_of_is_a_detached_copy_keyed_by_module_path():
    torch.manual_seed(0)
    net = Net()
    params = ft.params_of(net)
    assert isinstance(params, TensorDict)
    assert set(ft._tree.paths(params)) == {k for k, _ in net.named_parameters()}
    assert torch.equal(params["blocks", "1", "weight"], net.blocks[1].weight)
    assert not params["blocks", "1", "weight"].requires_grad
    params["blocks", "1", "weight"].add_(1.0)  # training the copy never touches the module
    assert not torch.equal(params["blocks", "1", "weight"], net.blocks[1].weight)
    with torch.no_grad():
        net.blocks[0].bias.add_(1.0)  # and the other way round
    assert not torch.equal(params["blocks", "0", "bias"], net.blocks[0].bias)
    buffers = ft.buffers_of(net)
    assert set(ft._tree.paths(buffers)) == {k for k, _ in net.named_buffers()}


def test_apply_runs_the_module_on_the_given_params_only():
    torch.manual_seed(0)
    net = Net().eval()
    params = ft.params_of(net)
    x = torch.randn(3, 4)
    assert torch.equal(ft.apply(net, params, x), net(x))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    doubled = params.apply(lambda t: 2 * t)
    out = ft.apply(net, doubled, x)
    assert not torch.equal(out, net(x))
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k  # the module's tensors were neither read nor written

    # gradients flow to the params given
    leaf = params.apply(lambda t: t.clone().requires_grad_(True))
    ft.apply(net, leaf, x).sum().backward()
    assert leaf["blocks", "0", "weight"].grad is not None


def test_apply_is_strict_and_names_the_key():
    net = Net()
    params = ft.params_of(net)
    missing = params.clone()
    del missing["blocks", "1", "bias"]
    with pytest.raises(KeyError, match=r"missing key\(s\) \['blocks.1.bias'\].*ft.params_of"):
        ft.apply(net, missing, torch.randn(2, 4))
    extra = params.clone()
    extra["head"] = TensorDict({"weight": torch.zeros(2, 2)}, [])
    with pytest.raises(KeyError, match=r"unexpected key\(s\) \['head.weight'\]"):
        ft.apply(net, extra, torch.randn(2, 4))
    wrong = params.clone()
    wrong["blocks", "0", "weight"] = torch.zeros(5, 4)
    with pytest.raises(
        ValueError, match=r"params\['blocks.0.weight'\] has shape \(5, 4\).*\(4, 4\)"
    ):
        ft.apply(net, wrong, torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"params must be a TensorDict \(from ft.params_of"):
        ft.apply(net, dict(net.named_parameters()), torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"params_of\(module\): expected an nn.Module"):
        ft.params_of(params)


def test_train_state_create():
    net = Net()
    opt = ft.optim.adamw(1e-3)
    state = ft.TrainState.create(ft.params_of(net), opt, seed=7)
    assert state.step.dtype == torch.int64 and int(state.step) == 0 and state.step.dim() == 0
    assert int(state.rng) == 7
    assert ft._tree.paths(state.opt_state) == ft._tree.paths(opt.init(ft.params_of(net)))
    assert len(state.extra.keys()) == 0
    with pytest.raises(TypeError, match=r"params must be a TensorDict; use ft.params_of"):
        ft.TrainState.create(dict(net.named_parameters()), opt)
    with pytest.raises(TypeError, match=r"ftrain.optim.GradientTransformation.*got SGD"):
        ft.TrainState.create(ft.params_of(net), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"seed must be an int"):
        ft.TrainState.create(ft.params_of(net), opt, seed=1.5)
