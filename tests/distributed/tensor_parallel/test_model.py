"""tp_copy: a copy of the model that runs on this process's pieces; the model is left alone."""

import torch
from torch import nn

import ftrain as ft
from ftrain.distributed.tensor_parallel.linear import PairCollectives
from ftrain.distributed.tensor_parallel.model import tp_copy
from ftrain.distributed.tensor_parallel.plans import (
    Colwise,
    Rowwise,
    gpt_plan,
    local_piece,
    resolve_plan,
)
from ftrain.internals.module_tables import param_slots
from tests._tiny import tiny_gpt, tokens

IDENTITY = PairCollectives(lambda x: x, lambda y: y)


def test_at_tp_1_the_copy_computes_what_the_model_does_and_leaves_it_alone():
    model = tiny_gpt()
    before = dict(model.__dict__), model.blocks[0].attn.__dict__.copy()
    copy = tp_copy(model, gpt_plan(), 1, IDENTITY)
    x = tokens(2)
    params = ft.params_of(model)
    torch.testing.assert_close(ft.apply(copy, params, x), ft.apply(model, params, x))
    assert copy is not model
    assert (dict(model.__dict__), model.blocks[0].attn.__dict__) == before
    # the copy places its tensors where the model keeps them (same tables)
    assert [id(t) for t, _ in param_slots(copy.modules())] == [
        id(t) for t, _ in param_slots(model.modules())
    ]


def test_each_process_runs_its_share_of_the_heads_and_features():
    """tp = 2 simulated in one process: each rank's copy, given its pieces, gives a partial
    output (the exit collective is the identity here); their sum, less the once-added bias,
    is the whole model's layer."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    plan = {"0": Colwise(), "2": Rowwise()}
    splits = resolve_plan(mlp, plan, 2)
    x = torch.randn(3, 8)
    outs = []
    for rank in range(2):
        # functional_call: ft.apply would refuse pieces of another shape than the model's
        pieces = {k: local_piece(p.detach(), splits[k], rank, 2) for k, p in mlp.named_parameters()}
        outs.append(torch.func.functional_call(tp_copy(mlp, plan, 2, IDENTITY), pieces, (x,)))
    torch.testing.assert_close(outs[0] + outs[1] - mlp[2].bias, mlp(x).detach())


def test_divided_head_counts_run_in_the_copy_only():
    model = tiny_gpt(n_head=4)
    seen = []
    hook = model.blocks[0].attn.register_forward_pre_hook(lambda m, a: seen.append(m.n_head))
    # whole weights at tp = 2 would not fit the halved head count: give the copy q/k/v pieces
    splits = resolve_plan(model, gpt_plan(), 2)
    params = ft.params_of(model)
    pieces = {k: local_piece(v, splits[k], 0, 2)
              for k, v in zip(ft.tree.paths(params), ft.tree.leaves(params))}  # fmt: skip
    torch.func.functional_call(tp_copy(model, gpt_plan(), 2, IDENTITY), pieces, (tokens(1),))
    hook.remove()
    assert seen == [2] and model.blocks[0].attn.n_head == 4  # the user's hook ran once, on 2 heads
