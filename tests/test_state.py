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
    assert ft.tree.paths(state.opt_state) == ft.tree.paths(opt.init(ft.params_of(net)))
    assert len(state.extra.keys()) == 0
    with pytest.raises(TypeError, match=r"params must be a TensorDict; use ft.params_of"):
        ft.TrainState.create(dict(net.named_parameters()), opt)
    with pytest.raises(TypeError, match=r"ftrain.optim.GradientTransformation.*got SGD"):
        ft.TrainState.create(ft.params_of(net), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"seed must be an int"):
        ft.TrainState.create(ft.params_of(net), opt, seed=1.5)


# -- apply: the per-module plan ----------------------------------------------------------------


class Tied(nn.Module):
    """An embedding whose output projection is the same Parameter (GPT-2 style weight tying)."""

    def __init__(self, vocab: int = 7, d: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))


def test_apply_tied_weight_gets_the_gradient_of_both_uses():
    torch.manual_seed(0)
    model = Tied()
    params = ft.params_of(model)
    assert ft.tree.paths(params) == ["emb.weight"]  # the tied name is absent, as in params_of
    idx = torch.tensor([[0, 3, 5], [6, 1, 2]])
    w = params["emb", "weight"].clone().requires_grad_(True)
    ft.apply(model, TensorDict({"emb": {"weight": w}}, []), idx).square().sum().backward()
    ref = params["emb", "weight"].clone().requires_grad_(True)
    out = torch.func.functional_call(model, {"emb.weight": ref}, (idx,), tie_weights=True)
    out.square().sum().backward()
    torch.testing.assert_close(w.grad, ref.grad, rtol=0, atol=0)
    # Both uses contribute: without the tie, the head would read the module's own weight and
    # only the embedding rows looked up would get a gradient.
    untied = params["emb", "weight"].clone().requires_grad_(True)
    out = torch.func.functional_call(model, {"emb.weight": untied}, (idx,), tie_weights=False)
    out.square().sum().backward()
    assert not torch.allclose(w.grad, untied.grad)
    assert untied.grad[4].abs().sum() == 0 and w.grad[4].abs().sum() > 0  # row 4: head only
    with pytest.raises(KeyError, match=r"unexpected key\(s\) \['head.weight'\]"):
        ft.apply(model, TensorDict({"emb": {"weight": w}, "head": {"weight": w}}, []), idx)


