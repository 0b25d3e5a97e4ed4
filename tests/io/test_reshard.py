"""Resharding loads (ftrain.io.reshard): checkpoints of 2 ranks (fsdp, zero1) and of one process,
loaded on 2 and 3 ranks under every strategy, bit for bit; bad input refused with the file or key
named. The checkpoints come from ``_sharded_ranks.py`` (``conftest.py``'s ``sharded_checkpoints``).
"""

from __future__ import annotations

import json
import shutil

import pytest

import ftrain as ft
import ftrain.io
from ftrain.io import meta as io_meta
from ftrain.io.reshard import within

from _tiny import tiny_gpt


def test_fsdp_checkpoint_of_2_ranks_loads_on_2_and_3_under_every_strategy(sharded_checkpoints):
    """Saved under fsdp on 2 ranks (and ddp, zero1, zero2, and whole by one process), loaded with ``like`` laid
    out by each strategy on 2 and 3 ranks: the layout is ``like``'s and ``unshard_state`` of the
    result equals the saved state bit for bit, for adamw, adamw8bit and adafactor states (ema
    and loss scale included)."""
    root, found = sharded_checkpoints
    checked = 0
    for name in ("two0", "two1", "three0", "three1", "three2"):
        for what, res in found[name]["loads"].items():
            assert res == {"differs": [], "layout": True}, (name, what)
            checked += 1
    # 3 optimizers x (3 sources on 2 ranks x 2 ranks + 4 sources on 3 ranks x 3 ranks) x 4
    assert checked == 3 * (3 * 2 + 4 * 3) * 4


def test_index_and_shards_that_disagree_are_refused_naming_file_and_key(
    sharded_checkpoints, tmp_path
):

    root, _ = sharded_checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(f"{root}/adamw-fsdp2", bad)

    def shrink(meta):
        meta["index"]["params.wte.weight"]["pieces"][1]["shape"] = [31, 32]

    _edit_meta(bad, shrink)
    with pytest.raises(ft.CheckpointError, match=r"rank-00001-of-00002.*'params.wte.weight'.*"
                       r"disagree"):  # fmt: skip
        ft.load(bad)
    shutil.rmtree(bad)
    shutil.copytree(f"{root}/adamw-fsdp2", bad)
    _edit_meta(bad, lambda m: m["index"]["params.wte.weight"]["pieces"].pop())
    with pytest.raises(ft.CheckpointError, match=r"pieces of 'params.wte.weight' do not cover"):
        ft.load(bad)


def test_a_missing_or_damaged_shard_is_refused_naming_it(sharded_checkpoints, tmp_path):

    root, _ = sharded_checkpoints
    bad = tmp_path / "bad"
    shutil.copytree(f"{root}/adamw-fsdp2", bad)
    (bad / "rank-00001-of-00002.safetensors").unlink()
    with pytest.raises(ft.CheckpointError, match=r"rank-00001-of-00002.safetensors is missing"):
        ft.load(bad)
    with pytest.raises(ft.CheckpointError, match=r"rank-00001-of-00002.safetensors is missing"):
        ftrain.io.verify_checkpoint(bad)
    shutil.copyfile(f"{root}/adamw-fsdp2/rank-00000-of-00002.safetensors",
                    bad / "rank-00001-of-00002.safetensors")  # fmt: skip
    with pytest.raises(ft.CheckpointError, match=r"rank-00001-of-00002.safetensors is damaged"):
        ft.load(bad)


def test_a_like_state_of_another_model_is_refused_naming_the_key(sharded_checkpoints):
    root, _ = sharded_checkpoints
    other = ft.TrainState.create(ft.params_of(tiny_gpt(d_model=16)), ft.optim.adamw(1e-2))
    with pytest.raises(ft.CheckpointError, match=r"params.wte.weight: float32\[64, 32\] in "
                       r"checkpoint, float32\[64, 16\] in `like`"):  # fmt: skip
        ft.load(f"{root}/adamw-fsdp2", like=other)


def _edit_meta(path, edit) -> None:
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    meta["meta_sha256"] = io_meta.meta_checksum(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_a_layout_split_along_another_dimension_loads_either_way(sharded_checkpoints):
    """The embedding split by columns (``Shard(1)``, as tensor parallelism splits it) is saved as
    column pieces of the same format and loads back as columns, or as fsdp's rows, bit for bit."""
    _, found = sharded_checkpoints
    for rank in ("two0", "two1"):
        got = found[rank]["columns"]
        assert got["placements"] == [["shard", 1]] and got["offsets"] == [[0, 0], [0, 16]]
        assert got["same layout"] and got["differs"] == [] and got["differs as rows"] == []


def test_a_parts_tree_is_cut_from_the_saved_one_in_its_order():
    """``within``: the saved tree's entries that a part (a pipeline stage's ``like``) has, in the
    saved order whatever the part's, empty TensorDicts kept."""
    saved = {"params": {"a": "f32[1]", "b": "f32[2]", "c": "f32[3]"},
             "opt_state": {"0": {}, "1": {"mu": {"a": "f32[1]", "b": "f32[2]", "c": "f32[3]"}}},
             "step": "int64[]"}  # fmt: skip
    part = {"step": "int64[]", "params": {"c": "f32[3]", "a": "f32[1]"},
            "opt_state": {"1": {"mu": {"c": "f32[3]"}}, "0": {}}}  # fmt: skip
    got = within(saved, part)
    assert json.dumps(got) == json.dumps(
        {"params": {"a": "f32[1]", "c": "f32[3]"},
         "opt_state": {"0": {}, "1": {"mu": {"c": "f32[3]"}}}, "step": "int64[]"}
    )  # fmt: skip
