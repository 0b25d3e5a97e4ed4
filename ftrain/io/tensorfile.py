"""Writing a safetensors file one tensor at a time, hashing it on the way.

``safetensors.torch.save_file`` first turns every tensor into a ``bytes`` copy, so a save briefly
holds the state twice. :func:`write` streams each tensor's own memory to the file instead (no copy
of a contiguous CPU tensor) and computes the file's sha256 as it writes, so a checkpoint's hash
costs no second read. The file is an ordinary safetensors file: ``safetensors.torch.load_file``
and ``safe_open`` read it.

Format (the safetensors specification): an 8-byte little-endian header length, a JSON header
``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` padded with
spaces to a multiple of 8 bytes, then the tensors' bytes back to back in header order.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

__all__ = ["DTYPES", "write", "write_lazy"]

# torch dtype -> the safetensors name of it
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying them."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write(
    file: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, int | str]:
    """Write ``tensors`` to the safetensors file ``file``; returns ``{"sha256", "bytes"}`` of it.

    Each tensor must be a plain CPU tensor; a non-contiguous one is copied (alone) before it is
    written, a contiguous one is written from its own memory. Several names may share memory.
    The file is flushed and fsynced before this returns. Raises ``TypeError`` naming a tensor of
    a dtype safetensors cannot hold.
    """
    specs = {k: (t.dtype, list(t.shape)) for k, t in tensors.items()}
    return write_lazy(file, specs, tensors.__getitem__, metadata)


def write_lazy(
    file: str | os.PathLike,
    specs: Mapping[str, tuple[torch.dtype, list[int]]],
    get: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> dict[str, int | str]:
    """:func:`write` of tensors made one at a time: ``specs`` gives each name's dtype and shape
    (the header comes first), ``get(name)`` the tensor, called once per name in order and dropped
    once written. So at most one of them is in memory at a time."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    start = 0
    for key, (dtype, shape) in specs.items():
        if dtype not in DTYPES:
            raise TypeError(
                f"cannot write {key!r}: safetensors holds no {dtype} tensors (legal dtypes: "
                f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)})."
            )
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [start, start + size]}  # fmt: skip
        start += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = hashlib.sha256()
    with open(file, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
        for key, (dtype, shape) in specs.items():
            t = get(key)
            if t.device.type != "cpu" or t.dtype != dtype or list(t.shape) != list(shape):
                raise ValueError(
                    f"cannot write {key!r}: expected a CPU {dtype}{list(shape)} tensor, got "
                    f"{t.device} {t.dtype}{list(t.shape)}; copy it to the CPU first."
                )
            if t.numel() == 0:
                continue
            raw = _raw(t if t.is_contiguous() else t.contiguous())  # (numel * itemsize,) bytes
            f.write(raw)
            digest.update(raw)
            del t, raw
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": Path(file).stat().st_size}
