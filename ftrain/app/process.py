"""Settings a training process applies to itself, and only to itself.

    ftrain train ...                 # the command calls keep_freed_memory() before it trains
    python benchmarks/run_all.py     # the benchmarks do the same, for both sides of a comparison

These change the whole process (here: glibc's malloc), so a library import never applies them: the
``ftrain`` command does for its own process, and a script that trains may call them itself.
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["keep_freed_memory"]


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the OS.

    A training step allocates and frees the same activation buffers every step (about 170 MiB a
    step for the default model). With glibc's defaults the large ones are fresh ``mmap`` regions,
    or the top of the heap is trimmed and regrown, so every step page-faults its activations in
    again: millions of faults and seconds of kernel time over the default run. After this call
    buffers up to 32 MiB come from the heap and the heap keeps up to 1 GiB of free memory. Process
    wide, so ``ftrain train`` calls it for its own process and a library import never does.
    Returns whether it took effect (only with glibc; elsewhere it does nothing).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # glibc's <malloc.h>
    settings = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_top_pad, 64 << 20))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)
