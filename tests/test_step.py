"""The train step's own guarantees (ftrain.train_step): purity, donation, explicit randomness,
metrics, and exact loss normalization."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain import optim
from ftrain.models import GPT, GPTConfig


def tiny_gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4, dropout=dropout)
    return GPT(cfg)


def lm_batch(seed: int = 0, rows: int = 4, pad: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens; the last ``pad`` targets of every other row are padding (-100)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (rows, 16), generator=g)
    y = torch.randint(0, 64, (rows, 16), generator=g)
    if pad:
        y[::2, -pad:] = -100
    return {"input": x, "target": y}


def lm_loss(model):
    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


def leaves(state) -> list[torch.Tensor]:
    return [t for t in state.values(include_nested=True, leaves_only=True)]


def snapshot(state) -> list[torch.Tensor]:
    return [t.clone() for t in leaves(state)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_step_is_pure_and_donation_is_in_place_with_equal_results():
    model = tiny_gpt()
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, mask=optim.decay_mask))
    state = ft.TrainState.create(ft.params_of(model), opt)
    state, _ = ft.train_step(lm_loss(model), opt)(state, lm_batch(9))  # non-zero moments
    batch = lm_batch()

    before = snapshot(state)
    pure_state, pure_metrics = ft.train_step(lm_loss(model), opt)(state, batch)
    assert same(snapshot(state), before)  # bitwise untouched
    assert not same(snapshot(pure_state.params), snapshot(state.params))

    donated = state.clone()
    params_before = [id(t) for t in leaves(donated.params)]
    new_state, metrics = ft.train_step(lm_loss(model), opt, donate=True)(donated, batch)
    assert [id(t) for t in leaves(new_state.params)] == params_before  # the same buffers...
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
    batch = lm_batch(pad=5)
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
    batch = lm_batch(pad=7)
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


def test_loss_must_be_a_scalar():
    model = tiny_gpt()
    opt = optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)

    def per_token(params, batch):
        out = ft.apply(model, params, batch["input"])
        return F.cross_entropy(out.flatten(0, 1), batch["target"].flatten(), reduction="none")

    with pytest.raises(ValueError, match=r"scalar loss, got a tensor of shape \(64,\).*\.mean\(\)"):
        ft.train_step(per_token, opt)(state, lm_batch())


def test_bad_step_arguments_are_refused_by_name():
    model = tiny_gpt()
    opt = optim.sgd(0.1)
    with pytest.raises(TypeError, match=r"loss_fn must be callable as loss_fn\(params, batch\)"):
        ft.train_step("loss", opt)
    with pytest.raises(TypeError, match=r"donate=.*expected a bool"):
        ft.train_step(lm_loss(model), opt, donate="yes")
    step = ft.train_step(lm_loss(model), opt)
    with pytest.raises(TypeError, match=r"state must be an ft.TrainState.*TrainState.create"):
        step(ft.params_of(model), lm_batch())
    other = ft.TrainState.create(ft.params_of(torch.nn.Linear(3, 2)), opt)
    with pytest.raises(KeyError, match=r"missing key\(s\) \['blocks.0.attn.proj.bias'"):
        step(other, lm_batch())


class _SharedGrad(torch.nn.Module):
    """``a`` and ``b`` enter only as ``a + b``: autograd hands both the *same* gradient tensor;
    ``c`` enters as ``c.sum()``: its gradient is a broadcast view (stride 0)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.c = torch.nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x):
        return ((x @ (self.a + self.b).T) ** 2).sum(-1) + self.c.sum()  # (N,) per-row losses


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scale"])
def test_params_sharing_one_gradient_tensor_or_a_broadcast_one_update_correctly(
    micro, donate, fp16
):
    model = _SharedGrad()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def loss_fn(params, batch):
        per_row = ft.apply(model, params, batch)
        return ft.Loss(per_row.sum(), torch.tensor(per_row.numel()))

    opt = optim.sgd(0.01)
    step = ft.train_step(loss_fn, opt, donate=donate)
    if micro > 1:
        step = ft.accumulate(step, micro)
    if fp16:
        step = ft.autocast(step, torch.float16, loss_scale=64.0)  # fp16 matmuls, scaled loss
    state = ft.TrainState.create(ft.params_of(model), opt, seed=0)
    for _ in range(3):
        state, _ = step(state, x)

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(3):
        ref_opt.zero_grad()
        ref(x).mean().backward()
        ref_opt.step()
    # a gradient applied twice (or divided twice) is off by 2x, far outside even fp16's tolerance
    tol = dict(rtol=2e-2, atol=2e-2) if fp16 else dict(rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), **tol)


