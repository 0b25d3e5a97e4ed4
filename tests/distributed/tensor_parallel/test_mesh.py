"""tensor_parallel.mesh: the ("dp", "tp") mesh and where a tensor-parallel state's tensors go."""

import torch

import ftrain as ft
from ftrain.distributed.dtensor import full_tensor
from ftrain.distributed.tensor_parallel.mesh import follow
from ftrain.distributed.tensor_parallel.plans import Split
from ftrain.testing import run_distributed
from tests._tiny import tiny_gpt


def test_optimizer_moments_follow_the_params_they_are_shaped_like():
    splits = {"fc.weight": Split(0), "ln.weight": Split(None)}
    shapes = {"fc.weight": torch.Size([4, 2]), "ln.weight": torch.Size([2])}
    opt_state = ft.tree.from_flat(
        {
            "mu.fc.weight": torch.zeros(4, 2),
            "mu.ln.weight": torch.zeros(2),
            "v_row.fc.weight": torch.zeros(4),  # another shape: not a moment of the weight
            "count": torch.zeros((), dtype=torch.int64),
        }
    )
    got = dict(zip(ft.tree.paths(opt_state), follow(splits, opt_state, shapes)))
    assert got == {
        "mu.fc.weight": Split(0),
        "mu.ln.weight": Split(None),
        "v_row.fc.weight": None,
        "count": None,
    }


def _layout():
    from ftrain.distributed.tensor_parallel.plans import gpt_plan

    model = tiny_gpt()
    opt = ft.optim.adamw(1e-3)
    state = ft.TrainState.create(ft.params_of(model), opt)
    tp = ft.tensor_parallel(model, gpt_plan(), ft.distributed.tp_mesh(1))
    laid = tp.shard_state(state)
    place = {p: str(t.placements) for p, t in zip(ft.tree.paths(laid.opt_state),
                                                   ft.tree.leaves(laid.opt_state))
             if hasattr(t, "placements")}  # fmt: skip
    plain = [p for p, t in zip(ft.tree.paths(laid.opt_state), ft.tree.leaves(laid.opt_state))
             if not hasattr(t, "placements")]  # fmt: skip
    again = tp.shard_state(laid)  # idempotent: a laid-out state is gathered and laid out again
    same = all(torch.equal(full_tensor(a), full_tensor(b))  # strided too, on torch 2.11
               for a, b in zip(ft.tree.leaves(again.params), ft.tree.leaves(laid.params)))  # fmt: skip
    return place, plain, same


def test_the_state_is_laid_out_on_the_mesh():
    place, plain, same = run_distributed(_layout, 1)[0]
    assert "sf=3" in place["0.mu.blocks.0.attn.qkv.weight"]  # q, k, v each split on its own
    assert "Shard(dim=1)" in place["0.nu.blocks.1.mlp.proj.weight"]
    assert place["0.mu.wte.weight"] == "(Replicate(), Replicate())"
    assert plain == ["0.count", "2.count", "2.lr"]  # counters and the lr stay plain
    assert same
