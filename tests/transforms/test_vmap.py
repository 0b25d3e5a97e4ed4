"""ft.vmap: K members in one step equal K sequential runs (without dropout), per-member learning
rates, per-member dropout streams independent of K, composition and errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain import tree
from ftrain.testing import assert_no_recompile, max_rel_error

from _tiny import lm_batch, lm_loss, tiny_gpt

K = 4
LRS = (1e-4, 2e-4, 3e-4, 5e-4)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # vmap's "no batching rule, falling back" notices
        warnings.filterwarnings("ignore", message=".*batching rule.*")
        yield


def _opt():
    return ft.optim.inject_hyperparams(ft.optim.adam)(learning_rate=1e-4)


def _members(opt, lrs=LRS, *, same_params=False, **model_kw):
    """One state per learning rate: different initial params (unless ``same_params``) and seeds.
    bias=False: a bias whose gradient is 0 in exact arithmetic makes Adam amplify rounding."""
    states = []
    for i, lr in enumerate(lrs):
        model = tiny_gpt(seed=0 if same_params else i, bias=False, **model_kw)
        state = ft.TrainState.create(ft.params_of(model), opt, seed=100 + i)
        states.append(ft.optim.set_hyperparams(state, learning_rate=lr))
    return states


def _step(opt, **model_kw):
    return ft.train_step(lm_loss(tiny_gpt(bias=False, **model_kw)), opt)


def _worst(a, b) -> float:
    return max(max_rel_error(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b)))


def _run(step, state, batches):
    for b in batches:
        state, metrics = step(state, b)
    return state, metrics


BATCHES = [lm_batch(4, seed=i) for i in range(20)]


def _ensemble_error(lrs) -> float:
    opt = _opt()
    step, states = _step(opt), _members(opt, lrs)
    stacked, metrics = _run(ft.vmap(step), ft.stack(states), BATCHES)
    assert all(v.shape == (len(lrs),) for v in metrics.values())
    assert torch.allclose(metrics["lr"], torch.tensor(lrs, dtype=metrics["lr"].dtype))
    alone = [_run(step, s, BATCHES)[0] for s in states]
    for got, want in zip(ft.unstack(stacked), alone):
        assert torch.equal(got.step, want.step) and torch.equal(got.rng, want.rng)
    return max(_worst(got.params, want.params) for got, want in zip(ft.unstack(stacked), alone))


def test_members_equal_sequential_runs_with_their_own_learning_rates():
    """The invariant: 4 members (different params, seeds, learning rates <= 5e-4) after 20 Adam
    steps equal 4 sequential runs of the plain step to 1e-5 relative (measured: ~2e-7)."""
    assert _ensemble_error(LRS) <= 1e-5


def test_deviation_at_a_large_learning_rate_is_what_the_docs_say():
    """At lr 1e-2 Adam amplifies batched kernels' rounding: measured 3e-6, 10x below the bound."""
    assert _ensemble_error((1e-2, 1e-2)) <= 3e-5


def test_same_params_different_learning_rates_train_differently():
    opt = _opt()
    stacked, _ = _run(ft.vmap(_step(opt)), ft.stack(_members(opt, same_params=True)), BATCHES[:2])
    a, b = ft.unstack(stacked)[:2]
    assert _worst(a.params, b.params) > 1e-4


def test_batch_axis_zero_gives_each_member_its_slice():
    opt = _opt()
    step, states = _step(opt), _members(opt, LRS[:2])
    batches = [lm_batch(4, seed=1), lm_batch(4, seed=2)]
    stacked = {k: torch.stack([b[k] for b in batches]) for k in batches[0]}
    out, metrics = ft.vmap(step, batch_axis=0)(ft.stack(states), stacked)
    for i, (got, s) in enumerate(zip(ft.unstack(out), states)):
        want, m = step(s, batches[i])
        assert _worst(got.params, want.params) <= 1e-5
        assert torch.allclose(metrics["loss"][i], m["loss"])


