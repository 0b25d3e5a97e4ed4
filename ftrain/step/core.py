"""The train step as data: ``Step(loss_fn, optimizer, transforms)``, and ``train_step``.

Calling a step runs one optimizer step in phases; the hooks of its transforms
(:class:`ftrain.Transform`) act on each phase, in the order the transforms were applied
(``step.explain()`` prints the order a given step resolves to):

1. **set-up**  ``init`` hooks add their entries to ``state.extra``; the random generators are
   seeded from ``(state.rng, state.step)`` (``ftrain.rng``); the ``"eager"`` wraps run.
2. **forward** the batch is ``split`` into pieces; for each, ``loss_fn(params, piece)`` runs
   inside the ``forward`` hooks (contexts, other params, the model ``ft.apply`` runs rewritten),
   and its result is normalized into an ``ft.Loss`` (a sum and its count).
3. **grad**    the gradient ``engine`` differentiates the summed totals (times any ``loss_scale``)
   with respect to leaf copies of the params, one backward per piece, into one buffer.
4. **reduce**  ``reduce`` hooks sum gradients, totals and counts across processes; then *one*
   division by the whole batch's count (and the loss scale), so normalization is exact.
5. **update**  ``gradients`` hooks see the result (change it, skip the update, add metrics or
   state); the optimizer's pure update and ``params + updates`` follow, with no host sync.

Phases 2-5 are :meth:`Step.core` (:meth:`Step.backward`, then :meth:`Step.finish`), which the
``wrap`` hooks wrap into the function the call runs: the ``"traced"`` ones, the compiler's
(``"compile"``), then the ``"eager"`` ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from ftrain import rng, tree
from ftrain.apply import ApplyCache, caching
from ftrain.internals import foreach
from ftrain.losses import Loss, RowMean, as_loss, warn_row_weighted
from ftrain.optim.base import GradientTransformation, LeafContext, leaf_apply
from ftrain.optim.primitives import global_norm, recorded_learning_rate
from ftrain.state import TrainState
from ftrain.step import capabilities, explain
from ftrain.step.engine import AutogradEngine, Grads, nonzero
from ftrain.step.transform import STAGES, Gradients, LossCall, StepFn, Transform

__all__ = ["Step", "Resolved", "train_step"]


class Resolved(NamedTuple):
    """The transforms acting in each phase, worked out once when the step is built
    (``step.resolved``; :meth:`Step.explain` prints it)."""

    init: tuple[Transform, ...]
    split: tuple[Transform, ...]
    forward: tuple[Transform, ...]  # innermost first (capabilities.forward_rank, then as applied)
    loss_scale: tuple[Transform, ...]
    reduce: tuple[Transform, ...]
    gradients: tuple[Transform, ...]
    wrap: tuple[tuple[str, Transform], ...]  # (stage, transform), innermost first
    optimizer: tuple[Transform, ...]
    engine: tuple[Transform, ...]
    combines_rows: tuple[Transform, ...]  # declare COMBINES_ROWS
    weighs_rows: bool  # no transform declares WEIGHS_ROWS: a plain scalar's weights are checked
    gradient_engine: object  # what the engine hooks made of the default one


def _overrides(t: Transform, hook: str) -> bool:
    return getattr(type(t), hook) is not getattr(Transform, hook)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Step:
    """One optimizer step as data. Call it: ``state, metrics = step(state, batch)``.

    Build it with :func:`train_step` and change it with transforms (``ft.accumulate(step, 4)``,
    ``MyTransform(...)(step)``); each returns a new Step and leaves its argument as it was.
    ``transforms`` holds what was applied, innermost first. The module docstring lists the phases.
    """

    loss_fn: Callable[..., Any]
    optimizer: GradientTransformation
    transforms: tuple[Transform, ...] = ()
    donate: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        ts = self.transforms
        capabilities.check_combination(ts)
        per_call = {
            h: tuple(t for t in ts if _overrides(t, h))
            for h in ("init", "split", "loss_scale", "reduce", "gradients")
        }
        # the engine's gradients are the step's unless a transform reduces them afterwards
        reduced_after = capabilities.reduced_after_backward(ts, per_call["reduce"])
        optimizer = self.optimizer
        engine = AutogradEngine(capabilities.reduces_in_backward(ts), reduced_after)
        swapped: dict[str, list[Transform]] = {"optimizer": [], "engine": []}
        replaced = []  # changed what the engine computes (not only added a gradient sink)
        reducer_of = None  # the transform whose engine hook added the engine's reducer
        for t in ts:
            new_opt, new_engine = t.optimizer(optimizer), t.engine(engine)
            if new_opt is not optimizer:
                swapped["optimizer"].append(t)
            if new_engine is not engine:
                swapped["engine"].append(t)
                if not (isinstance(new_engine, AutogradEngine) and new_engine.adds_sink_to(engine)):
                    replaced.append(t)
                if getattr(new_engine, "reducer", None) is not getattr(engine, "reducer", None):
                    reducer_of = t
            optimizer, engine = new_opt, new_engine
        capabilities.check_engines(replaced)
        if isinstance(engine, AutogradEngine):  # what it may hand over in this step
            compiled = bool(capabilities.notes(ts, capabilities.COMPILES))
            engine = engine.trusted(compiled, per_call["reduce"][:1] == (reducer_of,))
        call: LossCall = _call_loss_fn(self.loss_fn)
        forwards = []
        for t in sorted(ts, key=capabilities.forward_rank):
            new = t.forward(call)
            if new is not call:
                forwards.append(t)
            call = new
        combines = tuple(t for t, _ in capabilities.notes(ts, capabilities.COMBINES_ROWS))
        resolved = Resolved(
            **per_call,
            forward=tuple(forwards),
            wrap=(),  # filled in below: a wrap hook may read the rest (ft.compile does)
            optimizer=tuple(swapped["optimizer"]),
            engine=tuple(swapped["engine"]),
            combines_rows=combines,
            weighs_rows=not capabilities.notes(ts, capabilities.WEIGHS_ROWS),
            gradient_engine=engine,
        )
        derived = {
            "resolved": resolved,
            "_call": call,
            "_apply": leaf_apply(optimizer),
            "_cache": ApplyCache(),
            "_notices": _Notices(),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        fn: StepFn = self.core
        wraps = []
        for stage in STAGES:
            for t in ts:
                new = t.wrap(fn, stage)
                if new is not fn:
                    wraps.append((stage, t))
                fn = new
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "resolved", resolved._replace(wrap=tuple(wraps)))

    # -- building ---------------------------------------------------------------------------
    def add(self, transform: Transform) -> Step:
        """A new step: this one with ``transform`` applied last (``transform(step)`` calls this).
        Ordering rules are checked now."""
        return dataclasses.replace(self, transforms=(*self.transforms, transform))

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the transforms applied, innermost first."""
        return tuple(t.name for t in self.transforms)

    def explain(self) -> str:
        """The resolved pipeline, one line per hook in the order they run: the transforms whose
        hook acts there and whether it runs eagerly or compiled (``ftrain.step.explain``)."""
        return explain.explain(self)

    def explain_rows(self) -> list[explain.Row]:
        """:meth:`explain` as data: ``Row(phase, hook, transforms, runs)`` per hook, in order."""
        return explain.rows(self)

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__qualname__", repr(self.loss_fn))
        inner = ", ".join(map(repr, self.transforms))
        return f"Step(loss_fn={name}, transforms=[{inner}], donate={self.donate})"

    # -- phases -----------------------------------------------------------------------------
    def init_extra(self, state: TrainState) -> TrainState:
        """``state`` with the entries transforms keep in ``state.extra`` added where missing.

        Calling the step does this itself; call it up front to give a compiled step its final
        state structure from the first call, or to save a state before the first step.
        """
        for t in self.resolved.init:
            state = t.init(state)
        return state

    def split(self, batch: Any) -> list[Any]:
        """The pieces (micro-batches) the step runs forward and backward one at a time."""
        pieces = [batch]
        for t in self.resolved.split:
            pieces = [q for p in pieces for q in t.split(p)]
        return pieces

    def forward(self, params: TensorDict, batch: Any, state: TrainState | None = None) -> Loss:
        """The loss of one piece: ``loss_fn(params, batch)`` inside the transforms' ``forward``
        hooks (contexts, other params, the model rewritten), normalized into an ``ft.Loss``. The
        params are the step's own (``state.params`` or leaf copies of them); ``state`` is what
        hooks that read it get (``ft.lora`` takes its frozen base from it)."""
        return self._forward(params, batch, state)[0]

    def _forward(
        self, params: TensorDict, batch: Any, state: TrainState | None, pieces: int = 0
    ) -> tuple[Loss, bool]:
        """:meth:`forward`, and whether the loss function returned a bf16/fp16 mean. ``pieces``:
        how many pieces this one is among when the step combines them (0: it does not care)."""
        out = self._call(params, batch, state)
        raw = out[0] if isinstance(out, tuple) and not isinstance(out, (Loss, RowMean)) else out
        if pieces and isinstance(raw, torch.Tensor):  # a plain scalar, weighted by rows
            self._row_weighted(pieces)
        mean = raw.value if isinstance(raw, RowMean) else raw
        low_mean = isinstance(mean, torch.Tensor) and mean.dtype in (torch.float16, torch.bfloat16)
        return as_loss(out, batch), low_mean

    def _row_weighted(self, pieces: int) -> None:
        """Warn, once per step, that a plain scalar loss is being weighted by rows. While
        ``torch.compile`` traces, note it for :meth:`__call__` to tell after the call (a warning
        would break the graph; dynamo replays the note, an attribute write, after each call)."""
        if torch.compiler.is_compiling():
            self._notices.pending = pieces
        elif not self._notices.told:
            self._notices.told = True
            hooks = self.resolved
            warn_row_weighted(
                self.loss_fn,
                pieces,
                [f"ft.{t.name}" for t in hooks.split],
                [f"ft.{t.name}" for t in hooks.combines_rows],
            )

    @property
    def piecewise(self) -> bool:
        """The batch is split and each piece's :meth:`backward` alone sums to that of all (no
        transform replaces the gradient engine, which may look at all pieces at once)."""
        return bool(self.resolved.split) and not capabilities.replaces_engine(self.transforms)

    def loss_scale(self, state: TrainState) -> torch.Tensor | None:
        """The 0-d tensor the loss is multiplied by before backward (fp16's), or None."""
        scale = None
        for t in self.resolved.loss_scale:
            mine = t.loss_scale(state)
            if mine is not None:
                scale = mine if scale is None else scale * mine
        return scale

    def core(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Phases 2-5 (forward, grad, reduce, update), without the set-up or ``wrap`` hooks:
        :meth:`backward` of the :meth:`split` batch, then :meth:`finish` (what's compiled)."""
        scale = self.loss_scale(state)
        return self.finish(state, self.backward(state, self.split(batch), scale), scale)

    def backward(self, state: TrainState, pieces: list, scale, of: int | None = None) -> Grads:
        """Phases 2-3: the engine's forward and backward over ``pieces``, summed; ``of`` pieces
        in the whole step (default: these; ``ft.compile`` runs a :attr:`piecewise` one by one)."""
        of = len(pieces) if of is None else of
        hooks = self.resolved
        combined = hooks.weighs_rows and (of > 1 or hooks.combines_rows)
        pieces_of = of if combined else 0  # check the weights a plain scalar gets

        def forward(params: TensorDict, piece: Any) -> tuple[Loss, bool]:
            return self._forward(params, piece, state, pieces_of)

        return self.resolved.gradient_engine(forward, state.params, pieces, scale)

    def finish(
        self, state: TrainState, out: Grads, scale
    ) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Phases 4-5 from ``out``, the whole batch's :meth:`backward` with loss ``scale``: the
        reduction, the one division by the count, the ``gradients`` hooks and the update."""
        hooks = self.resolved
        grads, total, count, aux, owned = out
        if hooks.reduce:  # phase 4: sums across processes
            sums = torch.stack([total.float(), count.float()])
            for t in hooks.reduce:
                new, sums = t.reduce(grads, sums)
                # tensors handed back are still what they were; new ones are the step's own
                owned = owned or not any(a is b for a, b in zip(new, grads))
                grads = new
            total, count = sums[0], sums[1]
        denom = nonzero(count.to(torch.float32))  # the one division, by the whole batch's count
        if scale is not None:
            denom = denom * scale
        if grads and denom.device != grads[0].device:  # on the host already (ft.offload's sink)
            denom = denom.to(grads[0].device)  # a host sync (the count lives on the device)
        if owned:
            foreach.div_(grads, denom)
        else:  # autograd's own (see AutogradEngine): out of place, then the buffers are ours
            grads = list(foreach.div(grads, denom))
        metrics = {
            "loss": total / nonzero(count),
            "count": count,
            "grad_norm": _whole(global_norm(grads)),
            **aux,
        }
        skip, extra = None, state.extra
        if hooks.gradients:  # phase 5: what transforms make of the gradients
            tdef = tree.structure(state.params)
            g = Gradients(tdef.unflatten(grads), None, metrics, extra)
            for t in hooks.gradients:
                g = t.gradients(g, state)
            grads, gdef = tree.flatten(g.grads)
            if gdef != tdef:
                raise ValueError(
                    "a transform's gradients hook returned grads whose keys differ from the "
                    f"params' ({gdef} vs {tdef}); keep the params' structure."
                )
            skip, metrics, extra = g.skip, g.metrics, g.extra
        params, opt_state, lr = self._apply_update(state, grads, skip)
        new_state = tree.new_tensorclass(
            TrainState,
            {
                "params": params,
                "opt_state": opt_state,
                "step": state.step + 1,
                "rng": state.rng,
                "extra": extra,
            },
        )
        loss, count, grad_norm = metrics.pop("loss"), metrics.pop("count"), metrics.pop("grad_norm")
        return new_state, {
            "loss": loss,
            "count": count,
            "grad_norm": grad_norm,
            "lr": lr,
            **metrics,
        }

    def _apply_update(
        self, state: TrainState, grads: list[torch.Tensor], skip: torch.Tensor | None
    ) -> tuple[TensorDict, TensorDict, torch.Tensor]:
        """The optimizer's update from normalized ``grads`` (which it may overwrite) applied to the
        params (a fused optimizer's kernel writes them itself, as torch.optim's does; others give
        updates and one multi-tensor add follows); a ``skip`` that is True changes nothing.
        Returns the new params, the new optimizer state and the learning rate it recorded."""
        p, tdef = tree.flatten(state.params)
        s, sdef = tree.flatten(state.opt_state)
        inplace = self.donate and skip is None
        new_p, new_s = self._apply(grads, s, p, LeafContext(tdef, sdef, inplace, True))
        if skip is not None:  # the old params and state kept as a whole, by a tensor: no host sync
            new_p = [torch.where(skip, o, n) for n, o in zip(new_p, p)]
            new_s = [torch.where(skip, o, n) for n, o in zip(new_s, s)]
        p = new_p
        lr = recorded_learning_rate(new_s, sdef)
        if self.donate:  # most tensors are the input's own: keep the containers holding only them
            return tdef.rebuild(p, state.params), sdef.rebuild(new_s, state.opt_state), lr
        return tdef.unflatten(p), sdef.unflatten(new_s), lr

    # -- calling ----------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"step(state, batch): state must be an ft.TrainState, got {type(state).__name__}. "
                "Create one with ft.TrainState.create(params, optimizer)."
            )
        state = self.init_extra(state)
        device = tree.first_leaf(state.params).device
        with caching(self._cache), rng.seeded(rng.step_seed(state), device):
            out = self._fn(state, batch)
        if self._notices.pending:  # noted while a compiled step was traced
            self._row_weighted(self._notices.pending)
            self._notices.pending = 0
        return out


class _Notices:
    """What a step has to tell its user once, and whether it has: the one mutable part of a Step
    besides its apply cache (so a new step, e.g. with another transform, tells again)."""

    def __init__(self) -> None:
        self.told = False  # the ScalarLossWarning was issued
        self.pending = 0  # a compiled call saw a plain scalar among this many pieces


def _check_fields(step: Step) -> None:
    """What ``train_step`` (or ``Step(...)`` directly) must be given, checked when it is built."""
    if not callable(step.loss_fn):
        raise TypeError(
            f"train_step(loss_fn, ...): loss_fn must be callable as loss_fn(params, batch), "
            f"got {type(step.loss_fn).__name__}."
        )
    if not isinstance(step.optimizer, GradientTransformation):
        raise TypeError(
            "train_step(loss_fn, optimizer): optimizer must be an ftrain.optim."
            f"GradientTransformation (e.g. ftrain.optim.adamw(3e-4)), got {type(step.optimizer).__name__}."
            + (
                " torch.optim optimizers hold state inside; ftrain's are pure functions."
                if isinstance(step.optimizer, torch.optim.Optimizer)
                else ""
            )
        )
    if not isinstance(step.donate, bool):
        raise TypeError(f"train_step(donate=...): expected a bool, got {step.donate!r}.")
    for i, t in enumerate(step.transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"Step(transforms=...): item {i} is {t!r}, not an ft.Transform.")


def _call_loss_fn(loss_fn: Callable[..., Any]) -> LossCall:
    """The innermost call the ``forward`` hooks wrap: the loss function itself."""

    def call(params: TensorDict, batch: Any, state: TrainState | None) -> Any:
        return loss_fn(params, batch)

    return call


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a value reduced from sharded (DTensor) gradients, e.g. their norm."""
    if type(x) is torch.Tensor or not hasattr(x, "full_tensor"):
        return x
    return x.full_tensor()


def train_step(
    loss_fn: Callable[..., Any], optimizer: GradientTransformation, *, donate: bool = False
) -> Step:
    """The step ``(state, batch) -> (state, metrics)`` that minimizes ``loss_fn`` with ``optimizer``.

    Args:
        loss_fn: ``loss_fn(params, batch)`` returning an :class:`ftrain.Loss` (a sum and its
            count), a scalar tensor (a mean over the batch rows), ``ft.losses.row_mean(scalar)``
            (the same, declared), or ``(loss, aux_dict)``. It calls the model through
            :func:`ftrain.apply`. Where the step combines pieces (``ft.accumulate`` splits the
            batch, ``ft.shard`` sums across processes), a plain scalar is weighted by its rows,
            which is wrong for a token mean over padded rows (e.g. a Hugging Face ``out.loss``):
            the first call then issues an ``ft.losses.ScalarLossWarning`` naming the two fixes,
            ``ft.Loss(total, count)`` (``ft.losses.causal_lm``) or ``ft.losses.row_mean``.
        optimizer: an ``ftrain.optim`` :class:`GradientTransformation`.
        donate: let the step update ``state``'s tensors in place (saves a copy of params and
            optimizer state). The state passed in must not be used afterwards.

    Guarantees: the input state is not modified (unless ``donate``); the same state and batch give
    the same result (dropout included: the random stream comes from ``state.rng`` and
    ``state.step``); gradients are those of ``sum(total) / sum(count)`` over the whole batch
    (a count of 0 counts as 1; a fractional count, e.g. a sum of weights, is used as is);
    metrics are 0-d tensors (``loss``, ``count``, ``grad_norm`` before any clipping, ``lr`` and the
    loss's aux, each aux value averaged over micro-batches with equal weight), computed without a
    host sync. A parameter the loss does not use gets a zero gradient, as in optax: the optimizer
    still applies momentum and weight decay to it, where ``torch.optim`` skips a parameter whose
    ``.grad`` is None.
    """
    return Step(loss_fn=loss_fn, optimizer=optimizer, donate=donate)
