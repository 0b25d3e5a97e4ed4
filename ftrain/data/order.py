"""Sample orders: pure functions `order(epoch) -> int64[n]` of the dataset indices for an epoch.

The loader asks its order for the indices of each epoch. An order holds no position, so the
loader's whole state is (epoch, sample), and the same seed gives the same batches whatever the
number of workers. Write your own as any callable `epoch -> array of n indices in [0, n)`;
give it a `key` string if you want `Loader.load_state_dict` to check that it did not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["BucketByLength", "Sequential", "Shuffled", "bucket_by_length", "make_order"]


def _rng(seed: int, epoch: int, stream: int) -> np.random.RandomState:
    # RandomState's streams are frozen across numpy versions: an order stays the same forever.
    return np.random.RandomState([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, stream])


def _check_seed(who: str, seed: int) -> None:
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"{who}: seed must be an int in [0, 2**32), got {seed!r}")


@dataclass(frozen=True)
class Sequential:
    """`0, 1, ..., n - 1` in every epoch."""

    n: int

    @property
    def key(self) -> str:
        return "sequential"

    def __call__(self, epoch: int) -> np.ndarray:
        return np.arange(self.n, dtype=np.int64)


@dataclass(frozen=True)
class Shuffled:
    """A permutation of `range(n)` drawn from (seed, epoch) alone: a new order each epoch."""

    n: int
    seed: int = 0

    def __post_init__(self):
        _check_seed("Shuffled", self.seed)

    @property
    def key(self) -> str:
        return f"shuffle(seed={self.seed})"

    def __call__(self, epoch: int) -> np.ndarray:
        return _rng(self.seed, epoch, 0).permutation(self.n).astype(np.int64)


@dataclass(frozen=True)
class BucketByLength:
    """Length-bucketed order: consecutive groups of `batch_size` hold examples of similar length.

    Per epoch: shuffle all indices (seed, epoch); cut them into pools of
    `pool_batches * batch_size`; sort each pool by length; cut each pool into batches; shuffle
    the order of the full batches. A partial batch (when `batch_size` does not divide n) comes
    last, so `drop_last` drops it. Same idea as fairseq's and Hugging Face's length-grouped
    samplers.

    Guarantees: every epoch is a permutation of `range(n)`, deterministic by (seed, epoch); a
    batch holds examples from one pool, so its padding is small while the batches, and the order
    of examples across the epoch, stay random. Larger pools cut padding further and mix less.
    """

    lengths: np.ndarray = field(repr=False)
    batch_size: int
    seed: int = 0
    pool_batches: int = 50

    def __post_init__(self):
        _check_seed("bucket_by_length", self.seed)
        for name in ("batch_size", "pool_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"bucket_by_length: {name} must be a positive int, got {v!r}")
        lengths = np.asarray(self.lengths)
        if lengths.ndim != 1 or lengths.dtype.kind not in "iuf":
            raise ValueError(
                f"bucket_by_length: lengths must be a 1-D sequence of numbers, got shape "
                f"{lengths.shape} {lengths.dtype}"
            )
        object.__setattr__(self, "lengths", lengths)

    @property
    def key(self) -> str:
        return f"length(seed={self.seed}, pool_batches={self.pool_batches})"

    def __call__(self, epoch: int) -> np.ndarray:
        n, B = len(self.lengths), self.batch_size
        rng = _rng(self.seed, epoch, 1)
        perm = rng.permutation(n)
        pool = self.pool_batches * B  # a multiple of B: only the very last batch can be partial
        batches = []
        for start in range(0, n, pool):
            c = perm[start : start + pool]
            c = c[np.argsort(self.lengths[c], kind="stable")]  # stable: ties stay in random order
            batches.extend(c[i : i + B] for i in range(0, len(c), B))
        tail = batches.pop() if n % B else np.empty(0, dtype=np.int64)
        order = rng.permutation(len(batches))
        out = [batches[i] for i in order] + [tail]
        return np.concatenate(out).astype(np.int64)


def bucket_by_length(
    lengths: Sequence[int] | np.ndarray, batch_size: int, *, seed: int = 0, pool_batches: int = 50
) -> BucketByLength:
    """The length-bucketed order of examples with these lengths (see `BucketByLength`).

    Usually reached through `loader(dataset, batch_size, order="length")`, which reads
    `dataset.lengths`; call it yourself to choose `pool_batches`.
    """
    return BucketByLength(np.asarray(lengths), batch_size, seed, pool_batches)


def make_order(order, dataset, n: int, batch_size: int, seed: int) -> Callable[[int], np.ndarray]:
    """The order function ``loader(order=...)`` names: "shuffle", "sequential", "length" or a
    callable ``epoch -> n indices``, checked against the dataset and batch size."""
    who = "loader"
    if order == "shuffle":
        return Shuffled(n, seed)
    if order == "sequential":
        return Sequential(n)
    if order == "length":
        lengths = getattr(dataset, "lengths", None)
        if lengths is None or len(lengths) != n:
            raise ValueError(
                f"{who}: order='length' needs dataset.lengths, one length per example ({n}); "
                f"{type(dataset).__name__} has {'none' if lengths is None else len(lengths)}. "
                "Use ftrain.data.DocumentDataset or add a lengths attribute"
            )
        return BucketByLength(np.asarray(lengths), batch_size, seed)
    if isinstance(order, str) or not callable(order):
        raise ValueError(
            f"{who}: order must be 'shuffle', 'sequential', 'length' or a callable "
            f"epoch -> indices, got {order!r}"
        )
    if isinstance(order, BucketByLength) and order.batch_size != batch_size:
        raise ValueError(
            f"{who}: the bucket_by_length order was built for batch_size={order.batch_size}, "
            f"the loader has batch_size={batch_size}; build both with the same batch_size"
        )
    idx = np.asarray(order(0))
    if idx.shape != (n,) or idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= n:
        raise ValueError(
            f"{who}: order(epoch) must return {n} int indices in [0, {n}), one per sample; "
            f"order(0) gave shape {idx.shape} {idx.dtype}"
        )
    return order
