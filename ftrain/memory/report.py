"""What ``ft.memory`` and ``ft.fit`` return: :class:`MemoryReport` and :class:`FitReport`
(byte sizes are read and written by :mod:`ftrain.internals.units`)."""

from __future__ import annotations

import dataclasses

from ftrain.internals.units import format_bytes, parse_bytes

__all__ = ["MemoryReport", "FitReport", "Candidate", "parse_bytes", "format_bytes"]


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
