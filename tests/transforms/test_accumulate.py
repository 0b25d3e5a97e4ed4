"""ft.accumulate (ftrain.transforms.accumulate): k micro-batches equal one step on the whole batch,
also token-weighted with uneven padding, and its argument checks."""

from collections import namedtuple

import pytest
import torch

import ftrain as ft
from ftrain.testing import assert_steps_close, max_rel_error

from _tiny import UNEVEN, gpt_step, lm_batch, lm_loss


@pytest.mark.parametrize("rows,k", [(16, 2), (16, 4), (16, 8), (10, 4)])
def test_accumulate_equals_one_step_on_the_whole_batch(rows, k):
    _, step, state = gpt_step()
    batch = lm_batch(rows, lengths=UNEVEN)
    # The reference really is token-weighted: micro-batches hold different numbers of tokens.
    counts = [int((t != -100).sum()) for t in torch.tensor_split(batch["target"], k)]
    assert len(set(counts)) > 1
    assert_steps_close(ft.accumulate(step, k), step, state, batch, steps=3, rtol=1e-5)


def test_naive_mean_of_micro_batch_means_differs():
    """The test above can fail: averaging per-micro-batch mean losses (what a loop that calls
    ``(loss / k).backward()`` does) weights tokens unequally and is caught at its tolerance."""
    model, step, state = gpt_step()

    def mean_loss(params, batch):  # a plain scalar: a mean over its own micro-batch
        return lm_loss(model)(params, batch).value

    naive = ft.accumulate(ft.train_step(mean_loss, ft.optim.sgd(0.5, momentum=0.9)), 4)
    with pytest.raises(AssertionError, match="relative error"):
        assert_steps_close(naive, step, state, lm_batch(16, lengths=UNEVEN), steps=1, rtol=1e-5)


def test_accumulate_loss_metric_is_the_token_weighted_mean():
    model, step, state = gpt_step()
    batch = lm_batch(10, lengths=UNEVEN)
    _, metrics = ft.accumulate(step, 4)(state, batch)
    expected = lm_loss(model)(state.params, batch)  # by hand, whole batch
    assert int(metrics["count"]) == int(expected.count) == sum(UNEVEN[:10])
    assert max_rel_error(metrics["loss"], expected.value) < 1e-6


def test_accumulate_splits_namedtuple_and_nested_dict_batches():
    Batch = namedtuple("Batch", "x y")
    lin = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(lin), opt)

    def tuple_loss(params, b):  # a mean over rows, declared (the rows are read from the batch)
        return ft.losses.row_mean((ft.apply(lin, params, b.x) - b.y).pow(2).mean())

    def nested_loss(params, b):
        return ft.losses.row_mean((ft.apply(lin, params, b["in"]["x"]) - b["y"]).pow(2).mean())

    for loss_fn, batch in [(tuple_loss, Batch(x, y)), (nested_loss, {"in": {"x": x}, "y": y})]:
        whole, _ = ft.train_step(loss_fn, opt)(state, batch)
        acc, _ = ft.accumulate(ft.train_step(loss_fn, opt), 3)(state, batch)
        for k in ("weight", "bias"):
            torch.testing.assert_close(acc.params[k], whole.params[k])


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_micro_batches_must_be_a_positive_int(k):
    _, step, _ = gpt_step()
    with pytest.raises(ValueError, match=r"must be an integer >= 1"):
        ft.accumulate(step, k)


def test_micro_batches_more_than_rows():
    _, step, state = gpt_step()
    with pytest.raises(ValueError, match=r"got a batch of 3 rows.*micro_batches <= 3"):
        ft.accumulate(step, 4)(state, lm_batch(3, lengths=UNEVEN))


def test_accumulate_twice_names_both_counts_and_asks_for_one():
    _, step, _ = gpt_step()
    with pytest.raises(ValueError) as refused:
        ft.accumulate(ft.accumulate(step, 2), 3)
    message = str(refused.value)
    assert "ft.accumulate was applied twice: micro_batches=2, then micro_batches=3" in message
    assert "apply it once" in message
