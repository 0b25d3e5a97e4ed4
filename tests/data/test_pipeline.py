"""ftrain.data.loader (ftrain/data/pipeline.py): determinism, coverage, exact resume, workers,
devices, processes sharing one order, and bad arguments refused when the loader is built."""

import json

import numpy as np
import pytest
import torch

from ftrain import data

from _data import Numbered, Varied, ids, take

# -- determinism and coverage ----------------------------------------------------------------


def test_same_seed_same_batches_other_seed_other_batches():
    ds = Numbered(50)
    a = ids(data.loader(ds, 8, seed=1, drop_last=False))
    b = ids(data.loader(ds, 8, seed=1, drop_last=False))
    c = ids(data.loader(ds, 8, seed=2, drop_last=False))
    assert a == b and a != c
    assert sorted(sum(a, [])) == sorted(sum(c, []))  # different order, no different samples
    batch = next(iter(data.loader(ds, 8, seed=1)))
    assert torch.equal(batch["x"][:, 0], batch["id"]) and batch["x"].shape == (8, 2)


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_sample_once_per_epoch(drop_last):
    n, B = 43, 8
    ld = data.loader(Numbered(n), B, seed=0, drop_last=drop_last)
    epochs = [ids(ld) for _ in range(3)]
    assert ld.epoch == 3
    for batches in epochs:
        flat = sum(batches, [])
        assert len(flat) == len(set(flat))  # no sample twice in an epoch
        if drop_last:
            assert [len(b) for b in batches] == [B] * (n // B) == [B] * len(ld)
            assert set(flat) < set(range(n)) and len(flat) == n - n % B
        else:
            assert [len(b) for b in batches] == [B] * (n // B) + [n % B]
            assert sorted(flat) == list(range(n))
    assert epochs[0] != epochs[1]  # a new order each epoch
    if drop_last:  # which samples sit out changes with the epoch
        assert len({frozenset(sum(e, [])) for e in epochs}) > 1


@pytest.mark.parametrize("order", ["shuffle", "length"])
def test_workers_do_not_change_the_order(order):
    ds = Varied(np.random.RandomState(0).randint(1, 30, size=70))
    ref = data.loader(ds, 4, seed=5, order=order, num_workers=0, prefetch=0, drop_last=False)
    par = data.loader(ds, 4, seed=5, order=order, num_workers=2, prefetch=3, drop_last=False)
    for _ in range(2):  # two epochs
        a, b = list(ref), list(par)
        assert len(a) == len(b) == 18
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_process_workers_give_the_same_batches(tmp_path):
    data.build_token_dataset([("a", "hello world " * 40)], tmp_path, progress=False)
    ds = data.TokenDataset(tmp_path, 8, splits=(1, 0, 0))
    a = list(data.loader(ds, 4, seed=3))
    b = list(data.loader(ds, 4, seed=3, num_workers=2, worker_method="process"))
    assert len(a) == len(b) > 5
    assert all(torch.equal(x["input"], y["input"]) for x, y in zip(a, b, strict=True))


def test_token_dataset_batches(tmp_path):
    data.build_token_dataset(
        [("a", "some text " * 30), ("b", "more " * 50)], tmp_path, progress=False
    )
    ds = data.TokenDataset(tmp_path, 16, splits=(1, 0, 0))
    batches = list(data.loader(ds, 4, seed=0, num_workers=2))
    assert len(batches) == len(ds) // 4
    for b in batches:
        assert b.keys() == {"input", "target"}
        assert b["input"].dtype == b["target"].dtype == torch.int64
        assert b["input"].shape == b["target"].shape == (4, 16)
        assert torch.equal(b["input"][:, 1:], b["target"][:, :-1])


# -- resume ----------------------------------------------------------------------------------------


def _same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(xs, ys, strict=True)
    )


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop", [0, 1, 3, 5, 6, 7, 13])  # 6 batches per epoch (n=43, B=8)
def test_resume_finite_epochs_matches_an_uninterrupted_loader(drop_last, stop):
    n, B, epochs = 43, 8, 3
    ds = Numbered(n)
    make = dict(batch_size=B, seed=7, drop_last=drop_last)
    ref = data.loader(ds, **make)
    per_epoch = len(ref)
    reference = [ids(ref) for _ in range(epochs)]
    flat_ref = sum(reference, [])
    # interrupted: take `stop` batches (crossing epoch ends as a training loop would), save
    first = data.loader(ds, **make, num_workers=2, prefetch=4)
    got = []
    while len(got) < stop:
        got += ids(take(iter(first), stop - len(got)))
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == stop // per_epoch
    # a fresh loader, other worker count and prefetch, continues exactly
    second = data.loader(ds, **make, num_workers=0, prefetch=1)
    second.load_state_dict(state)
    assert second.epoch == stop // per_epoch
    rest = ids(second)  # the rest of the interrupted epoch
    while second.epoch < epochs:
        rest += ids(second)
    assert got + rest == flat_ref


@pytest.mark.parametrize("stop", [0, 2, 5, 6, 11, 12, 17])
def test_resume_infinite_stream_across_epoch_boundaries(stop):
    # 21 samples, batch 4, drop_last=False: the stream does not break at epoch ends, so
    # batches straddle epochs; an epoch is 5.25 batches.
    ds = Numbered(21)
    ref = data.loader(ds, 4, seed=3, drop_last=False, infinite=True)
    reference = ids(take(iter(ref), 20))
    flat = sum(reference, [])
    for e in range(3):  # every sample once per epoch of the stream
        assert sorted(flat[21 * e : 21 * (e + 1)]) == list(range(21))
    first = data.loader(ds, 4, seed=3, drop_last=False, infinite=True, num_workers=2)
    got = ids(take(iter(first), stop))
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["epoch"], state["sample"]) == divmod(4 * stop, 21) == (first.epoch, first.sample)
    second = data.loader(ds, 4, seed=3, drop_last=False, infinite=True)
    second.load_state_dict(state)
    assert got + ids(take(iter(second), 20 - stop)) == reference


