"""ftrain.optim.schedule_free against the ``schedulefree`` package's AdamWScheduleFree.

The reference runs in train mode (its params are ``y``); after every step its ``.eval()`` params
(``x``) are read and ``.train()`` is called again, then ``y`` is restored bit for bit (the two
switches round). The models have no biases in the closed-loop runs: a key projection's bias gets
a gradient of pure rounding noise (softmax ignores it), which Adam-type normalization turns into
O(1) steps, so two correct implementations part at once. The open-loop run (both optimizers fed
the reference's gradients) keeps the biases.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ftrain as ft
from ftrain import optim
from ftrain.testing import assert_no_recompile

from _tiny import flat, make_batches, mean_ce, tiny_gpt

schedulefree = pytest.importorskip("schedulefree")

STEPS = 50
LR = 3e-3


def rel(a: dict, b: dict) -> float:
    """Worst per-tensor relative error ``||a - b|| / ||b||``."""
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def reference(model, batches, *, lr_at=None, groups=None, **kw):
    """The package's run: per step ``(y, x, grads)`` by module path. ``lr_at(k)`` sets the
    groups' lr before step ``k``; ``groups(params)`` makes param groups."""
    m = copy.deepcopy(model)
    params = list(m.parameters())
    b1, b2 = kw.pop("b1", 0.9), kw.pop("b2", 0.999)
    opt = schedulefree.AdamWScheduleFree(
        groups(params) if groups else params, lr=LR, betas=(b1, b2), **kw
    )
    opt.train()
    out = []
    for k, (x, t) in enumerate(batches):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(k)
        opt.zero_grad()
        mean_ce(m(x), t).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        y = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt.eval()
        x_ = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt.train()
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(y[n])
        out.append((y, x_, grads))
    return out


def loss_fn(model):
    return lambda p, b: mean_ce(ft.apply(model, p, b[0]), b[1])


