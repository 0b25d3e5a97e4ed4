"""ftrain.optim.fused: ``adam``, ``adamw`` and ``sgd`` with ``fused=None``/``True`` (torch's fused
kernels) against the same optimizer with ``fused=False`` (the foreach chain).

The invariant (DESIGN.md section 3), checked as ``tests/optim/test_alias.py`` checks ftrain against
torch.optim:

* *step for step*: along a 50-step foreach run of a tiny GPT, each fused update from the same
  params, state and gradients gives the same updates and new state to 1e-6 relative (worst tensor,
  ``||a - b|| / ||b||``), and ``optim.update_and_apply`` (the kernel writing the params) the same
  new params, with decay masks, schedules, ``inject_hyperparams``, ``partition``, clipping before,
  and in place (donated) as well as pure; the state has one layout and the
  recorded ``lr`` is bitwise the same. Each comparison checks that the fused kernel really ran (its
  calls are counted) and that the run moved the params by far more than the tolerance.
* *trajectory*: 50 steps of ``ft.train_step``, fused against foreach. Adam amplifies 1-ulp
  differences (the attention's key bias has a gradient of pure rounding noise, which Adam scales
  to full steps), so, as in test_optim.py, the bound is 3x the distance between torch's own fused
  and foreach AdamW on the same run (global relative L2; about 2e-6). SGD is linear in the
  gradients: there the two paths agree to 1e-6 (in fact bitwise) over the whole run.
"""

from __future__ import annotations

import math

import pytest
import torch

import ftrain as ft
from ftrain import optim

from _tiny import flat, make_batches, mean_ce, tiny_gpt

STEPS = 50
TOL = 1e-6


def rel(a: dict, b: dict) -> float:
    """Worst per-tensor relative error ``||a - b|| / ||b||`` over the float leaves (0 if none)."""
    assert a.keys() == b.keys()
    return max(
        (
            ((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)).item()
            for k in b
            if b[k].is_floating_point() and b[k].dim()
        ),
        default=0.0,
    )


def global_rel(a: dict, b: dict) -> float:
    """``||a - b|| / ||b||`` over all tensors taken as one vector."""
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b)
    return math.sqrt(num / sum((b[k].double() ** 2).sum() for k in b))


def grads_at(model, params, batch):
    """The gradients of the mean token loss at ``params`` (a TensorDict like them)."""
    leaves, tdef = ft.tree.flatten(params)
    leaves = [t.detach().requires_grad_() for t in leaves]
    loss = mean_ce(ft.apply(model, tdef.unflatten(leaves), batch[0]), batch[1])
    return tdef.unflatten(list(torch.autograd.grad(loss, leaves)))


def clone(td):
    return td.apply(torch.clone)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How often each torch fused kernel was called (they are counted, then run)."""
    calls = {"_fused_adam_": 0, "_fused_adamw_": 0, "_fused_sgd_": 0}
    for name in calls:
        real = getattr(torch, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    return calls


def assert_step_for_step(make, kernel_calls, *, inplace=False):
    """Along ``make(False)``'s 50-step run, ``make(None)``'s update from the same params, state
    and grads agrees to TOL (updates and new state); the same layout and the same ``lr``."""
    model = tiny_gpt()
    fused, chain = make(None), make(False)
    params = ft.params_of(model)
    state = chain.init(params)
    assert list(flat(fused.init(params))) == list(flat(state))  # one layout
    for i, batch in enumerate(make_batches()):
        grads = grads_at(model, params, batch)
        u_f, s_f = fused.update(clone(grads), clone(state), params, inplace=inplace)
        u_c, s_c = chain.update(clone(grads), clone(state), params, inplace=inplace)
        assert rel(flat(u_f), flat(u_c)) <= TOL, i
        assert rel(flat(s_f), flat(s_c)) <= TOL, i
        # update_and_apply: the kernel writes the params (in place when inplace=True)
        given = clone(params)
        p_a, s_a = optim.update_and_apply(fused, clone(grads), clone(state), given, inplace=inplace)
        assert (p_a is given) == inplace
        assert rel(flat(p_a), flat(optim.apply_updates(params, u_c))) <= TOL, i
        assert rel(flat(s_a), flat(s_c)) <= TOL, i
        for k, v in flat(s_c).items():
            if k.endswith("lr") or not v.is_floating_point():  # counters and the recorded lr
                assert torch.equal(flat(s_f)[k], v), (i, k)
        params, state = optim.apply_updates(params, u_c), s_c
    assert sum(kernel_calls.values()) >= 2 * STEPS  # the fused path ran, both ways
    moved = rel(flat(ft.params_of(model)), flat(params))
    assert moved > 1e3 * TOL  # it trained: the agreement is not trivial


def run(opt, *, donate=False, steps=STEPS, state=None, batches=None):
    """``steps`` steps of ``ft.train_step`` on the tiny GPT; the final state and the lrs seen."""
    model = tiny_gpt()
    step = ft.train_step(lambda p, b: mean_ce(ft.apply(model, p, b[0]), b[1]), opt, donate=donate)
    state = state if state is not None else ft.TrainState.create(ft.params_of(model), opt)
    lrs = []
    for b in (batches or make_batches())[:steps]:
        state, metrics = step(state, b)
        lrs.append(metrics["lr"])
    return state, torch.stack(lrs)


@pytest.fixture(scope="module")
def torch_spread():
    """torch's own fused against foreach AdamW (lr 1e-3), 50 steps: global relative L2."""

    def torch_run(**kw):
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
        for x, y in make_batches():
            opt.zero_grad()
            mean_ce(model(x), y).backward()
            opt.step()
        return {k: v.detach() for k, v in model.named_parameters()}

    return max(global_rel(torch_run(fused=True), torch_run(foreach=True)), 1e-7)