# -- randomness ---------------------------------------------------------------------------------


def _dropout_run(states, steps=2):
    opt = _opt()
    return _run(ft.vmap(_step(opt, dropout=0.2)), ft.stack(states), BATCHES[:steps])


def test_dropout_is_reproducible_and_independent_of_the_other_members():
    """Member i's result with dropout depends on its own key only: the same alone (K=1) as among
    4, and the same run twice; equal params and lr with different seeds diverge."""
    opt = _opt()
    states = _members(opt, (2e-4,) * K, same_params=True)
    together, metrics = _dropout_run(states)
    again, metrics_again = _dropout_run(states)
    assert torch.equal(metrics["loss"], metrics_again["loss"])
    assert _worst(together.params, again.params) == 0.0
    alone, _ = _dropout_run(states[2:3])
    assert _worst(ft.unstack(alone)[0].params, ft.unstack(together)[2].params) <= 1e-6
    a, b = ft.unstack(together)[:2]
    assert _worst(a.params, b.params) > 1e-5  # same params and lr, different seeds
    assert metrics["loss"][0] != metrics["loss"][1]


# -- composition --------------------------------------------------------------------------------


def test_accumulate_equals_the_whole_batch():
    opt = _opt()
    states = ft.stack(_members(opt, LRS[:2]))
    whole, _ = ft.vmap(_step(opt))(states, BATCHES[0])
    for s in (ft.vmap(ft.accumulate(_step(opt), 2)), ft.accumulate(ft.vmap(_step(opt)), 2)):
        split, _ = s(states, BATCHES[0])
        assert _worst(split.params, whole.params) <= 1e-5


def test_autocast_bf16_is_close_to_fp32_per_member():
    opt = _opt()
    states = _members(opt, LRS[:2])
    step = ft.autocast(_step(opt), torch.bfloat16)
    out, metrics = ft.vmap(step)(ft.stack(states), BATCHES[0])
    for i, s in enumerate(states):
        _, m = step(s, BATCHES[0])
        assert abs(float(metrics["loss"][i]) - float(m["loss"])) <= 1e-2


def test_checkpoint_is_refused_when_built():
    step = _step(_opt())
    for build in (
        lambda: ft.vmap(ft.checkpoint(step)),
        lambda: ft.checkpoint(ft.vmap(step)),
    ):
        with pytest.raises(ValueError, match="saved-tensor hooks"):
            build()
    with pytest.raises(ValueError, match="batch_axis"):
        ft.vmap(step, batch_axis=1)


def test_wrap_hooks_see_the_stacked_state_in_either_order():
    """ft.vmap wraps at the "traced" stage, inside every "eager" wrap: an ft.wrap applied before
    it wraps the vmapped step too."""
    opt = _opt()
    step, state = _step(opt), ft.stack(_members(opt, LRS[:2]))
    seen = []

    def spy(inner):
        def fn(s, batch):
            seen.append(tuple(s.step.shape))
            return inner(s, batch)

        return fn

    for spied in (ft.vmap(ft.wrap(step, spy)), ft.wrap(ft.vmap(step), spy)):
        spied(state, BATCHES[0])
    assert seen == [(2,), (2,)]


def test_compile_in_either_order_equals_the_eager_vmapped_step_without_recompiles():
    """ft.vmap's wrap is at the "traced" stage, inside ft.compile's, so both orders compile the
    vmapped step. With dropout on (the
    keyed masks are traced into the graph) they equal the eager vmapped step over 4 steps, and
    steps 2..4 compile nothing."""
    opt = _opt()
    step = _step(opt, dropout=0.2, n_layer=1)
    state = ft.stack(_members(opt, LRS[:2], n_layer=1))
    want, want_metrics = _run(ft.vmap(step), state, BATCHES[:4])
    for compiled in (
        ft.compile(ft.vmap(step), backend="eager"),
        ft.vmap(ft.compile(step, backend="eager")),
    ):
        got, history = assert_no_recompile(compiled, state, BATCHES[:4])
        assert _worst(got.params, want.params) <= 1e-5
        assert _worst(got.opt_state, want.opt_state) <= 1e-5
        assert torch.allclose(history[-1]["loss"], want_metrics["loss"], rtol=1e-5)


