"""Pipeline parallelism: the model's blocks cut into stages over the ``pp`` ranks of a mesh.

**Rule:** the ``pp`` processes of a pipeline, each given the same batch and holding the params
and optimizer state of its own stages, take the same step as one process holding the whole
model: the schedule runs each micro-batch's forward through the stages in order and its
backward back, the last stage computes the step's own loss, gradients are plain sums over the
micro-batches, and the one division by the count uses the whole batch's count, reduced over
the pipeline. A tensor two stages use (an embedding tied to the head) is held by both ranks,
its gradient summed between them, so its copies stay equal.

Where the model is cut and what each stage runs: ``ftrain.distributed.pipeline.cut``. How one
rank runs its stages under ``torch.distributed.pipelining``'s schedule:
``ftrain.distributed.pipeline.runner``.

Composition:

* ``ft.shard(step, strategy, mesh=mesh["dp"])``, any strategy: each pipeline replica gets its
  part of the batch (a 2-D ``("dp", "pp")`` run); ``state = ft.shard_state(pp.shard_state(
  state), strategy, mesh=mesh["dp"])``. Under ``"fsdp"`` the engine gathers this rank's stage
  params from their ``dp`` shards once, when the step starts, runs every micro-batch on them,
  and leaves their summed gradients to fsdp's reduce, one reduce-scatter when the schedule is
  done (``ftrain.distributed.data_parallel.step_gather``): fsdp's per-block gathering follows
  one micro-batch at a time, which the schedules interleave, and would gather once per
  micro-batch. So during the step a rank holds its stages' whole params and gradients, as under
  ``"zero2"`` (plus the shards), and between steps 1/dp of params and optimizer state.
* ``ft.accumulate`` (each piece a pipeline flush of its own), ``ft.checkpoint`` (the stages'
  blocks recomputed) and ``ft.autocast`` (the stages' forwards and the loss in its precision)
  compose in any order; ``ft.compile`` is refused (point-to-point sends, a Python schedule).
* The optimizers of ``ftrain.optim`` run on each rank's own params;
  ``clip_by_global_norm`` and the ``grad_norm`` metric take the norm over the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ftrain import tree
from ftrain.apply import apply, rewritten
from ftrain.distributed.data_parallel.step_gather import gather_for_step, unreduced_grads
from ftrain.distributed.dtensor import is_dtensor
from ftrain.distributed.launch import dp_ranks, group_device, require_group
from ftrain.distributed.pipeline.cut import (
    Family,
    blocks_of,
    check_split,
    cut,
    even_split,
    family_of,
    stage_ranks,
)
from ftrain.distributed.pipeline.layout import gather_stages, keep_stages, whole_tree
from ftrain.distributed.pipeline.runner import (
    SCHEDULES,
    SINGLE_STAGE,
    V_SHAPED,
    Runner,
    StageInput,
    refusal,
)
from ftrain.internals.blocks import replace_forwards
from ftrain.losses import Loss
from ftrain.optim.primitives import global_norm, with_whole_model_norm
from ftrain.state import TrainState
from ftrain.step import Transform
from ftrain.step.capabilities import (
    DATA_PARALLEL_OVER,
    PIPELINES,
    REPLACES_ENGINE,
    SHARDED_STATE,
    UNTRACEABLE,
)
from ftrain.step.engine import Grads

__all__ = ["Pipeline", "pipeline"]


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline(Transform):
    """Pipeline parallelism for ``model`` on ``mesh``'s ``pp`` dimension; see :func:`pipeline`."""

    name = "pipeline"

    model: nn.Module
    mesh: Any
    schedule: str
    microbatches: int
    blocks_per_stage: tuple[int, ...]
    inputs: Callable[[Any], torch.Tensor] = dataclasses.field(repr=False)
    family: Family = dataclasses.field(repr=False)
    runner: Runner = dataclasses.field(repr=False)

    @property
    def pp(self) -> int:
        return self.mesh["pp"].size()

    @property
    def keys(self) -> list[str]:
        """The params keys this rank holds (its stages'), in the model's order."""
        mine = set(self.runner.keys)
        return [k for k, _ in self.model.named_parameters() if k in mine]

    # -- the state ------------------------------------------------------------------------------
    def shard_state(self, state: TrainState) -> TrainState:
        """``state`` (whole, the same on every process) keeping only this rank's params and the
        optimizer and ``extra`` entries shaped like them (moments); counters stay. The inverse,
        every process's pieces put together: :meth:`unshard_state`."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"pipeline.shard_state(state): expected an ft.TrainState, got "
                f"{type(state).__name__}."
            )
        names = [k for k, _ in self.model.named_parameters()]
        have = tree.paths(state.params)
        if sorted(have) != sorted(names):
            missing = sorted(set(names) - set(have))[:3]
            raise ValueError(
                "pipeline.shard_state: expected the whole model's params (ft.params_of(model)); "
                f"{'missing ' + str(missing) if missing else 'got other keys'}. Lay a state out "
                "once, after creating or loading it whole; to resume, load a checkpoint onto "
                "the laid-out state: ft.load(path, like=state, pipeline=pp)."
            )
        mine, keys = set(self.runner.keys), {k: i for i, k in enumerate(names)}
        return state.replace(
            **{
                f: keep_stages(getattr(state, f), mine, keys)
                for f in ("params", "opt_state", "extra")
            }
        )

    def unshard_state(self, state: TrainState) -> TrainState:
        """The whole state on every process, from each rank's pieces (a collective over the
        pipeline: each tensor is broadcast from a rank that holds it). What :meth:`shard_state`
        laid out, put back together: ``unshard_state(shard_state(s))`` is ``s``, bitwise."""
        group = self.mesh["pp"].get_group()
        keys = {k: i for i, (k, _) in enumerate(self.model.named_parameters())}
        return state.replace(
            **{
                f: gather_stages(getattr(state, f), keys, group)
                for f in ("params", "opt_state", "extra")
            }
        )

    def whole_tree(self, trees: Sequence[dict]) -> dict:
        """The checkpoint tree (``ftrain.io``'s) of the whole state, in its order, from the
        trees of the parts that :meth:`shard_state` left on any processes (replicas included):
        what ``ft.save(state, path, pipeline=pp)`` indexes and ``ft.load(path, like=state,
        pipeline=pp)`` checks ``like`` against. Pure (the caller gathers the trees)."""
        keys = {k: i for i, (k, _) in enumerate(self.model.named_parameters())}
        return whole_tree(trees, keys)

    # -- hooks ----------------------------------------------------------------------------------
    def capabilities(self) -> Mapping[str, str]:
        return {
            PIPELINES: f"pp={self.pp}",
            REPLACES_ENGINE: "torch.distributed.pipelining's schedule runs forward and backward",
            SHARDED_STATE: "",
            DATA_PARALLEL_OVER: dp_ranks(self.mesh),
            UNTRACEABLE: "its schedule sends activations between processes from Python; run "
            "the pipelined step eagerly",
        }

    def engine(self, engine):
        return PipelineEngine(self.runner, self.mesh["dp"])

    def wrap(self, fn, stage: str):
        if stage != "eager":
            return fn
        mine = sorted(self.runner.keys)

        def laid_out(state, batch):
            if sorted(tree.paths(state.params)) != mine:
                raise ValueError(
                    "ft.pipeline: the state's params are not this rank's stages'. Call state = "
                    "pp.shard_state(state) once, after creating or loading the whole state "
                    "(pp = ft.pipeline(model, mesh, ...))."
                )
            return fn(state, batch)

        return laid_out

    def forward(self, fn):
        answered = rewritten(fn, self, "ft.pipeline")

        def pipelined(params, batch, state):
            if isinstance(batch, StageInput):  # a stage's forward, under the outer hooks
                batch.output = apply(batch.stage.body, params, batch.x)
                zero = torch.zeros((), device=batch.x.device)
                return Loss(zero, zero)
            return answered(params, batch, state)  # the loss, on the last stage

        return pipelined

    def rewrite(self, module: nn.Module) -> nn.Module:
        """The model as the loss function calls it on the last stage: its forward answers with
        this micro-batch's last-stage output."""
        runner = self.runner
        return replace_forwards(module, [(module, lambda current: runner.stage_output)])

    def rewrite_key(self) -> object:
        return self.runner

    def optimizer(self, optimizer):
        return with_whole_model_norm(optimizer, self.norm)

    def gradients(self, g, state):
        leaves, tdef = tree.flatten(g.grads)
        return g._replace(metrics={**g.metrics, "grad_norm": self.norm(leaves, tdef)})

    def norm(self, leaves: list[torch.Tensor], tdef) -> torch.Tensor:
        """The L2 norm over the whole model of ``leaves`` keyed like (a part of) the params: this
        rank's share, a tensor held by several ranks counted on the first, summed over the
        pipeline (a collective)."""
        counted = [t for k, t in zip(tdef.paths, leaves) if self.runner.counted_here(k)]
        device = leaves[0].device if leaves else torch.device("cpu")
        sq = global_norm(counted).square() if counted else torch.zeros((), device=device)
        if is_dtensor(sq):  # over ft.shard's dp pieces (zero1/zero2): DTensor made it whole
            sq = sq.full_tensor()
        sq = sq.to(device=device, dtype=torch.float32)
        dist.all_reduce(sq, group=self.mesh["pp"].get_group())
        return sq.sqrt()


class PipelineEngine:
    """The gradient engine of a pipelined step: this rank's stages under the schedule, once per
    piece (``ft.accumulate``'s), their gradients summed, ties summed across ranks. Params that
    fsdp keeps split over ``dp`` are gathered once for the whole step and their gradients left
    to ``ft.shard``'s reduce (``ftrain.distributed.data_parallel.step_gather``)."""

    def __init__(self, runner: Runner, dp: Any):
        self.runner, self.dp = runner, dp

    def __call__(self, forward, params, pieces, scale) -> Grads:
        whole = gather_for_step(params, self.dp)  # fsdp's shards, whole until the step ends
        grads, total, count, aux = self.runner.run(forward, whole, pieces, scale)
        grads = unreduced_grads(grads, params, self.dp)  # reduce-scattered once, by ft.shard
        grads = self.runner.reduce_shared(grads, tree.structure(params).paths)
        return Grads(grads, total, count, aux, True)

    def __repr__(self) -> str:
        return "PipelineEngine()"


def pipeline(
    model: nn.Module,
    mesh: Any,
    *,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    stages: Sequence[int] | Sequence[Sequence[str]] | None = None,
    virtual: int = 2,
    inputs: str | Callable[[Any], torch.Tensor] = "input",
    family: Family | None = None,
) -> Pipeline:
    """Pipeline parallelism for ``model``: a transform to apply to a step, which also lays out
    the state it trains (``pp.shard_state(state)``)::

        mesh = ft.distributed.pp_mesh(pp=2)                  # ("dp", "pp", "tp")
        pp = ft.pipeline(model, mesh, schedule="1f1b", microbatches=4)
        step = pp(ft.train_step(loss_fn, opt))
        state = pp.shard_state(state)
        # with data parallelism over dp: ft.shard(pp(step), "zero1", mesh=mesh["dp"]) and
        # state = ft.shard_state(pp.shard_state(state), "zero1", mesh=mesh["dp"])

    Args:
        model: the module the loss calls through ``ft.apply`` (never modified): the built-in
            GPT, a Hugging Face GPT-2 or Llama, or any model given a ``family``.
        mesh: a ``DeviceMesh`` over every process with a ``"pp"`` dimension
            (``ft.distributed.pp_mesh``); its ``"dp"`` dimension, if any, is for ``ft.shard``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"looped-bfs"``,
            ``"interleaved-zero-bubble"`` (``virtual`` stages per rank) or ``"zbv"`` (two per
            rank, V-shaped): ``torch.distributed.pipelining``'s schedules.
        microbatches: into how many equal micro-batches the schedule splits each batch (default:
            twice the number of stages); the batch rows must be a multiple of it.
        stages: the number of blocks of each stage, in order, or each stage's blocks by module
            name (``[["blocks.0", "blocks.1"], ["blocks.2"]]``); default: as even as they go.
        virtual: stages per rank for the interleaved schedules.
        inputs: the batch field the first stage reads (or a function ``batch -> tensor``).
        family: how to run a stage of a model ``ftrain.distributed.pipeline.families()`` does
            not know (a ``Family``).

    The loss function is the step's own, unchanged: on the last stage its model call returns the
    last stage's output for the micro-batch (logits). It must call the model once per call, with
    the token ids as the only tensor argument (no packed rows' ``position_ids``, no attention
    mask: pad targets with -100).

    **Invariant:** equals one process holding the whole model (fp32: 1e-5 after several steps),
    for every schedule, with ``accumulate``/``checkpoint``/``autocast``, and under ``ft.shard``
    over ``dp`` (ddp, zero1, zero2, fsdp). Metrics (loss, count, grad_norm) are the whole model's
    on every rank.

    Raises when built: no process group, a mesh without ``"pp"``, an unknown schedule, fewer
    blocks than stages, a ``stages`` that does not cut the blocks, ``microbatches`` fewer than
    the stages; ``compile`` in the step. At the first call: a state ``shard_state``
    did not lay out; a batch whose rows ``microbatches`` does not divide.
    """
    require_group("pipeline")
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "pp" not in names:
        raise ValueError(
            "ft.pipeline(model, mesh): expected a DeviceMesh with a dimension named 'pp' (e.g. "
            "mesh = ft.distributed.pp_mesh(pp=2))."
        )
    if schedule not in SCHEDULES:
        raise ValueError(
            f"ft.pipeline(schedule={schedule!r}): expected one of {sorted(SCHEDULES)}."
        )
    refused = refusal(schedule, dist.get_backend())
    if refused:
        raise ValueError(f"ft.pipeline(schedule={schedule!r}): {refused}.")
    family = family or family_of(model)
    family.check(model)
    pp = mesh["pp"].size()
    if schedule in SINGLE_STAGE:
        per_rank = 1
    elif schedule in V_SHAPED:
        per_rank = 2
    else:
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 2:
            raise ValueError(
                f"ft.pipeline(virtual={virtual!r}): schedule {schedule!r} runs several stages "
                "per rank; give virtual >= 2 (or schedule='1f1b' for one)."
            )
        per_rank = virtual
    n_stages = pp * per_rank
    n_blocks = len(blocks_of(model, family))
    if n_blocks < n_stages:
        raise ValueError(
            f"ft.pipeline: {n_blocks} blocks cannot fill {n_stages} stages (pp={pp} x "
            f"{per_rank} per rank); every stage needs a block. Fix: a smaller pp or virtual."
        )
    split = (
        even_split(n_blocks, n_stages)
        if stages is None
        else check_split(stages, n_blocks, n_stages, family.blocks)
    )
    if microbatches is None:
        microbatches = 2 * n_stages
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"ft.pipeline(microbatches={microbatches!r}): expected an int >= 1.")
    if microbatches < pp or (schedule not in SINGLE_STAGE and microbatches % pp):
        raise ValueError(
            f"ft.pipeline(microbatches={microbatches}): the {schedule!r} schedule needs at least "
            f"as many micro-batches as pipeline ranks ({pp})"
            + ("" if schedule in SINGLE_STAGE else ", and a multiple of them")
            + f"; e.g. microbatches={2 * pp}."
        )
    placement = stage_ranks(pp, per_rank, schedule in V_SHAPED)
    owner = [0] * n_stages
    for r, ids in enumerate(placement):
        for i in ids:
            owner[i] = r
    rank = mesh["pp"].get_local_rank()
    read = inputs if callable(inputs) else (lambda batch, key=inputs: batch[key])
    device = group_device()
    runner = Runner(
        model,
        family,
        cut(split),
        placement[rank],
        mesh["pp"].get_group(),
        owner,
        schedule,
        microbatches,
        read,
        device,
    )
    return Pipeline(model, mesh, schedule, microbatches, tuple(split), read, family, runner)