SCHEDULE = optim.warmup_cosine(3e-3, 5, STEPS)

CASES = {
    "adamw": lambda f: optim.adamw(1e-3, fused=f),
    "adamw-mask-schedule": lambda f: optim.adamw(
        SCHEDULE, weight_decay=0.1, mask=optim.decay_mask, fused=f
    ),
    "adam": lambda f: optim.adam(1e-3, fused=f),
    "adam-l2-mask": lambda f: optim.adam(3e-3, weight_decay=0.1, mask=optim.decay_mask, fused=f),
    "sgd": lambda f: optim.sgd(0.05, fused=f),
    "sgd-momentum-decay": lambda f: optim.sgd(0.05, momentum=0.9, weight_decay=0.01, fused=f),
    "sgd-nesterov-mask-schedule": lambda f: optim.sgd(
        optim.wsd(0.05, 5, 30, 15),
        momentum=0.9,
        nesterov=True,
        weight_decay=0.1,
        mask=optim.decay_mask,
        fused=f,
    ),
    "clip-adamw": lambda f: optim.chain(
        optim.clip_by_global_norm(0.1), optim.adamw(1e-3, mask=optim.decay_mask, fused=f)
    ),
    "inject-adamw": lambda f: optim.inject_hyperparams(optim.adamw)(
        learning_rate=SCHEDULE, weight_decay=0.1, mask=optim.decay_mask, fused=f
    ),
    "partition": lambda f: optim.partition(
        {
            "matrices": optim.adamw(1e-3, weight_decay=0.1, fused=f),
            "vectors": optim.sgd(0.05, momentum=0.9, nesterov=True, fused=f),
        },
        lambda p: p.apply(lambda t: "matrices" if t.dim() >= 2 else "vectors"),
    ),
}


@pytest.mark.slow(reason="50 steps of a GPT in each of 10 cases, about 25 s in all")
@pytest.mark.parametrize("name", list(CASES))
def test_fused_equals_foreach_step_for_step(name, kernel_calls):
    assert_step_for_step(CASES[name], kernel_calls)


@pytest.mark.parametrize("name", ["adamw-mask-schedule", "adam-l2-mask", "sgd-momentum-decay"])
def test_fused_equals_foreach_step_for_step_in_place(name, kernel_calls):
    """``inplace=True`` (a donated step): the moments are updated in the state's own buffers."""
    assert_step_for_step(CASES[name], kernel_calls, inplace=True)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_fused_trajectory_within_torchs_own_spread(donate, torch_spread, kernel_calls):
    fused, lr_fused = run(optim.adamw(1e-3, fused=True), donate=donate)
    chain, lr_chain = run(optim.adamw(1e-3, fused=False), donate=donate)
    assert kernel_calls["_fused_adamw_"] >= STEPS
    assert global_rel(flat(fused.params), flat(chain.params)) <= 3 * torch_spread
    assert rel(flat(fused.opt_state), flat(chain.opt_state)) <= 3 * torch_spread
    assert torch.equal(lr_fused, lr_chain)
    assert global_rel(flat(ft.params_of(tiny_gpt())), flat(chain.params)) > 1e3 * torch_spread


