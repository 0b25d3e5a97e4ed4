"""Tests for ftrain.io.checkpoint: exact round trips, like=, verification, no pickle, atomic save."""

import hashlib
import json
import os
import pickle
import warnings

import pytest
import safetensors.torch
import torch
from tensordict import NonTensorData, TensorDict
from torch import nn

import ftrain as ft
from ftrain.io import (
    CheckpointError,
    CheckpointWarning,
    latest_checkpoint,
    load,
    load_meta,
    meta_checksum,
    save,
    save_checkpoint,
    verify_checkpoint,
)

from _tiny import lm_batch, lm_loss, tiny_gpt

SMALL = dict(vocab_size=37, seq_len=8, d_model=16, n_head=2)  # overrides of _tiny.TINY_GPT


def make_model(seed=0, **overrides):
    return tiny_gpt(seed, **{**SMALL, **overrides})


def batch(seed=1, B=4):
    return lm_batch(B, seed, vocab=SMALL["vocab_size"], length=SMALL["seq_len"])


def with_fields(state, **fields):
    """``state`` with some fields swapped for new ones (``TrainState.replace`` merges nested
    TensorDicts into the old ones instead)."""
    kw = {f: getattr(state, f) for f in ("params", "opt_state", "step", "rng", "extra")}
    return ft.TrainState(**{**kw, **fields}, batch_size=[])


def trained_state(model, steps=2):
    """A state after a few adamw steps (non-trivial moments, counts, lr), with transform state
    in ``extra``: an fp16-style loss-scale sub-dict, an empty sub-dict, bf16 and bool tensors."""

    step = ft.train_step(lm_loss(model), ft.optim.adamw(1e-2, weight_decay=0.1))
    state = ft.TrainState.create(ft.params_of(model), ft.optim.adamw(1e-2, weight_decay=0.1))
    for i in range(steps):
        state, _ = step(state, batch(seed=i))
    extra = TensorDict(
        {
            "loss_scale": {
                "scale": torch.tensor(65536.0),
                "good_steps": torch.tensor(7, dtype=torch.int64),
            },
            "nothing": TensorDict({}, batch_size=[]),
            "half": torch.randn(3, 2).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "weird": torch.tensor([float("nan"), -0.0, float("inf")]),
        },
        batch_size=[],
    )
    return with_fields(state, extra=extra), step


def structure(td):
    """Every key (inner nodes included, so empty TensorDicts count) in order, with the leaf type."""
    return [
        (k, type(v).__name__, getattr(v, "dtype", None), tuple(getattr(v, "shape", ())))
        for k, v in td.items(include_nested=True)
    ]


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_states_identical(a, b):
    for field in ("params", "opt_state", "extra"):
        ta, tb = getattr(a, field), getattr(b, field)
        assert structure(ta) == structure(tb), field
        for (ka, va), (kb, vb) in zip(ta.items(True, True), tb.items(True, True), strict=True):
            assert ka == kb and va.dtype == vb.dtype and va.shape == vb.shape, ka
            assert torch.equal(bits(va), bits(vb)), ka
    for field in ("step", "rng"):
        va, vb = getattr(a, field), getattr(b, field)
        assert vb.dtype == torch.int64 and vb.dim() == 0 and vb.device.type == "cpu"
        assert torch.equal(va, vb)


@pytest.fixture(scope="module")
def state_and_step():
    return trained_state(make_model())


# --- round trip ----------------------------------------------------------------------------------


def test_round_trip_is_bitwise_exact(tmp_path, state_and_step):
    state, _ = state_and_step
    assert "1" in state.opt_state.keys() and state.opt_state["1"].is_empty()  # adamw's empty node
    path = save(state, tmp_path / "ck", extra={"config": {"lr": 1e-2, "betas": (0.9, 0.95)}})
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json",
        "params.safetensors",
        "state.safetensors",
    ]
    loaded = load(path)
    assert_states_identical(state, loaded)
    assert loaded.extra["half"].dtype == torch.bfloat16
    assert loaded.extra["mask"].dtype == torch.bool
    assert loaded.extra["nothing"].is_empty()
    meta = load_meta(path)
    assert meta["step"] == 2 and meta["extra"] == {"config": {"lr": 1e-2, "betas": [0.9, 0.95]}}
    assert set(meta["versions"]) == {"ftrain", "torch", "tensordict", "safetensors"}
    assert set(meta["files"]) == {"params.safetensors", "state.safetensors"}


