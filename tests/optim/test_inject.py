"""ftrain.optim.inject: injected hyper-parameters give the plain optimizer's results bit for bit,
a value set between steps drives the next update without a recompile, and it is saved and
resumed with the state."""

from __future__ import annotations

import sys

import pytest
import torch

import ftrain as ft
from ftrain import optim
from ftrain.optim.inject import HYPERPARAM_DTYPE
from ftrain.testing import assert_no_recompile

from _tiny import lm_batch, lm_loss, tiny_gpt

STEPS = 20


def run(opt, params, steps=STEPS, state=None, seed=0, before=None):
    """``steps`` updates of ``opt`` on random gradients; ``before(i, state) -> state`` runs
    before update ``i``. Returns the params, the state and every update's leaves."""
    state = opt.init(params) if state is None else state
    g = torch.Generator().manual_seed(seed)
    history = []
    for i in range(steps):
        if before is not None:
            state = before(i, state)
        grads = params.apply(lambda t: torch.randn(t.shape, generator=g))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        history.append(ft.tree.leaves(updates))
    return params, state, history


def assert_equal_trees(a, b):
    la, lb = ft.tree.leaves(a), ft.tree.leaves(b)
    assert ft.tree.paths(a) == ft.tree.paths(b) and len(la) == len(lb)
    for path, x, y in zip(ft.tree.paths(a), la, lb):
        assert torch.equal(x, y), path


def adamw_kw():
    return dict(b1=0.8, b2=0.99, eps=1e-7, weight_decay=0.1, mask=optim.decay_mask)


@pytest.mark.parametrize(
    "learning_rate",
    [1e-3, optim.warmup_cosine(1e-2, warmup_steps=5, decay_steps=STEPS, end_value=1e-4)],
    ids=["number", "schedule"],
)
def test_injected_adamw_is_adamw_bit_for_bit(learning_rate):
    params = ft.params_of(tiny_gpt(bias=True))
    injected = optim.inject_hyperparams(optim.adamw)(learning_rate=learning_rate, **adamw_kw())
    p1, s1, h1 = run(injected, params)
    p2, s2, h2 = run(optim.adamw(learning_rate, **adamw_kw()), params)
    assert all(torch.equal(a, b) for u1, u2 in zip(h1, h2) for a, b in zip(u1, u2))
    assert_equal_trees(p1, p2)
    assert_equal_trees(s1["inner_state"], s2)
    # Only what adamw takes as a schedule is injected; b1, eps, weight_decay stay fixed numbers.
    assert list(s1["hyperparams"].keys()) == ["learning_rate"]
    lr = s1["hyperparams", "learning_rate"]
    assert lr.dtype == HYPERPARAM_DTYPE and lr.shape == () and int(s1["count"]) == STEPS
    want = learning_rate if not callable(learning_rate) else float(learning_rate(STEPS - 1))
    assert float(lr) == want  # a schedule's entry holds the value it last gave


def test_a_value_set_between_steps_drives_the_next_update():
    params = ft.params_of(tiny_gpt())
    injected = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, **adamw_kw())
    _, state, _ = run(injected, params, steps=3)
    grads = params.apply(torch.ones_like)
    state = optim.set_hyperparams(state, learning_rate=4e-3)
    got, new_state = injected.update(grads, state, params)
    want, want_inner = optim.adamw(4e-3, **adamw_kw()).update(grads, state["inner_state"], params)
    assert_equal_trees(got, want)
    assert_equal_trees(new_state["inner_state"], want_inner)
    assert float(new_state["hyperparams", "learning_rate"]) == 4e-3  # kept for the next steps
    # the TensorDict way does the same
    state["hyperparams", "learning_rate"] = torch.tensor(4e-3, dtype=HYPERPARAM_DTYPE)
    assert_equal_trees(injected.update(grads, state, params)[0], want)


def test_the_lr_changes_every_step_of_a_compiled_donated_step_without_recompiling():
    model = tiny_gpt(n_layer=1)  # one block: dynamo traces each block's code anew
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, **adamw_kw())
    state = ft.TrainState.create(ft.params_of(model), opt)
    lrs = [1e-3 * (1 + i) for i in range(5)]
    batches = [{**lm_batch(4, seed=i), "lr": lr} for i, lr in enumerate(lrs)]

    def set_lr(inner):  # applied after compile: runs eagerly, between compiled calls
        def step(state, batch):
            state = optim.set_hyperparams(state, learning_rate=batch["lr"])
            return inner(state, {k: v for k, v in batch.items() if k != "lr"})

        return step

    compiled = ft.compile(ft.train_step(lm_loss(model), opt, donate=True), backend="eager")
    final, history = assert_no_recompile(ft.wrap(compiled, set_lr), state.clone(), batches)
    assert [float(m["lr"]) for m in history] == [
        float(torch.tensor(lr, dtype=torch.float32)) for lr in lrs
    ]
    # the same as a plain adamw rebuilt with each step's learning rate, eagerly; a compiled step
    # runs adamw's foreach chain (ftrain.optim.fused), so bit for bit means fused=False here
    s = state.replace(opt_state=state.opt_state["inner_state"])
    for lr, b in zip(lrs, batches):
        s, _ = ft.train_step(lm_loss(model), optim.adamw(lr, **adamw_kw(), fused=False))(s, b)
    assert_equal_trees(final.params, s.params)
    assert_equal_trees(final.opt_state["inner_state"], s.opt_state)


