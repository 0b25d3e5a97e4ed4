"""The train step: a pure function ``step(state, batch) -> (state, metrics)``.

A :class:`Step` is a frozen description of one optimizer step, split into phases that transforms
reach without re-implementing them:

1. **forward**  ``loss_fn(params, micro_batch)`` under the ``forward_contexts`` (autocast,
   activation checkpointing), normalized into an :class:`ftrain.Loss` (a sum and its count);
2. **grad**     ``torch.autograd.grad`` of the (loss-scaled) sum over leaf copies of the params,
   once per micro-batch, summed into one gradient buffer (``micro_batches``);
3. **reduce**   sums of gradients, loss totals and counts across processes (``reducer``, set by
   ``ft.shard``), then division by the total count, so normalization is exact;
4. **update**   the optimizer's pure ``update`` and ``params + updates``; with a ``loss_scaler``
   (fp16), a step whose gradients are not finite is skipped with tensor ops (no host sync).

Around the whole call: the random stream is seeded from ``(state.rng, state.step)`` inside
``torch.random.fork_rng`` (so the global RNG is left as it was), then any ``step_contexts``
(TF32), then the ``wrappers`` that user transforms add.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from tensordict import TensorDict

from ftrain import tree
from ftrain.losses import Loss, as_loss
from ftrain.optim.base import GradientTransformation, LeafContext, all_finite, leaf_update
from ftrain.optim.transforms import global_norm
from ftrain.state import TrainState

__all__ = ["Step", "train_step", "StepFn", "split_batch", "wrap"]

StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, torch.Tensor]]]
ContextFactory = Callable[[Any], contextlib.AbstractContextManager]


class LossScaler(Protocol):
    """What ``ft.autocast`` plugs into a step for fp16 (see ``ftrain.transforms.autocast``)."""

    def init(self) -> TensorDict: ...
    def scale(self, extra: TensorDict) -> torch.Tensor: ...
    def update(self, extra: TensorDict, finite: torch.Tensor) -> TensorDict: ...


class GradReducer(Protocol):
    """What ``ft.shard`` plugs into a step: sums across processes, in place or (returned) as new
    tensors. ``after_backward = True`` (optional) says the gradients reach :meth:`reduce`
    unreduced, so the step may weight each process's by its local count before the sum."""

    def reduce(
        self, grads: list[torch.Tensor], sums: torch.Tensor
    ) -> list[torch.Tensor] | None: ...


