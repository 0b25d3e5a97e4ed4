"""The torchdata side of ``ftrain.data.loader``: the source node that reads an order from a
position, the device copy, and keeping the caller's thread count. The one module that reaches into
torchdata's internals (:func:`stop_threads`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

__all__ = ["OrderNode", "to_device", "keep_num_threads", "stop_threads"]


class OrderNode(BaseNode[int]):
    """Source node: the indices of `order(epoch)` from a start position; no state of its own.

    Yields the first `per_epoch` indices of each epoch's order; stops at the end of the epoch,
    or goes on to the next epoch when `infinite`. With `world_size` > 1 the epochs form one
    global stream and this node yields every `world_size`-th index of it from `rank` on: the
    processes of a run share one sample order, whatever their number.
    """

    def __init__(
        self,
        order: Callable[[int], np.ndarray],
        per_epoch: int,
        infinite: bool,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        self.order, self.per_epoch, self.infinite = order, per_epoch, infinite
        self.rank, self.world_size = rank, world_size  # this process reads every world_size-th
        self.start = (0, 0)  # the global position, set by Loader before each reset

    def reset(self, initial_state: dict | None = None):
        super().reset(initial_state)
        if initial_state is not None:  # torchdata's snapshots (never used by Loader's resume)
            self.epoch, self.sample = initial_state["epoch"], initial_state["sample"]
        else:
            self.epoch, self.sample = self.start
            self.sample += self.rank  # this process's first sample of the global stream
        self._indices: np.ndarray | None = None

    def next(self) -> int:
        while self.sample >= self.per_epoch:  # the stream goes on in the next epoch's order
            if not self.infinite:
                raise StopIteration
            self.epoch, self.sample, self._indices = (
                self.epoch + 1,
                self.sample - self.per_epoch,
                None,
            )
        if self._indices is None:
            self._indices = self.order(self.epoch)
        i = int(self._indices[self.sample])
        self.sample += self.world_size
        return i

    def get_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample": self.sample}


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    # non_blocking: from pinned memory the copy is asynchronous; the next use of the tensor on
    # `device` waits for it on the stream, so there is no host sync here.
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
    }


def keep_num_threads(threads: int) -> None:
    """Give the caller back its intra-op thread count if the pipeline's threads changed it.

    torchdata's thread workers (and PinMemory's thread) call `torch.set_num_threads(1)` when
    they start. That count is process-wide: in a fresh process it leaves the caller's own ops,
    the training step included, on one thread. A worker may start a little after `reset()`,
    so this runs after `reset()` and after each batch; the workers keep their own count of 1.
    (`get_num_threads` is an atomic load, so the check costs nothing.)
    """
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def stop_threads(nodes: Sequence[BaseNode | None]) -> None:
    """Stop the threads (or processes) that ``nodes`` run, in order.

    torchdata's nodes have no public close(): their iterators stop their threads in the private
    ``_shutdown()`` (a public ``close()`` on the nodes would replace this). Give the mapper first:
    its next() then ends, so a prefetch thread that waits on it ends too.
    """
    for node in nodes:
        it = getattr(node, "_it", None)
        it = getattr(it, "_it", it)  # ParallelMapper -> _ParallelMapperImpl -> its iterator
        if hasattr(it, "_shutdown"):
            it._shutdown()
