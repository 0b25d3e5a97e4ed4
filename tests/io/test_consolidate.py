"""``ft.consolidate`` and ``ftrain consolidate`` (ftrain.io.consolidate): whole-tensor params from a
sharded checkpoint, one file or Hugging Face's sharded layout, loadable with load_state_dict."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch

import ftrain as ft
from ftrain.app.cli import main
from ftrain.internals.units import parse_bytes

from _tiny import tiny_gpt


def _params(root, opt="adamw"):
    params = ft.load(f"{root}/{opt}-whole").params.flatten_keys(".")
    return {k: params[k] for k in params.keys()}


def test_consolidate_a_sharded_checkpoint_into_one_state_dict(sharded_checkpoints, tmp_path):
    root, _ = sharded_checkpoints
    files = ft.consolidate(f"{root}/adamw-fsdp3", tmp_path / "out")
    assert files == [tmp_path / "out" / "model.safetensors"]
    sd = safetensors.torch.load_file(files[0])
    want = _params(root)
    assert sd.keys() == want.keys()
    assert all(torch.equal(sd[k], want[k]) for k in want)
    model = tiny_gpt(seed=1)
    model.load_state_dict(sd)  # strict: every key of the module, nothing else
    assert all(torch.equal(p, want[k]) for k, p in model.named_parameters())


def test_consolidate_past_the_size_limit_writes_hugging_faces_sharded_layout(
    sharded_checkpoints, tmp_path
):
    root, _ = sharded_checkpoints
    out = tmp_path / "hf"
    files = ft.consolidate(f"{root}/adamw-fsdp2", out, max_shard_size="20KB")
    n = len(files)
    assert n > 2 and [f.name for f in files] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    want = _params(root)
    assert index["weight_map"].keys() == want.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in want.values())
    got = {}
    for f in files:
        part = safetensors.torch.load_file(f)
        assert all(index["weight_map"][k] == f.name for k in part)
        # at most the limit, unless one tensor alone is larger
        assert sum(t.numel() * 4 for t in part.values()) <= 20_000 or len(part) == 1
        got.update(part)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(os.listdir(out)) == sorted(
        [f.name for f in files] + ["model.safetensors.index.json"]
    )


def test_ftrain_consolidate_reads_a_run_folders_newest_checkpoint(sharded_checkpoints, tmp_path,
                                                                   capsys):  # fmt: skip
    root, _ = sharded_checkpoints
    out = tmp_path / "cli"
    with pytest.warns(ft.io.CheckpointWarning, match="interrupted"):  # the killed save's leftover
        assert main(["consolidate", "--run", f"{root}/run", "--out", str(out)]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    sd = safetensors.torch.load_file(out / "model.safetensors")
    assert all(torch.equal(sd[k], v) for k, v in _params(root).items())
    with pytest.raises(SystemExit) as e:
        main(["consolidate", "--run", f"{root}/run", "--out", str(out), "--max-shard-size", "x"])
    assert e.value.code == 2
    assert "max_shard_size='x'" in capsys.readouterr().err
    assert main(["consolidate", "--run", str(tmp_path / "nothing"), "--out", str(out)]) == 1


def test_max_shard_size_is_read_by_the_one_byte_size_parser():
    def parse_size(size):
        return parse_bytes(size, "max_shard_size")

    assert parse_size(1000) == parse_size("1000") == parse_size("1KB") == 1000
    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("5gb") == 5 * 10**9
    for bad in ("", "5 apples", 0, "-1GB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_a_lora_checkpoint_is_refused_with_the_command_that_merges(tmp_path, capsys):
    from ftrain.transforms.lora import split_base

    model = tiny_gpt()
    lora = ft.lora(model, rank=2, targets=["attn.qkv"])
    state = lora.init_state(ft.params_of(model), ft.optim.adamw(1e-3))
    ft.save(split_base(state)[0], tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"LoRA run's checkpoint.*ftrain export --run .*ckpt"):
        ft.consolidate(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:
        main(["consolidate", "--run", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "--adapter for a PEFT adapter folder" in capsys.readouterr().err