def _mix(*xs: int) -> int:
    """SplitMix64 of the inputs: a well-spread 63-bit seed from a key and counters."""
    z = 0x9E3779B97F4A7C15
    for x in xs:
        z = (z ^ (x & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    return z & 0x7FFFFFFFFFFFFFFF


@contextlib.contextmanager
def _seeded(state: TrainState, device: torch.device) -> Any:
    """Seed the generators the step draws from (CPU, and the params' CUDA device) and restore
    them on exit, so the step neither depends on nor changes the global random state."""
    # int() of a CPU tensor reads host memory, not a device sync: TrainState keeps `step` and
    # `rng` on the CPU for that reason.
    seed = _mix(int(state.rng), int(state.step))
    gens = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gens.append(torch.cuda.default_generators[index])
    saved = [g.get_state() for g in gens]
    try:
        for g in gens:
            g.manual_seed(seed)
        yield
    finally:
        for g, s in zip(gens, saved):
            g.set_state(s)


def split_batch(batch: Any, k: int) -> list[Any]:
    """Split every tensor of ``batch`` (a tensor, or a dict/list/tuple of them) into ``k`` parts
    along dim 0, as evenly as possible (``torch.tensor_split``). Non-tensor leaves are shared."""
    if k == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return [batch] * k
        return list(torch.tensor_split(batch, k))
    if isinstance(batch, Mapping):
        parts = {key: split_batch(v, k) for key, v in batch.items()}
        return [type(batch)({key: parts[key][i] for key in batch}) for i in range(k)]
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(v, k) for v in batch]
        if hasattr(batch, "_fields"):  # a namedtuple takes its fields as arguments
            return [type(batch)(*(p[i] for p in parts)) for i in range(k)]
        return [type(batch)(p[i] for p in parts) for i in range(k)]
    return [batch] * k


def batch_rows(batch: Any) -> int | None:
    """The leading dimension shared by the batch's tensors (None if it holds no batched tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (tuple, list)) or isinstance(batch, Mapping):
        for v in values:
            r = batch_rows(v)
            if r is not None:
                return r
    return None


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step as data. Call it: ``state, metrics = step(state, batch)``.

    Build it with :func:`train_step` and change it with transforms (``ft.accumulate``,
    ``ft.checkpoint``, ``ft.autocast``, ``ft.shard``, ``ft.compile``, :func:`wrap`); each returns a
    new Step and leaves its argument as it was. Fields are the phases' settings (see the module
    docstring); ``transforms`` records what was applied, innermost first.
    """

    loss_fn: Callable[..., Any]
    optimizer: GradientTransformation
    donate: bool = False
    micro_batches: int = 1
    forward_contexts: tuple[ContextFactory, ...] = ()
    step_contexts: tuple[ContextFactory, ...] = ()
    loss_scaler: Any = None  # LossScaler | None
    reducer: Any = None  # GradReducer | None
    wrappers: tuple[Callable[[StepFn], StepFn], ...] = ()
    state_inits: tuple[Callable[[TrainState], TrainState], ...] = ()
    compiled: Callable | None = None
    transforms: tuple[str, ...] = ()

    # -- building ---------------------------------------------------------------------------
    def replace(self, name: str, **changes) -> Step:
        """A copy with ``changes`` applied and ``name`` appended to ``transforms``.

        For transform authors. Changing a phase after ``ft.compile`` is refused, because the
        compiled function would not see it.
        """
        if self.compiled is not None and name != "wrap":
            raise ValueError(
                f"ft.{name} was applied after ft.compile; compile must come last: "
                f"ft.compile(ft.{name}(step)). The compiled function would not see the change."
            )
        return dataclasses.replace(self, transforms=(*self.transforms, name), **changes)

    def init_extra(self, state: TrainState) -> TrainState:
        """``state`` with the entries transforms own (e.g. the fp16 loss scale) added if missing.

        Calling the step does this itself; call it up front to give a compiled step its final
        state structure from the first call, or to save a state before the first step.
        """
        if self.loss_scaler is not None and "loss_scale" not in state.extra.keys():
            extra = state.extra.clone(recurse=False)
            extra["loss_scale"] = self.loss_scaler.init()
            state = state.replace(extra=extra)
        for init in self.state_inits:
            state = init(state)
        return state

    # -- phases -----------------------------------------------------------------------------
    def forward(self, params: TensorDict, batch: Any) -> Loss:
        """Phase 1: the loss of one micro-batch, under the forward contexts."""
        return self._forward(params, batch)[0]

    def _forward(self, params: TensorDict, batch: Any) -> tuple[Loss, bool]:
        """:meth:`forward`, and whether the loss_fn returned a bf16/fp16 scalar mean."""
        out = _within(self.forward_contexts, params, lambda: self.loss_fn(params, batch))
        raw = out[0] if isinstance(out, tuple) and not isinstance(out, Loss) else out
        low_mean = isinstance(raw, torch.Tensor) and raw.dtype in (torch.float16, torch.bfloat16)
        return as_loss(out, batch), low_mean

    def grad(self, params: TensorDict, batch: Any, scale: torch.Tensor | None = None) -> _Grads:
        """Phase 2: the gradients of the micro-batches' summed losses, times ``scale`` if given.

        Usually the gradient of each micro-batch's ``total`` is taken directly. Two cases
        backpropagate the micro-batch's *mean* instead and weight the result by its count, so
        that the gradient entering the loss graph is O(1): with a loss ``scale`` (fp16), where
        ``total * scale`` would overflow fp16 for large counts; and when ``loss_fn`` returned a
        bf16/fp16 scalar mean, where the count itself would be rounded on its way into the
        graph (257 rows is 256 in bf16: every gradient off by 256/257). A reducer that sums
        gradients during backward (``fsdp``) cannot take local weights afterwards, so there the
        second case falls back to the sum (fp16 under fsdp defers its reduction instead).
        """
        values, tdef = tree.flatten(params)
        leaves = [p.detach().requires_grad_(True) for p in values]
        p_in = tdef.unflatten(leaves)
        micro = split_batch(batch, self.micro_batches)
        weights_ok = self.reducer is None or _reduces_after(self)
        grads: list[torch.Tensor] | None = None
        total = count = None
        owned = False
        aux: dict[str, torch.Tensor] = {}
        for mb in micro:
            loss, low_mean = self._forward(p_in, mb)
            if scale is not None or (low_mean and weights_ok):
                n = _nonzero(loss.count.detach().to(torch.float32))
                factor = 1.0 / n if scale is None else scale / n
                g = torch.autograd.grad(loss.total * factor, leaves, allow_unused=True)
                # weight by the count, out of place: the gradient of the sum, in fresh buffers
                weighted = iter(torch._foreach_mul([x for x in g if x is not None], n))
                g = [None if x is None else next(weighted) for x in g]
                fresh = True
            else:
                g = torch.autograd.grad(loss.total, leaves, allow_unused=True)
                fresh = False  # autograd's own: they may share memory ((a + b).sum() gives a
                # and b one gradient tensor) or be broadcast views, so never written in place
            if grads is None:  # later micro-batches add into these
                grads = [gi if gi is not None else torch.zeros_like(p) for gi, p in zip(g, leaves)]
                owned = fresh
            elif not owned:  # the first micro-batch's are autograd's: add out of place, once
                pairs = [(a, b) for a, b in zip(grads, g) if b is not None]
                summed = iter(torch._foreach_add([a for a, _ in pairs], [b for _, b in pairs]))
                grads = [a.clone() if b is None else next(summed) for a, b in zip(grads, g)]
                owned = True
            else:
                present = [(a, b) for a, b in zip(grads, g) if b is not None]
                torch._foreach_add_([a for a, _ in present], [b for _, b in present])
            t, c = loss.total.detach().float(), loss.count.detach()
            total, count = (t, c) if total is None else (total + t, count + c)
            for k, v in loss.aux.items():
                v = v.detach().float() / len(micro)
                aux[k] = v if k not in aux else aux[k] + v
        return _Grads(grads, total, count, aux, owned)

    def update(
        self,
        state: TrainState,
        grads: list[torch.Tensor],
        finite: torch.Tensor | None = None,
    ) -> tuple[TrainState, TensorDict]:
        """Phase 4: the optimizer update from normalized ``grads``; returns the new params and
        optimizer state. With ``finite`` (a 0-d bool tensor), a non-finite step changes nothing.

        ``grads`` belong to the step: the optimizer may overwrite them (no copy is made)."""
        params, tdef, opt_state, sdef = self._update_leaves(state, grads, finite)
        return self._trees(state, params, tdef, opt_state, sdef)

    def _trees(self, state, params, tdef, opt_state, sdef) -> tuple[TensorDict, TensorDict]:
        # Donated: most tensors are the input's own, so keep the containers that hold only them.
        if self.donate:
            return tdef.rebuild(params, state.params), sdef.rebuild(opt_state, state.opt_state)
        return tdef.unflatten(params), sdef.unflatten(opt_state)

    def _update_leaves(
        self, state: TrainState, grads: list[torch.Tensor], finite: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], tree.TreeDef, list[torch.Tensor], tree.TreeDef]:
        # The optimizer runs on leaf lists; TensorDicts are built once, by the caller.
        p, tdef = tree.flatten(state.params)
        s, sdef = tree.flatten(state.opt_state)
        inplace = self.donate and finite is None
        ctx = LeafContext(tdef, sdef, inplace, True)
        u, new_s = leaf_update(self.optimizer)(grads, s, p, ctx)
        if finite is not None:
            u = [torch.where(finite, x, torch.zeros_like(x)) for x in u]
            new_s = [torch.where(finite, n, o) for n, o in zip(new_s, s)]
        if self.donate:  # params + updates, one multi-tensor kernel
            torch._foreach_add_(p, u)
            new_p = p
        else:
            new_p = list(torch._foreach_add(p, u))
        return new_p, tdef, new_s, sdef

    def core(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        """Phases 1-4 without the RNG seeding, step contexts or wrappers (what ``compile``
        compiles)."""
        scaler = self.loss_scaler
        scale = scaler.scale(state.extra) if scaler is not None else None
        grads, total, count, aux, owned = self.grad(state.params, batch, scale)
        if self.reducer is not None:  # phase 3a: sums across processes
            sums = torch.stack([total.float(), count.float()])
            reduced = self.reducer.reduce(grads, sums)
            if reduced is not None:  # new tensors
                grads, owned = reduced, True
            total, count = sums[0], sums[1]
        # phase 3b: the one division, by the whole batch's count (and the loss scale)
        denom = _nonzero(count.to(torch.float32))
        if scale is not None:
            denom = denom * scale
        if owned:
            torch._foreach_div_(grads, denom)
        else:  # autograd's own (see grad): out of place, then the buffers are the step's own
            grads = list(torch._foreach_div(grads, denom))
        grad_norm = _whole(global_norm(grads))

        finite = _whole(all_finite(grads)) if scaler is not None else None
        p, tdef, s, sdef = self._update_leaves(state, grads, finite)  # phase 4 (see update)
        extra = state.extra
        if scaler is not None:
            extra = extra.clone(recurse=False)
            extra["loss_scale"] = scaler.update(state.extra["loss_scale"], finite)
        params, opt_state = self._trees(state, p, tdef, s, sdef)
        new_state = _new_state(
            params=params,
            opt_state=opt_state,
            step=state.step + 1,
            rng=state.rng,
            extra=extra,
        )
        metrics = {
            "loss": total / _nonzero(count),
            "count": count,
            "grad_norm": grad_norm,
            "lr": _find_lr(s, sdef),
            **aux,
        }
        if scaler is not None:
            metrics["skipped"] = ~finite
            metrics["loss_scale"] = extra["loss_scale", "scale"]
        return new_state, metrics

    # -- calling ----------------------------------------------------------------------------
    def _inner(self) -> StepFn:
        fn = self.compiled if self.compiled is not None else self.core
        for w in self.wrappers:
            fn = w(fn)
        return fn

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"step(state, batch): state must be an ft.TrainState, got {type(state).__name__}. "
                "Create one with ft.TrainState.create(params, optimizer)."
            )
        self._check_batch(batch)
        state = self.init_extra(state)
        device = tree.first_leaf(state.params).device
        with contextlib.ExitStack() as stack:
            stack.enter_context(_seeded(state, device))
            for ctx in self.step_contexts:
                stack.enter_context(ctx(state))
            return self._inner()(state, batch)

    def _check_batch(self, batch: Any) -> None:
        if self.micro_batches > 1:
            rows = batch_rows(batch)
            if rows is not None and rows < self.micro_batches:
                raise ValueError(
                    f"ft.accumulate(micro_batches={self.micro_batches}) got a batch of {rows} "
                    f"rows; every micro-batch needs at least one row. Use micro_batches <= {rows}."
                )


