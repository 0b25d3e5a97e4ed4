"""Tests for ftrain.io.state_files: a TrainState to (tree, tensors per file) and back, and tree
diffs."""

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain.io.state_files import (
    PARAMS_FILE,
    STATE_FILE,
    CheckpointError,
    differences,
    flatten,
    spec,
    tree_of,
    unflatten,
)


def small_state():
    w = torch.arange(6.0).reshape(2, 3)
    params = TensorDict({"lin": {"weight": w, "bias": torch.zeros(3)}}, batch_size=[])
    opt_state = TensorDict({"0": {"mu": {"lin": {"weight": w.t()}}}, "1": {}}, batch_size=[])
    extra = TensorDict({"half": torch.ones(2, dtype=torch.bfloat16)}, batch_size=[])
    return ft.TrainState(
        params=params,
        opt_state=opt_state,
        step=torch.tensor(7),
        rng=torch.tensor(-3),
        extra=extra,
        batch_size=[],
    )


def test_flatten_gives_the_tree_and_the_keys_of_each_file():
    state = small_state()
    tree, params, rest = flatten(state)
    assert tree == {
        "params": {"lin": {"weight": "float32[2, 3]", "bias": "float32[3]"}},
        "opt_state": {"0": {"mu": {"lin": {"weight": "float32[3, 2]"}}}, "1": {}},
        "step": "int64[]",
        "rng": "int64[]",
        "extra": {"half": "bfloat16[2]"},
    }
    assert list(tree["params"]["lin"]) == ["weight", "bias"]  # key order kept
    assert sorted(params) == ["lin.bias", "lin.weight"]  # the module's own state-dict keys
    assert sorted(rest) == ["extra.half", "opt_state.0.mu.lin.weight", "rng", "step"]
    assert tree_of(state) == tree
    # values as given, as contiguous CPU tensors that share no memory (safetensors needs that)
    assert torch.equal(rest["opt_state.0.mu.lin.weight"], state.params["lin", "weight"].t())
    tensors = [*params.values(), *rest.values()]
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    ptrs = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
    assert len(set(ptrs)) == len(ptrs)


def test_unflatten_rebuilds_the_exact_state():
    state = small_state()
    tree, params, rest = flatten(state)
    fields = unflatten(Path("ck"), tree, {PARAMS_FILE: params, STATE_FILE: rest})
    assert fields["opt_state"]["1"].is_empty() and list(fields["opt_state"].keys()) == ["0", "1"]
    for field in ("params", "opt_state", "extra"):
        got, want = fields[field], getattr(state, field)
        assert list(got.keys(True)) == list(want.keys(True))
        for key, value in want.items(True, True):
            assert value.dtype == got[key].dtype and torch.equal(value, got[key])
    assert fields["step"].item() == 7 and fields["rng"].item() == -3


def test_unflatten_refuses_tensors_that_do_not_match_the_tree():
    tree, params, rest = flatten(small_state())
    extra_tensor = {**rest, "extra.stray": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"ck/state.safetensors holds tensors .*extra.stray"):
        unflatten(Path("ck"), tree, {PARAMS_FILE: params, STATE_FILE: extra_tensor})
    missing = {k: v for k, v in params.items() if k != "lin.bias"}
    with pytest.raises(CheckpointError, match="lists 'lin.bias' but the tensor file lacks it"):
        unflatten(Path("ck"), tree, {PARAMS_FILE: missing, STATE_FILE: rest})
    wrong = {**params, "lin.bias": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=r"'lin.bias' is float32\[4\] .* float32\[3\]"):
        unflatten(Path("ck"), tree, {PARAMS_FILE: wrong, STATE_FILE: rest})


def test_flatten_refuses_what_a_checkpoint_cannot_hold():
    state = small_state()
    dotted = state.replace(extra=TensorDict({"a.b": torch.zeros(1), "a": {"b": 1.0}}, []))
    with pytest.raises(CheckpointError, match="both flatten to the key 'extra.a.b'"):
        flatten(dotted)
    with pytest.raises(CheckpointError, match="state.step must be a 0-d tensor"):
        flatten(state.replace(step=torch.tensor([1, 2])))


def test_spec_and_differences():
    assert spec(torch.zeros(2, 0, dtype=torch.int8)) == "int8[2, 0]"
    assert spec(torch.tensor(True)) == "bool[]"
    saved = {"a": {"w": "float32[2]", "e": {}}, "b": "int64[]", "c": {"x": "float32[1]"}}
    like = {"a": {"w": "float32[3]", "n": {"y": "bool[]"}}, "b": {"z": "int64[]"}, "c": saved["c"]}
    assert differences(saved, like) == [
        "a.w: float32[2] in checkpoint, float32[3] in `like`",
        "a.n.y: missing in checkpoint",
        "a.e (empty TensorDict): unexpected (in checkpoint, not in `like`)",
        "b: a tensor in checkpoint, a TensorDict in `like`",
    ]
    assert differences(saved, saved) == []
