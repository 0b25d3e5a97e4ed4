"""Byte sizes written the way people write them: ``parse_bytes("4GiB")``, ``format_bytes(n)``.

One grammar for every size ftrain reads (``ft.fit``'s budget, ``--memory-budget``,
``ft.consolidate``'s ``max_shard_size``): decimal ``KB``/``MB``/``GB``/``TB``, binary
``KiB``/``MiB``/``GiB``/``TiB``, a bare ``K``/``M``/``G``/``T`` meaning the binary unit.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(size: int | float | str, name: str = "budget") -> int:
    """Bytes from an int or a string such as ``"4GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"4G"``
    (a bare ``K``/``M``/``G``/``T`` means the binary unit, as ``torch`` and ``free -h`` print)."""
    if isinstance(size, bool):
        raise TypeError(f"{name}={size!r}: expected a number of bytes or a string like '4GiB'.")
    if isinstance(size, (int, float)):
        if size <= 0:
            raise ValueError(f"{name}={size!r}: must be > 0 bytes.")
        return int(size)
    if isinstance(size, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", size)
        if m:
            number, prefix, suffix = m.groups()
            unit = prefix.lower() + ("ib" if suffix is None and prefix else (suffix or "").lower())
            if unit in _UNITS and float(number) > 0:
                return int(float(number) * _UNITS[unit])
    raise ValueError(
        f"{name}={size!r}: expected a positive number of bytes or a size like '4GiB', '512MiB', "
        "'1.5GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; K/M/G/T alone mean KiB/.../TiB)."
    )


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, 3 significant digits: ``'1.50 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
