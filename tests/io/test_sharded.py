"""Sharded saves (ftrain.io.sharded): what each rank writes, the index, the memory a save
holds, a rank killed mid-save. The checkpoints come from ``_sharded_ranks.py`` (run once per
session by ``conftest.py``'s ``sharded_checkpoints``).
"""

from __future__ import annotations

import os
import warnings

import ftrain as ft

from _sharded_ranks import OPTS, differing, whole_state


def test_sharded_checkpoints_load_whole_on_one_process(sharded_checkpoints):
    """A checkpoint of 2 or 3 ranks (uneven rows) loads whole on one process, with or without
    ``like``, equal to the state saved whole; the index records the pieces and placements."""
    root, _ = sharded_checkpoints
    for opt in OPTS:
        reference = ft.load(f"{root}/{opt}-whole")
        keys = reference.to_tensordict().flatten_keys(".").keys()
        assert "extra.ema.wte.weight" in keys and "extra.loss_scale.scale" in keys
        for src in ("fsdp2", "fsdp3", "ddp-2", "zero1-2", "zero2-2"):
            assert differing(ft.load(f"{root}/{opt}-{src}"), reference) == [], (opt, src)
            like = whole_state(opt, steps=0)
            assert differing(ft.load(f"{root}/{opt}-{src}", like=like), reference) == []
    meta = ft.load_meta(f"{root}/adamw-fsdp3")
    assert meta["format_version"] == 2 and meta["world_size"] == 3
    entry = meta["index"]["params.wte.weight"]
    assert entry["placements"] == [["shard", 0]] and entry["mesh"] == [3]
    assert [p["offsets"] for p in entry["pieces"]] == [[0, 0], [22, 0], [44, 0]]
    assert [p["shape"][0] for p in entry["pieces"]] == [22, 22, 20]
    assert meta["index"]["step"]["pieces"] == [
        {"file": "rank-00000-of-00003.safetensors", "key": "step", "offsets": [], "shape": []}
    ]
    names = sorted(os.listdir(f"{root}/adamw-fsdp3"))
    assert names == ["meta.json"] + [f"rank-0000{r}-of-00003.safetensors" for r in range(3)]


def test_a_sharded_save_holds_only_this_ranks_pieces(sharded_checkpoints):
    """Measured with ``track_allocations``: a blocking sharded save of a CPU state allocates
    (almost) nothing; a background one copies this rank's shards (plus the few whole tensors
    rank 0 writes); gathering the state whole to save it (a save unaware of shards) costs the whole state."""
    _, found = sharded_checkpoints
    for name in ("two0", "two1"):
        for opt, m in found[name]["memory"].items():
            assert m["local"] < 0.75 * m["whole"], (name, opt, m)  # fsdp: about half each
            assert m["blocking"] <= m["biggest"], (name, opt, m)
            assert m["background"] <= m["local"] + m["biggest"], (name, opt, m)
            assert m["background"] >= 0.9 * m["local"], (name, opt, m)  # the copy is counted
            assert m["gathered"] >= m["whole"] - m["local"], (name, opt, m)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(sharded_checkpoints):
    root, _ = sharded_checkpoints
    run = f"{root}/run"
    leftovers = [n for n in os.listdir(run) if ".tmp-" in n]
    assert len(leftovers) == 1  # the unfinished save: never committed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = ft.latest_checkpoint(run)
    assert latest.name == "checkpoint-2"
    assert any("interrupted" in str(w.message) for w in caught)
    assert differing(ft.load(latest), ft.load(f"{root}/adamw-whole")) == []
