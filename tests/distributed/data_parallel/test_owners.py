"""ftrain.distributed.data_parallel.owners: owners are balanced and the same for equal inputs; an
Exchange's two trips, for 1 to 4 ranks in one process (the all-to-all replaced by what it computes);
and on_owners on 2 gloo ranks (the session's 2-rank run, ``_two_ranks.py``) against the same
function of the whole tensors in one process.
"""

from __future__ import annotations

import pytest
import torch

from ftrain.distributed.collectives import layout
from ftrain.distributed.data_parallel import owners as owners_module
from ftrain.distributed.data_parallel.owners import Exchange, exchange, on_owners, owners

from _two_ranks import OTHER_SHAPES, OWNED_SHAPES, owned_inputs, whole_fn

# mixed shapes; with 3 or 4 ranks some rank holds 0 rows of (1, 4) and of (2, 3)
SHAPES = [(5, 3), (1, 4), (7, 2), (5, 3), (2, 3), (3, 2, 2), (6,)]


def test_owners_by_hand():
    # costliest first, each to the least loaded rank (the lowest among equals)
    assert owners((4.0, 3.0, 3.0, 2.0), 2) == (0, 1, 1, 0)
    assert owners((1.0, 1.0, 1.0), 3) == (0, 1, 2)
    assert owners((5.0,), 3) == (0,)  # fewer tensors than ranks: the others own nothing
    assert owners((), 2) == ()
    assert owners((2.0, 7.0), 1) == (0, 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_owners_balance_the_cost(world):
    g = torch.Generator().manual_seed(world)
    costs = tuple(float(c) for c in torch.randint(1, 1000, (23,), generator=g))
    owner = owners(costs, world)
    assert owner == owners(tuple(costs), world)  # the same on every rank
    load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(world)]
    assert sorted(set(owner)) == list(range(world))
    assert max(load) <= sum(costs) / world + max(costs)


def chunk_of(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    pieces = torch.chunk(t, world)  # how DTensor splits a Shard(0) tensor
    return pieces[rank] if rank < len(pieces) else t[t.shape[0] :]


def all_to_all(monkeypatch, world: int, trip) -> list:
    """``trip(rank)`` on every rank, its all-to-all replaced by what it computes: the sends of
    every rank are captured first, then each rank receives its blocks of them, in rank order."""
    sends: list[list[torch.Tensor]] = []

    def capture(out, send, out_split, in_split, group):
        sends.append(list(send.clone().split(in_split)))
        out.zero_()

    monkeypatch.setattr(owners_module, "all_to_all_into", capture)
    for rank in range(world):
        trip(rank)
    results = []
    for rank in range(world):

        def received(out, send, out_split, in_split, group, rank=rank):
            parts = [sends[s][rank] for s in range(world)]
            assert [p.numel() for p in parts] == out_split  # what the senders meant for us
            out.copy_(torch.cat(parts))

        monkeypatch.setattr(owners_module, "all_to_all_into", received)
        results.append(trip(rank))
    return results


@pytest.mark.parametrize("shapes", [SHAPES, SHAPES[:1]], ids=["mixed", "one"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_an_exchange_computes_each_tensor_on_its_owner(monkeypatch, world, shapes):
    g = torch.Generator().manual_seed(0)
    wholes = [torch.randn(s, generator=g) for s in shapes]
    sizes = tuple(torch.Size(s) for s in shapes)
    owner = owners(tuple(float(s.numel()) for s in sizes), world)
    ex = Exchange(sizes, owner, world)
    pieces = [layout(sizes, world).local(wholes, r) for r in range(world)]
    assert all(torch.equal(p, chunk_of(w, world, r)) for r in range(world) for p, w in
               zip(pieces[r], wholes))  # fmt: skip

    got = all_to_all(monkeypatch, world, lambda r: ex.to_owners(pieces[r], r, None))
    for r in range(world):  # each owner has its tensors whole, and only those
        assert [tuple(t.shape) for t in got[r]] == [shapes[i] for i in ex.owned[r]]
        assert all(torch.equal(t, wholes[i]) for i, t in zip(ex.owned[r], got[r]))
    assert sorted(i for r in range(world) for i in ex.owned[r]) == list(range(len(shapes)))

    done = [[whole_fn(t) for t in got[r]] for r in range(world)]
    back = all_to_all(monkeypatch, world, lambda r: ex.back(done[r], r, None, wholes[0]))
    for r in range(world):  # each rank has its rows of every result
        for w, rows in zip(wholes, back[r]):
            assert torch.equal(rows, chunk_of(whole_fn(w), world, r))


def test_exchange_is_a_memo_of_shapes_owners_and_world():
    sizes = tuple(torch.Size(s) for s in SHAPES)
    owner = owners(tuple(float(s.numel()) for s in sizes), 3)
    assert exchange(sizes, owner, 3) is exchange(tuple(torch.Size(s) for s in SHAPES), owner, 3)


def test_plain_tensors_are_computed_here_in_one_call():
    ts = [torch.randn(s) for s in SHAPES]
    calls = []

    def fn(xs):
        calls.append(len(xs))
        return [whole_fn(x) for x in xs]

    got = on_owners(fn, ts, dtype=torch.float64)
    assert calls == [len(ts)]
    assert all(torch.equal(o, whole_fn(t.double())) for o, t in zip(got, ts))


def test_fn_must_keep_shapes_and_dtypes():
    ts = [torch.randn(2, 3)]
    with pytest.raises(ValueError, match=r"on_owners\(fn, \.\.\.\): fn must return .* same shape"):
        on_owners(lambda xs: [x.T for x in xs], ts)
    with pytest.raises(ValueError, match="same shape and dtype"):
        on_owners(lambda xs: [x.double() for x in xs], ts)
    with pytest.raises(ValueError, match="fn returned 0 tensors for 1"):
        on_owners(lambda xs: [], ts)


# -- on 2 gloo ranks: the session's 2-rank run (_two_ranks.py) --------------------------------------


def test_on_owners_on_two_ranks_equals_fn_of_the_whole_tensors(two_ranks):
    """Row-sharded tensors (mixed shapes, a float64 one, a rank holding 0 rows of one) are each
    computed on one rank and come back as Shard(0) rows; a plain tensor and a column-sharded one
    are computed on both ranks, laid out as they came."""
    wholes = owned_inputs()
    n = len(OWNED_SHAPES)
    seen = [tuple(s) for r in two_ranks for s in r["on_owners"]["seen"]]
    for shape in set(OWNED_SHAPES):  # each sharded tensor once, the others on every rank
        assert seen.count(shape) == OWNED_SHAPES.count(shape), shape
    for shape in OTHER_SHAPES:
        assert seen.count(shape) == len(two_ranks)
    for r in two_ranks:
        got = r["on_owners"]
        assert got["placements"] == ["(Shard(dim=0),)"] * n + ["plain", "(Shard(dim=1),)"]
        for w, o in zip(wholes, got["whole"]):
            assert o.dtype == w.dtype and torch.equal(o, whole_fn(w))