def test_resume_bucketed_variable_length_batches():
    ds = Varied(np.random.RandomState(1).randint(1, 40, size=90))
    make = dict(batch_size=8, seed=2, order="length", infinite=True)
    reference = list(take(iter(data.loader(ds, **make)), 25))
    first = data.loader(ds, **make)
    it = iter(first)
    got = take(it, 14)
    state = json.loads(json.dumps(first.state_dict()))
    take(it, 3)  # batches after the save are not part of the state
    second = data.loader(ds, **make, num_workers=2)
    second.load_state_dict(state)
    assert _same(got + take(iter(second), 11), reference)


def test_state_dict_does_not_count_prefetched_batches():
    ld = data.loader(Numbered(64), 4, seed=0, prefetch=6, num_workers=2)
    it = iter(ld)
    take(it, 3)
    sd = ld.state_dict()
    assert (sd["epoch"], sd["sample"]) == (0, 12)
    assert json.loads(json.dumps(sd)) == sd


def test_load_state_dict_refuses_another_loaders_state():
    sd = data.loader(Numbered(40), 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 8, now 4"):
        data.loader(Numbered(40), 4, seed=1).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"order: saved 'shuffle\(seed=1\)'"):
        data.loader(Numbered(40), 8, seed=2).load_state_dict(sd)
    with pytest.raises(ValueError, match="num_samples: saved 40, now 41"):
        data.loader(Numbered(41), 8, seed=1).load_state_dict(sd)
    lenient = data.loader(Numbered(40), 4, seed=1)
    lenient.load_state_dict({**sd, "epoch": 2, "sample": 8}, strict=False)
    assert (lenient.epoch, lenient.sample) == (2, 8)
    with pytest.raises(ValueError, match="not a loader state"):
        lenient.load_state_dict({"root": {}, "num_yielded": 3})
    with pytest.raises(ValueError, match="ints >= 0"):
        lenient.load_state_dict({**sd, "sample": -1})


def test_one_iterator_at_a_time():
    ld = data.loader(Numbered(40), 4, seed=0)
    old = iter(ld)
    next(old)
    new = iter(ld)
    assert next(new)["id"].shape == (4,)
    with pytest.raises(RuntimeError, match="newer iter"):
        next(old)


# -- devices and errors ----------------------------------------------------------------------------


