"""ft.checkpoint (ftrain.transforms.recompute): the same loss and gradients as without it, dropout
included, with fewer bytes saved for backward; and its argument checks."""

import pytest
import torch
from torch import nn

import ftrain as ft
from ftrain.models import Block
from ftrain.testing import assert_steps_close, saved_activation_bytes

from _tiny import UNEVEN, gpt_step, lm_batch

N_LAYER = 4  # blocks to checkpoint


@pytest.mark.parametrize("policy", ["blocks", "selective"])
def test_checkpoint_same_result_with_dropout(policy):
    _, step, state = gpt_step(dropout=0.2, n_layer=N_LAYER)
    batch = lm_batch(8, lengths=UNEVEN)
    assert_steps_close(ft.checkpoint(step, policy), step, state, batch, steps=2, rtol=1e-6)


def test_checkpoint_dropout_really_draws():
    """Guards the test above: with dropout the step is random, so agreement is not trivial."""
    _, step, state = gpt_step(dropout=0.2, n_layer=N_LAYER)
    a = step(state, lm_batch(8, lengths=UNEVEN))[1]["loss"]
    b = step(state.replace(rng=state.rng + 1), lm_batch(8, lengths=UNEVEN))[1]["loss"]
    assert a != b


def test_checkpoint_saves_fewer_bytes():
    _, step, state = gpt_step(dropout=0.1, n_layer=N_LAYER)
    batch = lm_batch(8, lengths=UNEVEN)
    none = saved_activation_bytes(step, state, batch)
    assert saved_activation_bytes(ft.checkpoint(step, "none"), state, batch) == none
    blocks = saved_activation_bytes(ft.checkpoint(step, "blocks"), state, batch)
    selective = saved_activation_bytes(ft.checkpoint(step, "selective"), state, batch)
    assert blocks <= 0.35 * none, (blocks, none)
    assert blocks < selective < none, (blocks, selective, none)


def test_checkpoint_modules_argument_picks_the_blocks():
    _, step, state = gpt_step(dropout=0.1, n_layer=N_LAYER)
    batch = lm_batch(8, lengths=UNEVEN)
    by_class = ft.checkpoint(step, modules=[Block])
    assert_steps_close(by_class, step, state, batch, steps=1, rtol=1e-6)
    assert saved_activation_bytes(by_class, state, batch) == saved_activation_bytes(
        ft.checkpoint(step), state, batch
    )


def test_checkpoint_without_blocks_says_how_to_name_them():
    model = nn.Linear(4, 1)
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.checkpoint(ft.train_step(lambda p, x: ft.apply(model, p, x).pow(2).mean(), opt))
    with pytest.raises(ValueError, match=r"found no blocks.*modules=\[MyBlock\]"):
        step(state, torch.randn(3, 4))


def test_checkpoint_bad_policy_lists_the_legal_ones():
    _, step, _ = gpt_step()
    with pytest.raises(ValueError, match=r"legal policies are \('blocks', 'selective', 'none'\)"):
        ft.checkpoint(step, "everything")


def test_checkpoint_bad_modules_say_what_is_expected():
    _, step, _ = gpt_step()
    with pytest.raises(TypeError, match=r"modules=...\): expected nn.Module subclasses"):
        ft.checkpoint(step, modules=["Block"])
    assert ft.checkpoint(step, modules=Block).transforms[0].modules == (Block,)  # one class
