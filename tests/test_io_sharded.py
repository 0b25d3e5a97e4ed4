"""Sharded checkpoints (ftrain.io.sharded, ftrain.io.reshard): saved by 2 ranks under fsdp, loaded
on 1, 2 and 3 ranks under every strategy, bit for bit, for adamw, adamw8bit and adafactor states
with an ema and a loss scale; the memory of a sharded save; a rank killed mid-save; bad input.

Two process launches (2 ranks, then 3) do every check that needs ranks; each writes what it found
to a JSON file and the tests here read it.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import ftrain as ft
import ftrain.io
from ftrain import tree
from ftrain.distributed import (
    STRATEGIES,
    DistributedError,
    local_bytes,
    run_distributed,
    shard_state,
    unshard_state,
)
from ftrain.io import meta as io_meta
from ftrain.io import tensorfile
from ftrain.testing import track_allocations

from _tiny import lm_batch, lm_loss, tiny_gpt

OPTS = ("adamw", "adamw8bit", "adafactor")


def whole_state(opt_name: str, steps: int = 2) -> ft.TrainState:
    """A tiny GPT's state after ``steps`` steps (0: fresh), with an ema of the params and an fp16
    loss scale in ``state.extra``; the same on every process (one thread, same seed)."""
    opt = {
        "adamw": ft.optim.adamw(1e-2),
        "adamw8bit": ft.optim.adamw8bit(1e-2),
        "adafactor": ft.optim.adafactor(1e-2),
    }[opt_name]
    model = tiny_gpt()
    step = ft.ema(ft.autocast(ft.train_step(lm_loss(model), opt), torch.float16), 0.9)
    state = step.init_extra(ft.TrainState.create(ft.params_of(model), opt, seed=0))
    for i in range(steps):
        state, _ = step(state, lm_batch(4, seed=i))
    return state


def differing(a: ft.TrainState, b: ft.TrainState) -> list[str]:
    """The dotted keys whose tensors are not bitwise equal (or whose trees differ)."""
    ta = a.to_tensordict().flatten_keys(".")
    tb = b.to_tensordict().flatten_keys(".")
    if sorted(ta.keys()) != sorted(tb.keys()):
        return ["<keys differ>"]
    return [
        k
        for k in ta.keys()
        if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k].view(-1), tb[k].view(-1))
    ]


def layouts(state: ft.TrainState) -> list:
    """The placement of every leaf (None for a plain tensor)."""
    return [
        tuple(map(str, t.placements)) if hasattr(t, "placements") else None
        for t in tree.leaves(state.to_tensordict())
    ]


def _report(root: str, name: str, found: dict) -> None:
    with open(os.path.join(root, f"{name}-rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(found, f)


def _on_two(root: str) -> None:
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    found: dict = {"loads": {}, "memory": {}}
    for opt in OPTS:
        whole = whole_state(opt)
        if rank == 0:
            ft.save(whole, f"{root}/{opt}-whole")  # the reference: one process, whole tensors
        fsdp = shard_state(whole, "fsdp")
        whole_bytes = local_bytes(whole)
        with track_allocations() as blocking:
            ft.save(fsdp, f"{root}/{opt}-fsdp2")
        with track_allocations() as copying:
            handle = ft.save(fsdp, f"{root}/{opt}-fsdp2-bg", blocking=False)
        handle.wait()
        with track_allocations() as gathering:  # the old way: gather whole, then save
            ft.save(unshard_state(fsdp), f"{root}/{opt}-gathered-{rank}")
        biggest = max(t.numel() * t.element_size() for t in tree.leaves(whole.to_tensordict()))
        found["memory"][opt] = {
            "blocking": blocking.peak,
            "background": copying.peak,
            "gathered": gathering.peak,
            "local": local_bytes(fsdp),
            "whole": whole_bytes,
            "biggest": biggest,
        }
        ft.save(shard_state(whole, "zero1"), f"{root}/{opt}-zero1-2")
        torch.distributed.barrier()  # the reference is on disk
        fresh = whole_state(opt, steps=0)
        for src in ("whole", "fsdp2", "fsdp2-bg"):
            for strategy in STRATEGIES:
                like = shard_state(fresh, strategy)
                got = ft.load(f"{root}/{opt}-{src}", like=like)
                found["loads"][f"{opt} {src} -> 2 {strategy}"] = {
                    "differs": differing(unshard_state(got), whole),
                    "layout": layouts(got) == layouts(like),
                }
    _report(root, "two", found)


def _on_three(root: str) -> None:
    torch.set_num_threads(1)
    found: dict = {"loads": {}}
    for opt in OPTS:
        reference = ft.load(f"{root}/{opt}-whole")
        fresh = whole_state(opt, steps=0)
        for src in ("fsdp2", "zero1-2"):
            for strategy in STRATEGIES:
                like = shard_state(fresh, strategy)
                got = ft.load(f"{root}/{opt}-{src}", like=like)
                found["loads"][f"{opt} {src} -> 3 {strategy}"] = {
                    "differs": differing(unshard_state(got), reference),
                    "layout": layouts(got) == layouts(like),
                }
        ft.save(shard_state(reference, "fsdp"), f"{root}/{opt}-fsdp3")  # uneven: 22/22/20 rows
    _report(root, "three", found)
    # A rank killed while writing its file: the run folder keeps its previous checkpoint.
    state = shard_state(ft.load(f"{root}/adamw-whole"), "fsdp")
    ft.save_checkpoint(f"{root}/run", state)
    if torch.distributed.get_rank() == 1:
        real = tensorfile.write

        def half_then_die(file, tensors, metadata=None):
            real(file, tensors, metadata)
            with open(file, "r+b") as f:
                f.truncate(os.path.getsize(file) // 2)
            os._exit(9)

        tensorfile.write = half_then_die
    ft.save_checkpoint(f"{root}/run", state.replace(step=state.step + 1))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoints and findings of the 2-rank and 3-rank launches."""
    root = str(tmp_path_factory.mktemp("sharded"))
    run_distributed(_on_two, 2, root)
    with pytest.raises(DistributedError, match="rank 1 ---\nthe process exited with code 9"):
        run_distributed(_on_three, 3, root, timeout=240)
    found = {}
    for name, world in (("two", 2), ("three", 3)):
        for r in range(world):
            with open(os.path.join(root, f"{name}-rank{r}.json")) as f:
                found[f"{name}{r}"] = json.load(f)
    return root, found