@pytest.mark.parametrize("name", ["sgd-momentum-decay", "sgd-nesterov-mask-schedule"])
def test_fused_sgd_trajectory_within_1e6(name, kernel_calls):
    (fused, _), (chain, _) = run(CASES[name](True)), run(CASES[name](False))
    assert kernel_calls["_fused_sgd_"] >= STEPS
    assert rel(flat(fused.params), flat(chain.params)) <= TOL
    assert rel(flat(fused.opt_state), flat(chain.opt_state)) <= TOL


def test_update_and_apply_without_a_kernel_of_its_own_is_update_then_add():
    """Any other optimizer: update_and_apply is update + apply_updates, bit for bit."""
    params = ft.params_of(tiny_gpt())
    grads = params.apply(torch.randn_like)
    for opt in (optim.lion(1e-3, weight_decay=0.1), optim.adamw(1e-3, fused=False)):
        state = opt.init(params)
        updates, want_s = opt.update(grads, state, params)
        got_p, got_s = optim.update_and_apply(opt, grads, state, params)
        assert rel(flat(got_p), flat(optim.apply_updates(params, updates))) == 0.0
        assert rel(flat(got_s), flat(want_s)) == 0.0


def test_a_donated_fused_step_updates_the_states_buffers_in_place():
    model = tiny_gpt()
    opt = optim.adamw(1e-3, fused=True)
    step = ft.train_step(lambda p, b: mean_ce(ft.apply(model, p, b[0]), b[1]), opt, donate=True)
    state = ft.TrainState.create(ft.params_of(model), opt)
    before = {k: v.data_ptr() for k, v in flat(state.opt_state).items() if v.dim()}
    state, _ = step(state, make_batches(1)[0])
    after = {k: v.data_ptr() for k, v in flat(state.opt_state).items() if v.dim()}
    assert after == before


def test_a_pure_update_changes_nothing_it_was_given():
    params = ft.params_of(tiny_gpt())
    grads = params.apply(torch.randn_like)
    for opt in (
        optim.adamw(1e-3, mask=optim.decay_mask, fused=True),
        optim.adam(1e-3, weight_decay=0.1, fused=True),
        optim.sgd(0.1, momentum=0.9, weight_decay=0.1, fused=True),
    ):
        state = opt.init(params)
        _, state = opt.update(grads, state, params)  # moments no longer zero
        copies = [t.clone() for t in (grads, state, params)]
        updates, new_state = opt.update(grads, state, params)
        for t, c in zip((grads, state, params), copies):
            assert (t == c).all()
        moved = zip(flat(new_state).values(), flat(state).values())
        assert any(not torch.equal(a, b) for a, b in moved)  # the new state is new tensors


def test_a_checkpoint_of_one_path_resumes_on_the_other(tmp_path, torch_spread, kernel_calls):
    """25 steps on one path, saved, loaded and continued for 25 steps on the other, equal 50
    steps of the foreach path (as closely as the fused path itself does)."""
    batches = make_batches()
    whole, _ = run(optim.adamw(1e-3, fused=False), batches=batches)
    for first, second in ((True, False), (False, True)):
        half, _ = run(optim.adamw(1e-3, fused=first), steps=25, batches=batches)
        ft.save(half, tmp_path / str(first))
        loaded = ft.load(tmp_path / str(first), like=half)
        resumed, _ = run(
            optim.adamw(1e-3, fused=second), state=loaded, batches=batches[25:], steps=25
        )
        assert global_rel(flat(resumed.params), flat(whole.params)) <= 3 * torch_spread
    assert kernel_calls["_fused_adamw_"] >= STEPS


