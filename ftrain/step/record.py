"""The train step as data: ``Step(loss_fn, optimizer, transforms)``, and ``train_step``.

Calling a step runs one optimizer step in phases; the hooks of its transforms
(:class:`ftrain.Transform`) act on each phase, in the order the transforms were applied:

1. **set-up**  ``init`` hooks add their entries to ``state.extra``; the random generators are
   seeded from ``(state.rng, state.step)`` (``ftrain.rng``); ``around_step`` contexts are entered.
2. **forward** the batch is ``split`` into pieces; for each, ``loss_fn(params, piece)`` runs under
   the ``around_forward`` contexts (params from the ``loss_params`` hooks; ``ft.apply`` runs the
   model's ``rewrite``), and its result is normalized into an ``ft.Loss`` (a sum and its count).
3. **grad**    the gradient ``engine`` differentiates the summed totals (times any ``loss_scale``)
   with respect to leaf copies of the params, one backward per piece, into one buffer.
4. **reduce**  ``reduce`` hooks sum gradients, totals and counts across processes; then *one*
   division by the whole batch's count (and the loss scale), so normalization is exact.
5. **update**  ``gradients`` hooks see the result (change it, skip the update, add metrics or
   state); the optimizer's pure update and ``params + updates`` follow, with no host sync.

Phases 2-5 are :meth:`Step.core` (:meth:`Step.backward`, then :meth:`Step.finish`), which the
``wrap`` hooks (compile, ema) wrap into the function the call runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from ftrain import foreach, rng, tree
from ftrain.apply import ApplyCache, caching, rewriting
from ftrain.losses import Loss, RowMean, as_loss, warn_row_weighted
from ftrain.optim.base import GradientTransformation, LeafContext, leaf_apply
from ftrain.optim.transforms import global_norm
from ftrain.state import TrainState
from ftrain.step.engine import AutogradEngine, Grads, nonzero
from ftrain.step.transform import Gradients, StepFn, Transform

__all__ = ["Step", "train_step"]


class _Hooks(NamedTuple):
    """The transforms acting in each phase, worked out once when the step is built."""

    init: tuple[Transform, ...]
    around_step: tuple[Transform, ...]
    split: tuple[Transform, ...]
    loss_params: tuple[Transform, ...]
    around_forward: tuple[Transform, ...]
    rewrites: tuple[Transform, ...]  # by rewrite_order, then as applied
    loss_scale: Transform | None
    reduce: tuple[Transform, ...]
    gradients: tuple[Transform, ...]


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
        for i, t in enumerate(ts):
            t.check(ts[:i], ts[i + 1 :])
        using = {h: tuple(t for t in ts if t.uses(h)) for h in _Hooks._fields if h != "rewrites"}
        scalers = using["loss_scale"]
        if len(scalers) > 1:
            raise ValueError(
                f"{' and '.join(f'ft.{t.name}' for t in scalers)} both scale the loss; one "
                "loss scale per step (fp16 autocast brings its own)."
            )
        rewrites = sorted((t for t in ts if t.uses("rewrite")), key=lambda t: t.rewrite_order)
        hooks = _Hooks(
            **{**using, "loss_scale": scalers[0] if scalers else None}, rewrites=tuple(rewrites)
        )
        optimizer, engine = self.optimizer, AutogradEngine()
        for t in ts:
            optimizer = t.optimizer(optimizer) if t.uses("optimizer") else optimizer
            engine = t.engine(engine) if t.uses("engine") else engine
        derived = {
            "_hooks": hooks,
            "_engine": engine,
            "_apply": leaf_apply(optimizer),
            "_cache": ApplyCache(),
            "_notices": _Notices(),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        fn: StepFn = self.core
        for t in sorted((t for t in ts if t.uses("wrap")), key=lambda t: t.wrap_order):
            fn = t.wrap(fn)
        object.__setattr__(self, "_fn", fn)

    # -- building ---------------------------------------------------------------------------
    def add(self, transform: Transform) -> Step:
        """A new step: this one with ``transform`` applied last (``transform(step)`` calls this).
        Ordering rules are checked now."""
        return dataclasses.replace(self, transforms=(*self.transforms, transform))

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the transforms applied, innermost first."""
        return tuple(t.name for t in self.transforms)

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
        for t in self._hooks.init:
            state = t.init(state)
        return state

    @contextlib.contextmanager
    def around_step(self, state: TrainState) -> Iterator[None]:
        """The transforms' ``around_step`` contexts, entered in order (what a call runs inside)."""
        with contextlib.ExitStack() as stack:
            for t in self._hooks.around_step:
                stack.enter_context(t.around_step(state))
            yield

    def split(self, batch: Any) -> list[Any]:
        """The pieces (micro-batches) the step runs forward and backward one at a time."""
        pieces = [batch]
        for t in self._hooks.split:
            pieces = [q for p in pieces for q in t.split(p)]
        return pieces

    def forward(self, params: TensorDict, batch: Any, state: TrainState | None = None) -> Loss:
        """The loss of one piece: ``loss_fn(params, batch)`` under the ``around_forward`` contexts,
        with the model rewritten as the transforms say, normalized into an ``ft.Loss``. The
        params are the step's own (``state.params`` or leaf copies of them), given to the
        ``loss_params`` hooks with ``state``, which a step with such hooks (``ft.lora``) needs."""
        if self._hooks.loss_params:
            if state is None:
                names = ", ".join(f"ft.{t.name}" for t in self._hooks.loss_params)
                raise TypeError(
                    f"Step.forward(params, batch, state): {names} make the loss function's "
                    "params from the state; pass the state."
                )
            forward = _with_loss_params(self._forward, self._hooks.loss_params, state)
            return forward(params, batch)[0]
        return self._forward(params, batch)[0]

    def _forward(self, params: TensorDict, batch: Any, pieces: int = 0) -> tuple[Loss, bool]:
        """:meth:`forward`, and whether the loss function returned a bf16/fp16 mean. ``pieces``:
        how many pieces this one is among when the step combines them (0: it does not care)."""
        contexts = [t.around_forward for t in self._hooks.around_forward]
        rewrites = self._hooks.rewrites
        if rewrites:
            with rewriting(rewrites) as calls:
                out = _within(contexts, params, lambda: self.loss_fn(params, batch))
            if not calls.count:
                names = ", ".join(f"ft.{t.name}" for t in rewrites)
                raise RuntimeError(
                    f"{names} acts on the model that the loss function calls through "
                    "ft.apply(model, params, ...), but the loss function never called ft.apply. "
                    "Call the model through ft.apply."
                )
        else:
            out = _within(contexts, params, lambda: self.loss_fn(params, batch))
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
            hooks = self._hooks
            warn_row_weighted(
                self.loss_fn,
                pieces,
                [f"ft.{t.name}" for t in hooks.split],
                [f"ft.{t.name}" for t in hooks.reduce],
            )

    @property
    def piecewise(self) -> bool:
        """The batch is split and each piece's :meth:`backward` alone sums to that of all."""
        return bool(self._hooks.split) and type(self._engine) is AutogradEngine

    def loss_scale(self, state: TrainState) -> torch.Tensor | None:
        """The 0-d tensor the loss is multiplied by before backward (fp16's), or None."""
        scaler = self._hooks.loss_scale
        return scaler.loss_scale(state) if scaler is not None else None

    def core(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Phases 2-5 (forward, grad, reduce, update), without the set-up or ``wrap`` hooks:
        :meth:`backward` of the :meth:`split` batch, then :meth:`finish` (what's compiled)."""
        scale = self.loss_scale(state)
        return self.finish(state, self.backward(state, self.split(batch), scale), scale)

    def backward(self, state: TrainState, pieces: list, scale, of: int | None = None) -> Grads:
        """Phases 2-3: the engine's forward and backward over ``pieces``, summed; ``of`` pieces
        in the whole step (default: these; ``ft.compile`` runs a :attr:`piecewise` one by one)."""
        hooks = self._hooks
        of = len(pieces) if of is None else of
        forward = self._forward
        combined = of > 1 or hooks.reduce
        if combined and not getattr(self._engine, "weighs_rows", False):  # check their weights
            forward = functools.partial(self._forward, pieces=of)
        if hooks.loss_params:  # what the loss function sees besides the differentiated params
            forward = _with_loss_params(forward, hooks.loss_params, state)
        return self._engine(forward, state.params, pieces, scale)

    def finish(
        self, state: TrainState, out: Grads, scale
    ) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Phases 4-5 from ``out``, the whole batch's :meth:`backward` with loss ``scale``: the
        reduction, the one division by the count, the ``gradients`` hooks and the update."""
        hooks = self._hooks
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
        lr = _find_lr(new_s, sdef)
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
            if not self._hooks.around_step:
                out = self._fn(state, batch)
            else:
                with self.around_step(state):
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


def _within(factories: list[Callable], arg: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` inside the contexts ``factory(arg)`` of ``factories``, the first outermost.

    Nested ``with`` statements rather than an ``ExitStack``: dynamo traces ``with torch.autocast``
    into the graph, but breaks the graph at the explicit ``__enter__`` call an ExitStack makes."""
    if not factories:
        return fn()
    with factories[0](arg):
        return _within(factories[1:], arg, fn)


def _with_loss_params(forward: Callable, transforms: tuple[Transform, ...], state: TrainState):
    """``forward`` called with the params the ``loss_params`` hooks make of the step's own."""

    def forward_with(params: TensorDict, piece: Any):
        for t in transforms:
            params = t.loss_params(params, state)
        return forward(params, piece)

    return forward_with


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a value reduced from sharded (DTensor) gradients, e.g. their norm."""
    if type(x) is torch.Tensor or not hasattr(x, "full_tensor"):
        return x
    return x.full_tensor()


def _lr_index(sdef: tree.TreeDef) -> int | None:
    # scale_by_learning_rate's state is {count, lr}: an `lr` leaf with a `count` sibling (a
    # parameter named `lr` also gives `lr` leaves, inside moment trees, without one)
    paths = set(sdef.paths)
    return next(
        (
            i
            for i, k in enumerate(sdef.paths)
            if k.rsplit(".", 1)[-1] == "lr" and k[: -len("lr")] + "count" in paths
        ),
        None,
    )


def _find_lr(opt_state: list[torch.Tensor], sdef: tree.TreeDef) -> torch.Tensor:
    """The ``lr`` leaf the optimizer recorded (from ``scale_by_learning_rate``), or NaN."""
    index = sdef.derived(_lr_index)
    if index is None:
        return torch.full((), float("nan"))
    return opt_state[index]


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
