"""``ft.Transform``: the one protocol every transform of a step uses, built-in or yours.

A transform is an immutable object with *hooks*: methods the step calls at fixed points of one
optimizer step. Each hook has a default that changes nothing; a transform overrides the ones it
needs. ``transform(step)`` returns a new step with the transform applied last (outermost).

Nine hooks, each changing one part of the step:

- ``optimizer(opt) -> opt`` and ``engine(engine) -> engine`` swap a component when the step is
  built; ``wrap(fn, stage) -> fn`` wraps the whole step function, in one of three stages
  (:data:`STAGES`); ``forward(fn) -> fn`` wraps one call of the loss function (a context, other
  params, the model rewritten with :func:`ftrain.apply.rewritten`).
- ``init(state)``, ``split(batch)``, ``loss_scale(state)``, ``reduce(grads, sums)`` and
  ``gradients(g, state)`` run on every call, at the phase their names say.

What a transform does that others must know of (it computes gradients with ``torch.func``, it
cannot be traced, it splits the batch across processes...) it *declares* in
:meth:`Transform.capabilities`; the step checks every pair of its transforms against one table
(:mod:`ftrain.step.capabilities`). ``step.explain()`` prints the resolved order of every hook, and
docs/transforms.md explains each one with examples. A transform holds no mutable attributes: what
it remembers between steps lives in ``state.extra`` (created in ``init``), so it is saved,
resumed, sharded and compiled like the rest of the state.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from ftrain.optim.base import GradientTransformation
    from ftrain.state import TrainState
    from ftrain.step.engine import GradEngine

__all__ = ["Transform", "Gradients", "StepFn", "LossCall", "STAGES", "HOOKS"]

StepFn = Callable[[Any, Any], tuple[Any, dict[str, torch.Tensor]]]
# One call of the loss function as the forward hooks see it: (params, batch, state) -> its output.
LossCall = Callable[[Any, Any, Any], Any]

# Where a ``wrap`` hook acts: "traced" wraps the step's core and is compiled with it under
# ft.compile; "compile" is the compiler's own (ft.compile); "eager" wraps the outside and always
# runs eagerly (seeding and process-wide settings belong there). Each transform's wrap is called
# once per stage, innermost stage first.
STAGES = ("traced", "compile", "eager")

# The hooks, in the order of the phases they act in (what Step.explain() reports).
HOOKS = (
    "optimizer",
    "engine",
    "wrap",
    "init",
    "split",
    "forward",
    "loss_scale",
    "reduce",
    "gradients",
)


# Names a transform might define expecting the step to call them, and what does that job.
_NOT_HOOKS = {
    "around_step": "wrap(fn, stage) at the 'eager' stage wraps the whole call",
    "around_forward": "forward(fn) wraps each call of the loss function",
    "loss_params": "forward(fn) can call the loss function with other params",
    "check": "declare what conflicts in capabilities(); check arguments in __init__",
    "uses": "a hook that does nothing returns its input (forward(fn) returns fn)",
    "compile_refusal": "declare capabilities() {UNTRACEABLE: why}",
    "once": "declare a capability of its own in capabilities(): each is exclusive",
    "rewrite_order": "a forward hook's place follows its capabilities (forward_rank)",
    "wrap_order": "choose the wrap's stage: 'traced' runs inside ft.compile",
}


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

    Class attribute ``name``: used in messages and ``repr`` (default: the class name in snake
    case). Keep a transform immutable (a frozen dataclass is a good fit), check its arguments in
    ``__init__``/``__post_init__``, and keep metrics as 0-d tensors (no ``.item()``: a host sync,
    and a graph break under compile).
    """

    name: str = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = _snake(cls.__name__)
        for attr, use in _NOT_HOOKS.items():  # would never be called: say so where it is written
            if attr in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__}.{attr}: not an ft.Transform hook, so the step would never "
                    f"call it; {use} (docs/transforms.md lists the hooks)."
                )
        if "rewrite" in cls.__dict__ and cls.forward is Transform.forward:
            raise TypeError(
                f"{cls.__name__}.rewrite: the step runs a model rewrite only from a forward hook; "
                "define forward(self, fn) returning ftrain.apply.rewritten(fn, self, name)."
            )
        wrap = cls.__dict__.get("wrap")
        if callable(wrap) and len(inspect.signature(wrap).parameters) != 3:
            raise TypeError(
                f"{cls.__name__}.wrap: the hook is wrap(self, fn, stage), called once per stage "
                f"of {STAGES}; return fn itself at the stages where it does nothing."
            )

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

    def capabilities(self) -> Mapping[str, str]:
        """What this transform does that other transforms must know of: capability -> note
        (``""``, or a detail that messages quote). The sentences of
        :mod:`ftrain.step.capabilities`, or your own (exclusive: a second transform declaring
        it is refused, which is how "apply once" is said)."""
        return {}

    # -- building: swap a component or wrap the whole step ------------------------------------
    def optimizer(self, optimizer: GradientTransformation) -> GradientTransformation:
        """The optimizer the step runs, given the one inside (e.g. run on shards)."""
        return optimizer

    def engine(self, engine: GradEngine) -> GradEngine:
        """The gradient engine, given the one inside (``ftrain.step.AutogradEngine`` by default).
        One that computes the gradients its own way declares ``REPLACES_ENGINE``."""
        return engine

    def wrap(self, fn: StepFn, stage: str) -> StepFn:
        """The step function ``(state, batch) -> (state, metrics)`` wrapping ``fn`` at ``stage``
        (one of :data:`STAGES`; called once for each). Return ``fn`` itself at the stages where
        this transform does nothing. The wrapper must not mutate its inputs."""
        return fn

    def forward(self, fn: LossCall) -> LossCall:
        """The call of the loss function, ``fn(params, batch, state) -> loss_fn's output``,
        wrapped: run it in a context (``torch.autocast``), with other params (``ft.lora`` adds its
        frozen base; ``params`` are what the engine differentiates), or with the model that
        ``ft.apply`` runs rewritten (:func:`ftrain.apply.rewritten`). Runs once per micro-batch,
        inside the gradient engine; ``state`` is the step's input state (None when
        ``Step.forward`` was called without one)."""
        return fn

    # -- each call ----------------------------------------------------------------------------
    def init(self, state: TrainState) -> TrainState:
        """``state`` with the entries this transform keeps in ``state.extra`` added when missing
        (leave present ones alone: a resumed state already has them)."""
        return state

    def split(self, batch: Any) -> list[Any]:
        """The pieces the batch is split into, each run forward and backward on its own."""
        return [batch]

    def loss_scale(self, state: TrainState) -> torch.Tensor | None:
        """A 0-d tensor the loss is multiplied by before backward (the gradients are divided by it
        after), or None. Declare ``SCALES_LOSS``: one transform of a step scales the loss."""
        return None

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
