"""ft.stack / ft.unstack: K states <-> one state with a leading member dimension on every leaf."""

import pytest
import torch

import ftrain as ft
from ftrain import tree
from ftrain.stack import is_stacked, members

from _tiny import tiny_gpt


def _states(k=3, opt=None):
    opt = opt or ft.optim.adamw(1e-3)  # a chain with an empty state entry (weight decay)
    return [ft.TrainState.create(ft.params_of(tiny_gpt(seed=i)), opt, seed=i) for i in range(k)]


def test_every_leaf_gets_the_member_dimension_and_unstack_inverts():
    states = _states()
    stacked = ft.stack(states)
    assert is_stacked(stacked) and members(stacked) == 3
    assert stacked.step.shape == (3,) and stacked.rng.tolist() == [0, 1, 2]
    for got, want in zip(tree.leaves(stacked.params), tree.leaves(states[1].params)):
        assert got.shape == (3, *want.shape) and torch.equal(got[1], want)
    for got, want in zip(ft.unstack(stacked), states):
        for field in ("params", "opt_state", "extra"):
            assert (
                tree.to_flat(getattr(got, field)).keys()
                == tree.to_flat(getattr(want, field)).keys()
            )
            for a, b in zip(tree.leaves(getattr(got, field)), tree.leaves(getattr(want, field))):
                assert torch.equal(a, b)
        assert torch.equal(got.step, want.step) and torch.equal(got.rng, want.rng)


def test_unstacked_members_are_copies():
    stacked = ft.stack(_states(2))
    member = ft.unstack(stacked)[0]
    tree.leaves(member.params)[0].add_(1.0)
    assert not torch.equal(tree.leaves(member.params)[0], tree.leaves(stacked.params)[0][0])


def test_extra_is_stacked_too():
    states = [
        ft.ema(ft.train_step(lambda p, b: p["w"].sum(), ft.optim.sgd(0.1)), 0.9).init_extra(s)
        for s in (
            ft.TrainState.create(tree.from_flat({"w": torch.ones(2) * i}), ft.optim.sgd(0.1))
            for i in range(2)
        )
    ]
    stacked = ft.stack(states)
    assert stacked.extra["ema", "w"].shape == (2, 2)


def test_a_structure_mismatch_names_the_first_differing_key():
    a, b = _states(2)
    other = ft.TrainState.create(ft.params_of(tiny_gpt(n_layer=1)), ft.optim.adamw(1e-3))
    with pytest.raises(ValueError, match=r"states\[1\] has no 'params.blocks.1.ln_1.weight'"):
        ft.stack([a, other])
    with pytest.raises(ValueError, match=r"states\[1\] has 'params.blocks.1.ln_1.weight'"):
        ft.stack([other, a])
    wide = ft.TrainState.create(ft.params_of(tiny_gpt(d_model=16)), ft.optim.adamw(1e-3))
    with pytest.raises(ValueError, match=r"'params.wte.weight' is float32\[64, 32\].*\[64, 16\]"):
        ft.stack([a, wide])
    sgd = ft.TrainState.create(ft.params_of(tiny_gpt()), ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="opt_state"):
        ft.stack([a, sgd])


def test_bad_arguments():
    a, b = _states(2)
    with pytest.raises(TypeError, match="non-empty list"):
        ft.stack([])
    with pytest.raises(TypeError, match="non-empty list"):
        ft.stack(a)
    with pytest.raises(ValueError, match="already stacked"):
        ft.stack([ft.stack([a, b]), ft.stack([a, b])])
    with pytest.raises(ValueError, match="not stacked"):
        ft.unstack(a)
    broken = ft.stack([a, b])
    broken = broken.replace(extra=tree.from_flat({"x": torch.zeros(())}))
    with pytest.raises(ValueError, match="'extra.x' has shape \\[\\]"):
        ft.unstack(broken)
