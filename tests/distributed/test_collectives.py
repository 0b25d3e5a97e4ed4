"""ftrain.distributed.collectives: the Layout math in one process, against torch.chunk (how DTensor
splits a ``Shard(0)`` tensor) and sums done by hand.

The two collectives a Layout makes are replaced by what they compute (every rank's send buffer,
concatenated; or summed and cut per rank), so the packing into flat segments and the unpacking
are checked for every rank without processes.
"""

from __future__ import annotations

import pytest
import torch

from ftrain.distributed import collectives
from ftrain.distributed.collectives import Layout, by_dtype, layout

SHAPES = [(5, 3), (2,), (1, 4), (7, 2, 2)]


def fulls(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def chunk_of(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows as DTensor's Shard(0) holds them: torch.chunk's piece, or 0 rows."""
    pieces = torch.chunk(t, world)
    return pieces[rank] if rank < len(pieces) else t[t.shape[0] :]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_each_rank_holds_the_rows_torch_chunk_gives_it(world):
    lay = Layout(tuple(torch.Size(s) for s in SHAPES), world)
    ts = fulls()
    for rank in range(world):
        mine = lay.local(ts, rank)
        for t, piece in zip(ts, mine):
            assert torch.equal(piece, chunk_of(t, world, rank))
            # a view of the whole tensor: no copy
            assert piece.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert sum(lay.sizes[rank]) == sum(p.numel() for p in mine)
    # every segment padded to the longest one, so that a group moves in one collective
    assert lay.segment == max(sum(s) for s in lay.sizes)
    assert all(sum(s) + pad == lay.segment for s, pad in zip(lay.sizes, lay.pads))
    assert sum(sum(s) for s in lay.sizes) == sum(t.numel() for t in ts)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_all_gather_puts_every_ranks_pieces_back_whole(world, monkeypatch):
    lay = Layout(tuple(torch.Size(s) for s in SHAPES), world)
    ts = fulls()
    sends = []

    def capture(out, send, group):
        sends.append(send.clone())

    monkeypatch.setattr(collectives, "all_gather_into", capture)
    for rank in range(world):
        lay.all_gather(lay.local(ts, rank), rank, group=None)
    assert all(s.numel() == lay.segment for s in sends)

    def gathered(out, send, group):  # what all-gather computes: every rank's send, in order
        out.copy_(torch.cat(sends))

    monkeypatch.setattr(collectives, "all_gather_into", gathered)
    for rank in range(world):
        whole = lay.all_gather(lay.local(ts, rank), rank, group=None)
        for got, want in zip(whole, ts):
            assert torch.equal(got, want)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_reduce_scatter_gives_each_rank_its_rows_of_the_sum(world, monkeypatch):
    lay = Layout(tuple(torch.Size(s) for s in SHAPES), world)
    per_rank = [fulls(seed) for seed in range(world)]  # each rank's whole tensors
    sends = []

    def capture(out, send, group):
        sends.append(send.clone())

    monkeypatch.setattr(collectives, "reduce_scatter_into", capture)
    for rank in range(world):
        lay.reduce_scatter(per_rank[rank], rank, group=None)
    assert all(s.numel() == world * lay.segment for s in sends)

    def scattered(out, send, group):  # what reduce-scatter computes for the rank called below
        seg = lay.segment
        out.copy_(sum(s[rank * seg : (rank + 1) * seg] for s in sends))

    monkeypatch.setattr(collectives, "reduce_scatter_into", scattered)
    total = [sum(ts[i] for ts in per_rank) for i in range(len(SHAPES))]
    for rank in range(world):
        got = lay.reduce_scatter(per_rank[rank], rank, group=None)
        for g, t in zip(got, total):
            torch.testing.assert_close(g, chunk_of(t, world, rank), rtol=1e-6, atol=1e-6)


def test_layout_is_a_memo_of_shapes_and_world():
    shapes = tuple(torch.Size(s) for s in SHAPES)
    assert layout(shapes, 2) is layout(tuple(torch.Size(s) for s in SHAPES), 2)
    assert layout(shapes, 3) is not layout(shapes, 2)
    assert layout(shapes, 3).rows == Layout(shapes, 3).rows


def test_by_dtype_groups_indices_in_order():
    ts = [torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.zeros(2), torch.zeros(())]
    assert by_dtype(ts) == {torch.float32: [0, 2, 3], torch.int64: [1]}
