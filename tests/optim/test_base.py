"""ftrain.optim's interface (ftrain/optim/base.py): ``chain``, ``masked``, ``apply_if_finite``,
``state_bytes`` and the pure ``(init, update)`` contract, against the same steps done by hand;
refusals that name the fix; updates that trace as one graph."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from ftrain import optim

from _optim import ftrain_run, params_and_grads, td, tensor_rel
from _tiny import flat, make_batches, mean_ce, tiny_gpt

# --- building blocks against the same steps by hand -----------------------------------------------


def test_chain_equals_the_transforms_applied_by_hand():
    params, grads = params_and_grads()
    parts = [
        optim.clip_by_global_norm(0.5),
        optim.scale_by_adam(),
        optim.add_decayed_weights(0.1),
        optim.scale_by_learning_rate(optim.linear_warmup(1e-2, 10)),
    ]
    opt = optim.chain(*parts)
    state = opt.init(params)
    for _ in range(3):
        updates, new_state = opt.update(grads, state, params)
        u = grads
        for i, part in enumerate(parts):
            u, s_i = part.update(u, state[str(i)], params)
            assert (s_i == new_state[str(i)]).all()
        assert (u == updates).all()  # bitwise
        state, params = new_state, optim.apply_updates(params, updates)


def test_a_transform_written_against_the_public_api_composes():
    """A user's momentum whose update *is* its state tensor: chained before in-place scaling
    (which a train step does), the state must still hold the momentum, not the scaled update."""

    def my_trace(decay):
        def init(params):
            return ft.tree.TensorDict({"m": params.apply(torch.zeros_like)}, batch_size=[])

        def update(updates, state, params=None):
            m = state["m"].apply(lambda x: x * decay) + updates  # returned twice, on purpose
            return m, ft.tree.TensorDict({"m": m}, batch_size=[])

        return optim.GradientTransformation(init, update)

    model, batches = tiny_gpt(), make_batches(5)
    want = ftrain_run(model, optim.sgd(0.05, momentum=0.9), batches)
    mine = optim.chain(my_trace(0.9), optim.scale_by_learning_rate(0.05))
    step = ft.train_step(lambda p, b: mean_ce(ft.apply(model, p, b[0]), b[1]), mine, donate=True)
    state = ft.TrainState.create(ft.params_of(model), mine)
    for b in batches:
        state, _ = step(state, b)
    assert tensor_rel(flat(state.params), want) <= 1e-6


def test_a_wrapper_made_with_functools_wraps_is_called():
    """A user's wrapper of a built-in's update (``functools.wraps`` copies the update's attributes)
    is what ``chain`` and the train step call, not the built-in it wraps."""
    import functools

    def halved(inner):
        @functools.wraps(inner.update)
        def update(updates, state, params=None):  # no ``inplace``: it must not be passed one
            u, s = inner.update(updates, state, params)
            return u.apply(lambda x: x * 0.5), s

        return optim.GradientTransformation(inner.init, update)

    params, grads = params_and_grads()
    sgd = optim.sgd(0.1)
    want = sgd.update(grads, sgd.init(params), params)[0].apply(lambda x: x * 0.5)
    opt = optim.chain(halved(sgd), optim.identity())
    got = opt.update(grads, opt.init(params), params)[0]
    assert (got == want).all()

    model, batches = tiny_gpt(), make_batches(3)
    ref = ftrain_run(model, optim.sgd(0.05), batches)
    assert tensor_rel(ftrain_run(model, halved(optim.sgd(0.1)), batches), ref) <= 1e-6


def test_update_is_pure_and_inplace_gives_the_same_result():
    params, grads = params_and_grads()
    opt = optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2, mask=optim.decay_mask))
    state = opt.update(grads, opt.init(params), params)[1]  # a state with non-zero moments
    before = [t.clone() for t in (grads, state, params)]
    updates, new_state = opt.update(grads, state, params)
    for was, now in zip(before, (grads, state, params)):
        assert (was == now).all()  # nothing passed in changed
    g2, s2 = grads.clone(), state.clone()
    updates2, new_state2 = opt.update(g2, s2, params, inplace=True)
    assert (updates2 == updates).all() and (new_state2 == new_state).all()
    assert not (s2 == state).all()  # ...and inplace=True did reuse the state's buffers


def test_masked_and_decay_mask():
    params, grads = params_and_grads()
    mask = optim.decay_mask(params)
    m = flat(mask)
    assert m["wte.weight"] and m["blocks.0.attn.qkv.weight"]
    assert not m["blocks.0.attn.qkv.bias"] and not m["ln_f.weight"]

    opt = optim.masked(optim.scale(-2.0), optim.decay_mask)
    updates, _ = opt.update(grads, opt.init(params), params)
    for k, u in flat(updates).items():
        g = flat(grads)[k]
        assert torch.equal(u, -2.0 * g if m[k] else g), k  # masked-out leaves pass through

    adam = optim.masked(optim.scale_by_adam(), mask)
    state = adam.init(params)
    assert set(flat(state["mu"])) == {k for k, v in m.items() if v}  # no memory for the others

    decayed = optim.adamw(1e-2, weight_decay=0.5, mask=optim.decay_mask)
    plain = optim.adamw(1e-2, weight_decay=0.0)
    u1 = flat(decayed.update(grads, decayed.init(params), params)[0])
    u0 = flat(plain.update(grads, plain.init(params), params)[0])
    for k in u0:
        p = flat(params)[k]
        expected = u0[k] - 1e-2 * 0.5 * p if m[k] else u0[k]
        assert torch.allclose(u1[k], expected, rtol=1e-5, atol=1e-9), k

    bad = td({"wte.weight": torch.tensor(True)})
    with pytest.raises(KeyError, match="missing .*ln_f.bias"):
        optim.masked(optim.scale(2.0), bad).init(params)
    with pytest.raises(TypeError, match="mask must be a TensorDict"):
        optim.masked(optim.scale(2.0), [True, False])


def test_apply_if_finite_skips_bad_updates_and_keeps_state():
    params, grads = params_and_grads()
    opt = optim.apply_if_finite(optim.adam(1e-2), max_consecutive_errors=2)
    state = opt.update(grads, opt.init(params), params)[1]
    bad = grads.clone()
    bad["wte", "weight"][0, 0] = float("nan")
    for i in (1, 2):
        updates, new_state = opt.update(bad, state, params)
        assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values(True, True))
        assert (new_state["inner"] == state["inner"]).all()
        assert int(new_state["notfinite_count"]) == i and int(new_state["total_notfinite"]) == i
        assert not bool(new_state["last_finite"])
        state = new_state
    good_state = state
    updates, state = opt.update(bad, state, params)  # the third bad step in a row goes through
    assert torch.isnan(updates["wte", "weight"]).any()
    assert int(state["notfinite_count"]) == 3 and int(state["total_notfinite"]) == 3
    updates, state = opt.update(grads, good_state, params)  # a finite update resets the count
    assert int(state["notfinite_count"]) == 0 and int(state["total_notfinite"]) == 2
    assert bool(state["last_finite"])
    assert all(torch.isfinite(u).all() for u in updates.values(True, True))


def test_state_bytes():
    params = ft.params_of(tiny_gpt())
    n = sum(p.numel() for p in params.values(True, True))
    counters = 8 + 8 + 4  # adam count, learning-rate count and lr
    assert optim.state_bytes(optim.adamw().init(params)) == 2 * 4 * n + counters
    assert optim.state_bytes(optim.sgd(0.1).init(params)) == 8 + 4
    assert optim.state_bytes(optim.sgd(0.1, momentum=0.9).init(params)) == 4 * n + 12
    masked = optim.masked(optim.scale_by_adam(), optim.decay_mask).init(params)
    n2 = sum(p.numel() for p in params.values(True, True) if p.dim() >= 2)
    assert optim.state_bytes(masked) == 2 * 4 * n2 + 8
    with pytest.raises(TypeError, match="expected a TensorDict"):
        optim.state_bytes([torch.zeros(3)])


# --- bad input: each error names the argument and the fix ------------------------------------------


def test_torch_optimizer_instead_of_gradient_transformation():
    model = tiny_gpt()
    torch_opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        TypeError, match=r"GradientTransformation.*torch.optim optimizers hold state"
    ):
        ft.train_step(lambda p, b: None, torch_opt)
    with pytest.raises(
        TypeError, match=r"optimizer must be an ftrain.optim.GradientTransformation"
    ):
        ft.TrainState.create(ft.params_of(model), torch_opt)
    with pytest.raises(
        TypeError, match=r"chain: argument 1 is AdamW, not a GradientTransformation"
    ):
        optim.chain(optim.scale(1.0), torch_opt)
    with pytest.raises(TypeError, match=r"inner must be a GradientTransformation"):
        optim.apply_if_finite(torch_opt)


def test_state_from_another_model_is_refused_by_name():
    params, grads = params_and_grads()
    opt = optim.adamw()
    other = ft.params_of(torch.nn.Linear(3, 2))
    with pytest.raises(KeyError, match=r"state\['mu'\] does not have the keys of the updates"):
        opt.update(grads, opt.init(other), params)
    with pytest.raises(KeyError, match=r"params and updates must have the same keys.*missing"):
        opt.update(grads, opt.init(params), other)


# --- compiled: learning rates and masks never break the graph --------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.chain(
            optim.clip_by_global_norm(1.0),
            optim.adamw(optim.warmup_cosine(1e-3, 2, 10), mask=optim.decay_mask),
        ),
        lambda: optim.adafactor(1e-2, weight_decay=0.01),
        lambda: optim.lion(1e-4, weight_decay=0.1),
        lambda: optim.sgd(optim.wsd(0.1, 1, 2, 3), momentum=0.9, nesterov=True),
    ],
    ids=["adamw-mask-schedule", "adafactor", "lion", "sgd-nesterov"],
)
def test_updates_trace_without_graph_breaks(make):
    """What ``ft.compile`` needs from an optimizer: the whole update traces as one graph (no
    host reads of schedules, bias corrections, clip factors or masks)."""
    import torch._dynamo as dynamo

    from ftrain.optim.base import LeafContext, leaf_update

    params, grads = params_and_grads()
    opt = make()
    state = opt.init(params)  # eager, as TrainState.create does: masks resolve here
    p, tree = ft.tree.flatten(params)
    s, sdef = ft.tree.flatten(state)
    fn = leaf_update(opt)

    def update(g, s, p):
        return fn(list(g), list(s), list(p), LeafContext(tree, sdef, False, False))

    dynamo.reset()
    explained = dynamo.explain(update)(list(grads.values(True, True)), s, p)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