def test_set_hyperparams_reaches_the_fused_kernel(kernel_calls):
    """inject_hyperparams: a learning rate set between steps is used by the next fused update
    (as by the foreach chain), with nothing rebuilt."""
    model = tiny_gpt()
    params = ft.params_of(model)
    make = optim.inject_hyperparams(optim.adamw)
    fused, chain = make(learning_rate=1e-3, fused=True), make(learning_rate=1e-3, fused=False)
    state = fused.init(params)
    for batch in make_batches(3):
        updates, state = fused.update(grads_at(model, params, batch), state, params)
        params = optim.apply_updates(params, updates)
    state = optim.set_hyperparams(state, learning_rate=1e-2)
    grads = grads_at(model, params, make_batches(4)[3])
    u_f, s_f = fused.update(grads, state, params)
    u_c, s_c = chain.update(grads, state, params)
    assert rel(flat(u_f), flat(u_c)) <= TOL and rel(flat(s_f), flat(s_c)) <= TOL
    assert float(s_f["inner_state", "2", "lr"]) == pytest.approx(1e-2)
    assert kernel_calls["_fused_adamw_"] == 4


def test_fused_true_is_refused_at_init_where_torch_has_no_kernel():
    on_meta = ft.params_of(torch.nn.Linear(3, 2, device="meta"))
    with pytest.raises(
        ValueError, match=r"adamw\(fused=True\): torch has no fused kernel for meta"
    ):
        optim.adamw(fused=True).init(on_meta)
    transposed = ft.tree.from_flat({"w": torch.randn(4, 3).t()})
    with pytest.raises(ValueError, match=r"sgd\(fused=True\).*non-contiguous.*fused=None"):
        optim.sgd(0.1, fused=True).init(transposed)


def test_fused_none_falls_back_to_the_chain_where_torch_has_no_kernel(kernel_calls):
    """A non-contiguous leaf has no fused kernel: ``fused=None`` runs the foreach chain, bitwise."""
    params = ft.tree.from_flat({"w": torch.randn(4, 3).t(), "b": torch.randn(4)})
    grads = params.apply(torch.randn_like)
    got = optim.adamw(1e-2).update(grads, optim.adamw(1e-2).init(params), params)[0]
    want = optim.adamw(1e-2, fused=False).update(grads, optim.adamw().init(params), params)[0]
    assert sum(kernel_calls.values()) == 0
    assert all(torch.equal(a, b) for a, b in zip(flat(got).values(), flat(want).values()))


def test_bad_fused_values_and_torch_only_options_are_refused_by_name():
    with pytest.raises(TypeError, match=r"adamw\(fused=\.\.\.\): expected True.*got 'yes'"):
        optim.adamw(fused="yes")
    with pytest.raises(TypeError, match=r"'amsgrad'\. ftrain's Adam has no AMSGrad"):
        optim.adamw(amsgrad=True)
    with pytest.raises(TypeError, match=r"lion: unknown option 'fused'.*adam, adamw and sgd only"):
        optim.lion(fused=True)
    with pytest.raises(TypeError, match=r"'foreach'.*fused=False for the foreach chain"):
        optim.adam(foreach=True)


@pytest.mark.slow
def test_compiled_fused_step_equals_eager():
    """ft.compile of a donated ``fused=True`` AdamW step (mask, schedule): it compiles (the
    chain, which dynamo traces where torch's fused kernel cannot be), with no recompile as the
    schedule moves, and equals the eager fused step as closely as the two paths agree (a few
    steps: far below 1e-5). AOT autograd's graphs run as traced (``aot_eager``): what is
    ftrain's here is the tracing; inductor's code generation is test_compile's."""
    from ftrain.testing import assert_no_recompile

    model = tiny_gpt()
    opt = optim.adamw(SCHEDULE, weight_decay=0.1, mask=optim.decay_mask, fused=True)
    loss_fn = lambda p, b: mean_ce(ft.apply(model, p, b[0]), b[1])  # noqa: E731
    batches = make_batches(4)
    eager, _ = run(opt, steps=4, batches=batches, donate=True)
    compiled = ft.compile(ft.train_step(loss_fn, opt, donate=True), backend="aot_eager")
    state, _ = assert_no_recompile(
        compiled, ft.TrainState.create(ft.params_of(model), opt), batches
    )
    assert global_rel(flat(state.params), flat(eager.params)) <= 1e-5