CASES = {
    "warmup-decay": dict(warmup_steps=10, weight_decay=0.1),
    "betas-r-power-eps-warmup": dict(
        b1=0.95, b2=0.99, r=0.5, weight_lr_power=1.0, eps=1e-6, warmup_steps=5
    ),
}


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_matches_the_package_over_50_steps(kw):
    """Train params (y) and eval params (x) after every step, ft.train_step against the
    package's loop, within 1e-5 relative."""
    model, batches = tiny_gpt(bias=False), make_batches()
    want = reference(model, batches, **kw)
    opt = optim.schedule_free_adamw(LR, **kw)
    step = ft.train_step(loss_fn(model), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    for (y, x, _), batch in zip(want, batches):
        state, _ = step(state, batch)
        assert rel(flat(state.params), y) <= 1e-5
        assert rel(flat(optim.schedule_free_eval_params(state.opt_state, state.params)), x) <= 1e-5
    start = flat(ft.params_of(model))
    assert rel(y, start) > 0.1 and rel(x, y) > 1e-2  # it trained, and x is not y


def test_a_decay_mask_and_a_schedule_match_the_package_with_groups_and_lr_changes():
    """``mask=decay_mask`` is the package with two param groups (decayed matrices, the rest
    not); a learning-rate schedule is the package with ``group["lr"]`` set before each step."""
    model, batches = tiny_gpt(bias=False), make_batches()
    schedule = optim.linear_schedule(LR, LR / 4, STEPS)

    def groups(params):
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    want = reference(
        model, batches, lr_at=lambda k: float(schedule(k)), groups=groups, warmup_steps=5
    )
    opt = optim.schedule_free_adamw(
        schedule, warmup_steps=5, weight_decay=0.1, mask=optim.decay_mask
    )
    step = ft.train_step(loss_fn(model), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    for (y, x, _), batch in zip(want, batches):
        state, metrics = step(state, batch)
        assert rel(flat(state.params), y) <= 1e-5
        assert rel(flat(optim.schedule_free_eval_params(state.opt_state, state.params)), x) <= 1e-5
    assert metrics["lr"].item() == pytest.approx(float(schedule(STEPS - 1)), rel=1e-6)


def test_same_gradients_same_arithmetic_biases_included():
    """Open loop: ftrain's update fed the package's gradients (taken at the package's params)
    each step; its own params stay within 1e-6 of the package's over 50 steps."""
    model, batches = tiny_gpt(), make_batches()
    kw = dict(warmup_steps=10, weight_decay=0.1)
    want = reference(model, batches, **kw)
    opt = optim.schedule_free_adamw(LR, **kw)
    params = ft.params_of(model)
    state = opt.init(params)
    for y, x, grads in want:
        updates, state = opt.update(ft.tree.from_flat(grads), state, params)
        params = optim.apply_updates(params, updates)
        assert rel(flat(params), y) <= 1e-6
        assert rel(flat(optim.schedule_free_eval_params(state, params)), x) <= 1e-6


def test_resume_is_bit_exact(tmp_path):
    """20 steps, ft.save / ft.load, 10 more: every tensor equals 30 uninterrupted steps."""
    model, batches = tiny_gpt(), make_batches(30)
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.schedule_free_adamw(LR, warmup_steps=25, weight_decay=0.1, r=0.5),
    )
    step = ft.train_step(loss_fn(model), opt, donate=True)
    whole = ft.TrainState.create(ft.params_of(model), opt)
    for b in batches:
        whole, _ = step(whole, b)
    state = ft.TrainState.create(ft.params_of(model), opt)
    for b in batches[:20]:
        state, _ = step(state, b)
    ft.save(state, tmp_path / "ckpt")
    state = ft.load(tmp_path / "ckpt")
    for b in batches[20:]:
        state, _ = step(state, b)
    a, b = flat(whole.to_tensordict()), flat(state.to_tensordict())
    assert a.keys() == b.keys() and any(k.endswith(".z.wte.weight") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_compiled_step_never_recompiles():
    """Warmup ends, the weights and the average move: counters and sums are tensors."""
    model = tiny_gpt(bias=False)
    opt = optim.schedule_free_adamw(optim.linear_schedule(LR, 0.0, 6), warmup_steps=3)
    step = ft.compile(ft.train_step(loss_fn(model), opt), backend="eager")
    state = ft.TrainState.create(ft.params_of(model), opt)
    state, _ = assert_no_recompile(step, state, make_batches(6))
    assert int(state.opt_state["count"]) == 6


def test_eval_params_formula_and_where_it_finds_the_state():
    """``x = (y - (1 - b1) z) / b1`` for the leaves the schedule-free state covers, found
    inside a chain or a mask; the other leaves are returned as they are."""
    model = tiny_gpt()
    params = ft.params_of(model)
    inner = optim.schedule_free_adamw(LR, b1=0.8, weight_decay=0.1)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.masked(inner, optim.decay_mask))
    state = opt.init(params)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        grads = params.apply(lambda t, g=g: torch.randn(t.shape, generator=g))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    x = flat(optim.schedule_free_eval_params(state, params))
    z = flat(state["1", "z"])
    y = flat(params)
    for k in y:
        if k in z:
            assert torch.allclose(x[k], (y[k] - 0.2 * z[k]) / 0.8, rtol=1e-5, atol=1e-7), k
            assert not torch.equal(x[k], y[k]), k
        else:  # biases and norms: not under the mask, trained by nothing here
            assert x[k] is y[k] or torch.equal(x[k], y[k]), k
    assert z.keys() < y.keys()


def test_errors_name_the_fix():
    params = ft.params_of(tiny_gpt())
    with pytest.raises(ValueError, match="no schedule-free state.*schedule_free_adamw"):
        optim.schedule_free_eval_params(optim.adamw(LR).init(params), params)
    state = optim.schedule_free_adamw(LR).init(params)
    other = ft.params_of(torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match="z\\['wte.weight'\\].*state.params"):
        optim.schedule_free_eval_params(state, other)
    with pytest.raises(ValueError, match="b1 must be a number in \\(0.0, 1.0\\)"):
        optim.schedule_free_adamw(LR, b1=0.0)
    with pytest.raises(ValueError, match="warmup_steps must be an integer >= 0"):
        optim.schedule_free_adamw(LR, warmup_steps=-1)
    with pytest.raises(ValueError, match="b2 must be"):
        optim.schedule_free_adamw(LR, b2=1.0)


def test_the_docstring_examples_run():
    import doctest

    import ftrain.optim.schedule_free as module

    assert doctest.testmod(module).failed == 0
