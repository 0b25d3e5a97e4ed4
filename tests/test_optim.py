"""ftrain.optim against torch.optim and against the same steps done by hand.

The comparisons train a tiny GPT (d=32, 2 layers) on a fresh random batch per step, the same
batches for both sides. Two kinds of checks:

* *step for step*: at every one of 50 steps both optimizers start from torch's params and state and
  get torch's gradients; the results must agree to 1e-6 relative (a few float32 ulps). This is the
  arithmetic check, free of any amplification.
* *trajectory*: 50 steps of ``ft.train_step`` against ``loss.backward(); opt.step()``. Adam-type
  updates amplify 1-ulp differences over time (torch's own foreach and fused AdamW drift apart by
  about 2e-6 in 50 steps here), so the bound is relative to that drift: no more than 3x the distance
  between torch's two implementations, measured in the same test.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ftrain as ft
from ftrain import optim

from _tiny import flat, make_batches, mean_ce, tiny_gpt

STEPS = 50


# --- helpers ---------------------------------------------------------------------------------


def torch_run(model, make_opt, batches) -> dict[str, torch.Tensor]:
    """The imperative loop: ``zero_grad; loss.backward(); opt.step()``."""
    m = copy.deepcopy(model)
    opt = make_opt(m.parameters())
    for x, y in batches:
        opt.zero_grad()
        mean_ce(m(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in m.named_parameters()}


def ftrain_run(model, opt, batches) -> dict[str, torch.Tensor]:
    """The same loop as a pure ``ft.train_step``."""
    step = ft.train_step(lambda p, b: mean_ce(ft.apply(model, p, b[0]), b[1]), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    for b in batches:
        state, _ = step(state, b)
    return flat(state.params)


def tensor_rel(a: dict, b: dict) -> float:
    """Worst per-tensor relative error ``||a - b|| / ||b||``."""
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def global_rel(a: dict, b: dict) -> float:
    """``||a - b|| / ||b||`` over all tensors taken as one vector."""
    num = sum(((a[k] - b[k]) ** 2).sum() for k in b)
    den = sum((b[k] ** 2).sum() for k in b)
    return math.sqrt(num / den)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def grads_of(model, batch) -> tuple[dict, dict]:
    """Params and gradients (by module path) of the mean loss on ``batch``."""
    m = copy.deepcopy(model)
    mean_ce(m(batch[0]), batch[1]).backward()
    return (
        {k: v.detach().clone() for k, v in m.named_parameters()},
        {k: v.grad.clone() for k, v in m.named_parameters()},
    )


def td(d: dict) -> ft.tree.TensorDict:
    return ft.tree.from_flat(dict(d))


# --- SGD: trajectory within 1e-6 ---------------------------------------------------------------

SGD_CASES = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(weight_decay=0.1),
    dict(momentum=0.9, weight_decay=0.01),
]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: "-".join(kw) or "plain")
def test_sgd_matches_torch_over_50_steps(kw):
    model, batches = tiny_gpt(), make_batches()
    want = torch_run(model, lambda p: torch.optim.SGD(p, lr=0.05, **kw), batches)
    got = ftrain_run(model, optim.sgd(0.05, **kw), batches)
    assert tensor_rel(got, want) <= 1e-6
    moved = tensor_rel(flat(ft.params_of(model)), want)
    assert moved > 1e-3  # the run trained: a 1e-6 agreement is not trivial


def _decay_groups(params, weight_decay: float) -> list[dict]:
    """torch's way to say ``mask=decay_mask``: matrices in a decayed group, the rest not."""
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize(
    "torch_cls,ours,kw,steps,tol",
    [
        (torch.optim.SGD, optim.sgd, dict(lr=0.05, momentum=0.9), STEPS, 1e-6),
        (torch.optim.Adam, optim.adam, dict(lr=3e-3), 3, 1e-5),  # adam amplifies rounding
    ],
    ids=["sgd", "adam"],
)
def test_l2_decay_mask_matches_torch_param_groups(torch_cls, ours, kw, steps, tol):
    model, batches = tiny_gpt(), make_batches(steps)
    want = torch_run(model, lambda p: torch_cls(_decay_groups(p, 0.1), **kw), batches)
    ftrain_kw = {"learning_rate" if k == "lr" else k: v for k, v in kw.items()}
    got = ftrain_run(model, ours(**ftrain_kw, weight_decay=0.1, mask=optim.decay_mask), batches)
    assert global_rel(got, want) <= tol
    everywhere = ftrain_run(model, ours(**ftrain_kw, weight_decay=0.1), batches)
    assert global_rel(everywhere, want) > 10 * tol  # the mask changes the result


