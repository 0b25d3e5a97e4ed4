"""ftrain.rng: seeded() seeds torch's generator for a block and restores it; the counter-based
streams (fold_in, uniform, normal) are pure functions of a key with the right distributions."""

from __future__ import annotations

import math

import pytest
import torch

import ftrain as ft
from ftrain import rng

N = 1 << 16  # samples for the moments: standard errors of about 0.004


def test_seeded_restores_the_global_generator_also_on_error():
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    with rng.seeded(123):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), want)  # as if the block had not run
    torch.manual_seed(7)
    with pytest.raises(RuntimeError, match="boom"):
        with rng.seeded(123):
            torch.rand(5)
            raise RuntimeError("boom")
    assert torch.equal(torch.rand(3), want)
    with rng.seeded(123):
        assert torch.equal(torch.rand(3), inside)  # same seed, same numbers


def test_seeded_gives_the_stream_of_torch_manual_seed_and_reseed_moves_to_another():
    torch.manual_seed(5)
    want = torch.randn(4)
    with rng.seeded(5):
        assert torch.equal(torch.randn(4), want)
        rng.reseed(6)
        other = torch.randn(4)
    torch.manual_seed(6)
    assert torch.equal(torch.randn(4), other)
    with rng.seeded(6):
        assert not torch.equal(torch.randn(4), want)


def test_step_seed_mixes_the_key_the_step_and_the_salt():
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(torch.nn.Linear(2, 2)), opt, seed=3)
    seed = rng.step_seed(state)
    assert seed == rng.mix(3, 0) and 0 <= seed < 2**63
    later = state.replace(step=state.step + 1)
    seeds = {seed, rng.step_seed(later), rng.step_seed(state, 1), rng.step_seed(state, 2)}
    assert len(seeds) == 4
    assert rng.step_seed(state, 1) == rng.mix(3, 0, 1)
    assert rng.mix(1, 2) != rng.mix(2, 1)  # order matters


def test_same_key_same_numbers_and_keys_as_ints_or_tensors_agree():
    key = torch.tensor(42)
    assert torch.equal(rng.uniform(key, (5, 3)), rng.uniform(key, (5, 3)))
    assert torch.equal(rng.normal(key, (7,)), rng.normal(42, (7,)))
    assert torch.equal(rng.normal(key, (4, 2)).flatten(), rng.normal(key, (8,)))
    assert rng.normal(key, (2, 3), dtype=torch.float64).dtype == torch.float64
    assert rng.uniform(key, (0,)).shape == (0,)


def test_fold_in_derives_different_streams():
    key = torch.tensor(42)
    assert rng.fold_in(key, 7).dtype == torch.int64 and rng.fold_in(key, 7).dim() == 0
    assert torch.equal(rng.fold_in(key, 7), rng.fold_in(42, torch.tensor(7)))
    keys = [rng.fold_in(k, d) for k in (0, 1, 42, 2**40) for d in (0, 1, 2, 2**33)]
    assert len({int(k) for k in keys}) == len(keys)
    a = rng.normal(rng.fold_in(key, 0), (N,), dtype=torch.float64)
    b = rng.normal(rng.fold_in(key, 1), (N,), dtype=torch.float64)
    c = rng.normal(key, (N,), dtype=torch.float64)
    for x, y in ((a, b), (a, c), (b, c)):  # uncorrelated streams
        assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) < 5 / math.sqrt(N)


def test_uniform_is_in_the_open_unit_interval_and_flat():
    u = rng.uniform(torch.tensor(3), (N,), dtype=torch.float64)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / N)
    counts = torch.histc(u, bins=16, min=0, max=1)
    chi2 = float(((counts - N / 16) ** 2 / (N / 16)).sum())
    assert chi2 < 45, chi2  # 15 degrees of freedom: exceeded with probability about 1e-4
    assert float(rng.uniform(1, (N,)).min()) > 0  # float32 too (24 bits: never rounds to 0 or 1)
    assert float(rng.uniform(1, (N,)).max()) < 1


def test_normal_has_the_moments_of_a_standard_normal():
    z = rng.normal(torch.tensor(11), (N,), dtype=torch.float64)
    se = 1 / math.sqrt(N)
    assert abs(float(z.mean())) < 5 * se
    assert abs(float(z.var()) - 1) < 5 * math.sqrt(2) * se
    assert abs(float((z**3).mean())) < 5 * math.sqrt(15) * se  # skewness 0
    assert abs(float((z**4).mean()) - 3) < 5 * math.sqrt(96) * se  # kurtosis 3
    assert abs(float((z.abs() < 1).double().mean()) - 0.682689) < 0.01  # the bell's shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_uniform_stays_in_the_open_unit_interval_in_low_precision(dtype):
    u = rng.uniform(1, (N,), dtype=dtype)
    assert float(u.min()) > 0 and float(u.max()) < 1
