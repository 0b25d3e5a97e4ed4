"""Saves that do not stall training: :class:`Saver`, one background save at a time.

    saver = ft.Saver()
    for n in range(steps):
        state, metrics = step(state, next(batches))
        if n % 100 == 0:
            saver.save_checkpoint("runs/a", state, extra={"loader": loader.state_dict()})
    saver.wait()  # the last checkpoint is committed (an error of any save is raised here)

Each save copies the state to host memory at once (pinned for CUDA tensors; a sharded state's
process keeps only its own pieces) and writes it from a background thread while the next steps
run. The next save waits for the one before it, and raises its error if it failed; so does
``wait()``. A kill during a write leaves the previous checkpoint whole (the writes are atomic).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrain.io.background import SaveHandle
from ftrain.io.checkpoint import snapshot
from ftrain.io.runs import save_checkpoint
from ftrain.state import TrainState

__all__ = ["Saver"]


class Saver:
    """One save at a time, in the background: each save first waits for the one before.

    The pending save lives in this object, and so does the process group a sharded save runs
    its collectives on (made at its first sharded save: every process calls it then). Use it as
    a context manager, or call :meth:`wait` before the program relies on the last checkpoint.
    """

    def __init__(self) -> None:
        self._pending: SaveHandle | None = None
        self._group: Any = None

    def wait(self) -> Path | None:
        """Wait for the pending save; returns its path (None if there was none), or raises its
        error."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def save(
        self,
        state: TrainState,
        path: str | os.PathLike,
        *,
        extra: Mapping | None = None,
        blocking: bool = False,
        pipeline: Any = None,
    ) -> SaveHandle:
        """``ft.save(state, path, extra=extra, pipeline=pipeline)`` in the background (or now with
        ``blocking``), after the previous save of this saver has ended. Returns its handle."""
        path = Path(path)

        def write(snap, group):
            return snap.write(path, group)

        return self._start(state, extra, blocking, write, path, pipeline)

    def save_checkpoint(
        self,
        run_dir: str | os.PathLike,
        state: TrainState,
        *,
        keep: int | None = 3,
        extra: Mapping | None = None,
        blocking: bool = False,
        pipeline: Any = None,
    ) -> SaveHandle:
        """``ft.save_checkpoint(run_dir, state, keep=keep, extra=extra, pipeline=pipeline)`` in
        the background (or now with ``blocking``), after the previous save of this saver has
        ended."""

        def write(snap, group):
            return save_checkpoint(run_dir, snap, keep=keep, group=group)

        return self._start(state, extra, blocking, write, Path(run_dir), pipeline)

    def _start(self, state, extra, blocking, write, where: Path, pipeline) -> SaveHandle:
        self.wait()
        snap = snapshot(state, extra, copy=not blocking, pipeline=pipeline)
        if snap.plan is not None and self._group is None:
            self._group = snap.new_group()
        group = self._group if snap.plan is not None else None
        handle = SaveHandle(
            lambda: write(snap, group), f"ft.Saver save to {str(where)!r}", background=not blocking
        )
        if not blocking:
            self._pending = handle
        else:
            handle.wait()
        return handle

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.wait()
        else:  # already failing: wait without hiding the first error, but say the save failed
            try:
                self.wait()
            except Exception as e:  # noqa: BLE001
                warnings.warn(
                    f"ft.Saver: the last save failed too ({e!r}); the checkpoint before it is "
                    "the newest whole one.",
                    RuntimeWarning,
                    stacklevel=2,
                )