_LR_INDEX: dict[tree.TreeDef, int | None] = {}


def _within(factories: tuple[ContextFactory, ...], arg: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` inside the contexts ``factory(arg)`` of ``factories``, the first outermost.

    Nested ``with`` statements rather than an ``ExitStack``: dynamo traces ``with torch.autocast``
    into the graph, but breaks the graph at the explicit ``__enter__`` call an ExitStack makes."""
    if not factories:
        return fn()
    with factories[0](arg):
        return _within(factories[1:], arg, fn)


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a value reduced from sharded (DTensor) gradients, e.g. their norm."""
    if type(x) is torch.Tensor or not hasattr(x, "full_tensor"):
        return x
    return x.full_tensor()


class _Grads(NamedTuple):
    """What :meth:`Step.grad` returns."""

    grads: list[torch.Tensor]  # of the summed loss, in the params' key order, times the scale
    total: torch.Tensor  # sum of the micro-batches' loss totals
    count: torch.Tensor  # sum of their counts
    aux: dict[str, torch.Tensor]  # aux metrics averaged over micro-batches
    owned: bool  # fresh buffers the step may overwrite; else autograd's own (may alias)


def _reduces_after(step: Step) -> bool:
    """Whether the step's reducer sums the gradients after backward (ddp, zero1, zero2), so that
    they may be weighted by the local count first; fsdp sums them during backward."""
    return getattr(step.reducer, "after_backward", False)


def _nonzero(count: torch.Tensor) -> torch.Tensor:
    """``count``, or 1 where it is 0 (an empty batch): a fractional count (weights) is kept."""
    return torch.where(count != 0, count, torch.ones_like(count))


def _find_lr(opt_state: list[torch.Tensor], sdef: tree.TreeDef) -> torch.Tensor:
    """The ``lr`` leaf the optimizer recorded (from ``scale_by_learning_rate``), or NaN.

    ``opt_state`` is the state's leaf list and ``sdef`` its structure; the position of the leaf is
    looked up once per structure."""
    compiling = torch.compiler.is_compiling()  # then leave module state alone (dynamo guards it)
    index = -1 if compiling else _LR_INDEX.get(sdef, -1)
    if index == -1:
        # scale_by_learning_rate's state is {count, lr}: an `lr` leaf with a `count` sibling (a
        # parameter named `lr` also gives `lr` leaves, inside moment trees, without one)
        paths = set(sdef.paths)
        index = next(
            (
                i
                for i, k in enumerate(sdef.paths)
                if k.rsplit(".", 1)[-1] == "lr" and k[: -len("lr")] + "count" in paths
            ),
            None,
        )
        if not compiling:
            _LR_INDEX[sdef] = index
    if index is None:
        return torch.full((), float("nan"))
    return opt_state[index]


def _new_state(**fields: Any) -> TrainState:
    """``TrainState(**fields, batch_size=[])``, without the constructor's checks in eager mode
    (every field is a tensor or a TensorDict with an empty batch size: 5x cheaper)."""
    if torch.compiler.is_compiling():
        return TrainState(**fields, batch_size=[])
    td = TensorDict._new_unsafe(fields, batch_size=torch.Size([]), nested=False)
    return TrainState._from_tensordict(td)


def train_step(
    loss_fn: Callable[..., Any], optimizer: GradientTransformation, *, donate: bool = False
) -> Step:
    """The step ``(state, batch) -> (state, metrics)`` that minimizes ``loss_fn`` with ``optimizer``.

    Args:
        loss_fn: ``loss_fn(params, batch)`` returning an :class:`ftrain.Loss` (a sum and its
            count), a scalar tensor (a mean over the batch rows), or ``(loss, aux_dict)``. It calls
            the model through :func:`ftrain.apply`.
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
    if not callable(loss_fn):
        raise TypeError(
            f"train_step(loss_fn, ...): loss_fn must be callable as loss_fn(params, batch), "
            f"got {type(loss_fn).__name__}."
        )
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            "train_step(loss_fn, optimizer): optimizer must be an ftrain.optim."
            f"GradientTransformation (e.g. ftrain.optim.adamw(3e-4)), got {type(optimizer).__name__}."
            + (
                " torch.optim optimizers hold state inside; ftrain's are pure functions."
                if isinstance(optimizer, torch.optim.Optimizer)
                else ""
            )
        )
    if not isinstance(donate, bool):
        raise TypeError(f"train_step(donate=...): expected a bool, got {donate!r}.")
    return Step(loss_fn=loss_fn, optimizer=optimizer, donate=donate)


def wrap(
    step: Step,
    wrapper: Callable[[StepFn], StepFn],
    *,
    name: str = "wrap",
    init: Callable[[TrainState], TrainState] | None = None,
) -> Step:
    """Add an outer layer to ``step``: the new step calls ``wrapper(inner)(state, batch)``.

    This is how to write your own transform (EMA of params, logging, gradient noise on the
    result) and keep the phases reachable by the built-in transforms applied later. ``wrapper``
    must return a function with the step's signature and must not mutate its inputs.

    ``init(state) -> state`` adds the entries the wrapper keeps in ``state.extra`` when they are
    missing; the step runs it before every call (outside ``ft.compile``), and
    ``step.init_extra(state)`` runs it up front.
    """
    if not isinstance(step, Step):
        raise TypeError(f"wrap(step, ...): step must be an ft.Step, got {type(step).__name__}.")
    if not callable(wrapper):
        raise TypeError("wrap(step, wrapper): wrapper must be callable as wrapper(inner_step_fn).")
    inits = step.state_inits if init is None else (*step.state_inits, init)
    return dataclasses.replace(
        step,
        wrappers=(*step.wrappers, wrapper),
        state_inits=inits,
        transforms=(*step.transforms, name),
    )
