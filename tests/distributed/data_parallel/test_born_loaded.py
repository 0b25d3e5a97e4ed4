"""ftrain.distributed.data_parallel.born_loaded: saved weights read as each process's fsdp rows
(a template with its params on meta, ``ftrain.models.empty_causal_lm``) equal, bitwise, the
whole load then ``ft.shard_state``; no tensor is read whole. Tiny GPT-2 and Llama (rotary
buffers: the template's stay real), saved in fp32 and bf16; 2 gloo processes, one
``run_distributed`` call."""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from ftrain.distributed import NotLaidOut, local_bytes, shard_state, sharded_params_from_files
from ftrain.distributed.dtensor import local
from ftrain.models import empty_causal_lm, load_causal_lm
from ftrain.models.hf import weight_files
from ftrain.testing import run_distributed, track_allocations

from _hf import tiny_hf_dir

pytest.importorskip("transformers")


def _folders(root):
    from transformers import AutoModelForCausalLM

    out = {kind: tiny_hf_dir(root / kind, kind) for kind in ("gpt2", "llama")}
    bf16 = root / "llama-bf16"  # saved in bf16: both ways convert to float32
    AutoModelForCausalLM.from_pretrained(out["llama"], dtype=torch.bfloat16).save_pretrained(bf16)
    out["llama-bf16"] = bf16
    return out


def _on_each_rank(folders):
    sgd = ft.optim.sgd(0.1)
    out = {}
    for kind, folder in folders.items():
        template = empty_causal_lm(folder)
        with track_allocations() as mem:
            mine = sharded_params_from_files(template, weight_files(folder))
        whole = ft.TrainState.create(ft.params_of(load_causal_lm(folder)), sgd)
        want = shard_state(whole, "fsdp").params
        same = list(ft.tree.paths(mine)) == list(ft.tree.paths(want)) and all(
            tuple(a.placements) == tuple(b.placements) and torch.equal(local(a), local(b))
            for a, b in zip(ft.tree.leaves(mine), ft.tree.leaves(want))
        )
        buffers_real = all(not b.is_meta for b in template.buffers())
        out[kind] = (same, mem.peak, local_bytes(ft.TrainState.create(mine, sgd)), buffers_real)
    try:
        sharded_params_from_files(empty_causal_lm(folders["gpt2"]), weight_files(folders["llama"]))
    except NotLaidOut as e:
        out["wrong files"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_on_each_rank, 2, _folders(tmp_path_factory.mktemp("hf")))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-bf16"])
def test_each_process_reads_its_rows_bitwise_the_whole_load_sharded(ranks, kind):
    for rank in ranks:
        same, peak, shard, buffers_real = rank[kind]
        assert same and buffers_real
        # its rows (one tensor's at a time in flight): never the model (2 shards here)
        assert peak <= 1.2 * shard, (peak, shard)


def test_files_of_another_model_are_refused_naming_the_parameter(ranks):
    for rank in ranks:
        assert "no tensor named 'transformer.wpe.weight'" in rank["wrong files"]
