"""Tensor parallelism (Megatron's column/row-parallel linears) on the ``tp`` dimension of a mesh.

**Rule:** the ``tp`` processes of a group, each given the same batch and holding its pieces of
the block matrices, take the same step as one process holding them whole. Gradients of the split
matrices are each process's own piece; those of whole parameters (embeddings, norms) come out
equal on every process, each the whole gradient, so nothing is summed across ``tp`` twice.

How it is laid out (``ftrain.distributed.tensor_parallel.mesh``), how the forward runs on the pieces
(``ftrain.distributed.tensor_parallel.model``) and which collectives surround each column/row pair
(:meth:`TensorParallel.collectives`, the one place to change them) live in ``ftrain.distributed``.

Composition:

* ``ft.shard(step, strategy, mesh=mesh["dp"])`` splits the batch over the ``dp`` dimension of
  the same mesh (a 2-D ``("dp", "tp")`` run), with any strategy: ``ddp``; ``zero1``/``zero2``
  split the optimizer state (and grads) over ``dp`` too, ``fsdp`` the params as well
  (``state = ft.shard_state(tp.shard_state(state), "fsdp", mesh=mesh["dp"])``). Each piece is
  split again over ``dp`` along a dimension tensor parallelism does not split
  (``ftrain.distributed.data_parallel.dp_split``), so fsdp's gather gives the ``tp`` piece the
  forward needs. Either order of wrapping, ``ft.shard(tp(step), ...)`` or ``tp(ft.shard(step,
  ...))``.
* ``ft.accumulate``, ``ft.checkpoint`` (a recomputed block runs its collectives again) and
  ``ft.autocast`` compose in any order; ``ft.compile`` is refused (collectives and DTensor).
* The optimizers of ``ftrain.optim`` run on the pieces unchanged (DTensor makes their norms
  global), except ``adamw8bit``, whose codes quantize blocks of whole tensors: refused by
  ``shard_state``.
* Randomness: dropout draws the same stream on every ``tp`` process, so the whole activations
  between pairs get the same masks (under ``sequence_parallel``, masks per global position);
  dropout inside a pair (attention probabilities of this process's heads) equals one process
  only in distribution.

``sequence_parallel=True`` splits the activations between the pairs along the sequence
(``ftrain.distributed.tensor_parallel.sequence_region``): the plan's ``SequenceParallel`` modules
run on ``T / tp`` positions, the pairs all-gather / reduce-scatter the sequence, and the gradients
of the whole parameters inside them (norms, row-parallel biases), partial sums, are added over
``tp`` by the gradient engine; their ``nn.Dropout`` masks are drawn per global position. The rule
above holds unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ftrain import tree
from ftrain.apply import rewritten
from ftrain.distributed.dtensor import is_dtensor, on_shards
from ftrain.distributed.launch import dp_ranks, require_group
from ftrain.distributed.tensor_parallel.linear import PairCollectives, megatron
from ftrain.distributed.tensor_parallel.mesh import check_tp_mesh, lay_out, lay_out_state
from ftrain.distributed.tensor_parallel.model import tp_copy
from ftrain.distributed.tensor_parallel.plans import Split, resolve_plan
from ftrain.distributed.tensor_parallel.sequence_region import (
    SumPartialGrads,
    in_region,
    partial_params,
    region,
    sequence_forwards,
    sequence_pair,
)
from ftrain.state import TrainState
from ftrain.step import Transform
from ftrain.step.capabilities import (
    DATA_PARALLEL_OVER,
    SHARDED_PARAMS,
    SHARDED_STATE,
    SPLITS_MATRICES,
    UNTRACEABLE,
)

__all__ = ["TensorParallel", "tensor_parallel"]


@dataclasses.dataclass(frozen=True, eq=False)
class TensorParallel(Transform):
    """Tensor parallelism for ``model`` as ``plan`` says, on ``mesh``'s ``tp`` dimension, with
    ``sequence_parallel`` between the pairs (see :func:`tensor_parallel`)."""

    model: nn.Module
    plan: Mapping[str, object]
    mesh: Any
    sequence_parallel: bool = False
    splits: dict[str, Split] = dataclasses.field(init=False, repr=False)
    sequence_region: tuple[str, ...] = dataclasses.field(init=False, repr=False)  # split modules
    partial: frozenset[str] = dataclasses.field(init=False, repr=False)  # their whole params

    name = "tensor_parallel"

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(
                f"ft.tensor_parallel(model, ...): expected the nn.Module the loss calls through "
                f"ft.apply, got {type(self.model).__name__}."
            )
        require_group("tensor_parallel")
        object.__setattr__(self, "mesh", check_tp_mesh(self.mesh, "tensor_parallel"))
        _check_vocab_head(self.model, self.plan)
        object.__setattr__(self, "splits", resolve_plan(self.model, self.plan, self.tp))
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(
                f"ft.tensor_parallel(sequence_parallel={self.sequence_parallel!r}): expected "
                "True or False."
            )
        names = region(self.model, self.plan) if self.sequence_parallel else []
        object.__setattr__(self, "sequence_region", tuple(names))
        object.__setattr__(self, "partial", partial_params(self.model, names, self.splits))

    @property
    def tp(self) -> int:
        """The number of processes that split each matrix."""
        return self.mesh["tp"].size()

    @property
    def group(self):
        """The ``tp`` process group (what ``vocab_parallel_cross_entropy`` reduces over)."""
        return self.mesh.get_group("tp")

    def collectives(self, path: str = "") -> PairCollectives:
        """The communication entering the column-parallel layer and leaving the row-parallel one
        at module ``path``, over the ``tp`` group; the one place that chooses them. Megatron's f
        and g (identity / all-reduce); with ``sequence_parallel``, inside the sequence region
        (the ``SequenceParallel`` modules; every path when ``path`` is empty), an all-gather over
        the sequence in (the column-parallel linear saving only the slice) and a reduce-scatter
        over it out. A column-parallel ``lm_head`` after the region sees the gathered sequence
        and keeps Megatron's f."""
        group = self.mesh.get_group("tp")
        inside = not path or in_region(path, self.sequence_region)
        return sequence_pair(group) if self.sequence_parallel and inside else megatron(group)

    def shard_state(self, state: TrainState) -> TrainState:
        """``state`` (whole, the same on every process) laid out on the mesh: this process's
        pieces of the split parameters and of the optimizer moments and ``extra`` entries shaped
        like them; everything else whole. No traffic but a check that the params agree."""
        return lay_out_state(state, self.splits, self.mesh)

    def lay_out_param(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """One whole parameter (plain, the same on every process) as :meth:`shard_state` lays it
        out: this process's piece of a split one, a replicated DTensor of an unsplit one, and one
        the plan does not name left plain. For ``ft.distributed.sharded_init(...,
        layout=tp.lay_out_param, mesh=tp.mesh["dp"])``: a state born laid out, never whole."""
        split = self.splits.get(name)
        return whole if split is None else lay_out(whole, split, self.mesh)

    # -- building -------------------------------------------------------------------------------
    def capabilities(self):
        return {
            SPLITS_MATRICES: f"tp={self.tp}",
            SHARDED_PARAMS: "tensor parallel",
            SHARDED_STATE: "tensor parallel",
            DATA_PARALLEL_OVER: dp_ranks(self.mesh),
            UNTRACEABLE: "its collectives run on DTensor params; run the tensor-parallel step "
            "eagerly",
        }

    def optimizer(self, optimizer):
        return on_shards(optimizer)  # the params, grads and moments are DTensors

    def engine(self, engine):
        if not self.partial:
            return engine
        # sequence parallelism: norms (and row-parallel biases) saw this process's positions only
        return SumPartialGrads(engine, self.partial, self.mesh.get_group("tp"))

    def wrap(self, fn, stage: str):
        if stage != "eager":
            return fn

        def laid_out(state, batch):
            leaves = tree.leaves(state.params)
            if leaves and not (is_dtensor(leaves[0]) and leaves[0].device_mesh == self.mesh):
                raise ValueError(
                    "ft.tensor_parallel: the state is not laid out for tensor parallelism on this "
                    "mesh. Call state = tp.shard_state(state) once, after creating or loading it "
                    "(tp = ft.tensor_parallel(model, plan, mesh))."
                )
            return fn(state, batch)

        return laid_out

    def forward(self, fn):
        return rewritten(fn, self, "ft.tensor_parallel")

    def rewrite(self, module: nn.Module) -> nn.Module:
        """The tensor-parallel copy of ``module`` that ``ft.apply`` runs (apply's Rewrite)."""
        more = []
        if self.sequence_parallel:
            more = sequence_forwards(
                module, list(self.sequence_region), self.mesh.get_group("tp"), self.tp
            )
        return tp_copy(module, self.plan, self.tp, self.collectives, more)


def _check_vocab_head(model: nn.Module, plan: Mapping[str, object]) -> None:
    """A plan that splits ``lm_head`` on a GPT whose head is the embedding (tied): say so."""
    tied = getattr(getattr(model, "config", None), "tie_weights", False)
    if tied and "lm_head" in plan and getattr(model, "lm_head", None) is None:
        raise ValueError(
            "ft.tensor_parallel: the plan splits 'lm_head' (gpt_plan(vocab_parallel=True)), but "
            "this GPT ties its output head to the embedding, so it has no lm_head to split. Fix: "
            "build it with GPTConfig(..., tie_weights=False), or use gpt_plan()."
        )


def tensor_parallel(
    model: nn.Module, plan: Mapping[str, object], mesh: Any, *, sequence_parallel: bool = False
) -> TensorParallel:
    """Tensor parallelism for ``model``: a transform to apply to a step, which also lays out the
    state it trains (``tp.shard_state(state)``)::

        mesh = ft.distributed.tp_mesh(2)                  # ("dp", "tp"), tp = 2
        tp = ft.tensor_parallel(model, gpt_plan(), mesh)
        step = ft.shard(tp(step), "ddp", mesh=mesh["dp"])  # or tp(step) alone when dp = 1
        state = tp.shard_state(state)
        # zero1 / zero2 / fsdp over dp: the same, and the state split over dp after tp's layout
        state = ft.shard_state(state, "fsdp", mesh=mesh["dp"])  # with ft.shard(..., "fsdp", ...)

    Args:
        model: the module the loss calls through ``ft.apply`` (it is never modified).
        plan: module-path patterns -> ``Colwise()`` / ``Rowwise()`` / ``Divide(...)`` /
            ``SequenceParallel()``
            (``ftrain.distributed.tensor_parallel.plans``: ``gpt_plan``, ``hf_gpt2_plan``,
            ``hf_llama_plan``).
        mesh: a ``DeviceMesh`` over every process with a ``"tp"`` dimension
            (``ft.distributed.tp_mesh(tp)``).
        sequence_parallel: split the activations between the pairs along the sequence (dim 1)
            inside the modules the plan marks ``SequenceParallel()`` (the blocks): each process
            keeps ``1 / tp`` of the norms' activations; the pairs all-gather and reduce-scatter
            the sequence instead of all-reducing; the partial gradients of the norms and
            row-parallel biases there are summed over ``tp`` after backward; each ``nn.Dropout``
            there masks per global position (``sequence_dropout``). False (default):
            Megatron's all-reduces, every activation between the pairs whole, as before.

    With ``plan = gpt_plan(vocab_parallel=True)`` (an untied GPT) the model returns this
    process's vocabulary slice of the logits; train it with
    ``ft.distributed.vocab_parallel_cross_entropy(logits, targets, tp.group)``.

    **Invariant:** equals one process holding the whole params (fp32: 1e-5 after several steps,
    any optimizer of ``ftrain.optim`` but ``adamw8bit``), also on a 2-D mesh under ``ft.shard`` over ``dp`` (ddp,
    zero1, zero2, fsdp) and with ``accumulate``/``checkpoint``/``autocast``; with
    ``sequence_parallel`` too (the norms' params included), and with the vocabulary-parallel loss.

    Raises when built: no process group, a mesh without ``"tp"`` or not over every process, a
    pattern that names no module, a split dimension (or divided head count) not divisible by the
    tp size, ``shard`` over another mesh than ``mesh["dp"]``, ``compile``; with
    ``sequence_parallel``: a plan without ``SequenceParallel()`` (``hf_llama_plan``) or whose
    region skips a module; a plan that splits ``lm_head`` of a GPT with tied weights. From
    ``shard_state``: ``adamw8bit`` state. At the first call: a state that ``shard_state`` did not
    lay out; with ``sequence_parallel``, a sequence length not divisible by the tp size.
    """
    return TensorParallel(model, plan, mesh, sequence_parallel)