def test_fresh_state_with_empty_extra_round_trips(tmp_path):
    state = ft.TrainState.create(ft.params_of(nn.Linear(3, 2)), ft.optim.sgd(0.1))
    loaded = load(save(state, tmp_path / "ck"), like=state)
    assert_states_identical(state, loaded)
    assert loaded.extra.is_empty()


def test_resumed_state_continues_bit_for_bit(tmp_path, state_and_step):
    state, step = state_and_step
    loaded = load(save(state, tmp_path / "ck"), like=state)
    for i in range(2):
        state, m1 = step(state, batch(seed=10 + i))
        loaded, m2 = step(loaded, batch(seed=10 + i))
        assert torch.equal(m1["loss"], m2["loss"])
    assert_states_identical(state, loaded)


def test_non_contiguous_and_shared_tensors_are_saved_as_values(tmp_path):
    state = ft.TrainState.create(ft.params_of(nn.Linear(4, 4)), ft.optim.sgd(0.1))
    w = torch.arange(16.0).reshape(4, 4)
    extra = TensorDict({"t": w.t(), "same": w, "again": w, "row": w[1]}, batch_size=[])
    loaded = load(save(with_fields(state, extra=extra), tmp_path / "ck"))
    for k in ("t", "same", "again", "row"):
        assert torch.equal(loaded.extra[k], extra[k])


def test_load_device_keeps_step_and_rng_on_cpu(tmp_path, state_and_step):
    state, _ = state_and_step
    loaded = load(save(state, tmp_path / "ck"), device="meta")
    assert all(t.device.type == "meta" for t in loaded.params.values(True, True))
    assert loaded.step.device.type == "cpu" and loaded.rng.device.type == "cpu"


# --- the params file is a plain state dict -------------------------------------------------------


def test_params_file_loads_into_a_plain_module(tmp_path, state_and_step):
    state, _ = state_and_step
    path = save(state, tmp_path / "ck")
    fresh = make_model(seed=123)
    fresh.load_state_dict(safetensors.torch.load_file(path / "params.safetensors"))
    x = batch(seed=5)["input"]
    with torch.no_grad():
        assert torch.equal(fresh(x), ft.apply(make_model(seed=7), state.params, x))


