"""What ``ft.memory`` and ``ft.fit`` return: :class:`MemoryReport` and :class:`FitReport`
(byte sizes are read and written by :mod:`ftrain.internals.units`)."""

from __future__ import annotations

import dataclasses

from ftrain.internals.units import format_bytes, parse_bytes

__all__ = ["MemoryReport", "FitReport", "Candidate", "parse_bytes", "format_bytes"]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Predicted bytes per rank of one call of a step (see :func:`ftrain.memory`).

    Where the bytes live: when the step's params are on an accelerator (``device`` is not
    ``"cpu"``), the fields without a prefix count the accelerator's bytes and the ``host_``
    fields the host's (CPU memory: ``ft.offload``'s optimizer state and update). On a CPU plan
    the host is the device: every byte is in the unprefixed fields and the ``host_`` ones are 0.

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
        device: the device type the step's params are planned on (``"cuda"``, ``"cpu"``).
        host_params, host_gradients, host_optimizer, host_activations, host_update: the same
            kinds, on the host (0 on a CPU plan).
        host_peak: the most host bytes alive at once (0 on a CPU plan).
        in_flight: the most micro-batches whose activations are alive at once: 1, but under
            ``ft.pipeline`` what this rank's schedule keeps (GPipe: all of them; 1F1B: up to
            ``p - s`` on stage ``s`` of ``p``); ``activations`` is then one micro-batch's
            through one of this rank's stages, the last stage's loss included.

    **Invariant:** ``peak`` is the device's peak (``device_peak``) whatever the host holds, so a
    budget compares against it alone; ``state + host_state`` is the same for a step with and
    without ``ft.offload`` (offload moves bytes, it does not remove them).
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
    device: str = "cpu"
    host_params: int = 0
    host_gradients: int = 0
    host_optimizer: int = 0
    host_activations: int = 0
    host_update: int = 0
    host_peak: int = 0
    in_flight: int = 1

    @property
    def state(self) -> int:
        """params + gradients + optimizer state on the device: what stays whatever the batch."""
        return self.params + self.gradients + self.optimizer

    @property
    def host_state(self) -> int:
        """params + gradients + optimizer state on the host (0 on a CPU plan)."""
        return self.host_params + self.host_gradients + self.host_optimizer

    @property
    def device_peak(self) -> int:
        """The device's peak: ``peak``, named for tables that show the host's beside it."""
        return self.peak

    @property
    def host_apart(self) -> bool:
        """Whether host bytes are counted apart (the params are not on the CPU)."""
        return self.device != "cpu"

    def __str__(self) -> str:
        rows = [
            ("params", self.params, self.host_params),
            ("gradients", self.gradients, self.host_gradients),
            ("optimizer state", self.optimizer, self.host_optimizer),
            (
                f"activations (1 of {self.micro_batches} micro-batches"
                + (f", {self.in_flight} alive at once)" if self.in_flight > 1 else ")"),
                self.activations,
                self.host_activations,
            ),
            ("update (transient)", self.update, self.host_update),
            ("batch", self.batch, 0),
            ("peak (" + self.peak_phase + ")", self.peak, self.host_peak),
        ]
        width = max(len(r[0]) for r in rows) + 2
        head = f"ft.memory: {' > '.join(self.transforms) or 'train_step'}"
        if self.world_size > 1:
            head += f", per rank of {self.world_size}"
        lines = [head]
        if not self.host_apart:
            lines += [f"  {name:<{width}}{format_bytes(n):>11}" for name, n, _ in rows]
            lines.append("  (a CPU plan: host == device, every byte above is host memory)")
            return "\n".join(lines)
        lines.append(f"  {'':<{width}}{self.device:>11}{'host':>11}")
        lines += [f"  {k:<{width}}{format_bytes(d):>11}{format_bytes(h):>11}" for k, d, h in rows]
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
    offload: str = "none"  # "optimizer": ft.offload (state and update on the host)
    host_peak: int = 0  # the host's peak bytes (0 on a CPU plan)

    @property
    def label(self) -> str:
        """``'k=2 selective bf16'`` (and the shard strategy and offload when there are)."""
        s = f"k={self.micro_batches} {self.policy} {self.precision}"
        s += f" {self.strategy}" if self.strategy else ""
        return s + (f" offload={self.offload}" if self.offload != "none" else "")


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
        lines.append(f"  {'composition':<40}{'peak':>11}{'host peak':>11}{'time':>7}  fits")
        for c in self.candidates:
            mark = " <- chosen" if c == self.chosen else ""
            lines.append(
                f"  {c.label:<40}{format_bytes(c.peak):>11}{format_bytes(c.host_peak):>11}"
                f"{c.time:>7.2f}  {'yes' if c.fits else 'no'}{mark}"
            )
        lines.append(f"  {self.reason}")
        return "\n".join(lines)
