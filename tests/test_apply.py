"""ftrain.apply: ft.apply runs a module's code on the params given (strict, tied weights, buffers,
nested calls, a meta template), leaves the module as it was (also on error, also under a step's
rewrites), and its scoped rewrites and cache.

References: torch.func.functional_call and modules called by hand.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import ftrain as ft
from ftrain.apply import ApplyCache, caching, rewriting
from ftrain.internals.blocks import replace_forwards

from _tiny import Net, gpt_step, lm_batch


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


# -- nothing written onto the module by a step's rewrites -------------------------------------------


def module_tables(model: nn.Module) -> dict:
    """Everything a step could write onto ``model`` and its submodules: each one's attribute names,
    its parameter, buffer and submodule tables (by identity), its forward and hook counts."""
    out = {}
    for name, m in model.named_modules():
        out[name] = (
            sorted(m.__dict__),
            {k: id(v) for k, v in m._parameters.items()},
            {k: id(v) for k, v in m._buffers.items()},
            {k: id(v) for k, v in m._modules.items()},
            m.__dict__.get("forward"),
            m.forward.__func__,
            {k: len(v) for k, v in m.__dict__.items() if "hook" in k and isinstance(v, dict)},
        )
    return out


@pytest.mark.parametrize("policy", ["blocks", "selective"])
def test_a_checkpointed_step_writes_nothing_onto_the_module(policy):
    model, step, state = gpt_step(dropout=0.1)
    before = module_tables(model)
    assert before[""][4] is None  # no forward in the instance's __dict__
    ft.accumulate(ft.checkpoint(step, policy), 2)(state, lm_batch(4))
    assert module_tables(model) == before
    for m in model.modules():
        assert all(isinstance(p, nn.Parameter) and p.grad is None for p in m._parameters.values())


def test_a_rewrite_needs_the_loss_to_call_ft_apply():
    model = nn.Linear(3, 1)
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)

    def by_hand(params, x):  # uses the params without ft.apply: nothing to checkpoint
        return (x @ params["weight"].T + params["bias"]).pow(2).mean()

    ft.train_step(by_hand, opt)(state, torch.ones(2, 3))  # fine without a rewrite
    with pytest.raises(
        RuntimeError,
        match=r"ft\.checkpoint acts on the model .* never called ft\.apply\. "
        r"Call the model through ft\.apply\.",
    ):
        ft.checkpoint(ft.train_step(by_hand, opt))(state, torch.ones(2, 3))


# -- rewrites and the cache, scoped ----------------------------------------------------------------


class Affine:
    """A rewrite: the module's output times ``a`` plus ``b``; notes the module it was given."""

    def __init__(self, a: float, b: float, seen: list):
        self.a, self.b, self.seen = a, b, seen

    def rewrite(self, module):
        self.seen.append(module)

        def make(current):
            return lambda *args: self.a * current(*args) + self.b

        return replace_forwards(module, [(module, make)])


def test_rewriting_runs_the_rewrites_in_order_and_counts_the_calls():
    torch.manual_seed(0)
    net = Net().eval()
    params, x = ft.params_of(net), torch.randn(3, 4)
    seen: list = []
    double, plus_one = Affine(2.0, 0.0, seen), Affine(1.0, 1.0, seen)
    with rewriting([double, plus_one]) as calls:
        out = ft.apply(net, params, x)
        ft.apply(net, params, x)
        with rewriting([Affine(3.0, 0.0, seen)]) as inner:  # nested: acts closer to the module
            torch.testing.assert_close(ft.apply(net, params, x), 6 * net(x) + 1)
    torch.testing.assert_close(out, 2 * net(x) + 1, rtol=0, atol=0)  # not 2 * (net(x) + 1)
    assert seen[0] is net and seen[1] is not net  # the second got the first one's result
    assert seen[2] is net  # the nested block's rewrite got the module itself
    assert (calls.count, inner.count) == (3, 1)  # an enclosing block counts nested calls too
    ft.apply(net, params, x)  # outside: not counted, not rewritten
    assert calls.count == 3
    torch.testing.assert_close(ft.apply(net, params, x), net(x), rtol=0, atol=0)


def test_caching_reuses_the_plan_and_notices_a_registered_parameter():
    torch.manual_seed(0)
    net = Net().eval()
    params, x = ft.params_of(net).apply(lambda t: 2 * t), torch.randn(3, 4)
    want = torch.func.functional_call(net, ft.state_dict_of(params), (x,))
    cache = ApplyCache()
    with caching(cache):
        torch.testing.assert_close(ft.apply(net, params, x), want, rtol=0, atol=0)
        plan = cache.plan(net)
        torch.testing.assert_close(ft.apply(net, params, x), want, rtol=0, atol=0)
        assert cache.plan(net) is plan  # worked out once, reused
        net.blocks[0].scale = nn.Parameter(torch.ones(1))
        assert cache.plan(net) is not plan  # the module changed: worked out again
        with pytest.raises(KeyError, match=r"missing key\(s\) \['blocks.0.scale'\]"):
            ft.apply(net, params, x)


def test_caching_keeps_the_rewritten_copy():
    net, x = Net().eval(), torch.randn(3, 4)
    params = ft.params_of(net)
    uncached: list = []
    with rewriting([Affine(2.0, 0.0, uncached)]):
        outs = [ft.apply(net, params, x) for _ in range(3)]
    cached: list = []
    with caching(ApplyCache()), rewriting([Affine(2.0, 0.0, cached)]):
        outs += [ft.apply(net, params, x) for _ in range(3)]
    assert (len(uncached), len(cached)) == (3, 1)
    assert all(torch.equal(o, outs[0]) for o in outs)
