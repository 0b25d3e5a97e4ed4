"""Shared by the tests of ftrain.optim: the same training run done by torch.optim and by ftrain,
relative errors, and a tiny GPT's params and gradients as TensorDicts."""

from __future__ import annotations

import copy
import math

import torch

import ftrain as ft

from _tiny import flat, make_batches, mean_ce, tiny_gpt


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


def params_and_grads(seed: int = 0):
    model = tiny_gpt(seed)
    p, g = grads_of(model, make_batches(1, seed)[0])
    return td(p), td(g)