def test_fsdp_checkpoint_of_2_ranks_loads_on_2_and_3_under_every_strategy(saved):
    """Saved under fsdp on 2 ranks (and zero1, and whole by one process), loaded with ``like`` laid
    out by each strategy on 2 and 3 ranks: the layout is ``like``'s and ``unshard_state`` of the
    result equals the saved state bit for bit, for adamw, adamw8bit and adafactor states (ema
    and loss scale included)."""
    root, found = saved
    checked = 0
    for name in ("two0", "two1", "three0", "three1", "three2"):
        for what, res in found[name]["loads"].items():
            assert res == {"differs": [], "layout": True}, (name, what)
            checked += 1
    # 3 optimizers x (3 sources on 2 ranks x 2 ranks + 2 sources on 3 ranks x 3 ranks) x 4
    assert checked == 3 * (3 * 2 + 2 * 3) * 4


def test_sharded_checkpoints_load_whole_on_one_process(saved):
    """A checkpoint of 2 or 3 ranks (uneven rows) loads whole on one process, with or without
    ``like``, equal to the state saved whole; the index records the pieces and placements."""
    root, _ = saved
    for opt in OPTS:
        reference = ft.load(f"{root}/{opt}-whole")
        assert "extra.ema" in reference.to_tensordict().flatten_keys(".").keys() or any(
            k.startswith("extra.ema") for k in reference.to_tensordict().flatten_keys(".").keys()
        )
        for src in ("fsdp2", "fsdp3", "zero1-2"):
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


