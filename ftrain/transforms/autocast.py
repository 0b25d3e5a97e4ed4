"""Mixed precision: forward in bf16/fp16, params and optimizer math in fp32."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from tensordict import TensorDict

from ftrain import tree
from ftrain.optim.base import all_finite
from ftrain.state import TrainState
from ftrain.step import Gradients, Step, Transform
from ftrain.step.capabilities import SCALES_LOSS, SETS_PRECISION

__all__ = ["Autocast", "autocast", "DynamicLossScale", "StaticLossScale"]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """fp16 loss scaling that adapts: halve the scale after a step with non-finite gradients
    (which is skipped), double it after ``growth_interval`` finite steps in a row.

    State (in ``state.extra["loss_scale"]``): ``scale`` (fp32) and ``good_steps`` (int64).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0

    def init(self) -> TensorDict:
        """The state it keeps: ``scale`` (0-d fp32) and ``good_steps`` (0-d int64)."""
        return TensorDict(
            {
                "scale": torch.tensor(self.init_scale, dtype=torch.float32),
                "good_steps": torch.zeros((), dtype=torch.int64),
            },
            batch_size=[],
        )

    def scale(self, extra: TensorDict) -> torch.Tensor:
        """The 0-d scale the loss is multiplied by now, from ``state.extra``."""
        return extra["loss_scale", "scale"]

    def update(self, ls: TensorDict, finite: torch.Tensor) -> TensorDict:
        """The next state, from this one and whether the step's gradients were finite (0-d bool);
        tensor ops only, no host sync."""
        scale, good = ls["scale"], ls["good_steps"]
        good = torch.where(finite, good + 1, torch.zeros_like(good))
        grow = good >= self.growth_interval
        scale = torch.where(
            finite,
            torch.where(grow, scale * self.growth_factor, scale),
            (scale * self.backoff_factor).clamp_min(self.min_scale),
        )
        good = torch.where(grow, torch.zeros_like(good), good)
        return TensorDict({"scale": scale, "good_steps": good}, batch_size=[])


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed fp16 loss scale; steps with non-finite gradients are still skipped."""

    value: float

    def init(self) -> TensorDict:
        """The state it keeps: ``scale`` (0-d fp32) and ``good_steps`` (0-d int64)."""
        return TensorDict(
            {
                "scale": torch.tensor(self.value, dtype=torch.float32),
                "good_steps": torch.zeros((), dtype=torch.int64),
            },
            batch_size=[],
        )

    def scale(self, extra: TensorDict) -> torch.Tensor:
        """The 0-d scale the loss is multiplied by now, from ``state.extra``."""
        return extra["loss_scale", "scale"]

    def update(self, ls: TensorDict, finite: torch.Tensor) -> TensorDict:
        """The next state: the scale stays; ``good_steps`` counts finite steps in a row."""
        good = torch.where(finite, ls["good_steps"] + 1, torch.zeros_like(ls["good_steps"]))
        return TensorDict({"scale": ls["scale"], "good_steps": good}, batch_size=[])


@contextlib.contextmanager
def _tf32_enabled():
    """TF32 matmuls and convolutions for this block only; the previous settings come back."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])


@dataclasses.dataclass(frozen=True, eq=False)
class Autocast(Transform):
    """Mixed precision (see :func:`autocast`): the ``forward`` hook enters ``torch.autocast``;
    with ``tf32``, ``wrap`` at the eager stage allows TF32 matmuls for the call. A loss scale
    (fp16) is :class:`LossScaled`'s, which :func:`autocast` builds."""

    dtype: torch.dtype = torch.bfloat16
    scaler: DynamicLossScale | StaticLossScale | None = None
    tf32: bool = False

    name = "autocast"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"ft.autocast(dtype={self.dtype!r}): legal dtypes are torch.bfloat16, "
                "torch.float16 and torch.float32 (no autocast)."
            )
        if not isinstance(self.tf32, bool):
            raise TypeError(f"ft.autocast(tf32={self.tf32!r}): expected a bool.")
        if self.scaler is not None:
            if not isinstance(self.scaler, (DynamicLossScale, StaticLossScale)):
                raise TypeError(
                    f"Autocast(scaler={self.scaler!r}): expected a DynamicLossScale, a "
                    "StaticLossScale or None."
                )
            if self.dtype is not torch.float16:
                raise ValueError(
                    f"ft.autocast: a loss scale only applies to torch.float16; "
                    f"{_DTYPES[self.dtype]} needs no loss scaling. Drop the argument."
                )
            if not isinstance(self, LossScaled):
                raise TypeError(
                    "Autocast(scaler=...): the loss scale's hooks are LossScaled's; build it with "
                    "ft.autocast(step, torch.float16, loss_scale=...)."
                )
        elif isinstance(self, LossScaled):
            raise TypeError(
                "LossScaled(scaler=None): give it a DynamicLossScale or StaticLossScale."
            )

    def capabilities(self):
        return {SETS_PRECISION: _DTYPES[self.dtype]}

    def wrap(self, fn, stage: str):
        if stage != "eager" or not self.tf32:
            return fn

        def with_tf32(state, batch):
            with _tf32_enabled():
                return fn(state, batch)

        return with_tf32

    def forward(self, fn):
        if self.dtype is torch.float32:
            return fn
        dtype = self.dtype

        def autocast_call(params, batch, state):
            device = tree.first_leaf(params).device
            with torch.autocast(device_type=device.type, dtype=dtype):
                return fn(params, batch, state)

        return autocast_call


