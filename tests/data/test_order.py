"""ftrain.data's sample orders (ftrain/data/order.py): sequential, a custom order, and bucketing by
length, a deterministic permutation that cuts padding."""

import numpy as np
import pytest
import torch

from ftrain import data

from _data import Numbered, Varied, ids


def test_sequential_order_and_custom_order():
    ld = data.loader(Numbered(10), 4, order="sequential", drop_last=False)
    assert ids(ld) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

    def reverse_then_rotate(epoch):
        return np.roll(np.arange(10)[::-1], epoch)

    ld = data.loader(Numbered(10), 5, order=reverse_then_rotate)
    assert ids(ld) == [[9, 8, 7, 6, 5], [4, 3, 2, 1, 0]]
    assert ids(ld) == [[0, 9, 8, 7, 6], [5, 4, 3, 2, 1]]


@pytest.mark.parametrize("n, B", [(1000, 16), (37, 4), (8, 8)])
def test_bucket_by_length_is_a_deterministic_permutation(n, B):
    lengths = np.random.RandomState(0).randint(1, 500, size=n)
    order = data.bucket_by_length(lengths, B, seed=4, pool_batches=5)
    e0, e1 = order(0), order(1)
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(n))
    assert np.array_equal(e0, data.bucket_by_length(lengths, B, seed=4, pool_batches=5)(0))
    assert n <= B or not np.array_equal(e0, e1)
    # the partial batch (if any) is last, so drop_last drops exactly it
    full = n - n % B
    assert sorted(e0[:full].tolist() + e0[full:].tolist()) == list(range(n))


def _padding(batches) -> float:
    mask = torch.cat([b["mask"].flatten() for b in batches])
    return 1.0 - float(mask.float().mean())


def test_bucketing_cuts_padding_versus_random_batches():
    lengths = np.random.RandomState(0).lognormal(4.0, 0.8, size=2000).astype(int) + 1
    ds = Varied(lengths)
    random = list(data.loader(ds, 16, seed=0))
    bucketed = list(data.loader(ds, 16, seed=0, order="length"))
    assert len(random) == len(bucketed) == 125
    assert _padding(bucketed) < 0.25 * _padding(random)
    # same samples, every batch a real batch: padded positions are exactly the ones past length
    for b in bucketed:
        rows = b["input"][:, 0]
        assert torch.equal(b["mask"].sum(1), torch.as_tensor(lengths[rows.numpy()]))
        assert (b["target"][~b["mask"]] == -100).all() and (b["input"][~b["mask"]] == -1).all()
    assert sorted(torch.cat([b["input"][:, 0] for b in bucketed]).tolist()) == list(range(2000))


def test_document_dataset_with_bucketing(tmp_path):
    rng = np.random.RandomState(0)
    texts = [(f"d{i}", "x" * int(rng.lognormal(3.5, 1.0)) + "\n") for i in range(200)]
    data.build_token_dataset(texts, tmp_path, progress=False)
    ds = data.DocumentDataset(tmp_path, 64, splits=(1, 0, 0))
    random = list(data.loader(ds, 8, seed=0))
    bucketed = list(data.loader(ds, 8, seed=0, order="length"))
    assert _padding(bucketed) < 0.5 * _padding(random)
    assert all(b["mask"].any(1).all() for b in bucketed)  # no empty row
    assert all((b["input"][~b["mask"]] == ds.eot_id).all() for b in bucketed)
