"""ftrain.state: params_of and buffers_of (detached copies keyed by module path), state_dict_of,
and TrainState (create, replace)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft

from _tiny import Net


def test_params_of_is_a_detached_copy_keyed_by_module_path():
    torch.manual_seed(0)
    net = Net()
    params = ft.params_of(net)
    assert isinstance(params, TensorDict)
    assert set(ft.tree.paths(params)) == {k for k, _ in net.named_parameters()}
    assert torch.equal(params["blocks", "1", "weight"], net.blocks[1].weight)
    assert not params["blocks", "1", "weight"].requires_grad
    params["blocks", "1", "weight"].add_(1.0)  # training the copy never touches the module
    assert not torch.equal(params["blocks", "1", "weight"], net.blocks[1].weight)
    with torch.no_grad():
        net.blocks[0].bias.add_(1.0)  # and the other way round
    assert not torch.equal(params["blocks", "0", "bias"], net.blocks[0].bias)
    buffers = ft.buffers_of(net)
    assert set(ft.tree.paths(buffers)) == {k for k, _ in net.named_buffers()}
    assert torch.equal(buffers["norm", "running_var"], net.norm.running_var)
    buffers["norm", "running_var"].add_(1.0)
    assert torch.equal(net.norm.running_var, torch.ones(4))  # a copy too
    with pytest.raises(TypeError, match=r"params_of\(module\): expected an nn.Module"):
        ft.params_of(params)
    with pytest.raises(TypeError, match=r"buffers_of\(module\): expected an nn.Module"):
        ft.buffers_of(params)


def test_state_dict_of_is_flat_with_the_modules_names_and_shares_the_tensors():
    net = Net()
    params = ft.params_of(net)
    flat = ft.state_dict_of(params)
    assert list(flat) == [k for k, _ in net.named_parameters()]
    assert flat["blocks.1.weight"] is params["blocks", "1", "weight"]
    other = Net()
    missing, unexpected = other.load_state_dict(flat, strict=False)
    assert unexpected == [] and not set(missing) & set(flat)  # every parameter loaded
    assert torch.equal(other.blocks[1].weight, net.blocks[1].weight)


def test_train_state_create():
    net = Net()
    opt = ft.optim.adamw(1e-3)
    state = ft.TrainState.create(ft.params_of(net), opt, seed=7)
    assert state.step.dtype == torch.int64 and int(state.step) == 0 and state.step.dim() == 0
    assert int(state.rng) == 7
    assert ft.tree.paths(state.opt_state) == ft.tree.paths(opt.init(ft.params_of(net)))
    assert len(state.extra.keys()) == 0
    with pytest.raises(TypeError, match=r"params must be a TensorDict; use ft.params_of"):
        ft.TrainState.create(dict(net.named_parameters()), opt)
    with pytest.raises(TypeError, match=r"ftrain.optim.GradientTransformation.*got SGD"):
        ft.TrainState.create(ft.params_of(net), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"seed must be an int"):
        ft.TrainState.create(ft.params_of(net), opt, seed=1.5)


def test_train_state_replace_replaces_a_field_wholesale():
    a, b = torch.zeros(2), torch.ones(2)
    state = ft.TrainState.create(TensorDict({"a": a, "b": b}, []), ft.optim.sgd(0.1))
    new_params = TensorDict({"a": torch.full((2,), 5.0)}, [])
    new = state.replace(params=new_params)
    assert list(new.params.keys()) == ["a"]  # not merged into the old params: "b" is gone
    assert new.params is new_params  # nothing copied
    assert new.opt_state is state.opt_state and new.step is state.step and new.rng is state.rng
    assert list(state.params.keys()) == ["a", "b"] and state.params["a"] is a  # old one intact
    with pytest.raises(TypeError, match=r"\['parms'\] are not fields of TrainState"):
        state.replace(parms=new_params)


def test_param_count_counts_each_number_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied: one tensor under two names
    assert ft.param_count(ft.params_of(model)) == 10 * 4 + 10  # the tie counts once
    assert ft.param_count(ft.params_of(model)) == sum(p.numel() for p in model.parameters())
    with pytest.raises(TypeError, match="num_params"):
        ft.param_count(model)


def test_to_device_moves_the_tensors_but_keeps_step_and_rng_on_the_cpu():
    net = Net()
    opt = ft.optim.adamw(1e-3)
    state = ft.TrainState.create(ft.params_of(net), opt)
    moved = state.to_device("meta")  # a device that exists everywhere
    assert all(t.device.type == "meta" for t in ft.tree.leaves(moved.params))
    assert all(t.device.type == "meta" for t in ft.tree.leaves(moved.opt_state))
    assert moved.step.device.type == moved.rng.device.type == "cpu"
    assert all(t.device.type == "cpu" for t in ft.tree.leaves(state.params))  # the input stays