def test_every_alias_that_decays_weights_takes_mask():
    import inspect

    for name, make in optim.OPTIMIZERS.items():
        options = inspect.signature(make).parameters
        if "weight_decay" in options:
            assert "mask" in options, name


def test_the_optimizer_table_is_read_only():
    with pytest.raises(TypeError):
        optim.OPTIMIZERS["mine"] = optim.sgd  # type: ignore[index]
    assert "mine" not in optim.OPTIMIZERS and "adamw" in optim.OPTIMIZERS


# --- Adam / AdamW: step for step and trajectory ----------------------------------------------


ADAM_CASES = [
    ("adamw", torch.optim.AdamW, optim.adamw, dict(lr=1e-3, weight_decay=0.01)),
    ("adam", torch.optim.Adam, optim.adam, dict(lr=1e-3, weight_decay=0.0)),
    ("adam-l2", torch.optim.Adam, optim.adam, dict(lr=3e-3, weight_decay=0.1)),
]


def _adam_state(opt, params: dict, torch_opt, torch_params: dict) -> ft.tree.TensorDict:
    """An ftrain adam/adamw state holding torch's moments and step count."""
    state = opt.init(td(params))
    by_param = {id(p): name for name, p in torch_params.items()}
    mu, nu = {}, {}
    for p, s in torch_opt.state.items():
        mu[by_param[id(p)]], nu[by_param[id(p)]] = s["exp_avg"].clone(), s["exp_avg_sq"].clone()
        count = torch.tensor(int(s["step"]), dtype=torch.int64)
    adam_key = "0" if "mu" in state["0"].keys() else "1"  # adam with L2 has the decay first
    state[adam_key, "count"] = count
    state[adam_key, "mu"] = td({k: mu[k] for k in params})
    state[adam_key, "nu"] = td({k: nu[k] for k in params})
    lr_key = str(len(state.keys()) - 1)
    state[lr_key, "count"] = count.clone()
    return state


@pytest.mark.parametrize("name,torch_cls,ours,kw", ADAM_CASES, ids=[c[0] for c in ADAM_CASES])
def test_adam_matches_torch_step_for_step(name, torch_cls, ours, kw):
    """Along torch's own 50-step run, each ftrain update from torch's params, moments and
    gradients gives torch's next params to 1e-6 (direct ``opt.update`` + ``apply_updates``)."""
    model = copy.deepcopy(tiny_gpt())
    named = dict(model.named_parameters())
    topt = torch_cls(model.parameters(), foreach=True, **kw)
    opt = ours(kw["lr"], weight_decay=kw["weight_decay"])
    for i, (x, y) in enumerate(make_batches()):
        topt.zero_grad()
        mean_ce(model(x), y).backward()
        params = {k: v.detach().clone() for k, v in named.items()}
        grads = {k: v.grad.clone() for k, v in named.items()}
        state = opt.init(td(params)) if i == 0 else _adam_state(opt, params, topt, named)
        topt.step()
        updates, new_state = opt.update(td(grads), state, td(params))
        got = flat(optim.apply_updates(td(params), updates))
        for k, v in named.items():
            assert max_rel(got[k], v.detach()) <= 1e-6, (i, k)
            adam = new_state["0" if "mu" in new_state["0"].keys() else "1"]
            assert max_rel(adam["mu"][tuple(k.split("."))], topt.state[v]["exp_avg"]) <= 1e-6
            assert max_rel(adam["nu"][tuple(k.split("."))], topt.state[v]["exp_avg_sq"]) <= 1e-6


@pytest.mark.parametrize(
    "name,torch_cls,ours,kw", ADAM_CASES[:2], ids=[c[0] for c in ADAM_CASES[:2]]
)
def test_adam_trajectory_within_torchs_own_spread(name, torch_cls, ours, kw):
    """50 steps of ft.train_step are no further from torch's foreach Adam(W) than 3x the distance
    between torch's foreach and fused implementations on the same run (global relative L2; about
    2e-6 here, so not a trivially loose bound; 1e-7 floor in case fused and foreach coincide)."""
    model, batches = tiny_gpt(), make_batches()
    foreach = torch_run(model, lambda p: torch_cls(p, foreach=True, **kw), batches)
    fused = torch_run(model, lambda p: torch_cls(p, fused=True, **kw), batches)
    got = ftrain_run(model, ours(kw["lr"], weight_decay=kw["weight_decay"]), batches)
    spread = max(global_rel(fused, foreach), 1e-7)
    assert global_rel(got, foreach) <= 3 * spread
    assert global_rel(flat(ft.params_of(model)), foreach) > 1e3 * spread  # it trained


# --- Adafactor --------------------------------------------------------------------------------


