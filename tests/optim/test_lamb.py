"""lamb (ftrain/optim/lamb.py): the trust ratio and LAMB against the same steps done by hand."""

import torch

import ftrain as ft
from ftrain.optim.lamb import lamb, scale_by_trust_ratio


def test_trust_ratio_by_hand():
    params = ft.params_of(torch.nn.Linear(4, 3))
    g = params.apply(lambda p: torch.full_like(p, 0.5))
    t = scale_by_trust_ratio()
    u, _ = t.update(g, t.init(params), params)
    for k in ("weight", "bias"):
        ratio = params[k].norm() / g[k].norm()
        torch.testing.assert_close(u[k], g[k] * ratio)


def test_lamb_matches_by_hand_reference():
    torch.manual_seed(0)
    params = ft.params_of(torch.nn.Linear(5, 3))
    opt = lamb(0.01, weight_decay=0.1)
    state = opt.init(params)
    p = {k: v.clone() for k, v in ft.state_dict_of(params).items()}
    mu = {k: torch.zeros_like(v) for k, v in p.items()}
    nu = {k: torch.zeros_like(v) for k, v in p.items()}
    for t in range(1, 4):
        grads = params.apply(torch.randn_like)
        updates, state = opt.update(grads, state, params)
        params = ft.optim.apply_updates(params, updates)
        for k in p:
            g = ft.state_dict_of(grads)[k]
            mu[k] = 0.9 * mu[k] + 0.1 * g
            nu[k] = 0.999 * nu[k] + 0.001 * g * g
            adam = (mu[k] / (1 - 0.9**t)) / ((nu[k] / (1 - 0.999**t)).sqrt() + 1e-6)
            r = adam + 0.1 * p[k]
            p[k] = p[k] - 0.01 * (p[k].norm() / r.norm()) * r
        for k in p:
            torch.testing.assert_close(ft.state_dict_of(params)[k], p[k], rtol=1e-5, atol=1e-6)
