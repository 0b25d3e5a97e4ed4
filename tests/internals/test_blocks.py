"""ftrain.internals.blocks: find_blocks picks the layers, and replace_forwards builds a copy whose
targets run new forwards while the original module and every submodule stay exactly as they were."""

from __future__ import annotations

import copy

import torch
from torch import nn

import ftrain as ft
from ftrain.internals.blocks import find_blocks, in_mode, replace_forwards
from ftrain.internals.module_tables import copy_module
from ftrain.models import Block

from _tiny import Chain, tiny_gpt, tokens


def test_find_blocks_prefers_the_list_of_layers_over_longer_lists_of_leaves():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))  # 8 leaves
            self.tables = nn.ModuleList([nn.Embedding(1000, 4)])  # many params, a leaf
            # 2 layers, each a Sequential of leaves (which must not be picked itself)
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2)
            )

    net = Net()
    assert find_blocks(net) == list(net.layers)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(4, 4)
            self.mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))

    one_layer = nn.Module()
    one_layer.layers = nn.ModuleList([Layer()])
    assert find_blocks(one_layer) == list(one_layer.layers)  # not the mlp inside the layer
    leaves = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert find_blocks(leaves) == list(leaves)  # no composite children: the longest container
    assert find_blocks(nn.Linear(4, 4)) == []


def test_find_blocks_by_class_takes_the_outermost_matches():
    model = tiny_gpt()
    assert find_blocks(model, [Block]) == list(model.blocks)
    assert find_blocks(model, [nn.LayerNorm]) == [
        m for m in model.modules() if isinstance(m, nn.LayerNorm)
    ]
    assert find_blocks(model.blocks[0], [Block]) == [model.blocks[0]]  # the module itself
    assert find_blocks(model, [nn.Conv1d]) == []


def everything(model: nn.Module) -> dict:
    """Each submodule's ``__dict__``, with the tables in it copied (so that a write into one shows),
    by identity of the values."""
    return {
        name: {
            k: {kk: id(vv) for kk, vv in v.items()} if isinstance(v, dict) else id(v)
            for k, v in m.__dict__.items()
        }
        for name, m in model.named_modules()
    }


def doubled(current):
    return lambda *args: 2 * current(*args)


def test_replace_forwards_leaves_the_module_and_every_submodule_untouched():
    model = tiny_gpt()
    calls = []
    model.blocks[0].mlp.register_forward_hook(lambda *a: calls.append(0))  # on a target
    model.blocks[1].register_forward_hook(lambda *a: calls.append(1))  # on the way to one
    before = everything(model)
    copy = replace_forwards(model, [(b.mlp, doubled) for b in model.blocks])
    copy(tokens()).sum().backward()
    assert everything(model) == before
    assert calls == [0, 1]  # each hook once: a replacement does not run its target's again
    assert all(p.grad is not None for p in model.parameters())  # the copy's are the model's


def test_the_copy_shares_params_and_buffers_and_copies_only_the_path_to_each_target():
    model = tiny_gpt()
    target = model.blocks[1].mlp
    copy = replace_forwards(model, [(target, doubled)])

    # params and buffers: the same objects, under the same names
    def ids(pairs):
        return [(name, id(t)) for name, t in pairs]

    assert ids(copy.named_parameters()) == ids(model.named_parameters())
    assert ids(copy.named_buffers()) == ids(model.named_buffers())
    # the path root -> blocks -> blocks[1] -> mlp is copied, everything else is shared
    assert copy is not model and type(copy) is type(model)
    assert copy.blocks is not model.blocks
    assert copy.blocks[1] is not model.blocks[1] and copy.blocks[1].mlp is not target
    assert copy.blocks[0] is model.blocks[0]
    assert copy.blocks[1].attn is model.blocks[1].attn
    assert copy.wte is model.wte
    assert copy.blocks[1].mlp.fc is target.fc  # the target's own children too
    assert replace_forwards(model, []) is model
    assert replace_forwards(model, [(nn.Linear(2, 2), doubled)]) is model  # not under model


def test_the_copy_runs_the_replaced_forward():
    torch.manual_seed(0)
    chain = Chain(2)
    x = torch.randn(3, 16)
    copy = replace_forwards(chain, [(chain.blocks[0], doubled)])
    torch.testing.assert_close(copy(x), chain.blocks[1](2 * chain.blocks[0](x)), rtol=0, atol=0)
    torch.testing.assert_close(chain(x), chain.blocks[1](chain.blocks[0](x)), rtol=0, atol=0)


def plus_one(current):
    return lambda *args: current(*args) + 1


def test_two_replacements_chain_in_order_and_a_root_sees_its_replaced_descendants():
    torch.manual_seed(0)
    chain = Chain(2)
    x = torch.randn(3, 16)
    b0, b1 = chain.blocks
    # one target twice: the second replacement wraps the first
    copy = replace_forwards(chain, [(b0, plus_one), (b0, doubled)])
    torch.testing.assert_close(copy(x), b1(2 * (b0(x) + 1)), rtol=0, atol=0)
    copy = replace_forwards(chain, [(b0, doubled), (b0, plus_one)])
    torch.testing.assert_close(copy(x), b1(2 * b0(x) + 1), rtol=0, atol=0)
    # the root, listed first, is replaced last: its `current` already runs the doubled block
    copy = replace_forwards(chain, [(chain, plus_one), (b1, doubled)])
    torch.testing.assert_close(copy(x), 2 * b1(b0(x)) + 1, rtol=0, atol=0)


def test_copy_module_is_a_new_object_holding_the_same_tables():
    model = tiny_gpt()
    copy = copy_module(model)
    assert copy is not model and type(copy) is type(model)
    assert copy._parameters is model._parameters and copy._modules is model._modules
    idx = tokens()
    params = ft.params_of(model)
    assert torch.equal(ft.apply(copy, params, idx), ft.apply(model, params, idx))


def test_a_later_rewrite_reaches_inside_an_earlier_replaced_forward():
    # fsdp replaces the root's forward, then ft.checkpoint replaces the blocks' forwards: the
    # root's new forward must run the replaced blocks, not the blocks as they were
    torch.manual_seed(0)
    chain = Chain(2)
    x = torch.randn(3, 16)
    b0, b1 = chain.blocks
    first = replace_forwards(chain, [(chain, plus_one)])
    second = replace_forwards(first, [(b, doubled) for b in find_blocks(first)])
    torch.testing.assert_close(second(x), 2 * b1(2 * b0(x)) + 1, rtol=0, atol=0)
    torch.testing.assert_close(first(x), chain(x) + 1, rtol=0, atol=0)  # left as it was


def test_in_mode_reaches_inside_a_replaced_forward():
    # evaluation (ftrain.evaluate) sets eval mode on the rewritten copy, e.g. fsdp's, whose root
    # forward runs an inner copy: dropout inside it must be off too
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    expected = copy.deepcopy(model).eval()(x) + 1
    replaced = replace_forwards(model, [(model, plus_one)])
    evaluated = in_mode(replaced, training=False)
    torch.testing.assert_close(evaluated(x), expected, rtol=0, atol=0)
    assert not any(m.training for m in evaluated.modules())
    assert replaced.training and all(m.training for m in model.modules())  # left as they were
