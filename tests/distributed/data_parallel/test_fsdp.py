"""ftrain.distributed.data_parallel.fsdp: under ``ft.shard(step, "fsdp")`` whole parameters exist
one block at a time (track_gathered measures it), and the tracker's own accounting.

The 2-rank results come from the session's one run (``two_ranks`` in conftest.py).
"""

from __future__ import annotations

import gc

import pytest
import torch

import ftrain as ft
from ftrain.distributed import track_gathered

from _tiny import chain_step
from _two_ranks import PREFETCH_CONFIGS, gpt


def _sizes(model, world=2):
    """Bytes of one block's params, of the params outside the blocks, of all; and of the flat
    receive buffer of one block's gather (each tensor's rows padded to ``world`` equal parts)."""
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    rest = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    total = sum(p.numel() * 4 for p in model.parameters())
    per_rank = sum(-(-p.shape[0] // world) * p[0].numel() * 4 for p in model.blocks[0].parameters())
    return block, rest, total, world * per_rank


@pytest.mark.parametrize("name", ["fsdp", "fsdp+checkpoint"])
def test_fsdp_holds_the_shard_plus_one_block(two_ranks, name):
    """Without prefetch, the whole params alive at any moment: the params outside the blocks
    plus one block."""
    block, rest, total, _ = _sizes(gpt(n_layer=4))
    for r in two_ranks:
        peak, gathers = r["peak", name, False]
        assert gathers > 0
        assert peak <= rest + block, (peak, rest, block)
        assert peak < 0.35 * total


@pytest.mark.parametrize("name", ["fsdp", "fsdp+checkpoint"])
def test_prefetch_holds_one_block_more(two_ranks, name):
    """With prefetch, the next block's gather buffer is alive while a block computes: more than
    one block (so the gathers did start early), and about one flat buffer of a block more than
    without (two at most: gloo's worker thread may let go of a finished gather's buffer a moment
    after it is waited)."""
    block, rest, total, flat = _sizes(gpt(n_layer=4))
    for r in two_ranks:
        peak, _ = r["peak", name, True]
        assert rest + block < peak <= rest + block + 2 * flat, (peak, rest, block, flat)
        assert rest + block + 2 * flat < total  # the bound means something: 4 blocks


@pytest.mark.parametrize("name", list(PREFETCH_CONFIGS))
def test_prefetch_changes_no_bit(two_ranks, name):
    """The collectives started early (async all-gathers and reduce-scatters) give the same bits
    as the blocking ones: params, optimizer state and loss after 3 steps, on each rank."""
    for r in two_ranks:
        off, on = r["prefetch", name]
        for part in ("params", "opt_state"):
            assert off[part].keys() == on[part].keys()
            for k in off[part]:
                assert torch.equal(off[part][k], on[part][k]), (name, part, k)
        assert torch.equal(off["loss"], on["loss"])


def test_the_tracker_counts_the_bytes_alive_at_the_peak():
    """``peak`` is the most bytes of tracked tensors alive at once: a tensor freed before the
    next one is made no longer counts; ``gathers`` counts every tensor."""
    with track_gathered() as t:
        a = torch.zeros(100)  # 400 bytes
        t.add(a)
        b = torch.zeros(50, dtype=torch.float64)  # 400 bytes
        t.add(b)
        assert t.peak == 800
        del a
        gc.collect()
        c = torch.zeros(10)  # 40 bytes; b is still alive
        t.add(c)
    assert t.peak == 800 and t.gathers == 3
    assert sum(n for ref, n in t.alive if not ref.expired()) == 440


def test_nothing_is_gathered_outside_fsdp():
    step, state, _ = chain_step(2)
    with track_gathered() as t:
        ft.accumulate(ft.checkpoint(step), 2)(state, torch.randn(4, 16))
    assert (t.peak, t.gathers) == (0, 0)
