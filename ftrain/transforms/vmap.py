"""K models trained in one step: ``ft.vmap`` of a step over a stacked state (``ft.stack``).

**Rule:** member i of the new state is what the step makes of member i of the old one, with the
shared batch (``batch_axis=None``) or its own slice of it (``batch_axis=0``).

Two hooks of the public protocol do it: ``engine`` swaps the gradient engine for
:class:`~ftrain.step.FuncEngine` (``torch.autograd.grad`` cannot run inside ``torch.func.vmap``;
``torch.func.grad`` can), and ``wrap`` runs the step function under ``torch.func.vmap`` with the
state's leaves batched along their first dimension. The hooks that act inside the step (split,
forward hooks, reduce, gradients, the optimizer) run per member, inside; ``init`` and the
``"eager"`` wraps see the stacked state. Inside, ftrain's multi-tensor kernels run per tensor
(``ftrain.internals.foreach.looped``: vmap cannot batch some of them) and ``ft.shard``'s all-reduce
runs once on the members' buffers together. The ``wrap`` acts at the ``"traced"`` stage, inside
``ft.compile``'s, so ``ft.compile`` compiles the vmapped step whichever was applied first.

Randomness: inside the vmapped step, dropout (``F.dropout``, ``nn.Dropout`` and the ``dropout_p``
of ``F.scaled_dot_product_attention``) draws its masks from member i's own key with
:class:`ftrain.internals.keyed_dropout.keyed_dropout`: the n-th dropout call of a step draws from
``fold_in(fold_in(fold_in(rng_i, step_i), rank), n)`` (``rank``: the process's rank,
0 without ``torch.distributed``), so member i's masks depend on its own key, step and data
only: not on K, nor on the other members. Those are not the masks the plain step draws (it uses
torch's generators, seeded from the state): a vmapped member and the plain step agree exactly
only without dropout. Other random calls (``torch.rand`` in a model) draw from torch's generators
under ``torch.func.vmap(randomness="different")``: different between members and reproducible
(the generators are seeded from every member's key and step), but dependent on K.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch.overrides import TorchFunctionMode

from ftrain import rng, tree
from ftrain.distributed.launch import rank_and_world
from ftrain.internals import foreach, func_scope
from ftrain.internals.keyed_dropout import keyed_dropout
from ftrain.stack import members
from ftrain.state import TrainState
from ftrain.step import Step, StepFn, Transform
from ftrain.step.capabilities import REPLACES_ENGINE, STACKED_STATE, TORCH_FUNC_GRADIENTS
from ftrain.step.func_engine import FuncEngine

__all__ = ["Vmap", "vmap"]

_FIELDS = ("params", "opt_state", "extra")

_NO_CHECKPOINT = (
    "torch.func (which ft.vmap differentiates with) refuses the saved-tensor hooks that "
    "activation checkpointing runs on, so ft.vmap and ft.checkpoint do not compose in either "
    "order. Leave out ft.checkpoint (or use policy='none'), or train the members one by one."
)


@dataclasses.dataclass(frozen=True, eq=False)
class Vmap(Transform):
    """The step over a stacked state (the ``engine`` and ``wrap`` hooks); see :func:`vmap`."""

    batch_axis: int | None = None

    def __post_init__(self) -> None:
        if self.batch_axis is not None and (
            isinstance(self.batch_axis, bool) or self.batch_axis != 0
        ):
            raise ValueError(
                f"ft.vmap(batch_axis={self.batch_axis!r}): legal values are None (every member "
                "gets the whole batch) and 0 (the batch has a leading member dimension)."
            )

    def capabilities(self):
        return {
            STACKED_STATE: f"batch_axis={self.batch_axis}",
            TORCH_FUNC_GRADIENTS: "",
            REPLACES_ENGINE: "torch.func per member",
        }

    def engine(self, engine):
        return FuncEngine()  # REPLACES_ENGINE: no other transform of the step replaces it

    def wrap(self, fn: StepFn, stage: str) -> StepFn:
        if stage != "traced":
            return fn
        batch_axis = self.batch_axis

        def vmapped(state, batch):
            k = members(state, "ft.vmap(step)(state, batch)")
            if batch_axis == 0:
                _check_batch(batch, k)
            salt = rank_and_world()[0]  # dropout differs between ranks, as under ft.shard
            structure = []  # the new state's structure, found inside the vmapped call

            def member(leaves, member_batch):
                s = _unflatten(state, leaves)
                key = rng.fold_in(rng.fold_in(s.rng, s.step), salt)
                with keyed_dropout(key), _batched_all_reduce():
                    new, metrics = fn(s, member_batch)
                out, defs = _flatten(new)
                structure.append(defs)
                return out, metrics

            leaves, _ = _flatten(state)
            run = torch.func.vmap(member, in_dims=(0, batch_axis), randomness="different")
            # set outside vmap: dynamo traces the flags into the body
            with foreach.looped(), func_scope.entered():
                out, metrics = run(leaves, batch)
            # an output that no member changed comes back expanded (stride 0): give it memory
            # (a no-op for the others; no stride test, which dynamo cannot trace on symbolic
            # shapes once a compiled vmapped step sees a second batch size)
            out = [t.contiguous() for t in out]
            return _unflatten_with(structure[-1], out), metrics

        return vmapped


class _AllReduce(torch.autograd.Function):
    """``dist.all_reduce`` out of place, with a vmap rule: the members' buffers are reduced as one
    tensor, in one collective (c10d's in-place op has no batching rule)."""

    @staticmethod
    def forward(t, op, group):
        out = t.clone()
        dist.all_reduce(out, op=op, group=group)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass  # the step never differentiates through its reduction

    @staticmethod
    def vmap(info, in_dims, t, op, group):
        return _AllReduce.forward(t, op, group), in_dims[0]


class _batched_all_reduce(TorchFunctionMode):  # noqa: N801 - used as a function
    """``dist.all_reduce(t)`` inside the vmapped step (``ft.shard``'s reduction) as
    :class:`_AllReduce`, written back into ``t``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is dist.all_reduce:
            t = args[0] if args else kwargs["tensor"]
            op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            t.copy_(_AllReduce.apply(t, op, group))
            return None
        return func(*args, **kwargs)


def _flatten(state: TrainState) -> tuple[list[torch.Tensor], tuple]:
    """The leaves of ``state`` (params, opt_state, extra, then step and rng) and their trees."""
    out, defs = [], []
    for field in _FIELDS:
        values, tdef = tree.flatten(getattr(state, field))
        out += values
        defs.append((tdef, len(values)))
    return [*out, state.step, state.rng], tuple(defs)


def _unflatten_with(defs: tuple, leaves: list[torch.Tensor]) -> TrainState:
    fields, i = {}, 0
    for field, (tdef, n) in zip(_FIELDS, defs):
        fields[field] = tdef.unflatten(leaves[i : i + n])
        i += n
    fields["step"], fields["rng"] = leaves[i], leaves[i + 1]
    return tree.new_tensorclass(TrainState, fields)


def _unflatten(like: TrainState, leaves: list[torch.Tensor]) -> TrainState:
    return _unflatten_with(_flatten(like)[1], leaves)


def _leaves(batch: Any) -> list[Any]:
    """The leaves of a batch: a tensor, or TensorDicts, dicts, lists and tuples of them."""
    if isinstance(batch, TensorDictBase):
        return list(batch.values(True, True))
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [x for b in batch for x in _leaves(b)]
    return [batch]


def _check_batch(batch: Any, k: int) -> None:
    """With ``batch_axis=0``: every leaf of the batch is a tensor with a leading member
    dimension of size K."""
    for t in _leaves(batch):
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"ft.vmap(step, batch_axis=0): the batch holds a {type(t).__name__} ({t!r:.40}), "
                "which has no member dimension. Every leaf of the batch must be a tensor with "
                "one slice per member: close other values into loss_fn, or use ft.vmap(step) "
                "(batch_axis=None) for one batch shared by every member."
            )
        if t.dim() == 0 or t.shape[0] != k:
            raise ValueError(
                f"ft.vmap(step, batch_axis=0): the batch holds a tensor of shape {list(t.shape)}, "
                f"but each tensor needs a leading member dimension of size {k} (one slice per "
                "member, e.g. torch.stack of K batches). For one batch shared by every member, "
                "use ft.vmap(step) (batch_axis=None)."
            )


def vmap(step: Step, *, batch_axis: int | None = None) -> Step:
    """Train the K members of a stacked state (``ft.stack(states)``) in one step, with
    ``torch.func.vmap``: ensembles and hyper-parameter sweeps in one run.

    Args:
        step: an ``ft.Step``. ``ft.accumulate``, ``ft.autocast``, ``ft.ema`` and
            ``ft.shard(step, "ddp")`` (members replicated on every process, the batch split
            between them) compose, before or after. ``ft.compile``, before or after, compiles the
            vmapped step (``torch.func.vmap`` inside the compiled function) with no recompiles.
            ``ft.checkpoint`` is refused when the step is built, in either order
            (``torch.func`` refuses saved-tensor hooks).
        batch_axis: None: every member trains on the same batch; 0: every tensor of the batch has
            a leading dimension of size K, and member i trains on its slice i.

    The new state is stacked like the old one; metrics have shape ``[K]``. Hyper-parameters may
    differ between members: build the optimizer with ``ftrain.optim.inject_hyperparams`` and
    stack states whose ``opt_state["hyperparams", ...]`` differ (e.g. a learning-rate sweep).
    Randomness: see the module docstring; the same stacked state and batch give the same result,
    and member i's dropout masks depend on member i's ``rng`` and ``step`` only.

    **Invariant:** without dropout, member i of ``vmap(step)`` equals ``step`` run on member i
    alone (fp32: 1e-5 relative over 20 Adam steps at learning rates <= 5e-4; batched kernels round
    differently, and at larger rates Adam amplifies it: docs/vmap.md gives measured values).
    Errors when called: a state that is not stacked (or a leaf without the member dimension),
    and with ``batch_axis=0`` a batch tensor without a leading dimension of size K.
    """
    return Vmap(batch_axis)(step)