def test_tied_module_loads_with_strict_false(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

    state = ft.TrainState.create(ft.params_of(Tied()), ft.optim.sgd(0.1))
    assert "weight" not in state.params["b"].keys()  # params_of keeps the first name only
    path = save(state, tmp_path / "ck")
    module = Tied()
    result = module.load_state_dict(
        safetensors.torch.load_file(path / "params.safetensors"), strict=False
    )
    assert result.missing_keys == ["b.weight"] and not result.unexpected_keys
    assert torch.equal(module.b.weight, state.params["a", "weight"])


# --- like= ---------------------------------------------------------------------------------------


def test_like_with_another_model_lists_every_difference(tmp_path, state_and_step):
    state, _ = state_and_step
    path = save(state, tmp_path / "ck")
    other = ft.TrainState.create(
        ft.params_of(make_model(n_layer=3, d_model=24)), ft.optim.adamw(1e-2, weight_decay=0.1)
    )
    with pytest.raises(CheckpointError) as e:
        load(path, like=other)
    msg, diffs = str(e.value), e.value.differences
    assert "does not match `like`" in msg and f"({len(diffs)} difference(s))" in msg
    assert "params.blocks.2.attn.qkv.weight: missing in checkpoint" in msg
    assert "params.wte.weight: float32[37, 16] in checkpoint, float32[37, 24] in `like`" in msg
    assert f"... and {len(diffs) - 30} more" in msg
    assert "opt_state.0.mu.blocks.2.ln_1.weight: missing in checkpoint" in diffs
    assert "opt_state.0.nu.ln_f.bias: float32[16] in checkpoint, float32[24] in `like`" in diffs


def test_like_reports_dtype_and_unexpected_keys(tmp_path, state_and_step):
    state, _ = state_and_step
    path = save(state, tmp_path / "ck")
    like = with_fields(state, extra=TensorDict({"half": torch.zeros(3, 2)}, batch_size=[]))
    with pytest.raises(CheckpointError) as e:
        load(path, like=like)
    msg = str(e.value)
    assert "extra.half: bfloat16[3, 2] in checkpoint, float32[3, 2] in `like`" in msg
    assert "extra.loss_scale.scale: unexpected" in msg
    assert "extra.nothing (empty TensorDict): unexpected" in msg
    assert_states_identical(state, load(path, like=state))  # the matching state passes


def test_a_pipelines_load_without_like_is_refused(tmp_path, state_and_step):
    path = save(state_and_step[0], tmp_path / "ck")
    with pytest.raises(ValueError, match=r"give like= too, the state pp.shard_state laid out"):
        load(path, pipeline=object())


def test_a_like_holding_part_of_the_checkpoint_is_told_of_pipeline(tmp_path, state_and_step):
    """A like missing only some of the saved tensors (a pipeline stage's, laid out) is refused
    with the load that reads a part; one that differs otherwise with the usual advice."""
    state, _ = state_and_step
    path = save(state, tmp_path / "ck")
    part = state.replace(params=state.params.exclude("wte"))
    with pytest.raises(CheckpointError, match=r"like=like, pipeline=pp\)"):
        load(path, like=part)
    with pytest.raises(CheckpointError, match="saved from a different model") as e:
        load(path, like=state.replace(params=state.params.exclude("wte").set("new", torch.ones(1))))
    assert "pipeline=pp" not in str(e.value)


# --- damage --------------------------------------------------------------------------------------


def flip_byte(file, offset_from_end=3):
    data = bytearray(file.read_bytes())
    data[-offset_from_end] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["params.safetensors", "state.safetensors"])
def test_a_flipped_byte_is_refused_with_the_file_name(tmp_path, state_and_step, name):
    state, _ = state_and_step
    path = save(state, tmp_path / "checkpoint-12")
    flip_byte(path / name)
    with pytest.raises(CheckpointError, match=rf"checkpoint-12/{name} is damaged \(sha256"):
        load(path)


def test_damaged_meta_and_missing_files_are_refused(tmp_path, state_and_step):
    state, _ = state_and_step
    path = save(state, tmp_path / "ck", extra={"lr": 0.25})
    meta = path / "meta.json"
    good = meta.read_text()
    meta.write_text(good.replace('"lr": 0.25', '"lr": 0.75'))  # still valid JSON
    with pytest.raises(CheckpointError, match=r"meta.json is damaged \(checksum"):
        load_meta(path)
    meta.write_text(good[:-10])
    with pytest.raises(CheckpointError, match=r"meta.json is damaged \(not valid JSON"):
        load(path)
    meta.unlink()
    with pytest.raises(CheckpointError, match=r"meta.json is missing"):
        load(path)
    meta.write_text(good)
    (path / "state.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"state.safetensors is missing"):
        load(path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load(tmp_path / "nowhere")


# --- no pickle -----------------------------------------------------------------------------------


def test_nothing_is_pickled(tmp_path, state_and_step, monkeypatch):
    state, _ = state_and_step

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    for mod, name in [
        (pickle, "load"),
        (pickle, "loads"),
        (pickle, "dump"),
        (pickle, "dumps"),
        (pickle, "Unpickler"),
        (pickle, "Pickler"),
        (torch, "load"),
        (torch, "save"),
    ]:
        monkeypatch.setattr(mod, name, refuse)
    save_checkpoint(tmp_path, state, extra={"a": 1})
    path = latest_checkpoint(tmp_path)
    assert_states_identical(state, load(path, like=state))
    assert load_meta(path)["extra"] == {"a": 1}


# --- extra must be JSON --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"loader": {"pos": torch.tensor(3)}}, "extra['loader']['pos'] is a Tensor"),
        ({"cfg": {"lr": float("nan")}}, "extra['cfg']['lr'] is nan"),
        ({"ids": {1: "a"}}, "extra['ids'] has the key 1"),
        ({"seen": [1, {2, 3}]}, "extra['seen'][1] is a set"),
    ],
)
def test_non_json_extra_is_refused_with_its_key(tmp_path, state_and_step, extra, named):
    state, _ = state_and_step
    with pytest.raises(TypeError, match=named.replace("[", r"\[").replace("]", r"\]")):
        save(state, tmp_path / "ck", extra=extra)
    assert not any(tmp_path.iterdir())  # nothing written


