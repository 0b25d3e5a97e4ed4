"""ftrain.internals.batch: split_batch cuts every tensor of a nested batch along dim 0 as
torch.tensor_split does, keeping container types; batch_rows finds the leading dimension."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from ftrain.internals.batch import batch_rows, split_batch

Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize("rows,k", [(6, 1), (6, 3), (7, 3), (3, 3), (10, 4)])
def test_split_batch_cuts_every_tensor_as_tensor_split_does(rows, k):
    x = torch.arange(rows * 2).view(rows, 2)
    y = torch.arange(rows)
    batch = {"in": {"x": x, "pair": Pair(x, [y, "tag"])}, "y": y, "scale": torch.tensor(0.5)}
    parts = split_batch(batch, k)
    assert len(parts) == k
    xs, ys = torch.tensor_split(x, k), torch.tensor_split(y, k)
    for i, p in enumerate(parts):
        assert type(p) is dict and type(p["in"]["pair"]) is Pair and type(p["in"]["pair"].y) is list
        assert torch.equal(p["in"]["x"], xs[i]) and torch.equal(p["in"]["pair"].x, xs[i])
        assert torch.equal(p["y"], ys[i]) and torch.equal(p["in"]["pair"].y[0], ys[i])
        assert p["scale"] is batch["scale"]  # 0-d: shared by every part
        assert p["in"]["pair"].y[1] == "tag"  # not a tensor: shared
    assert [len(p["y"]) for p in parts] == [len(t) for t in ys]  # the first rows % k get one more
    assert torch.equal(torch.cat([p["y"] for p in parts]), y)


def test_split_batch_of_one_part_is_the_batch_itself():
    batch = {"x": torch.zeros(3)}
    assert split_batch(batch, 1)[0] is batch


def test_split_batch_keeps_tuples_and_splits_a_bare_tensor():
    x = torch.arange(4)
    a, b = split_batch((x, x), 2)
    assert type(a) is tuple and torch.equal(a[0], x[:2]) and torch.equal(b[1], x[2:])
    assert [t.tolist() for t in split_batch(x, 2)] == [[0, 1], [2, 3]]


def test_batch_rows_is_the_first_batched_tensors_leading_dimension():
    assert batch_rows(torch.zeros(5, 2)) == 5
    assert batch_rows({"scale": torch.tensor(1.0), "x": {"a": torch.zeros(3, 4)}}) == 3
    assert batch_rows(Pair("text", [torch.tensor(2.0), torch.zeros(7)])) == 7
    assert batch_rows({"scale": torch.tensor(1.0), "name": "x"}) is None
    assert batch_rows("text") is None