def test_pin_memory_is_skipped_off_cuda():
    ld = data.loader(Numbered(16), 4, pin_memory=True, device="cpu")
    assert ld.pin_memory is False
    batch = next(iter(ld))
    assert batch["id"].device.type == "cpu" and not batch["id"].is_pinned()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            data.loader(Numbered(16), 4, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_arrive_on_the_device():
    ref = list(data.loader(Numbered(32), 4, seed=0))
    ld = data.loader(Numbered(32), 4, seed=0, device="cuda", pin_memory=True, num_workers=2)
    assert ld.pin_memory
    got = list(ld)
    assert all(b["id"].is_cuda for b in got)
    assert _same([{k: v.cpu() for k, v in b.items()} for b in got], ref)


class Broken(Numbered):
    def __getitem__(self, i):
        return [i]


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: data.loader(Numbered(10), 0), ValueError, "batch_size must be a positive"),
        (lambda: data.loader(Numbered(0), 4), ValueError, "dataset is empty"),
        (lambda: data.loader(Numbered(3), 4), ValueError, "drop_last=False"),
        (lambda: data.loader(Numbered(8), 4, num_workers=-1), ValueError, "num_workers"),
        (lambda: data.loader(Numbered(8), 4, prefetch=-1), ValueError, "prefetch"),
        (lambda: data.loader(Numbered(8), 4, seed=-1), ValueError, "seed"),
        (lambda: data.loader(Numbered(8), 4, device="gpu0"), ValueError, "not a torch device"),
        (lambda: data.loader(Numbered(8), 4, order="random"), ValueError, "'shuffle'"),
        (lambda: data.loader(Numbered(8), 4, order="length"), ValueError, "dataset.lengths"),
        (lambda: data.loader(Numbered(8), 4, order=lambda e: [0, 1]), ValueError, "8 int indices"),
        (lambda: data.loader(Broken(8), 4), TypeError, "dict of tensors"),
        (lambda: data.loader([1, 2], 1), TypeError, "dict of tensors"),
        (
            lambda: data.loader(Varied([1, 2, 3]), 2, collate=data.stack_collate),
            ValueError,
            "PadCollate",
        ),
        (lambda: data.loader(object(), 4), TypeError, "map-style"),
    ],
)
def test_bad_arguments_fail_when_the_loader_is_built(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_infinite_loader_has_no_len_but_epochs():
    ld = data.loader(Numbered(10), 5, infinite=True)
    with pytest.raises(TypeError, match="no len"):
        len(ld)
    assert ld.batches_per_epoch == 2
    it = iter(ld)
    take(it, 5)
    assert (ld.epoch, ld.sample) == (2, 5)


# -- several processes ------------------------------------------------------------------------------


@pytest.mark.parametrize("infinite", [False, True])
def test_processes_share_one_global_order_and_position(infinite):
    """World size 2 or 3: process r takes every world-th sample of the one global order from the
    r-th on, so a global batch holds the samples a one-process loader's batch of the same global
    size holds; the position is global, so a state saved with 2 processes resumes on 1 or 3
    with the batches that follow."""
    ds = Numbered(23)  # uneven over 2 and 3 processes
    one = data.loader(ds, 6, seed=5, infinite=infinite)
    reference = ids(take(iter(one), 7 if infinite else 3))
    for world in (2, 3):
        ranks = [data.loader(ds, 6 // world, seed=5, infinite=infinite, rank=r, world_size=world)
                 for r in range(world)]  # fmt: skip
        streams = [ids(take(iter(ld), len(reference))) for ld in ranks]
        for k, batch in enumerate(reference):
            assert [s[k] for s in streams] == [batch[r::world] for r in range(world)]
        assert len({json.dumps(ld.state_dict()) for ld in ranks}) == 1
        assert ranks[0].state_dict() == one.state_dict()
    if infinite:  # resume on another number of processes, mid-stream
        two = [data.loader(ds, 3, seed=5, infinite=True, rank=r, world_size=2) for r in (0, 1)]
        for ld in two:
            take(iter(ld), 3)
        again = data.loader(ds, 2, seed=5, infinite=True, rank=1, world_size=3)
        again.load_state_dict(two[0].state_dict())
        assert ids(take(iter(again), 4)) == [b[1::3] for b in reference[3:7]]
    with pytest.raises(ValueError, match="rank must be < world_size"):
        data.loader(ds, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pass drop_last=True or infinite=True"):
        data.loader(ds, 2, rank=0, world_size=2, drop_last=False)


def test_an_old_pass_collected_late_leaves_the_new_passs_threads_alone():
    """The previous pass, kept alive by a reference cycle, is collected (its finalizer runs)
    while the next pass is being started, after its threads started: it must not stop them.
    A garbage collection can run at any allocation, on any thread; with the old pass still
    counted newest at that moment, the new pass delivered 0 or 1 batches of an epoch."""
    import gc

    ds = Varied(np.random.RandomState(0).randint(1, 30, size=40))
    par = data.loader(ds, 4, seed=5, num_workers=2, prefetch=2, drop_last=False)
    want = len(list(data.loader(ds, 4, seed=5, num_workers=0, prefetch=0, drop_last=False)))
    old = iter(par)
    next(old)
    old.cycle = old  # collected only by the cycle collector, not when the new pass drops it
    del old
    reset = par._root.reset

    def reset_then_collect(*args, **kwargs):
        reset(*args, **kwargs)  # the new pass's threads run from here
        gc.collect()  # the old pass's finalizer runs now

    par._root.reset = reset_then_collect
    gc.disable()  # no collection before the one above
    try:
        got = list(par)
    finally:
        gc.enable()
        par._root.reset = reset
    assert len(got) == want - 1  # the rest of the epoch: the old pass took one batch
