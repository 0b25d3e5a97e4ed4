"""ft.evaluate: summed totals over summed counts, no gradients, eval mode without touching the
module."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain.evaluate import EvalMode
from ftrain.models import GPT, GPTConfig

V, T = 11, 8


def gpt(dropout=0.0):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, seq_len=T, d_model=16, n_layer=2, n_head=2, dropout=dropout))


def batches(lengths_per_batch, seed=0):
    """LM batches whose rows hold the given numbers of targets (-100 after them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in lengths_per_batch:
        x = torch.randint(0, V, (len(lengths), T), generator=g)
        y = torch.randint(0, V, (len(lengths), T), generator=g)
        y = torch.where(torch.arange(T) < torch.tensor(lengths)[:, None], y, -100)
        out.append({"input": x, "target": y})
    return out


def lm_loss(model):
    def loss_fn(params, b):
        return ft.losses.cross_entropy(ft.apply(model, params, b["input"]), b["target"])

    return loss_fn


LENGTHS = [[8, 1], [2, 3, 1], [8, 8, 8, 8]]  # batches with 9, 6 and 32 targets


def test_evaluate_is_the_token_weighted_mean_over_all_batches():
    model = gpt()
    params = ft.params_of(model)
    data = batches(LENGTHS)
    # by hand: every target's loss, one mean over all of them
    with torch.no_grad():
        per_token = [
            F.cross_entropy(
                model(b["input"]).flatten(0, 1), b["target"].flatten(), reduction="none"
            )
            for b in data
        ]
    valid = torch.cat([t[b["target"].flatten() != -100] for t, b in zip(per_token, data)])
    want = valid.double().mean().item()
    got = ft.evaluate(lm_loss(model), params, iter(data))  # any iterable, read once
    assert got["loss"] == pytest.approx(want, rel=1e-6)
    assert got["count"] == len(valid) == 47 and got["batches"] == 3
    assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
    # and not the mean of the per-batch means, which weights the 6-token batch like the 32
    means = [lm_loss(model)(params, b).value.item() for b in data]
    assert abs(sum(means) / 3 - want) > 1e-3


def test_evaluate_runs_without_gradients_and_reports_perplexity_only_for_token_losses():
    model = gpt()
    seen = []

    def row_loss(params, b):
        seen.append(torch.is_grad_enabled())
        return ft.losses.row_mean(ft.apply(model, params, b["input"]).pow(2).mean())

    got = ft.evaluate(row_loss, ft.params_of(model), batches(LENGTHS))
    assert seen == [False, False, False]
    assert "perplexity" not in got
    assert got["count"] == 2 + 3 + 4  # rows


def test_evaluate_runs_modules_in_eval_mode_without_touching_them():
    model = gpt(dropout=0.5)
    model.train()
    params, data = ft.params_of(model), batches(LENGTHS)
    modes = [m.training for m in model.modules()]
    with torch.no_grad():
        model.eval()
        want = sum(lm_loss(model)(params, b).total.double() for b in data).item() / 47
        model.train()
    got = ft.evaluate(lm_loss(model), params, data)
    assert got["loss"] == pytest.approx(want, rel=1e-6)  # dropout off
    assert [m.training for m in model.modules()] == modes
    # eval_mode=False runs the modules in their own (training) mode: dropout on
    noisy = ft.evaluate(lm_loss(model), params, data, eval_mode=False)
    assert abs(noisy["loss"] - got["loss"]) > 1e-3


def test_evaluate_runs_a_hugging_face_model_in_eval_mode():
    pytest.importorskip("transformers")
    from ftrain.models import tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2(n_positions=T, n_embd=16, n_layer=1, n_head=2, dropout=0.5)
    ids = torch.randint(0, 257, (3, T), generator=torch.Generator().manual_seed(0))

    def loss_fn(params, b):
        return ft.losses.causal_lm(ft.apply(model, params, b).logits, b)

    got = ft.evaluate(loss_fn, ft.params_of(model), [ids])
    model.eval()
    with torch.no_grad():
        want = model(ids, labels=ids).loss.item()
    assert got["loss"] == pytest.approx(want, rel=1e-6)
    assert got["count"] == 3 * (T - 1)


def test_eval_mode_copy_shares_tables_and_copies_a_shared_submodule_once():
    shared = torch.nn.Dropout(0.5)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), shared, torch.nn.Sequential(shared))
    copy = EvalMode().rewrite(model)
    assert copy is not model and not copy.training and model.training
    assert all(not m.training for m in copy.modules())
    assert copy[1] is copy[2][0]  # still one module
    assert copy[0]._parameters is model[0]._parameters  # ft.apply places tensors as usual


def test_evaluate_refuses_no_batches_and_bad_arguments():
    model = gpt()
    with pytest.raises(ValueError, match="held no batch"):
        ft.evaluate(lm_loss(model), ft.params_of(model), itertools.islice([], 0))
    with pytest.raises(TypeError, match="params must be a TensorDict"):
        ft.evaluate(lm_loss(model), model, [])
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ft.evaluate(None, ft.params_of(model), [])
