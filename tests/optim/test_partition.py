"""ftrain.optim.partition: each label's parameters updated by its own transform, bit for bit as
that transform alone on their sub-tree; labels in every accepted form; the errors at init."""

from __future__ import annotations

import sys

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain import optim
from ftrain.testing import assert_no_recompile

from _tiny import gpt_step, lm_batch, lm_loss, tiny_gpt

STEPS = 24


def label_of(path: str, p: torch.Tensor) -> str:
    """Matrices of the blocks to AdamW (weight decay on matrices only), the embedding to SGD with
    Nesterov momentum, norms and biases to Lion with weight decay."""
    if p.dim() >= 2:
        return "adamw" if path.startswith("blocks") else "sgd"
    return "lion"


def labels_fn(params):
    return {k: label_of(k, v) for k, v in ft.tree.to_flat(params).items()}


def transforms(fused=None):
    return {
        "adamw": optim.adamw(1e-2, weight_decay=0.1, mask=optim.decay_mask, fused=fused),
        "sgd": optim.sgd(0.1, momentum=0.9, nesterov=True, fused=fused),
        "lion": optim.chain(optim.clip_by_global_norm(0.5), optim.lion(1e-3, weight_decay=0.5)),
    }


def subtree(td, label: str):
    return ft.tree.from_flat(
        {k: v for k, v in ft.tree.to_flat(td).items() if label_of(k, v) == label}
    )


def test_each_label_is_updated_as_its_transform_alone_bit_for_bit():
    params = ft.params_of(tiny_gpt(bias=True))
    opt = optim.partition(transforms(), labels_fn)
    alone = transforms()
    state = opt.init(params)
    assert list(state.keys()) == ["adamw", "sgd", "lion"]
    refs = {k: (subtree(params, k), t.init(subtree(params, k))) for k, t in alone.items()}
    for k, (_, s) in refs.items():  # each state covers only its label's leaves
        assert ft.tree.to_flat(state[k]).keys() == ft.tree.to_flat(s).keys()
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        grads = params.apply(lambda t: torch.randn(t.shape, generator=g))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for k, t in alone.items():
            p, s = refs[k]
            u, s = t.update(subtree(grads, k), s, p)
            refs[k] = (optim.apply_updates(p, u), s)
            for path, want in ft.tree.to_flat(u).items():
                assert torch.equal(ft.tree.to_flat(updates)[path], want), path
    for k, (p, s) in refs.items():
        for path, want in ft.tree.to_flat(p).items():
            assert torch.equal(ft.tree.to_flat(params)[path], want), path
        for (path, got), want in zip(ft.tree.to_flat(state[k]).items(), ft.tree.leaves(s)):
            assert torch.equal(got, want), (k, path)


def test_labels_as_a_tensordict_of_strings_a_nested_dict_or_dotted_keys_agree():
    params = ft.params_of(tiny_gpt())
    flat = labels_fn(params)
    as_td = TensorDict(flat).unflatten_keys(".")
    forms = [
        labels_fn,
        flat,  # dotted keys
        as_td.to_dict(),  # a nested dict of strings
        as_td,  # a TensorDict of strings
        lambda p: TensorDict(labels_fn(p)).unflatten_keys("."),  # a function giving a TensorDict
    ]
    assert (
        isinstance(forms[2]["wte"]["weight"], str) and as_td["wte", "weight"] == "sgd"
    )  # stored as non-tensor data
    grads = params.apply(lambda t: torch.full_like(t, 0.5))
    results = []
    for labels in forms:
        opt = optim.partition(transforms(), labels)
        results.append(ft.tree.leaves(opt.update(grads, opt.init(params), params)[0]))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_a_compiled_donated_step_matches_eager_without_recompiling():
    model, _, _ = gpt_step(n_layer=1)  # one block: dynamo traces each block's code anew
    opt = optim.partition(transforms(), labels_fn)
    state = ft.TrainState.create(ft.params_of(model), opt)
    # a compiled step runs adamw's and sgd's foreach chains (ftrain.optim.fused): bit for bit
    # against the eager step means fused=False there
    eager = ft.train_step(lm_loss(model), optim.partition(transforms(fused=False), labels_fn))
    compiled = ft.compile(ft.train_step(lm_loss(model), opt, donate=True), backend="eager")
    batches = [lm_batch(4, seed=i) for i in range(4)]
    final, _ = assert_no_recompile(compiled, state.clone(), batches)
    s = state
    for b in batches:
        s, _ = eager(s, b)
    for a, b in zip(ft.tree.leaves(final.params), ft.tree.leaves(s.params)):
        assert torch.equal(a, b)
    for a, b in zip(ft.tree.leaves(final.opt_state), ft.tree.leaves(s.opt_state)):
        assert torch.equal(a, b)


def test_errors_at_init_name_the_label_or_the_parameter():
    params = ft.params_of(torch.nn.Linear(3, 2))
    two = {"a": optim.sgd(0.1), "b": optim.adam(1e-3)}
    with pytest.raises(KeyError, match=r"no label for \['bias'\]"):
        optim.partition(two, {"weight": "a"}).init(params)
    with pytest.raises(KeyError, match=r"labels for keys the params do not have \['scale'\]"):
        optim.partition(two, {"weight": "a", "bias": "b", "scale": "a"}).init(params)
    with pytest.raises(KeyError, match=r"no transform: 'adamw' \(on \['bias'\]\).*\['a', 'b'\]"):
        optim.partition(two, {"weight": "a", "bias": "adamw"}).init(params)
    with pytest.raises(ValueError, match="no parameter has the label 'b'.*Remove 'b'"):
        optim.partition(two, {"weight": "a", "bias": "a"}).init(params)
    with pytest.raises(TypeError, match=r"label of 'bias' is int 3"):
        optim.partition(two, {"weight": "a", "bias": 3}).init(params)
    with pytest.raises(TypeError, match="labels must be a TensorDict of strings"):
        optim.partition(two, ["a", "b"])
    with pytest.raises(TypeError, match=r"transforms\['b'\] is type"):
        optim.partition({"a": optim.sgd(0.1), "b": torch.optim.SGD}, {"weight": "a"})
    with pytest.raises(ValueError, match="non-empty string without '.'"):
        optim.partition({"a.b": optim.sgd(0.1)}, {"weight": "a.b"})
    with pytest.raises(TypeError, match="non-empty mapping"):
        optim.partition({}, {})
    other = optim.partition(
        {"b": optim.adam(1e-3), "a": optim.sgd(0.1)}, {"weight": "a", "bias": "b"}
    )
    opt = optim.partition(two, {"weight": "a", "bias": "b"})
    with pytest.raises(KeyError, match="Build the state with this optimizer's init"):
        opt.update(params, other.init(params), params)


def test_docstring_example_runs():
    import doctest

    assert doctest.testmod(sys.modules["ftrain.optim.partition"]).failed == 0