@dataclasses.dataclass(frozen=True, eq=False)
class LossScaled(Autocast):
    """fp16 autocast with a loss scale: ``init`` keeps the scale in ``state.extra["loss_scale"]``,
    ``loss_scale`` gives it to the engine, ``gradients`` skips a step whose gradients are not
    finite and updates the scale (see :func:`autocast`)."""

    name = "autocast"

    def capabilities(self):
        return {**super().capabilities(), SCALES_LOSS: type(self.scaler).__name__}

    def init(self, state: TrainState) -> TrainState:
        if "loss_scale" in state.extra.keys():
            return state
        extra = state.extra.clone(recurse=False)
        extra["loss_scale"] = self.scaler.init()
        return state.replace(extra=extra)

    def loss_scale(self, state: TrainState) -> torch.Tensor:
        return self.scaler.scale(state.extra)

    def gradients(self, g: Gradients, state: TrainState) -> Gradients:
        finite = all_finite(tree.leaves(g.grads))
        extra = g.extra.clone(recurse=False)
        extra["loss_scale"] = self.scaler.update(state.extra["loss_scale"], finite)
        skip = ~finite if g.skip is None else g.skip | ~finite
        metrics = {**g.metrics, "skipped": ~finite, "loss_scale": extra["loss_scale", "scale"]}
        return g._replace(skip=skip, metrics=metrics, extra=extra)


def autocast(
    step: Step,
    dtype: torch.dtype = torch.bfloat16,
    *,
    loss_scale: str | float | DynamicLossScale | StaticLossScale | None = "dynamic",
    tf32: bool = False,
) -> Step:
    """Run the forward (and so the backward) under ``torch.autocast(dtype)``.

    Params, gradients and the optimizer stay fp32 (master weights). With ``torch.float16``,
    the loss is multiplied by a loss scale before backward and the gradients divided by it after;
    a step whose gradients are not finite leaves params and optimizer state untouched, reports
    ``metrics["skipped"] == True``, and (``loss_scale="dynamic"``) halves the scale. The scale and
    its counter live in ``state.extra["loss_scale"]``, so they are saved and resumed. bf16 has
    fp32's range and needs no scaling. ``torch.float32`` means no autocast (useful with
    ``tf32=True``). ``tf32=True`` allows TF32 matmuls for the extent of the step only.

    **Invariant:** bf16 and fp16 results are close to fp32: on small models the loss agrees to
    1e-2 and each gradient tensor to 3e-2, relative to its largest entry (bf16 measures about
    8e-3, fp16 about 1e-3; ``tests/transforms/test_autocast.py``). fp16 never applies a non-finite update.
    """
    if dtype not in _DTYPES:
        raise ValueError(
            f"ft.autocast(dtype={dtype!r}): legal dtypes are torch.bfloat16, torch.float16 and "
            "torch.float32 (no autocast)."
        )
    scaler = None
    if dtype is torch.float16:
        if loss_scale == "dynamic":
            scaler = DynamicLossScale()
        elif isinstance(loss_scale, (DynamicLossScale, StaticLossScale)):
            scaler = loss_scale
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            if loss_scale <= 0:
                raise ValueError(f"ft.autocast(loss_scale={loss_scale}): must be > 0.")
            scaler = StaticLossScale(float(loss_scale))
        elif loss_scale is not None:
            raise ValueError(
                f"ft.autocast(loss_scale={loss_scale!r}): use 'dynamic', a positive number, "
                "a DynamicLossScale(...), a StaticLossScale(...), or None."
            )
    elif loss_scale not in ("dynamic", None):
        raise ValueError(
            f"ft.autocast(loss_scale={loss_scale!r}) only applies to torch.float16; "
            f"{_DTYPES[dtype]} needs no loss scaling. Drop the argument."
        )

    return (LossScaled if scaler is not None else Autocast)(dtype, scaler, tf32)(step)