def test_bf16_mean_loss_gives_the_mean_gradient_whatever_the_row_count():
    # The gradient entering a bf16 loss is O(1): a count of 257 rows is 256 in bf16, and had the
    # step backpropagated mean * 257 every gradient would be scaled by 256/257.
    lin = torch.nn.Linear(3, 1, bias=False)

    def loss_fn(params, x):
        return ft.apply(lin, params, x).pow(2).mean()  # bf16 under autocast

    opt = optim.sgd(1.0)
    x = torch.randn(257, 3, generator=torch.Generator().manual_seed(0))
    state = ft.TrainState.create(ft.params_of(lin), opt)
    new, _ = ft.autocast(ft.train_step(loss_fn, opt), torch.bfloat16)(state, x)
    w = state.params["weight"].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(x, w).pow(2).mean()
    (g,) = torch.autograd.grad(ref, w)
    torch.testing.assert_close(state.params["weight"] - new.params["weight"], g, rtol=1e-4, atol=0)


def test_fp16_mean_loss_over_many_rows_reports_a_finite_loss():
    lin = torch.nn.Linear(4, 1)
    x = 30 * torch.randn(4096, 4, generator=torch.Generator().manual_seed(0))

    def loss_fn(params, x):
        return ft.apply(lin, params, x).pow(2).mean()  # mean * 4096 overflows fp16

    opt = optim.sgd(1e-3)
    state = ft.TrainState.create(ft.params_of(lin), opt)
    _, m16 = ft.autocast(ft.train_step(loss_fn, opt), torch.float16, loss_scale=1.0)(state, x)
    _, m32 = ft.train_step(loss_fn, opt)(state, x)
    assert torch.isfinite(m16["loss"]) and not m16["skipped"]
    torch.testing.assert_close(m16["loss"], m32["loss"], rtol=1e-2, atol=0)


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


def test_lr_metric_is_the_optimizers_even_with_a_parameter_named_lr():
    model = torch.nn.Module()
    model.lr = torch.nn.Parameter(torch.ones(3))

    def loss_fn(params, x):
        return (params["lr"] * x).sum()

    opt = optim.adamw(1e-3)
    state = ft.TrainState.create(ft.params_of(model), opt)
    _, metrics = ft.train_step(loss_fn, opt)(state, torch.ones(2, 3))
    assert metrics["lr"].dim() == 0 and float(metrics["lr"]) == pytest.approx(1e-3)


def test_accumulate_splits_namedtuple_and_nested_dict_batches():
    from collections import namedtuple

    Batch = namedtuple("Batch", "x y")
    lin = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)
    opt = optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(lin), opt)

    def tuple_loss(params, b):
        return (ft.apply(lin, params, b.x) - b.y).pow(2).mean()

    def nested_loss(params, b):
        return (ft.apply(lin, params, b["in"]["x"]) - b["y"]).pow(2).mean()

    for loss_fn, batch in [(tuple_loss, Batch(x, y)), (nested_loss, {"in": {"x": x}, "y": y})]:
        whole, _ = ft.train_step(loss_fn, opt)(state, batch)
        acc, _ = ft.accumulate(ft.train_step(loss_fn, opt), 3)(state, batch)
        for k in ("weight", "bias"):
            torch.testing.assert_close(acc.params[k], whole.params[k])
