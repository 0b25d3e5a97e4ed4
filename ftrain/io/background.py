"""A save that runs in a background thread: :class:`SaveHandle`.

The thread is not a daemon, so the interpreter's exit waits for it: a run that returns while its
last save is still being written still ends with that checkpoint committed. On Linux it runs at a
lower priority (nice +10, that thread only): on a machine whose cores are all busy, the training
step goes first and the write takes what is left. Its error, if any, is
kept and raised by :meth:`SaveHandle.wait`; a handle dropped without ``wait()`` after a failure
warns, so a failed save is never silent.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["SaveHandle"]


def _lower_priority() -> None:
    """Raise this thread's niceness by 10 (Linux: setpriority of a thread id is per thread)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))


class SaveHandle:
    """A checkpoint being written from a background thread (``ft.save(..., blocking=False)``).

    ``wait()`` blocks until the write ends and returns its path, or raises its error (every
    time it is called). ``done()`` says whether it ended. The checkpoint appears at its path
    only when the write has committed it whole.
    """

    def __init__(self, write: Callable[[], Path], what: str, *, background: bool = True):
        self.what = what
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(write,), name=what)
            self._thread.start()
        else:
            self._run(write)

    def _run(self, write: Callable[[], Path]) -> None:
        if self._thread is not None:
            _lower_priority()
        try:
            self._path = write()
        except BaseException as e:  # noqa: BLE001 - kept for wait() to raise
            self._error = e

    def done(self) -> bool:
        """Whether the write has ended (committed, or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """The checkpoint's path once the write has committed it; raises the write's error.
        With ``timeout`` (seconds), a ``TimeoutError`` if it has not ended by then."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.what} is still writing after {timeout} s.")
        self._observed = True
        if self._error is not None:
            raise self._error
        return self._path  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error else "done")
        return f"SaveHandle({self.what}, {state})"

    def __del__(self) -> None:
        if self._error is not None and not self._observed:
            warnings.warn(
                f"{self.what} failed and nobody waited for it: {self._error!r}. Call "
                "handle.wait() (or use ft.Saver) to get the error where it happened.",
                RuntimeWarning,
                stacklevel=1,
            )