def test_adafactor_matches_torch_step_for_step():
    """Along torch.optim.Adafactor's own run (lr 1e-2, weight decay 0.1), each ftrain update from
    torch's params and factored moments gives torch's next params and moments to 1e-6."""
    model = copy.deepcopy(tiny_gpt())
    named = dict(model.named_parameters())
    topt = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = optim.adafactor(1e-2, weight_decay=0.1)
    for i, (x, y) in enumerate(make_batches()):
        topt.zero_grad()
        mean_ce(model(x), y).backward()
        params = {k: v.detach().clone() for k, v in named.items()}
        grads = {k: v.grad.clone() for k, v in named.items()}
        state = opt.init(td(params))
        if i:  # torch's state into ftrain's layout
            for k, v in named.items():
                s, key = topt.state[v], tuple(k.split("."))
                for ours_name, torch_name in (
                    ("v_row", "row_var"),
                    ("v_col", "col_var"),
                    ("v", "variance"),
                ):
                    if torch_name in s:
                        state["0", ours_name, key] = s[torch_name].clone()
            count = torch.tensor(int(topt.state[named["wte.weight"]]["step"]), dtype=torch.int64)
            for part in ("0", "3", "5"):  # factored_rms, relative step, learning rate
                state[part, "count"] = count.clone()
        topt.step()
        updates, new_state = opt.update(td(grads), state, td(params))
        got = flat(optim.apply_updates(td(params), updates))
        for k, v in named.items():
            assert max_rel(got[k], v.detach()) <= 1e-6, (i, k)
            s, key = topt.state[v], tuple(k.split("."))
            if "row_var" in s:
                assert max_rel(new_state["0", "v_row", key], s["row_var"]) <= 1e-6
                assert max_rel(new_state["0", "v_col", key], s["col_var"]) <= 1e-6
            else:
                assert max_rel(new_state["0", "v", key], s["variance"]) <= 1e-6


def test_adafactor_trajectory_matches_torch():
    """50 train steps: within 3x of the spread between torch's single-tensor and foreach Adafactor
    (floor 1e-7), and the state is factored: rows + cols per matrix.

    Without weight decay: torch multiplies params by ``1 - lr * wd`` rounded to fp32, a relative
    error of up to 3e-4 *of the decay itself*, the same at every step; ftrain adds ``lr * wd * p``.
    Over 50 steps that alone puts torch ~8e-7 from the exact decay, more than its two
    implementations differ by. Weight decay is checked step for step above."""
    model, batches = tiny_gpt(), make_batches()
    single = torch_run(model, lambda p: torch.optim.Adafactor(p, lr=1e-2), batches)
    foreach = torch_run(model, lambda p: torch.optim.Adafactor(p, lr=1e-2, foreach=True), batches)
    got = ftrain_run(model, optim.adafactor(1e-2), batches)
    spread = max(global_rel(foreach, single), 1e-7)
    assert global_rel(got, single) <= 3 * spread
    assert global_rel(flat(ft.params_of(model)), single) > 1e3 * spread  # it trained

    params = ft.params_of(model)
    state = optim.adafactor().init(params)
    expected = 8 * 3 + 4  # three counters and the lr
    for p in params.values(True, True):
        expected += 4 * (p.shape[-2] + p.shape[-1] if p.dim() >= 2 else p.numel())
    assert optim.state_bytes(state) == expected
    assert optim.state_bytes(state) < 0.1 * sum(p.numel() * 4 for p in params.values(True, True))


def test_adafactor_names_torchs_options():
    with pytest.raises(TypeError, match="decay_rate=0.8"):
        optim.adafactor(beta2_decay=-0.8)
    with pytest.raises(TypeError, match="eps1=..., eps2="):
        optim.adafactor(eps=(None, 1e-3))
    with pytest.raises(TypeError, match="clipping_threshold"):
        optim.adafactor(d=1.0)
    with pytest.raises(ValueError, match="clipping_threshold must be a number >= 1.0"):
        optim.adafactor(clipping_threshold=0.5)


# --- Lion against a by-hand reference ------------------------------------------------------------


def test_lion_matches_by_hand_reference():
    """Lion (Chen et al. 2023, Algorithm 2), one tensor at a time:
    c = b1 m + (1 - b1) g; p = p - lr (sign(c) + wd p); m = b2 m + (1 - b2) g.

    Without biases: the key bias of attention gets a zero gradient up to rounding, and the sign of
    rounding noise is not something two implementations can agree on."""
    lr, b1, b2, wd = 1e-3, 0.9, 0.99, 0.1
    model, batches = tiny_gpt(bias=False), make_batches(20)
    ref = copy.deepcopy(model)
    mom = {k: torch.zeros_like(p) for k, p in ref.named_parameters()}
    opt = optim.lion(lr, b1=b1, b2=b2, weight_decay=wd)
    got = ftrain_run(model, opt, batches)
    for x, y in batches:
        ref.zero_grad()
        mean_ce(ref(x), y).backward()
        with torch.no_grad():
            for k, p in ref.named_parameters():
                g, m = p.grad, mom[k]
                c = b1 * m + (1 - b1) * g
                p.sub_(lr * (torch.sign(c) + wd * p))
                mom[k] = b2 * m + (1 - b2) * g
    want = {k: v.detach() for k, v in ref.named_parameters()}
    assert tensor_rel(got, want) <= 1e-5
    assert tensor_rel(flat(ft.params_of(model)), want) > 1e-3