def test_unsupported_state_is_refused_with_its_key(tmp_path, state_and_step):
    state, _ = state_and_step
    bad = with_fields(
        state, extra=TensorDict({"ema": TensorDict({}, batch_size=[3])}, batch_size=[3])
    )
    with pytest.raises(
        CheckpointError, match=r"state.extra: it is a TensorDict with batch_size \[3\]"
    ):
        save(bad, tmp_path / "ck")
    bad = with_fields(state, extra=TensorDict({"name": NonTensorData("x")}, batch_size=[]))
    with pytest.raises(CheckpointError, match=r"state.extra.name: it is a NonTensorData"):
        save(bad, tmp_path / "ck")
    with pytest.raises(TypeError, match="must be an ft.TrainState"):
        save(state.params, tmp_path / "ck")


def test_a_foreign_directory_is_not_replaced(tmp_path, state_and_step):
    state, _ = state_and_step
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        save(state, tmp_path / "ck")
    assert (tmp_path / "ck" / "notes.txt").read_text() == "mine"


# --- atomicity -----------------------------------------------------------------------------------


def dies_at(monkeypatch, call):
    """Make the ``call``-th ``os.replace`` and every later one fail, as if the process died there
    (nothing after it, the rollback included, reaches the disk)."""
    real, count = os.replace, [0]

    def replace(src, dst):
        count[0] += 1
        if count[0] >= call:
            raise OSError("simulated crash")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("call", [1, 2], ids=["before-aside", "between-renames"])
def test_a_crash_while_replacing_leaves_the_old_checkpoint_loadable(
    tmp_path, state_and_step, monkeypatch, call
):
    old, _ = state_and_step
    new = with_fields(old, params=old.params.apply(lambda t: t + 1), step=old.step + 1)
    path = save(old, tmp_path / "checkpoint-2")
    with monkeypatch.context() as m:
        dies_at(m, call)
        with pytest.raises(OSError, match="simulated crash"):
            save(new, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_states_identical(old, load(path))
        found = latest_checkpoint(tmp_path)
    assert found is not None
    assert_states_identical(old, load(found))
    if call == 2:  # the old version is aside under a temporary name: said so, and used
        assert not path.exists()
        assert any(issubclass(w.category, CheckpointWarning) for w in caught)
    save(new, path)  # the next save recovers and cleans up
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]
    assert_states_identical(new, load(path))


# --- verify_checkpoint and meta_checksum ---------------------------------------------------------


def test_verify_checkpoint_checks_every_file_without_loading(tmp_path, state_and_step):
    state, _ = state_and_step
    path = save(state, tmp_path / "ck", extra={"note": "x"})
    meta = verify_checkpoint(path)
    assert meta == load_meta(path) and meta["extra"] == {"note": "x"}
    flip_byte(path / "state.safetensors")
    with pytest.raises(CheckpointError, match=r"ck/state.safetensors is damaged \(sha256"):
        verify_checkpoint(path)
    with open(path / "params.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match=r"params.safetensors is damaged \(size"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        verify_checkpoint(tmp_path / "nowhere")


def test_meta_checksum_lets_a_tool_edit_meta_json(tmp_path, state_and_step):
    state, _ = state_and_step
    path = save(state, tmp_path / "ck", extra={"lr": 0.25})
    meta = json.loads((path / "meta.json").read_text())
    # independent reference: sha256 of the canonical JSON of every other key
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert meta_checksum(meta) == meta["meta_sha256"] == hashlib.sha256(canonical).hexdigest()
    meta["extra"]["lr"] = 0.5
    (path / "meta.json").write_text(json.dumps(meta))  # edited, checksum stale
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_meta(path)
    meta["meta_sha256"] = meta_checksum(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    assert load_meta(path)["extra"] == {"lr": 0.5}
    assert_states_identical(state, load(path))
