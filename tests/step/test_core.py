"""ftrain.step.core: the train step's own guarantees (``ft.train_step``, ``ft.Step``): purity and
donation, explicit randomness, metrics, exact loss normalization, and bad input refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain import optim
from ftrain.transforms import Accumulate, Checkpoint

from _tiny import T, lm_batch, lm_loss, tiny_gpt


def snapshot(td) -> list[torch.Tensor]:
    return [t.clone() for t in td.values(include_nested=True, leaves_only=True)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def padded(pad: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """4 rows; the last ``pad`` targets of every other row are padding (-100)."""
    return lm_batch(4, seed, lengths=[T - pad, T, T - pad, T])


def test_step_is_pure_and_donation_is_in_place_with_equal_results():
    model = tiny_gpt()
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, mask=optim.decay_mask))
    state = ft.TrainState.create(ft.params_of(model), opt)
    state, _ = ft.train_step(lm_loss(model), opt)(state, lm_batch(seed=9))  # non-zero moments
    batch = lm_batch()

    before = snapshot(state)
    pure_state, pure_metrics = ft.train_step(lm_loss(model), opt)(state, batch)
    assert same(snapshot(state), before)  # bitwise untouched
    assert not same(snapshot(pure_state.params), snapshot(state.params))

    donated = state.clone()
    params_before = [id(t) for t in ft.tree.leaves(donated.params)]
    new_state, metrics = ft.train_step(lm_loss(model), opt, donate=True)(donated, batch)
    assert [id(t) for t in ft.tree.leaves(new_state.params)] == params_before  # the same buffers
    assert same(snapshot(donated.params), snapshot(new_state.params))  # ...updated in place
    assert same(snapshot(new_state), snapshot(pure_state))  # and the same numbers, bitwise
    for k in pure_metrics:
        assert torch.equal(metrics[k], pure_metrics[k]), k


def test_same_state_and_batch_give_the_same_result_with_dropout():
    model = tiny_gpt(dropout=0.2)
    opt = optim.adamw(1e-3)
    step = ft.train_step(lm_loss(model), opt)
    state = ft.TrainState.create(ft.params_of(model), opt, seed=1)
    batch = lm_batch()

    a_state, a = step(state, batch)
    torch.rand(100)  # whatever the global generator does in between
    b_state, b = step(state, batch)
    assert torch.equal(a["loss"], b["loss"]) and same(snapshot(a_state), snapshot(b_state))

    other = ft.TrainState.create(ft.params_of(model), opt, seed=2)
    c_state, c = step(other, batch)
    assert not torch.equal(a["loss"], c["loss"])  # another rng key: other dropout masks
    d_state, d = step(a_state, batch)  # the next step draws other masks too
    no_dropout = ft.train_step(lm_loss(tiny_gpt(dropout=0.0)), opt)
    e = no_dropout(state, batch)[1]
    assert not torch.equal(a["loss"], e["loss"])  # dropout did act


def test_the_step_leaves_the_global_random_state_alone():
    model = tiny_gpt(dropout=0.2)
    opt = optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    ft.train_step(lm_loss(model), opt)(state, lm_batch())
    assert torch.equal(torch.rand(5), expected)


def test_metrics_are_0d_tensors_with_loss_count_grad_norm_lr():
    model = tiny_gpt()
    sched = optim.linear_warmup(1e-2, 10)
    opt = optim.adamw(sched)
    state = ft.TrainState.create(ft.params_of(model), opt)
    batch = padded(5)
    state2, metrics = ft.train_step(lm_loss(model), opt)(state, batch)
    assert {"loss", "count", "grad_norm", "lr"} <= set(metrics)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())

    params = copy.deepcopy(model)
    logits = params(batch["input"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=-100)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params.parameters()]))
    assert int(metrics["count"]) == 4 * 16 - 2 * 5
    assert float(metrics["loss"]) == pytest.approx(float(loss.detach()), rel=1e-6)
    assert float(metrics["grad_norm"]) == pytest.approx(float(norm), rel=1e-5)
    assert float(metrics["lr"]) == 0.0  # the first step uses the schedule at count 0
    assert int(state2.step) == 1
    _, metrics = ft.train_step(lm_loss(model), opt)(state2, batch)
    assert float(metrics["lr"]) == pytest.approx(1e-3)


def test_token_weighted_loss_gives_the_gradient_of_sum_over_count():
    """With padding, the gradient the optimizer receives is that of (sum of valid token losses) /
    (number of valid tokens) over the whole batch."""
    model = tiny_gpt()
    seen = []
    record = optim.stateless(lambda u, p: seen.extend(t.clone() for t in u) or u)
    opt = optim.chain(record, optim.sgd(0.1))
    state = ft.TrainState.create(ft.params_of(model), opt)
    batch = padded(7)
    ft.train_step(lm_loss(model), opt)(state, batch)

    ref = copy.deepcopy(model)
    logits = ref(batch["input"]).flatten(0, 1)
    target = batch["target"].flatten()
    total = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    (total / (target != -100).sum()).backward()
    got = dict(zip(ft.tree.paths(state.params), seen))
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max()), name

    # the mean over *rows* of per-row means is a different objective: the step must not be it
    per_row = F.cross_entropy(
        ref(batch["input"]).transpose(1, 2), batch["target"], ignore_index=-100, reduction="none"
    )
    rows_mean = (per_row.sum(1) / (batch["target"] != -100).sum(1)).mean()
    ref.zero_grad()
    rows_mean.backward()
    assert not torch.allclose(got["wte.weight"], ref.wte.weight.grad, rtol=1e-3)


def test_a_fractional_count_normalizes_by_that_count():
    lin = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def loss_fn(params, x):  # importance weights summing to 0.5
        return ft.Loss(ft.apply(lin, params, x).pow(2).sum() * 0.125, torch.tensor(0.5))

    opt = optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(lin), opt)
    new, metrics = ft.train_step(loss_fn, opt)(state, x)
    ref = copy.deepcopy(lin)
    loss = ref(x).pow(2).sum() * 0.125 / 0.5
    loss.backward()
    torch.testing.assert_close(metrics["loss"], loss.detach())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name] - new.params[name], 0.1 * p.grad)


def test_a_count_of_zero_counts_as_one():
    """An empty batch (count 0) gives the gradient of the total itself, never a division by 0."""
    lin = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def loss_fn(params, x):
        return ft.Loss(ft.apply(lin, params, x).sum() * 1e-3, torch.tensor(0))

    opt = optim.sgd(1.0)
    state = ft.TrainState.create(ft.params_of(lin), opt)
    new, metrics = ft.train_step(loss_fn, opt)(state, x)
    ref = copy.deepcopy(lin)
    (ref(x).sum() * 1e-3).backward()
    assert torch.isfinite(metrics["loss"]) and int(metrics["count"]) == 0
    torch.testing.assert_close(metrics["loss"], ref(x).sum().detach() * 1e-3)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name] - new.params[name], p.grad)


def test_lr_metric_is_the_optimizers_even_with_a_parameter_named_lr():
    model = torch.nn.Module()
    model.lr = torch.nn.Parameter(torch.ones(3))

    def loss_fn(params, x):
        return (params["lr"] * x).sum()

    opt = optim.adamw(1e-3)
    state = ft.TrainState.create(ft.params_of(model), opt)
    _, metrics = ft.train_step(loss_fn, opt)(state, torch.ones(2, 3))
    assert metrics["lr"].dim() == 0 and float(metrics["lr"]) == pytest.approx(1e-3)


def test_the_step_is_data_and_transforms_make_new_steps():
    """``Step`` holds the loss function, the optimizer and the transforms applied (innermost
    first); a transform returns a new step and leaves its argument as it was."""
    model = tiny_gpt()
    opt = optim.sgd(0.1)
    loss_fn = lm_loss(model)
    step = ft.train_step(loss_fn, opt)
    assert (step.loss_fn, step.optimizer, step.transforms, step.names) == (loss_fn, opt, (), ())
    both = ft.checkpoint(ft.accumulate(step, 2))
    assert step.transforms == () and both.loss_fn is loss_fn and both.optimizer is opt
    assert [type(t) for t in both.transforms] == [Accumulate, Checkpoint]
    assert both.names == ("accumulate", "checkpoint")
    assert both.transforms[0].micro_batches == 2
    assert "Accumulate(micro_batches=2), Checkpoint(policy='blocks'" in repr(both)


def test_bad_step_arguments_are_refused_by_name():
    model = tiny_gpt()
    opt = optim.sgd(0.1)
    with pytest.raises(TypeError, match=r"loss_fn must be callable as loss_fn\(params, batch\)"):
        ft.train_step("loss", opt)
    with pytest.raises(TypeError, match=r"optimizer must be an ftrain.optim.*torch.optim"):
        ft.train_step(lm_loss(model), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"donate=.*expected a bool"):
        ft.train_step(lm_loss(model), opt, donate="yes")
    with pytest.raises(TypeError, match=r"Step\(transforms=...\): item 0 is 'accumulate'"):
        ft.Step(lm_loss(model), opt, transforms=("accumulate",))
    step = ft.train_step(lm_loss(model), opt)
    with pytest.raises(TypeError, match=r"state must be an ft.TrainState.*TrainState.create"):
        step(ft.params_of(model), lm_batch())
    other = ft.TrainState.create(ft.params_of(torch.nn.Linear(3, 2)), opt)
    with pytest.raises(KeyError, match=r"missing key\(s\) \['blocks.0.attn.proj.bias'"):
        step(other, lm_batch())
