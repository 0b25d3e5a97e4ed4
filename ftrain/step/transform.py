"""``ft.Transform``: the one protocol every transform of a step uses, built-in or yours.

A transform is an immutable object with *hooks*: methods the step calls at fixed points of one
optimizer step. Each hook has a default that changes nothing; a transform overrides the ones it
needs. ``transform(step)`` returns a new step with the transform applied last (outermost).

========  =======================================  ===============================================
when      hook                                     used by
========  =======================================  ===============================================
building  ``check(inner, outer)``                  ordering rules (each once, accumulate once)
          ``optimizer(opt) -> opt``                ``shard`` (ZeRO runs the optimizer on shards)
          ``wrap(fn) -> fn``                       ``compile``, ``ema``, ``vmap``, ``wrap``
each call ``init(state) -> state``                 ``autocast`` (fp16 loss scale), ``ema``
          ``around_step(state) -> ctx``            ``autocast`` (TF32), ``shard`` (rank stream)
forward   ``split(batch) -> [batch, ...]``         ``accumulate``
          ``loss_params(params, state) -> p``      ``lora`` (frozen base + adapters)
          ``around_forward(params) -> ctx``        ``autocast`` (``torch.autocast``)
          ``rewrite(module) -> module``            ``checkpoint``, ``shard`` (fsdp gathering)
backward  ``engine(engine) -> engine``             the gradient engine (``AutogradEngine``)
          ``loss_scale(state) -> tensor``          ``autocast`` (fp16)
reduce    ``reduce(grads, sums) -> grads, sums``   ``shard`` (sums across processes)
update    ``gradients(g, state) -> g``             ``autocast`` (skip non-finite steps); yours:
                                                   noise, spike guards, gradient metrics
========  =======================================  ===============================================

``init``, ``around_step`` and the ``wrap`` of transforms applied after ``ft.compile`` (``ft.vmap``'s
excepted: its ``wrap_order`` puts it innermost) run eagerly around the compiled function; every
other hook runs inside it and is compiled with the step, whenever its transform was applied. Hooks run in
the order the transforms were applied (innermost first). A transform holds no mutable
attributes: what it remembers between steps lives in ``state.extra`` (created in ``init``), so it
is saved, resumed, sharded and compiled like the rest of the state.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from tensordict import TensorDict
from torch import nn

if TYPE_CHECKING:
    from ftrain.optim.base import GradientTransformation
    from ftrain.state import TrainState
    from ftrain.step.engine import GradEngine

__all__ = ["Transform", "Gradients", "StepFn", "INNER_HOOKS"]

StepFn = Callable[[Any, Any], tuple[Any, dict[str, torch.Tensor]]]

# The hooks that act inside the step function (ft.compile compiles them, wherever it was applied).
INNER_HOOKS = (
    "optimizer",
    "split",
    "loss_params",
    "around_forward",
    "rewrite",
    "engine",
    "loss_scale",
    "reduce",
    "gradients",
)


class Gradients(NamedTuple):
    """What the ``gradients`` hook sees and returns: the step's result so far, between the
    reduction and the optimizer update. Return a copy with ``g._replace(...)``.

    Attributes:
        grads: the gradients of the whole batch's mean loss (summed across processes, divided by
            the count and any loss scale), keyed like the params. What the optimizer will get.
        skip: a 0-d bool tensor: True skips the update (params and optimizer state stay as they
            were; the step counter still moves). None: never skipped (lets a donated step update
            in place). Combine with ``skip | mine`` when it is already set.
        metrics: the step's metrics so far (0-d tensors); add yours.
        extra: what the new state's ``extra`` will hold; put your running statistics here.
    """

    grads: TensorDict
    skip: torch.Tensor | None
    metrics: dict[str, torch.Tensor]
    extra: TensorDict


@runtime_checkable
class _StepLike(Protocol):
    """What a transform is applied to: an ``ft.Step`` (named by its members: the step's module
    imports this one)."""

    loss_fn: Any
    optimizer: Any
    transforms: tuple

    def add(self, transform: Transform) -> Any: ...


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Transform:
    """Base class of transforms: every hook does nothing. Subclass it and override hooks.

    Class attributes:
        name: used in messages and ``repr`` (default: the class name in snake case).
        once: applying a second transform of this class to one step is an error.
        rewrite_order: where this transform's :meth:`rewrite` runs among others: lower first,
            closer to the module's own code. fsdp's gathering (-1) runs inside activation
            checkpointing (0), so that a recomputed block gathers its parameters again.
        wrap_order: where this transform's :meth:`wrap` sits among others: lower inside, then as
            applied. ``ft.vmap`` (-1) is innermost, so ``ft.compile`` (0) compiles the vmapped
            step in either order, and every other wrap sees the stacked state.

    Keep a transform immutable (a frozen dataclass is a good fit), check its arguments in
    ``__init__``/``__post_init__``, and keep metrics as 0-d tensors (no ``.item()``: a host sync,
    and a graph break under compile).
    """

    name: str = ""
    once: ClassVar[bool] = False
    rewrite_order: ClassVar[int] = 0
    wrap_order: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = _snake(cls.__name__)

    def __call__(self, step):
        """``step`` with this transform applied last: a new step; ``step`` is left as it was."""
        if not isinstance(step, _StepLike):
            hint = ""
            if callable(step):
                hint = (
                    " A plain function cannot be transformed because its phases are hidden; build "
                    "the step with ft.train_step(loss_fn, optimizer) and apply transforms to it."
                )
            raise TypeError(
                f"ft.{self.name}(step): expected an ft.Step, got {type(step).__name__}.{hint}"
            )
        return step.add(self)

    def uses(self, hook: str) -> bool:
        """Whether this transform acts in ``hook`` (by default: whether its class overrides it).
        Override to opt out per instance (``autocast`` to bf16 has no loss scale)."""
        return getattr(type(self), hook) is not getattr(Transform, hook)

    def compile_refusal(self) -> str | None:
        """Why ``torch.compile`` cannot compile a step holding this transform, or None (it can)."""
        return None

    # -- building -----------------------------------------------------------------------------
    def check(self, inner: tuple[Transform, ...], outer: tuple[Transform, ...]) -> None:
        """Ordering rules, checked whenever a transform is added to the step: ``inner`` were
        applied before this one, ``outer`` after. Raise ``ValueError`` saying which order works.
        The default enforces ``once``."""
        if self.once and any(type(t) is type(self) for t in (*inner, *outer)):
            raise ValueError(
                f"ft.{self.name} was applied twice; apply it once, with the settings you want."
            )

    def optimizer(self, optimizer: GradientTransformation) -> GradientTransformation:
        """The optimizer the step runs, given the one inside (e.g. run on shards)."""
        return optimizer

    def wrap(self, fn: StepFn) -> StepFn:
        """The step function ``(state, batch) -> (state, metrics)`` wrapping ``fn``. It must not
        mutate its inputs."""
        return fn

    # -- each call ----------------------------------------------------------------------------
    def init(self, state: TrainState) -> TrainState:
        """``state`` with the entries this transform keeps in ``state.extra`` added when missing
        (leave present ones alone: a resumed state already has them)."""
        return state

    def around_step(self, state: TrainState) -> contextlib.AbstractContextManager:
        """A context entered around the whole call (eagerly, also around a compiled step)."""
        return contextlib.nullcontext()

    # -- forward ------------------------------------------------------------------------------
    def split(self, batch: Any) -> list[Any]:
        """The pieces the batch is split into, each run forward and backward on its own."""
        return [batch]

    def loss_params(self, params: TensorDict, state: TrainState) -> TensorDict:
        """The params the loss function is called with, given the step's own (the leaf copies the
        gradient engine differentiates, whose keys the optimizer state follows) and the state.
        Called once per piece, inside the gradient engine: what it takes from ``state`` is used,
        not differentiated (``ft.lora`` adds its frozen base here)."""
        return params

    def around_forward(self, params: TensorDict) -> contextlib.AbstractContextManager:
        """A context entered around each call of the loss function (once per micro-batch)."""
        return contextlib.nullcontext()

    def rewrite(self, module: nn.Module) -> nn.Module:
        """The module ``ft.apply`` runs in place of ``module`` during the forward. Return a
        rewritten copy (``ftrain.blocks.replace_forwards``), never a modified ``module``. The
        step keeps the copy and uses it again while :meth:`rewrite_key` returns the same object
        and the module is unchanged."""
        return module

    def rewrite_key(self) -> object:
        """What :meth:`rewrite` depends on besides the module and this transform (compared by
        identity; default None). fsdp's copy gathers in the current step's session."""
        return None

    # -- backward -----------------------------------------------------------------------------
    def engine(self, engine: GradEngine) -> GradEngine:
        """The gradient engine, given the one inside (``ftrain.step.AutogradEngine`` by default)."""
        return engine

    def loss_scale(self, state: TrainState) -> torch.Tensor | None:
        """A 0-d tensor the loss is multiplied by before backward (the gradients are divided by it
        after), or None. At most one transform of a step scales the loss."""
        return None

    # -- reduce and update --------------------------------------------------------------------
    def reduce(
        self, grads: list[torch.Tensor], sums: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Combine across processes: ``grads`` (gradients of the summed losses, in the params'
        leaf order) and ``sums`` (fp32 ``[loss total, count]``). Return new tensors or the given
        ones (which may be updated in place); the step divides by the count afterwards."""
        return grads, sums

    def gradients(self, g: Gradients, state: TrainState) -> Gradients:
        """The :class:`Gradients` to update with, given those so far (see its attributes)."""
        return g

    # -- display ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        fields = getattr(self, "__dataclass_fields__", None)
        if fields:
            shown = ", ".join(f"{k}={getattr(self, k)!r}" for k in fields if fields[k].repr)
            return f"{type(self).__name__}({shown})"
        return f"{type(self).__name__}()"
