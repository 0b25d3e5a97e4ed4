"""What ``ft.memory`` and ``ft.fit`` return: :class:`MemoryReport`, :class:`FitReport`, and byte
sizes written the way people write them (``"4GiB"``)."""

from __future__ import annotations

import dataclasses
import re

__all__ = ["MemoryReport", "FitReport", "Candidate", "parse_bytes", "format_bytes"]

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


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Predicted bytes per rank of one call of a step (see :func:`ftrain.memory`).

    Attributes:
        params: the params a rank holds (its shards under fsdp).
        gradients: the gradients the optimizer gets (their shards under zero2/fsdp).
        optimizer: the optimizer state a rank holds.
        activations: bytes saved for backward by one micro-batch's forward (the largest).
        update: the update's transient peak: bytes above those alive when it starts (new params
            and optimizer state while the old ones are held, temporaries of the math).
        batch: the batch (this rank's share).
        peak: the most bytes alive at once during the step, all of the above as they overlap.
        peak_phase: where the peak falls: ``"forward/backward"`` or ``"update"``.
        micro_batches: how many pieces the step splits the batch into.
        flops: floating-point operations of the step, recompute included (one rank).
        transforms: the names of the step's transforms, innermost first.
        world_size: ranks the bytes are divided among (1 without ``ft.shard``).
    """

    params: int
    gradients: int
    optimizer: int
    activations: int
    update: int
    batch: int
    peak: int
    peak_phase: str
    micro_batches: int
    flops: int
    transforms: tuple[str, ...]
    world_size: int = 1

    @property
    def state(self) -> int:
        """params + gradients + optimizer state: what stays whatever the batch."""
        return self.params + self.gradients + self.optimizer

    def __str__(self) -> str:
        rows = [
            ("params", self.params),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer),
            (f"activations (1 of {self.micro_batches} micro-batches)", self.activations),
            ("update (transient)", self.update),
            ("batch", self.batch),
        ]
        width = max(len(r[0]) for r in rows) + 2
        head = f"ft.memory: {' > '.join(self.transforms) or 'train_step'}"
        if self.world_size > 1:
            head += f", per rank of {self.world_size}"
        lines = [head]
        lines += [f"  {name:<{width}}{format_bytes(n):>11}" for name, n in rows]
        lines.append(f"  {'peak (' + self.peak_phase + ')':<{width}}{format_bytes(self.peak):>11}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One composition ``ft.fit`` considered, with its predicted peak and relative step time."""

    micro_batches: int
    policy: str
    precision: str
    strategy: str | None
    peak: int
    time: float  # predicted step time relative to the fastest composition considered
    fits: bool

    @property
    def label(self) -> str:
        """``'k=2 selective bf16'`` (and the shard strategy when there is one)."""
        s = f"k={self.micro_batches} {self.policy} {self.precision}"
        return s + (f" {self.strategy}" if self.strategy else "")


@dataclasses.dataclass(frozen=True)
class FitReport:
    """What :func:`ftrain.fit` considered and chose.

    Attributes:
        budget: bytes per rank.
        chosen: the composition returned.
        candidates: every composition planned, fastest predicted first.
        memory: the chosen step's :class:`MemoryReport`.
        reason: one sentence: why this one.
    """

    budget: int
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    memory: MemoryReport
    reason: str

    def __str__(self) -> str:
        lines = [f"ft.fit: budget {format_bytes(self.budget)} per rank; chose {self.chosen.label}"]
        lines.append(f"  {'composition':<28}{'peak':>11}{'time':>7}  fits")
        for c in self.candidates:
            mark = " <- chosen" if c == self.chosen else ""
            lines.append(
                f"  {c.label:<28}{format_bytes(c.peak):>11}{c.time:>7.2f}  "
                f"{'yes' if c.fits else 'no'}{mark}"
            )
        lines.append(f"  {self.reason}")
        return "\n".join(lines)
