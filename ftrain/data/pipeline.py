"""`loader`: a `torchdata.nodes` graph with an exact, JSON-serializable resume state.

    order(epoch) -> indices -> ParallelMapper(dataset[i], workers, in order) -> Batcher
        -> collate -> PinMemory (CUDA only) -> Prefetcher -> .to(device, non_blocking=True)

The order of samples is a pure function of (seed, epoch) (see `ftrain.data.order`), the
workers return results in order, and the batches are cut from that one stream; so a batch is
fixed by its position alone, and the loader's state is just that position: `{"epoch", "sample"}`.
Resuming restarts the graph at the position, never replays or skips anything, and works with a
different number of workers, prefetch depth or device.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torchdata.nodes import (
    BaseNode,
    Batcher,
    Mapper,
    ParallelMapper,
    PinMemory,
    Prefetcher,
)

from ftrain.data.collate import stack_collate
from ftrain.data.nodes import OrderNode, keep_num_threads, stop_threads, to_device
from ftrain.data.order import make_order

__all__ = ["Loader", "LoaderIterator", "loader"]

STATE_FORMAT = "ftrain.data.loader/1"
Batch = dict[str, torch.Tensor]


class LoaderIterator(Iterator[Batch]):
    """One pass of a `Loader` (`iter(loader)`). `close()`, or leaving a `with` block, stops its
    worker and prefetch threads; an iterator left open is closed at interpreter exit."""

    def __init__(self, loader: Loader):
        self._loader, self._closed = loader, False
        # This pass is the newest from here on, before the old one is dropped: the old one's
        # finalizer (below) may run at any moment after, on any thread (a garbage collection in
        # a worker thread), and must then find a newer pass and leave its threads alone.
        loader._iterators += 1
        number = loader._iterators
        if loader._active is not None:  # an earlier pass still open: its read-ahead threads may
            stop_threads(loader._thread_nodes)  # be inside the source; stop them before it moves
        loader._active = self
        loader._source.start = (loader._epoch, loader._sample)
        self._threads = torch.get_num_threads()
        loader._root.reset()  # restarts every node (and its threads) at the current position
        keep_num_threads(self._threads)
        # Worker threads still running inside torch when the interpreter exits can abort it
        # ("terminate called without an active exception"): an iterator still open then stops
        # them first (weakref.finalize runs at exit for objects still alive, and when one is
        # collected: then only if no newer iterator took over the threads).
        self._at_exit = weakref.finalize(self, _stop_if_newest, loader, number)

    def __next__(self) -> Batch:
        ld = self._loader
        if self._closed:
            raise StopIteration
        if ld._active is not self:
            raise RuntimeError(
                "Loader: a newer iter(loader) replaced this iterator; use one iterator at a "
                "time (loader positions are shared)"
            )
        try:
            batch = next(ld._root)
        finally:
            keep_num_threads(self._threads)
        ld._advance()
        return batch

    def close(self) -> None:
        """Stop the threads (or processes) that read ahead; `next()` then raises StopIteration.
        The loader keeps its position: a new `iter(loader)` goes on from the last batch taken."""
        if self._closed:
            return
        self._closed = True
        self._at_exit.detach()
        if self._loader._active is self:
            self._loader._active = None
            stop_threads(self._loader._thread_nodes)

    def __enter__(self) -> LoaderIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_if_newest(loader: Loader, number: int) -> None:
    if loader._iterators == number:
        stop_threads(loader._thread_nodes)


class Loader:
    """Iterable batches from a map-style dataset with an exact resume state. Build it with `loader`.

    Position: `(epoch, sample)`, the next sample of `order(epoch)` to read. Each `iter(loader)`
    continues from the position: to the end of the epoch (then the position is the next epoch's
    start), or forever with `infinite=True`. So `for epoch in range(3): for batch in loader:`
    runs three successive epochs, and a training loop for `max_steps` builds it with
    `infinite=True` and calls `next()` on one iterator.

    `state_dict()` after receiving k batches is the position after those k batches; a loader
    given it by `load_state_dict` yields batch k + 1 onwards, exactly as an uninterrupted loader.

    Threads: iterating leaves `torch.get_num_threads()` as it was at `iter(loader)`, although
    the worker threads run with one intra-op thread each. `iter(loader)` is a `LoaderIterator`:
    `with iter(loader) as batches:` (or `batches.close()`) stops its worker threads.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        num_workers: int,
        pin_memory: bool,
        prefetch: int,
        device: torch.device,
        seed: int,
        drop_last: bool,
        order: Callable[[int], np.ndarray],
        collate: Callable[[list], Batch],
        infinite: bool,
        worker_method: Literal["thread", "process"],
        rank: int = 0,
        world_size: int = 1,
    ):
        self.dataset, self.batch_size, self.device = dataset, batch_size, device
        self.num_workers, self.prefetch, self.seed = num_workers, prefetch, seed
        self.drop_last, self.infinite, self.order, self.collate = (
            drop_last,
            infinite,
            order,
            collate,
        )
        n = len(dataset)
        self.num_samples = n
        self.rank, self.world_size = rank, world_size
        # one global batch: every process's batch, cut from one sample order (strided)
        self.global_batch_size = g = batch_size * world_size
        # samples used per epoch: with drop_last, the tail that does not fill a batch is skipped
        self.samples_per_epoch = n - n % g if drop_last else n
        self.pin_memory = pin_memory and device.type == "cuda"
        self._epoch, self._sample = 0, 0
        self._active: object | None = None
        self._iterators = 0  # how many iter(loader) there were
        self._pin: BaseNode | None = None
        self._prefetcher: BaseNode | None = None

        # The graph, in the order the data flows. snapshot_frequency=0: torchdata's own resume
        # (a snapshot of the upstream state after every item) would be wasted work, since a
        # position is all this loader needs to resume.
        node: BaseNode = OrderNode(order, self.samples_per_epoch, infinite, rank, world_size)
        self._source = node
        # in_order=True: the workers' results come out in the sampler's order, so the batches
        # do not depend on the number of workers or on which one finishes first.
        node = self._mapper = ParallelMapper(
            node,
            dataset.__getitem__,
            num_workers=num_workers,
            in_order=True,
            method=worker_method,
            snapshot_frequency=0,
        )
        # drop_last=False here: the order node already left out the tail that drop_last drops.
        node = Batcher(node, batch_size, drop_last=False)
        node = Mapper(node, collate)
        if self.pin_memory:  # page-locked host memory: the host-to-device copy can run async
            node = self._pin = PinMemory(node, snapshot_frequency=0)
        if prefetch > 0:  # a background thread keeps `prefetch` batches ready
            node = self._prefetcher = Prefetcher(
                node, prefetch_factor=prefetch, snapshot_frequency=0
            )
        if device.type != "cpu":
            node = Mapper(node, functools.partial(to_device, device=device))
        self._root = node
        # the nodes that run threads, the mapper first (see stop_threads)
        self._thread_nodes = (self._mapper, self._pin, self._prefetcher)

    # -- position ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self._epoch

    @property
    def sample(self) -> int:
        """How many samples of the current epoch's order were already delivered (to every
        process together: the position is global)."""
        return self._sample

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one epoch (a last partial batch counted, when `drop_last=False`)."""
        return -(-self.samples_per_epoch // self.global_batch_size)

    def __len__(self) -> int:
        """Batches in a full epoch (`batches_per_epoch`); an infinite loader has no length."""
        if self.infinite:
            raise TypeError("an infinite loader has no len(); use loader.batches_per_epoch")
        return self.batches_per_epoch

    def _advance(self) -> None:
        m, B = self.samples_per_epoch, self.global_batch_size
        if self.infinite:  # one stream of epochs: a batch may end one epoch and start the next
            self._epoch, self._sample = divmod(self._epoch * m + self._sample + B, m)
        else:
            self._sample += min(B, m - self._sample)
            if self._sample >= m:
                self._epoch, self._sample = self._epoch + 1, 0

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> LoaderIterator:
        return LoaderIterator(self)

    # -- state ------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "batch_size": self.global_batch_size,  # per process x processes: what must match
            "drop_last": self.drop_last,
            "order": getattr(self.order, "key", type(self.order).__qualname__),
        }

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch delivered, plus what must match to resume.

        Plain ints, strings and bools: `json.loads(json.dumps(sd))` loads back unchanged.
        """
        return {
            "format": STATE_FORMAT,
            "epoch": self._epoch,
            "sample": self._sample,
            "config": self._config(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """Move to the saved position; the next `iter(loader)` starts there.

        With `strict=True` (the default) the dataset size, batch size, drop_last and order (its
        kind and seed) must be those of the loader that saved it, since otherwise the batches
        would differ; a ValueError lists what differs. `strict=False` resumes at the same
        (epoch, sample) anyway. Workers, prefetch, pin_memory and device may always differ,
        and so may the number of processes, as long as the global batch (``batch_size`` x
        ``world_size``) is the same: the position is one of the global sample order.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"Loader.load_state_dict: not a loader state (expected format {STATE_FORMAT!r}, "
                f"got {state_dict!r:.120}); pass what Loader.state_dict() returned"
            )
        epoch, sample = state_dict.get("epoch"), state_dict.get("sample")
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, sample)
        ):
            raise ValueError(
                f"Loader.load_state_dict: epoch and sample must be ints >= 0, got {epoch!r}, {sample!r}"
            )
        if strict:
            saved, mine = state_dict.get("config", {}), self._config()
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            if diff:
                lines = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
                raise ValueError(
                    f"Loader.load_state_dict: the state comes from a different loader ({lines}); "
                    "build the loader as it was to resume exactly, or pass strict=False to "
                    "resume at the same epoch and sample anyway"
                )
        if sample >= self.samples_per_epoch:
            epoch, sample = epoch + 1, 0
        self._epoch, self._sample = epoch, sample
        self._active = None  # an iterator started before this no longer matches the position

    def __repr__(self) -> str:
        return (
            f"Loader({type(self.dataset).__name__} of {self.num_samples}, batch_size="
            f"{self.batch_size}, workers={self.num_workers}, device={self.device}, "
            f"epoch={self._epoch}, sample={self._sample})"
        )


def loader(
    dataset: Any,
    batch_size: int,
    *,
    num_workers: int = 0,
    pin_memory: bool = True,
    prefetch: int = 2,
    device: str | torch.device = "cpu",
    seed: int = 0,
    drop_last: bool = True,
    order: str | Callable[[int], np.ndarray] = "shuffle",
    collate: Callable[[list], Batch] | None = None,
    infinite: bool = False,
    worker_method: Literal["thread", "process"] = "thread",
    rank: int = 0,
    world_size: int = 1,
) -> Loader:
    """Batches of `dataset` through a `torchdata.nodes` graph, resumable exactly.

    Guarantees:
      - Determinism: the batches depend only on the dataset, `batch_size`, `seed`, `order` and
        `drop_last`; never on `num_workers`, `prefetch`, `pin_memory`, `device` or timing.
      - Coverage: with the default order each epoch is a permutation of the dataset: every
        sample once (with `drop_last=True` the `len(dataset) % batch_size` samples that do not
        fill a batch sit out that epoch; which ones changes each epoch).
      - Resume: `state_dict()` is JSON-serializable; `load_state_dict` on a fresh loader (any
        number of workers) continues with exactly the batches the first one would have given,
        mid-epoch or across epoch boundaries.
      - Device: batches arrive on `device`, copied with `non_blocking=True`; host memory is
        pinned first only if `pin_memory` and `device` is CUDA (elsewhere it is skipped).
      - Checks happen here, not during iteration: arguments, an empty dataset, a first example
        that is not a dict of tensors, an order that is not n indices in range.

    Args:
        dataset: map-style: `len(dataset)` and `dataset[i] -> dict of tensors`.
        batch_size: examples per batch.
        num_workers: threads (or processes) that call `dataset[i]`; 0 reads in the iterating
            thread's pipeline without extra workers.
        pin_memory: pin host memory before a CUDA copy (ignored for other devices).
        prefetch: batches kept ready by a background thread (0: none).
        device: where the batches go.
        seed: seeds the order (a new permutation each epoch, drawn from (seed, epoch)).
        drop_last: skip the last partial batch of each epoch.
        order: "shuffle" (default), "sequential", "length" (length-bucketed, needs
            `dataset.lengths`; see `bucket_by_length`), or a callable `epoch -> n indices`.
        collate: examples -> batch; default `dataset.collate` if the dataset has one, else
            `stack_collate`.
        infinite: one iteration never ends; epochs follow each other in one stream.
        worker_method: "thread" (default; numpy and torch release the GIL) or "process"
            (the dataset must pickle).
        rank, world_size: this process's share of a data-parallel run. The processes share one
            global order; a global batch is `batch_size * world_size` consecutive samples of
            it, and process `rank` takes every `world_size`-th of them from the `rank`-th on.
            The position (`state_dict`) is global, so a run resumes on another number of
            processes with the same global batch and continues with the same samples.

    Example:
        >>> import torch
        >>> ds = [{"x": torch.tensor([i])} for i in range(10)]
        >>> ld = loader(ds, 4, seed=0)
        >>> [b["x"].shape for b in ld]
        [torch.Size([4, 1]), torch.Size([4, 1])]
        >>> ld.epoch, ld.state_dict()["sample"]
        (1, 0)
    """
    who = "loader"
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{who}: batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"{who}: num_workers must be an int >= 0, got {num_workers!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{who}: prefetch must be an int >= 0 (0: no prefetch), got {prefetch!r}")
    if not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{who}: seed must be an int in [0, 2**32), got {seed!r}")
    for name, v, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{who}: {name} must be an int >= {low}, got {v!r}")
    if rank >= world_size:
        raise ValueError(f"{who}: rank must be < world_size, got {rank} and {world_size}")
    if world_size > 1 and not (drop_last or infinite):
        raise ValueError(
            f"{who}: with world_size={world_size}, an epoch's last partial global batch would "
            "give the processes different numbers of batches; pass drop_last=True or "
            "infinite=True"
        )
    if worker_method not in ("thread", "process"):
        raise ValueError(
            f"{who}: worker_method must be 'thread' or 'process', got {worker_method!r}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{who}: device {device!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{who}: device={device!r} but CUDA is not available; use device='cpu'")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"{who}: dataset must be map-style (len(dataset) and dataset[i]), got "
            f"{type(dataset).__name__}"
        )
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{who}: the dataset is empty")
    if drop_last and n < batch_size * world_size:
        raise ValueError(
            f"{who}: batch_size={batch_size} x world_size={world_size} is larger than the "
            f"dataset ({n} samples) and "
            "drop_last=True, so there would be no batch; lower batch_size or pass drop_last=False"
        )

    order_fn = make_order(order, dataset, n, batch_size, seed)
    collate_fn = collate if collate is not None else getattr(dataset, "collate", stack_collate)
    if not callable(collate_fn):
        raise TypeError(f"{who}: collate must be callable, got {collate_fn!r:.80}")
    lengths = getattr(dataset, "lengths", None)
    if collate_fn is stack_collate and lengths is not None and len(set(np.asarray(lengths))) > 1:
        raise ValueError(
            f"{who}: the examples have different lengths (dataset.lengths), which stack_collate "
            "cannot stack; pass collate=ftrain.data.PadCollate()"
        )
    # Read one example now so that a dataset or collate that cannot work fails here.
    first = dataset[int(order_fn(0)[0])]
    if not isinstance(first, Mapping) or not all(isinstance(k, str) for k in first):
        raise TypeError(
            f"{who}: dataset[i] must be a dict of tensors (str -> Tensor), got "
            f"{type(first).__name__}"
        )
    collate_fn([first])

    return Loader(
        dataset,
        batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch=prefetch,
        device=dev,
        seed=seed,
        drop_last=drop_last,
        order=order_fn,
        collate=collate_fn,
        infinite=infinite,
        worker_method=worker_method,
        rank=rank,
        world_size=world_size,
    )
