"""ftrain.losses: cross_entropy as a sum and its count, and what a loss function may return
(as_loss), checked against torch.nn.functional and by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain.losses import as_loss, cross_entropy

from _tiny import lm_batch, tiny_gpt


def test_cross_entropy_is_the_sum_over_valid_tokens_and_their_number():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 7, (3, 5), generator=g)
    targets[0, 2:] = -100
    loss = cross_entropy(logits, targets)
    want = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    assert loss.total.dtype == torch.float32  # summed in fp32 whatever the logits' dtype
    torch.testing.assert_close(loss.total, want)
    assert int(loss.count) == 15 - 3
    torch.testing.assert_close(loss.value, want / 12)
    other = torch.where(targets == -100, 6, targets)  # another ignore_index
    loss = cross_entropy(logits, other, ignore_index=6)
    want = F.cross_entropy(
        logits.float().flatten(0, 1), other.flatten(), ignore_index=6, reduction="sum"
    )
    torch.testing.assert_close(loss.total, want)
    assert int(loss.count) == int((other != 6).sum()) < 12
    with pytest.raises(ValueError, match=r"logits \(3, 5, 7\) must be targets \(3, 4\) plus"):
        cross_entropy(logits, targets[:, :4])


def test_a_count_of_zero_gives_a_value_of_zero():
    assert float(ft.Loss(torch.tensor(0.0), torch.tensor(0)).value) == 0.0


def test_as_loss_takes_a_loss_a_scalar_mean_or_a_pair_with_aux():
    batch = {"x": torch.zeros(4, 2), "scale": torch.tensor(2.0)}
    total, count = torch.tensor(6.0), torch.tensor(3)
    assert as_loss(ft.Loss(total, count), batch) == ft.Loss(total, count, {})
    mean = as_loss(torch.tensor(1.5), batch)  # a mean over the 4 rows
    assert (float(mean.total), int(mean.count)) == (6.0, 4)
    acc = torch.tensor(0.5)
    pair = as_loss((ft.Loss(total, count, {"a": acc}), {"b": acc}), batch)
    assert pair.aux == {"a": acc, "b": acc}
    assert as_loss((torch.tensor(1.0), {"b": acc}), batch).aux == {"b": acc}
    assert int(as_loss(ft.Loss(total, 3), batch).count) == 3  # a number becomes a tensor


def test_as_loss_refuses_what_is_not_a_loss_and_says_what_to_return():
    batch = {"x": torch.zeros(4, 2)}
    with pytest.raises(TypeError, match=r"tuple of 3 items; return a Loss, a scalar tensor"):
        as_loss((torch.tensor(1.0), {}, 0), batch)
    with pytest.raises(TypeError, match=r"returned float; return ft\.Loss\(total, count\)"):
        as_loss(1.0, batch)
    with pytest.raises(TypeError, match=r"holds no tensor with a leading batch dimension"):
        as_loss(torch.tensor(1.0), {"scale": torch.tensor(2.0)})
    with pytest.raises(TypeError, match=r"Loss.total must be a floating-point tensor"):
        as_loss(ft.Loss(torch.tensor(3), torch.tensor(1)), batch)
    with pytest.raises(ValueError, match=r"Loss.count must be a 0-d tensor"):
        as_loss(ft.Loss(torch.tensor(3.0), torch.ones(2)), batch)


def test_loss_must_be_a_scalar():
    model = tiny_gpt()
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)

    def per_token(params, batch):
        out = ft.apply(model, params, batch["input"])
        return F.cross_entropy(out.flatten(0, 1), batch["target"].flatten(), reduction="none")

    with pytest.raises(ValueError, match=r"scalar loss, got a tensor of shape \(64,\).*\.mean\(\)"):
        ft.train_step(per_token, opt)(state, lm_batch())
