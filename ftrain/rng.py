"""Explicit randomness: every random number a step draws comes from ``(state.rng, state.step)``.

Two kinds of stream:

* **torch's generators**, for what models draw (dropout): :func:`seeded` seeds the CPU generator
  (and the params' CUDA device's) from a key for the extent of a block, inside
  ``torch.random.fork_rng``, so the global random state is left as it was. The step runs inside
  ``seeded(step_seed(state))``; ``ft.shard`` folds the rank in with :func:`reseed`, so that dropout
  differs between processes as it would between the rows of one batch.
* **counter-based tensors**, for what transforms draw: :func:`normal` and :func:`uniform` compute
  their numbers from a key tensor with integer hashing, as JAX's keys do. They are plain tensor
  ops, so they compile into the step's graph (``torch.manual_seed`` and ``torch.Generator`` break
  it), they do not depend on which rank draws them (gradient noise added after the reduce is the
  same on every process), and :func:`fold_in` derives independent streams from one key.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch

__all__ = ["mix", "step_seed", "seeded", "reseed", "fold_in", "uniform", "normal"]

_M64 = 0xFFFFFFFFFFFFFFFF
_M32 = 0xFFFFFFFF


def mix(*xs: int) -> int:
    """SplitMix64 of the integers ``xs``: a well-spread 63-bit seed from a key and counters."""
    z = 0x9E3779B97F4A7C15
    for x in xs:
        z = (z ^ (x & _M64)) * 0xBF58476D1CE4E5B9 & _M64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _M64
        z ^= z >> 31
    return z & 0x7FFFFFFFFFFFFFFF


def step_seed(state, *salt: int) -> int:
    """The seed of ``state``'s step: ``mix(state.rng, state.step, *salt)``; for a stacked state
    (``ft.stack``: one key and step per member) every member's key, then every member's step.
    Reading the CPU tensors reads host memory, not a device: ``TrainState`` keeps them there."""
    return mix(*state.rng.reshape(-1).tolist(), *state.step.reshape(-1).tolist(), *salt)


def _generators(device: torch.device) -> list[torch.Generator]:
    gens = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gens.append(torch.cuda.default_generators[index])
    return gens


@contextlib.contextmanager
def seeded(seed: int, device: torch.device = torch.device("cpu")) -> Iterator[None]:
    """Seed the CPU generator, and ``device``'s if it is a CUDA device, with ``seed`` for the
    extent of the block; their previous states come back on exit, also on error."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        reseed(seed, device)
        yield


def reseed(seed: int, device: torch.device = torch.device("cpu")) -> None:
    """Seed the generators :func:`seeded` forks (inside its block: restored when it ends)."""
    for g in _generators(device):
        g.manual_seed(seed)


# -- counter-based streams ------------------------------------------------------------------------


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 tensors holding values in [0, 2**32). The multiplier has 27
    bits, so no product leaves int64's range."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def _key32(key: torch.Tensor, salt: int) -> torch.Tensor:
    """All 64 bits of an int64 key hashed into 32 (values in [0, 2**32))."""
    return _hash32((key & _M32) ^ _hash32(((key >> 32) & _M32) ^ salt))


def fold_in(key: torch.Tensor | int, data: torch.Tensor | int) -> torch.Tensor:
    """A new key (0-d int64 tensor) from ``key`` and ``data``, independent of both for any use:
    ``fold_in(fold_in(state.rng, state.step), 7)`` is the stream number 7 of this step."""
    key = torch.as_tensor(key, dtype=torch.int64)
    data = torch.as_tensor(data, dtype=torch.int64, device=key.device)
    return _hash32(_key32(key, 0x9E3779B9) ^ _key32(data, 0x7F4A7C15))


def _bits(key: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """``n`` hashed 32-bit words of the stream ``key`` (any int64: all its bits count)."""
    counter = torch.arange(n, dtype=torch.int64, device=device)
    k = _key32(key.to(device), 0x5BD1E995)
    return _hash32(_hash32(counter ^ k) ^ _hash32(k ^ 0x632BE5AB))


def uniform(
    key: torch.Tensor | int,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Numbers uniform in (0, 1) of ``shape``, a pure function of ``key`` (same key, same numbers,
    on every process and in compiled or eager code). 24 random bits each, rounded to ``dtype``
    and kept strictly inside (0, 1) there."""
    key = torch.as_tensor(key, dtype=torch.int64)
    device = torch.device(device) if device is not None else key.device
    n = math.prod(shape)
    u = ((_bits(key, n, device) >> 8).to(torch.float64) + 0.5) * 2.0**-24
    # in a narrower dtype the ends would round to 0 or 1: keep them inside
    info = torch.finfo(dtype)
    u = u.to(dtype).clamp(min=info.tiny, max=1.0 - info.eps / 2)
    return u.reshape(tuple(shape))


def normal(
    key: torch.Tensor | int,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normal numbers of ``shape`` (Box-Muller on two uniform streams), a pure function of
    ``key`` like :func:`uniform`."""
    n = math.prod(shape)
    u = uniform(key, (2 * n,), dtype=torch.float64, device=device)
    z = torch.sqrt(-2.0 * torch.log(u[:n])) * torch.cos(2.0 * math.pi * u[n:])
    return z.to(dtype).reshape(tuple(shape))
