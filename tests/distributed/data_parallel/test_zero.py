"""ftrain.distributed.data_parallel.zero: shard_state lays a state out per strategy and keeps that
layout, unshard/unshard_state gather it back whole (to save and resume on any world size),
local_bytes counts what one process holds.

The 2-rank results come from the session's one run (``two_ranks`` in conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain import tree
from ftrain.distributed import STRATEGIES, local_bytes, shard_state, unshard, unshard_state

from _two_ranks import CONFIGS, RESUMED, gpt, sgd


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_state_keeps_the_layout_shard_state_gave_it(two_ranks, name, strategy):
    """After several steps the optimizer state is still laid out as shard_state laid it out:
    plain under ddp, Shard(0) rows otherwise. (adafactor's new column statistic is a reduction
    over the shards, which DTensor returns Replicate(); the step puts it back.)"""
    expected = {"plain"} if strategy == "ddp" else {"(Shard(dim=0),)"}
    for r in two_ranks:
        assert r[name, strategy]["layouts"] == expected


def test_optimizer_state_and_params_bytes_per_rank(two_ranks):
    """zero1/zero2/fsdp hold about half the optimizer state per rank; fsdp half the params."""
    for r in two_ranks:
        ddp = r["sgd", "ddp"]
        for strategy in STRATEGIES:
            if strategy == "ddp":
                continue
            got = r["sgd", strategy]
            opt_ratio = got["opt_bytes"] / ddp["opt_bytes"]
            param_ratio = got["param_bytes"] / ddp["param_bytes"]
            assert 0.4 < opt_ratio < 0.6, (strategy, opt_ratio)
            assert (0.4 < param_ratio < 0.6) if strategy == "fsdp" else param_ratio == 1.0


@pytest.mark.parametrize(("name", "strategy"), RESUMED)
def test_save_then_resume_continues_exactly(two_ranks, name, strategy):
    for r in two_ranks:
        resumed, straight = r["resume", name, strategy]
        for part in ("params", "opt_state"):
            for k in straight[part]:
                assert torch.equal(resumed[part][k], straight[part][k]), k


def test_a_sharded_checkpoint_loads_whole_in_one_process(two_ranks):
    """The checkpoint holds whole tensors: it loads without a process group, and shard_state
    would lay it out for any number of processes."""
    state = ft.load(f"{two_ranks[0]['tmp']}/adamw-fsdp")
    assert all(type(t) is torch.Tensor for t in tree.leaves(state.params))
    assert int(state.step) == 2
    assert tree.to_flat(state.params).keys() == tree.to_flat(ft.params_of(gpt())).keys()


def test_params_that_differ_between_processes_are_refused(two_ranks):
    for r in two_ranks:
        assert "differ between processes" in r["errors"]["params differ"]


# -- one process ---------------------------------------------------------------------------------


def test_unshard_and_local_bytes_of_plain_trees_need_no_process_group():
    """unshard of a plain tree is that tree; local_bytes counts every tensor's bytes (fields of a
    TrainState added up)."""
    params = ft.params_of(gpt())
    assert unshard(params) is params
    assert local_bytes(params) == sum(t.numel() * 4 for t in tree.leaves(params))
    state = ft.TrainState.create(params, ft.optim.adamw(1e-3))
    extra = TensorDict({"half": torch.zeros(3, dtype=torch.bfloat16)}, [])
    state = state.replace(extra=extra)
    by_hand = sum(
        t.numel() * t.element_size()
        for field in (state.params, state.opt_state, state.extra)
        for t in tree.leaves(field)
    )
    assert local_bytes(state) == by_hand == local_bytes(params) + local_bytes(state.opt_state) + 6


def test_shard_state_without_a_process_group_says_how_to_launch():
    state = ft.TrainState.create(ft.params_of(gpt()), sgd())
    with pytest.raises(RuntimeError, match=r"ft\.shard_state.*torchrun.*run_distributed"):
        shard_state(state, "zero1")


def test_shard_state_and_unshard_state_check_their_arguments():
    state = ft.TrainState.create(ft.params_of(gpt()), sgd())
    with pytest.raises(ValueError, match=r"strategy='zero3'.*'ddp', 'zero1', 'zero2', 'fsdp'"):
        shard_state(state, "zero3")
    with pytest.raises(TypeError, match=r"unshard_state\(state\): expected an ft.TrainState"):
        unshard_state(state.params)