def test_saved_and_resumed_with_the_state(tmp_path):
    model = tiny_gpt()
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-3, **adamw_kw())
    step = ft.train_step(lm_loss(model), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    batches = [lm_batch(4, seed=i) for i in range(4)]
    for b in batches[:2]:
        state, _ = step(state, b)
    state = optim.set_hyperparams(state, learning_rate=5e-3)
    ft.save(state, tmp_path / "ckpt")
    loaded = ft.load(tmp_path / "ckpt", like=state)
    lr = loaded.opt_state["hyperparams", "learning_rate"]
    assert lr.dtype == HYPERPARAM_DTYPE and float(lr) == 5e-3
    for b in batches[2:]:
        state, _ = step(state, b)
        loaded, _ = step(loaded, b)
    assert_equal_trees(state.to_tensordict(), loaded.to_tensordict())


def test_which_arguments_are_injected():
    seen = {}

    def factory(learning_rate, momentum=0.9, steps=10, nesterov=False, mask=None, scale=1.0,
                decay: float = 0.5):  # fmt: skip
        seen.update(locals())
        return optim.chain(optim.scale_by_schedule(momentum), optim.sgd(learning_rate, mask=mask))

    opt = optim.inject_hyperparams(factory, static_args="scale")(
        0.1, momentum=0.8, nesterov=True, mask=optim.decay_mask, scale=2.0, decay=0.1
    )
    state = opt.init(ft.params_of(torch.nn.Linear(2, 2)))
    # numbers and schedules where the factory expects a number or says nothing; not the int
    # `steps` (an int default), the bool, the mask function, static_args or `decay: float`
    assert list(state["hyperparams"].keys()) == ["learning_rate", "momentum"]
    assert callable(seen["learning_rate"]) and callable(seen["momentum"])
    assert seen["steps"] == 10 and seen["nesterov"] is True and seen["mask"] is optim.decay_mask
    assert seen["scale"] == 2.0 and seen["decay"] == 0.1
    assert float(state["hyperparams", "momentum"]) == 0.8


def test_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"static_args=...\): \['lr'\] are not arguments"):
        optim.inject_hyperparams(optim.adamw, static_args=("lr",))
    with pytest.raises(TypeError, match="factory must be a function"):
        optim.inject_hyperparams(3)

    def needs_number(learning_rate, beta=0.9):
        return optim.adamw(learning_rate, b1=beta)

    with pytest.raises(ValueError, match=r"refused a schedule in place of \['learning_rate', "
                       r"'beta'\].*static_args=\('learning_rate', 'beta'\)"):  # fmt: skip
        optim.inject_hyperparams(needs_number)(1e-3)
    assert optim.inject_hyperparams(needs_number, static_args="beta")(1e-3)  # the fix works

    def eager_reader(learning_rate):
        learning_rate(torch.zeros((), dtype=torch.int64))
        return optim.sgd(learning_rate)

    with pytest.raises(RuntimeError, match="readable only inside this optimizer's update"):
        optim.inject_hyperparams(eager_reader)(0.1)

    params = ft.params_of(torch.nn.Linear(2, 2))
    inner = optim.inject_hyperparams(optim.sgd)(0.1)
    twice = optim.chain(inner, inner)
    state = twice.init(params)
    with pytest.raises(KeyError, match=r"'learning_rate' is injected 2 times.*by its path"):
        optim.set_hyperparams(state, learning_rate=0.2)
    with pytest.raises(KeyError, match=r"'b1' is injected 0 times.*\['learning_rate'\]"):
        optim.set_hyperparams(inner.init(params), b1=0.5)
    with pytest.raises(ValueError, match=r"shape \(\); got a value of shape \(2,\)"):
        optim.set_hyperparams(inner.init(params), learning_rate=torch.ones(2))
    with pytest.raises(TypeError, match="must be an ft.TrainState or an optimizer state"):
        optim.set_hyperparams({"learning_rate": 1.0}, learning_rate=0.2)
    other = optim.inject_hyperparams(
        lambda learning_rate, scale: optim.chain(
            optim.scale_by_schedule(scale), optim.sgd(learning_rate)
        )
    )(0.1, 0.5)
    with pytest.raises(KeyError, match=r"holds the hyper-parameters \['learning_rate'\], this "
                       r"optimizer injects \['learning_rate', 'scale'\]"):  # fmt: skip
        other.update(params, inner.init(params), params)


def test_set_hyperparams_leaves_its_input_and_keeps_dtype_and_shape():
    params = ft.params_of(torch.nn.Linear(2, 2))
    opt = optim.inject_hyperparams(optim.sgd)(0.1)
    state = ft.TrainState.create(params, opt)
    new = optim.set_hyperparams(state, learning_rate=0.25)
    assert float(state.opt_state["hyperparams", "learning_rate"]) == 0.1  # unchanged
    got = new.opt_state["hyperparams", "learning_rate"]
    assert isinstance(new, ft.TrainState) and got.dtype == HYPERPARAM_DTYPE and float(got) == 0.25
    assert new.opt_state["inner_state"] is not None and torch.equal(new.step, state.step)
    stacked = state.opt_state.clone()  # one value per member, as ft.vmap's stacked states hold
    stacked["hyperparams", "learning_rate"] = torch.zeros(3, dtype=HYPERPARAM_DTYPE)
    one = optim.set_hyperparams(stacked, learning_rate=0.5)["hyperparams", "learning_rate"]
    assert one.tolist() == [0.5] * 3
    per = optim.set_hyperparams(stacked, learning_rate=torch.tensor([1.0, 2.0, 3.0]))
    assert per["hyperparams", "learning_rate"].dtype == HYPERPARAM_DTYPE


def test_docstring_example_runs():
    import doctest

    assert doctest.testmod(sys.modules["ftrain.optim.inject"]).failed == 0