class Optional(nn.Module):
    """A scale that is registered empty (None) and may be given a Parameter later."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_parameter("scale", None)

    def forward(self, x):
        y = self.lin(x)
        return y if self.scale is None else y * self.scale


def test_apply_sees_a_parameter_registered_after_the_first_call():
    torch.manual_seed(0)
    model = Optional()
    x = torch.randn(3, 4)
    before = ft.params_of(model)
    torch.testing.assert_close(ft.apply(model, before, x), model(x))
    # The module's table of parameters keeps its size (None -> Parameter): only identity changed.
    model.scale = nn.Parameter(torch.full((4,), 3.0))
    with pytest.raises(KeyError, match=r"missing key\(s\) \['scale'\]"):
        ft.apply(model, before, x)
    after = ft.params_of(model)
    after["scale"] = torch.full((4,), 2.0)
    want = torch.func.functional_call(model, ft.state_dict_of(after), (x,))
    torch.testing.assert_close(ft.apply(model, after, x), want, rtol=0, atol=0)
    assert torch.equal(model.scale, torch.full((4,), 3.0))  # the module's own, untouched
    # A parameter registered under a new name, and deleted again.
    model.lin.extra = nn.Parameter(torch.zeros(1))
    with pytest.raises(KeyError, match=r"missing key\(s\) \['lin.extra'\]"):
        ft.apply(model, after, x)
    del model.lin.extra
    torch.testing.assert_close(ft.apply(model, after, x), want, rtol=0, atol=0)


def test_apply_follows_a_replaced_submodule_and_a_new_tie():
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(3, 4)
    params = ft.params_of(net).apply(lambda t: t * 2)
    ft.apply(net, params, x)
    net.blocks[1] = nn.Linear(4, 4)  # same names and shapes, another module object
    want = torch.func.functional_call(net, ft.state_dict_of(params), (x,))
    torch.testing.assert_close(ft.apply(net, params, x), want, rtol=0, atol=0)
    assert not torch.equal(ft.apply(net, params, x), net(x))  # the new block read params too
    net.blocks[1].weight = net.blocks[0].weight  # tie after the first call: one key less
    with pytest.raises(KeyError, match=r"unexpected key\(s\) \['blocks.1.weight'\]"):
        ft.apply(net, params, x)
    del params["blocks", "1", "weight"]
    want = torch.func.functional_call(net, ft.state_dict_of(params), (x,), tie_weights=True)
    torch.testing.assert_close(ft.apply(net, params, x), want, rtol=0, atol=0)


class Fails(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin(x)
        raise RuntimeError("boom")


def test_apply_restores_the_module_when_the_forward_raises():
    model = Fails()
    own = {k: (p, p.detach().clone()) for k, p in model.named_parameters()}
    params = ft.params_of(model).apply(lambda t: t + 1)
    with pytest.raises(RuntimeError, match="boom"):
        ft.apply(model, params, torch.randn(2, 4))
    for k, p in model.named_parameters():
        assert p is own[k][0] and isinstance(p, nn.Parameter), k  # the same Parameter objects
        assert torch.equal(p, own[k][1]), k  # with the same values
    x = torch.randn(2, 4)  # and the module computes with them again
    w, b = own["lin.weight"][1], own["lin.bias"][1]
    torch.testing.assert_close(model.lin(x), torch.nn.functional.linear(x, w, b))


class Outer(nn.Module):
    """Calls another module through ft.apply, and itself once more, from inside its forward."""

    def __init__(self, inner: nn.Module, inner_params: TensorDict):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = [inner]  # a list, so that the inner module is no submodule of this one
        self.inner_params = inner_params

    def forward(self, x, again=None):
        h = ft.apply(self.inner[0], self.inner_params, self.lin(x))
        if again is not None:  # the same module, other params, in the middle of this call
            h = ft.apply(self, again, h)
        return self.lin(h)  # this call's params again


def test_nested_apply_of_two_modules_and_of_the_same_module():
    torch.manual_seed(0)
    inner = nn.Linear(4, 4)
    inner_params = ft.params_of(inner).apply(lambda t: t.clone().requires_grad_(True))
    outer = Outer(inner, inner_params)
    p = ft.params_of(outer).apply(lambda t: t.clone().requires_grad_(True))
    q = ft.params_of(outer).apply(lambda t: (3 * t).requires_grad_(True))
    x = torch.randn(2, 4)
    out = ft.apply(outer, p, x, again=q)

    def lin(td, h):
        return torch.nn.functional.linear(h, td["weight"], td["bias"])

    h = lin(inner_params, lin(p["lin"], x))
    want = lin(p["lin"], lin(q["lin"], lin(inner_params, lin(q["lin"], h))))
    torch.testing.assert_close(out, want)
    out.sum().backward()
    for td in (p, q, inner_params):  # gradients reach the params of every level
        assert all(t.grad is not None for t in ft.tree.leaves(td))
    for module in (outer, inner):
        assert all(isinstance(t, nn.Parameter) for t in module.parameters())
        assert all(t.grad is None for t in module.parameters())


def test_apply_with_buffers_given_and_on_a_meta_template():
    torch.manual_seed(0)
    net = Net().eval()
    params, buffers = ft.params_of(net), ft.buffers_of(net)
    buffers["norm", "running_mean"] = torch.full((4,), 5.0)
    x = torch.randn(3, 4)
    want = torch.func.functional_call(
        net, {**ft.state_dict_of(params), **ft.state_dict_of(buffers)}, (x,)
    )
    torch.testing.assert_close(ft.apply(net, params, x, buffers=buffers), want, rtol=0, atol=0)
    assert torch.equal(net.norm.running_mean, torch.zeros(4))  # the module's own, untouched
    with pytest.raises(KeyError, match=r"buffers do not match Net: unexpected key\(s\) \['nope'\]"):
        ft.apply(net, params, x, buffers=TensorDict({"nope": torch.zeros(1)}, []))
    with torch.device("meta"):
        template = Net().eval()
    torch.testing.assert_close(ft.apply(template, params, x, buffers=buffers), want, rtol=0, atol=0)


def test_apply_does_not_keep_the_module_alive():
    import gc
    import weakref

    net = Net()
    ft.apply(net, ft.params_of(net), torch.randn(2, 4))
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None


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
