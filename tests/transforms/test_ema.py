"""ft.ema (ftrain.transforms.ema): the average in state.extra equals the one done by hand, and the
params and metrics are those of the inner step."""

import pytest
import torch

import ftrain as ft
from ftrain.testing import max_rel_error

from _tiny import UNEVEN, gpt_step, lm_batch


def test_ema_matches_a_by_hand_average():
    _, step, state = gpt_step()
    decay = 0.8
    with_ema = ft.ema(step, decay)
    s_ema, s = state, state
    by_hand = ft.tree.leaves(state.params)
    for i in range(3):
        s_ema, m_ema = with_ema(s_ema, lm_batch(8, seed=i, lengths=UNEVEN))
        s, m = step(s, lm_batch(8, seed=i, lengths=UNEVEN))
        by_hand = [decay * e + (1 - decay) * p for e, p in zip(by_hand, ft.tree.leaves(s.params))]
        assert torch.equal(m_ema["loss"], m["loss"])
    for a, b in zip(ft.tree.leaves(s_ema.params), ft.tree.leaves(s.params)):
        assert torch.equal(a, b)  # the params are those of the inner step
    for a, b in zip(ft.tree.leaves(s_ema.extra["ema"]), by_hand):
        assert max_rel_error(a, b) < 1e-6


def test_ema_starts_from_the_params_and_leaves_the_input_state_alone():
    _, step, state = gpt_step()
    with_ema = ft.ema(step, 0.5)
    start = with_ema.init_extra(state)
    assert "ema" not in state.extra.keys()
    for a, b in zip(ft.tree.leaves(start.extra["ema"]), ft.tree.leaves(state.params)):
        assert torch.equal(a, b) and a is not b  # a copy of the params
    new, _ = with_ema(start, lm_batch(8, lengths=UNEVEN))
    for a, b in zip(ft.tree.leaves(start.extra["ema"]), ft.tree.leaves(state.params)):
        assert torch.equal(a, b)  # the input state's average is untouched


@pytest.mark.parametrize("decay", [1.0, -0.1])
def test_ema_decay_must_be_in_0_1(decay):
    _, step, _ = gpt_step()
    with pytest.raises(ValueError, match=r"ft\.ema\(decay=.*\): must be in \[0, 1\)"):
        ft.ema(step, decay)