def test_compiled_vmapped_steps_of_two_model_sizes_in_one_process():
    """A second model size in the same process makes dynamo trace the vmapped step with symbolic
    shapes (its code is the same): it still compiles, and equals the eager vmapped step."""
    opt = _opt()
    for d_model in (16, 24):
        step = _step(opt, n_layer=1, d_model=d_model)
        state = ft.stack(_members(opt, LRS[:2], n_layer=1, d_model=d_model))
        want, _ = _run(ft.vmap(step), state, BATCHES[:2])
        got, _ = _run(ft.compile(ft.vmap(step), backend="eager"), state, BATCHES[:2])
        assert _worst(got.params, want.params) <= 1e-5, d_model


def test_shard_ddp_splits_the_batch_and_equals_one_process(two_ranks):
    from _two_ranks import adamw, batches, gpt, run, vmap_members, whole

    step = ft.vmap(ft.train_step(lm_loss(gpt(bias=False)), adamw()))
    state, metrics = run(step, ft.stack(vmap_members(adamw())), batches())
    want = whole(state)
    for r in two_ranks:
        got, got_metrics = r["vmap"]
        for part in ("params", "opt_state"):
            for k in want[part]:
                assert max_rel_error(got[part][k], want[part][k]) <= 1e-5, (part, k)
        assert torch.allclose(got_metrics["loss"], metrics["loss"], rtol=1e-5)


# -- persistence --------------------------------------------------------------------------------


def test_save_load_and_unstack_continue_exactly(tmp_path):
    opt = _opt()
    step = _step(opt)
    stacked, _ = _run(ft.vmap(step), ft.stack(_members(opt, LRS[:2])), BATCHES[:2])
    ft.save(stacked, tmp_path / "ensemble")
    loaded = ft.load(tmp_path / "ensemble", like=stacked)
    straight, _ = _run(ft.vmap(step), stacked, BATCHES[2:4])
    resumed, _ = _run(ft.vmap(step), loaded, BATCHES[2:4])
    assert _worst(resumed.params, straight.params) == 0.0
    assert _worst(resumed.opt_state, straight.opt_state) == 0.0
    alone, _ = _run(step, ft.unstack(stacked)[1], BATCHES[2:4])
    assert _worst(alone.params, ft.unstack(straight)[1].params) <= 1e-5


# -- errors when called -------------------------------------------------------------------------


def test_bad_input_is_refused_when_called():
    opt = _opt()
    step, states = _step(opt), _members(opt, LRS[:2])
    with pytest.raises(ValueError, match="not stacked.*ft.stack"):
        ft.vmap(step)(states[0], BATCHES[0])
    with pytest.raises(ValueError, match=r"leading member dimension of size 2.*batch_axis=None"):
        ft.vmap(step, batch_axis=0)(ft.stack(states), BATCHES[0])  # 4 rows, not 2 members
    whole_batch = {k: v[None] for k, v in BATCHES[0].items()}  # 1 slice for 2 members
    with pytest.raises(ValueError, match="size 2"):
        ft.vmap(step, batch_axis=0)(ft.stack(states), whole_batch)
    as_td = TensorDict(whole_batch, batch_size=[])  # a TensorDict batch is checked alike
    with pytest.raises(ValueError, match="size 2"):
        ft.vmap(step, batch_axis=0)(ft.stack(states), as_td)
    with_int = {**{k: torch.stack([v, v]) for k, v in BATCHES[0].items()}, "n": 3}
    with pytest.raises(ValueError, match="holds a int .*close other values into loss_fn"):
        ft.vmap(step, batch_axis=0)(ft.stack(states), with_int)
