"""ftrain.optim's ready-made optimizers (ftrain/optim/alias.py) against torch.optim and against
the same steps done by hand.

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

import pytest
import torch

import ftrain as ft
from ftrain import optim

from _optim import ftrain_run, global_rel, max_rel, td, tensor_rel, torch_run
from _tiny import flat, make_batches, mean_ce, tiny_gpt

STEPS = 50


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


# --- the package's and this module's docstring examples ------------------------------------------


def test_docstring_examples_run():
    import doctest

    import ftrain.optim.alias

    for module in (ftrain.optim, ftrain.optim.alias):
        assert doctest.testmod(module).failed == 0, module.__name__