def test_a_sharded_save_holds_only_this_ranks_pieces(saved):
    """Measured with ``track_allocations``: a blocking sharded save of a CPU state allocates
    (almost) nothing; a background one copies this rank's shards (plus the few whole tensors
    rank 0 writes); gathering the state whole to save it, as before, costs the whole state."""
    _, found = saved
    for name in ("two0", "two1"):
        for opt, m in found[name]["memory"].items():
            assert m["local"] < 0.75 * m["whole"], (name, opt, m)  # fsdp: about half each
            assert m["blocking"] <= m["biggest"], (name, opt, m)
            assert m["background"] <= m["local"] + m["biggest"], (name, opt, m)
            assert m["background"] >= 0.9 * m["local"], (name, opt, m)  # the copy is counted
            assert m["gathered"] >= m["whole"] - m["local"], (name, opt, m)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(saved):
    root, _ = saved
    run = f"{root}/run"
    leftovers = [n for n in os.listdir(run) if ".tmp-" in n]
    assert len(leftovers) == 1  # the unfinished save: never committed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = ft.latest_checkpoint(run)
    assert latest.name == "checkpoint-2"
    assert any("interrupted" in str(w.message) for w in caught)
    assert differing(ft.load(latest), ft.load(f"{root}/adamw-whole")) == []


def test_background_save_commits_the_state_of_the_call(tmp_path):
    """``blocking=False`` copies the state first: changing it in place after the call does not
    change what is written; ``wait()`` returns the path; the error of a failed write is raised
    by ``wait()``."""
    state = whole_state("adamw", steps=1)
    expected = ft.load(ft.save(state, tmp_path / "ref"))
    handle = ft.save(state, tmp_path / "bg", blocking=False)
    for t in tree.leaves(state.params):
        t.add_(1.0)
    assert handle.wait() == tmp_path / "bg"
    assert differing(ft.load(tmp_path / "bg"), expected) == []
    (tmp_path / "file").write_text("not a checkpoint dir")
    bad = ft.save(expected, tmp_path / "file", blocking=False)
    with pytest.raises(ft.CheckpointError, match="not a directory"):
        bad.wait()


def test_saver_waits_for_the_previous_save_and_raises_its_error(tmp_path):
    state = whole_state("adamw", steps=1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    saver = ft.Saver()
    saver.save(state, tmp_path / "taken")  # refused in the background: holds a foreign file
    with pytest.raises(ft.CheckpointError, match="refusing to replace"):
        saver.save(state, tmp_path / "next")  # the next save raises the previous one's error
    with ft.Saver() as saver:
        for n in (1, 2, 3):
            saver.save_checkpoint(tmp_path / "run", state.replace(step=torch.tensor(n)), keep=2)
    assert [p.name for p in ft.list_checkpoints(tmp_path / "run")] == [
        "checkpoint-2",
        "checkpoint-3",
    ]


# --- bad input -----------------------------------------------------------------------------------


def _edit_meta(path, edit) -> None:
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    meta["meta_sha256"] = io_meta.meta_checksum(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_index_and_shards_that_disagree_are_refused_naming_file_and_key(saved, tmp_path):
    import shutil

    root, _ = saved
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


def test_a_missing_or_damaged_shard_is_refused_naming_it(saved, tmp_path):
    import shutil

    root, _ = saved
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


def test_a_like_state_of_another_model_is_refused_naming_the_key(saved):
    root, _ = saved
    other = ft.TrainState.create(ft.params_of(tiny_gpt(d_model=16)), ft.optim.adamw(1e-2))
    with pytest.raises(ft.CheckpointError, match=r"params.wte.weight: float32\[64, 32\] in "
                       r"checkpoint, float32\[64, 16\] in `like`"):  # fmt: skip
        ft.load(f"{root}/adamw-fsdp2", like=other)