# --- building blocks against the same steps by hand -----------------------------------------------


def _params_and_grads(seed: int = 0):
    model = tiny_gpt(seed)
    p, g = grads_of(model, make_batches(1, seed)[0])
    return td(p), td(g)


def test_chain_equals_the_transforms_applied_by_hand():
    params, grads = _params_and_grads()
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

    params, grads = _params_and_grads()
    sgd = optim.sgd(0.1)
    want = sgd.update(grads, sgd.init(params), params)[0].apply(lambda x: x * 0.5)
    opt = optim.chain(halved(sgd), optim.identity())
    got = opt.update(grads, opt.init(params), params)[0]
    assert (got == want).all()

    model, batches = tiny_gpt(), make_batches(3)
    ref = ftrain_run(model, optim.sgd(0.05), batches)
    assert tensor_rel(ftrain_run(model, halved(optim.sgd(0.1)), batches), ref) <= 1e-6


def test_update_is_pure_and_inplace_gives_the_same_result():
    params, grads = _params_and_grads()
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
    params, grads = _params_and_grads()
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
    params, grads = _params_and_grads()
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


def test_clip_by_global_norm():
    params, grads = _params_and_grads()
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values(True, True)]))
    opt = optim.clip_by_global_norm(float(norm) / 4)
    clipped, _ = opt.update(grads, opt.init(params))
    got = torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped.values(True, True)]))
    assert abs(float(got) - float(norm) / 4) <= 1e-6 * float(norm)
    for k, g in flat(clipped).items():  # same direction
        assert torch.allclose(g * 4, flat(grads)[k], rtol=1e-5, atol=1e-12)
    loose = optim.clip_by_global_norm(float(norm) * 2)
    same, _ = loose.update(grads, loose.init(params))
    assert (same == grads).all()  # below the threshold: bitwise unchanged
    with pytest.raises(ValueError, match="max_norm.*> 0"):
        optim.clip_by_global_norm(0.0)


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


def test_unknown_optimizer_option_names_the_fix():
    with pytest.raises(TypeError, match=r"unknown option 'betas'.*b1=\.\.\., b2=\.\.\."):
        optim.adamw(betas=(0.9, 0.95))
    with pytest.raises(TypeError, match=r"'lr'.*learning_rate=.*Options: learning_rate, b1"):
        optim.adam(lr=1e-3)
    with pytest.raises(TypeError, match="Did you mean 'weight_decay'"):
        optim.sgd(weight_decy=0.1)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: optim.adamw(-1e-3), r"adamw: learning_rate must be a number >= 0.0, got -0.001"),
        (lambda: optim.adamw(b1=1.0), r"adamw: b1 must be a number in \[0.0, 1.0\), got 1.0"),
        (lambda: optim.adam(b2=-0.1), r"adam: b2 must be a number in \[0.0, 1.0\)"),
        (lambda: optim.adamw(eps=-1.0), r"adamw: eps must be a number >= 0.0"),
        (lambda: optim.adamw(weight_decay=float("nan")), r"weight_decay must be a number"),
        (lambda: optim.sgd(0.1, momentum=1.5), r"sgd: momentum must be a number in \[0.0, 1.0\)"),
        (lambda: optim.sgd(0.1, nesterov=True), r"nesterov=True needs momentum > 0"),
        (lambda: optim.lion(b2="0.99"), r"lion: b2 must be a number"),
        (lambda: optim.adafactor(decay_rate=-0.8), r"adafactor: decay_rate must be a number >= 0"),
        (lambda: optim.adafactor(eps2=-1.0), r"adafactor: eps2 must be a number >= 0"),
        (
            lambda: optim.scale_by_learning_rate("fast"),
            r"learning rate must be a number or a schedule",
        ),
        (lambda: optim.scale_by_learning_rate(-1.0), r"learning rate must be >= 0"),
    ],
)
def test_invalid_hyperparameters_are_refused_at_build_time(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


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
    params, grads = _params_and_grads()
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

    params, grads = _params_and_grads()
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


def test_docstring_examples_run():
    import doctest

    import ftrain.optim.alias

    for module in (ftrain.optim, ftrain.optim.alias):
        assert doctest.testmod(module).failed == 0, module.__name__
