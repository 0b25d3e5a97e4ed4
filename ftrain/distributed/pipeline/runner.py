"""One pipeline rank's stages and schedule, run for one optimizer step (``ft.pipeline``'s engine).

**Rule:** the gradients a rank returns are those of the summed loss totals of the whole batch
with respect to its own stages' params: ``torch.distributed.pipelining``'s schedule runs the
micro-batches forward and backward with ``scale_grads=False`` (a plain sum; the step divides once
by the global count, as for every other step), and the loss of each micro-batch, on the last
stage, is the step's own: the user's ``loss_fn`` under every transform's forward hooks, with the
model call answered by the last stage's output (:meth:`Runner.stage_output`).

Each stage's module holds this step's params as real ``nn.Parameter`` leaves sharing the state's
storage (no copy): the zero-bubble schedules split backward into input and weight gradients by
walking ``stage.submod.parameters()``, and autograd accumulates each leaf's gradient over the
micro-batches into its ``.grad``. A tensor that two stages of one rank use (a tied embedding on a
V-shaped schedule's rank 0) is one leaf, so its two gradients add up there.

The stages' forwards go through the step's forward hooks too (``ft.autocast``'s precision,
``ft.checkpoint``'s recomputed blocks): the engine calls the step's forward with a
:class:`StageInput` in place of a batch, and ``ft.pipeline``'s hook, innermost, runs the stage.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from ftrain import tree
from ftrain.distributed.dtensor import is_dtensor, like, local
from ftrain.distributed.pipeline.cut import Family, StageCut, stage_module
from ftrain.internals.batch import batch_rows, split_batch
from ftrain.step.engine import nonzero

__all__ = ["SCHEDULES", "V_SHAPED", "Stage", "StageInput", "Runner", "refusal"]

# ft.pipeline's schedule names -> torch.distributed.pipelining's (get_schedule_class)
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "interleaved-zero-bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
}
SINGLE_STAGE = {"gpipe", "1f1b"}  # one stage per rank; the others take several
V_SHAPED = {"zbv"}  # two stages per rank, placed r and 2 pp - 1 - r


def refusal(schedule: str, backend: str) -> str | None:
    """Why ``schedule`` cannot run with this torch over ``backend``, or None. Before torch
    2.13 (its schedules' ``_initialize_pp_stages``), a multi-stage schedule's first step sends
    each stage's neighbours a message from one batch of sends, and gloo refuses a rank sending
    to itself, which the V placement does (rank 0 holds the first and the last stage)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if (
        schedule in V_SHAPED
        and backend == "gloo"
        and not hasattr(PipelineScheduleMulti, "_initialize_pp_stages")
    ):
        return (
            f"torch {torch.__version__}'s {SCHEDULES[schedule]} schedule cannot start over gloo "
            "(its first step has rank 0 send to itself); use 'interleaved-zero-bubble', or "
            "torch >= 2.13"
        )
    return None


class Stage(nn.Module):
    """What ``PipelineStage`` runs for one stage: ``body`` (the pruned model copy, its parameters
    this step's leaves) called through the step's forward hooks by ``runner``."""

    def __init__(self, body: nn.Module, names: dict[str, str], cut: StageCut, family: Family):
        super().__init__()
        self.body = body
        self.names = names  # body parameter name -> params key
        # where each parameter sits, by its name: a tied one (an HF head's weight, the
        # embedding's) at several places, all given the same tensor, so the tie holds
        self.slots: dict[str, list[tuple[nn.Module, str]]] = {}
        first: dict[int, str] = {}
        for name, p in body.named_parameters(remove_duplicate=False):
            *path, leaf = name.split(".")
            owner = body.get_submodule(".".join(path)) if path else body
            self.slots.setdefault(first.setdefault(id(p), name), []).append((owner, leaf))
        self.cut = cut
        self.family = family
        self.runner: Runner | None = None  # set for the extent of one step
        self.bound: TensorDict | None = None  # this step's leaves, by the body's names

    def bind(self, leaves: dict[str, nn.Parameter]) -> TensorDict:
        """Put this step's leaves in place of the body's parameters; their TensorDict, keyed
        by the body's names (what ``ft.apply`` runs the body with)."""
        td = TensorDict({}, batch_size=[])
        for name, key in self.names.items():
            for owner, leaf in self.slots[name]:
                owner._parameters[leaf] = leaves[key]
            td.set(tuple(name.split(".")), leaves[key])
        return td

    def release(self) -> None:
        """Drop the step's leaves (meta stand-ins again): no state tensor outlives the step."""
        for name in self.names:
            owner, leaf = self.slots[name][0]
            p = owner._parameters[leaf]
            stand_in = nn.Parameter(
                torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
            )
            for owner, leaf in self.slots[name]:
                owner._parameters[leaf] = stand_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runner is None:
            raise RuntimeError("ft.pipeline: a stage ran outside its step")
        return self.runner.run_stage(self, x)


class StageInput:
    """What the engine hands the step's forward in place of a batch: run ``stage`` on ``x``;
    ``ft.pipeline``'s forward hook puts the result in ``output``."""

    __slots__ = ("stage", "x", "output")

    def __init__(self, stage: Stage, x: torch.Tensor):
        self.stage, self.x = stage, x
        self.output: torch.Tensor | None = None


class Runner:
    """This rank's stages and their schedule (see the module's rule).

    Args:
        model: the template the loss function calls.
        family: its stage code.
        cuts: every stage of the pipeline; ``mine``: the indices this rank runs.
        group: the pipeline's process group; ``ranks``: the pipeline rank of each stage.
        schedule: a name of :data:`SCHEDULES`; ``microbatches``: into how many the batch goes.
        device: where the stages run.
    """

    def __init__(
        self,
        model: nn.Module,
        family: Family,
        cuts: Sequence[StageCut],
        mine: Sequence[int],
        group: Any,
        owner: Sequence[int],
        schedule: str,
        microbatches: int,
        inputs: Callable[[Any], torch.Tensor],
        device: torch.device,
    ):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.model, self.family, self.group = model, family, group
        self.inputs = inputs
        self.microbatches = microbatches
        # every stage's module (a pruned copy, its parameters on meta): this rank's kept, the
        # others' read for the keys they hold
        self.stages = []
        held: dict[str, set[int]] = {}  # key -> the ranks holding it
        for cut in cuts:
            body, names = stage_module(model, family, cut)
            if cut.index in mine:
                self.stages.append(Stage(body, names, cut, family))
            for k in names.values():
                held.setdefault(k, set()).add(owner[cut.index])
        self.stages.sort(key=lambda s: list(mine).index(s.cut.index))
        self.first = any(s.cut.first for s in self.stages)
        self.last = any(s.cut.last for s in self.stages)
        self.keys = sorted({k for s in self.stages for k in s.names.values()})
        # the keys held on several ranks (a tied embedding): their gradients are summed there
        self.shared = {k: sorted(r) for k, r in held.items() if len(r) > 1}
        self.rank = dist.get_rank(group)
        self.shapes = {k: (p.shape, p.dtype) for k, p in model.named_parameters()}
        pipe = [PipelineStage(s, s.cut.index, len(cuts), device, group=group) for s in self.stages]
        cls = get_schedule_class(SCHEDULES[schedule])
        self.schedule = cls(
            pipe[0] if schedule in SINGLE_STAGE else pipe,
            n_microbatches=microbatches,
            loss_fn=self._loss,
            scale_grads=False,  # sums over micro-batches: the step divides once, by the count
        )
        # set for the extent of one run()
        self.forward: Callable | None = None
        self.output: torch.Tensor | None = None
        self.pieces: list | None = None  # the micro-batches of the piece being run
        self.size = 0  # rows per micro-batch
        self.stub: TensorDict | None = None
        self.scale: torch.Tensor | None = None
        self.unit: torch.Tensor | None = None  # under a loss scale: what the losses are over
        self.tallies: dict[int, tuple[torch.Tensor, torch.Tensor, dict]] = {}

    def with_schedule(self, make: Callable[[list[Stage], Callable], Any]) -> Runner:
        """A copy of this runner, its stages shared, whose schedule is ``make(stages,
        loss_fn)`` in place of torch's (called as torch's is: ``step(*args, target=...)``):
        ``ft.memory`` runs the step with a local stand-in that sends nothing. **Invariant:**
        this runner is left as it was (its stages are bound and released by each run, as ever)."""
        other = copy.copy(self)
        other.schedule = make(other.stages, other._loss)
        return other

    # -- one step ----------------------------------------------------------------------------
    def run(self, forward, params: TensorDict, pieces: Sequence[Any], scale) -> tuple:
        """Forward and backward of ``pieces`` (each a batch the schedule splits into
        micro-batches): this rank's gradients in ``params``' leaf order, and the loss total,
        count and aux metrics of the whole batch, the same on every pipeline rank."""
        values, tdef = tree.flatten(params)
        keys = list(tdef.paths)
        leaves = {k: nn.Parameter(v.detach(), requires_grad=True) for k, v in zip(keys, values)}
        p_in = tdef.unflatten([leaves[k] for k in keys])
        self.forward, self.scale, self.unit = forward, scale, None
        bound = [s.bind(leaves) for s in self.stages]
        for s, td in zip(self.stages, bound):
            s.runner, s.bound = self, td
        device = values[0].device if values else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        count = torch.zeros((), dtype=torch.float32, device=device)
        aux: dict[str, torch.Tensor] = {}
        try:
            if self.last:
                self.stub = self._stub(p_in, device)
            for piece in pieces:
                rows = batch_rows(piece)
                if rows is None or rows % self.microbatches:
                    raise ValueError(
                        f"ft.pipeline: a batch of {rows} rows does not split into "
                        f"microbatches={self.microbatches} equal micro-batches (the stages "
                        "exchange fixed shapes). Fix: a batch size (per process and micro-batch "
                        "of ft.accumulate) that is a multiple of microbatches."
                    )
                self.size = rows // self.microbatches
                self.pieces, self.tallies = split_batch(piece, self.microbatches), {}
                # the target torch splits like the inputs: each micro-batch's rows, so the
                # loss finds its part of the batch (any fields, any structure)
                target = torch.arange(rows)
                args = (self.inputs(piece).contiguous(),) if self.first else ()
                self.schedule.step(*args, target=target, return_outputs=False)
                for t, c, a in self.tallies.values():
                    total, count = total + t, count + c
                    for k, v in a.items():
                        v = v.detach().float() / (len(pieces) * self.microbatches)
                        aux[k] = aux[k] + v if k in aux else v
            grads = [
                leaves[k].grad if leaves[k].grad is not None else torch.zeros_like(values[i])
                for i, k in enumerate(keys)
            ]
            unit = self.unit if self.unit is not None else torch.zeros((), device=device)
        finally:
            for s in self.stages:
                s.runner = None
                s.bound = None
                s.release()
            self.forward = self.pieces = self.stub = self.scale = self.output = self.unit = None
            self.tallies = {}
        # the last stage's loss, count and aux: the same on every rank of the pipeline
        names = sorted(aux)
        sums = torch.stack([total, count, unit.to(total), *(aux[k] for k in names)])
        if not self.last:
            sums.zero_()
        dist.all_reduce(sums, group=self.group)
        for i, k in enumerate(names):
            aux[k] = sums[3 + i]
        if scale is not None:  # the gradients of the totals times the scale, as the step wants
            torch._foreach_mul_(grads, sums[2])
        return grads, sums[0], sums[1], aux

    def reduce_shared(self, grads: list[torch.Tensor], keys: Sequence[str]) -> list[torch.Tensor]:
        """``grads`` (keyed by ``keys``) with the gradient of each tensor held by several ranks
        summed over them: an all-reduce over the pipeline, zeros from the ranks without it (a
        collective: every rank takes part, in the same order)."""
        out = list(grads)
        at = {k: i for i, k in enumerate(keys)}
        device = grads[0].device if grads else torch.device("cpu")
        for k in sorted(self.shared):
            i = at.get(k)
            if i is not None:  # a tensor-parallel one: its piece (the same on every holder)
                g = (local(out[i]) if is_dtensor(out[i]) else out[i]).clone()
            else:  # a tied tensor tensor parallelism splits is refused when built
                shape, dtype = self.shapes[k]
                g = torch.zeros(shape, dtype=dtype, device=device)
            dist.all_reduce(g, group=self.group)
            if i is not None:
                out[i] = like(g, out[i]) if is_dtensor(out[i]) else g
        return out

    def counted_here(self, key: str) -> bool:
        """Whether this rank counts ``key`` in a norm over the whole model (each tensor once)."""
        ranks = self.shared.get(key)
        return ranks is None or ranks[0] == self.rank

    # -- what the schedule calls -------------------------------------------------------------
    def run_stage(self, stage: Stage, x: torch.Tensor) -> torch.Tensor:
        """One stage's forward, through the step's forward hooks (``ft.pipeline``'s runs it)."""
        call = StageInput(stage, x)
        self.forward(stage.bound, call)
        return call.output

    def _loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's ``loss_fn(output, target)`` on the last stage: the step's loss of the
        micro-batch ``rows``, with the model's output answered by ``output``."""
        i = int(rows[0]) // self.size  # rows is on the host: no sync
        self.output = output
        try:
            loss, _ = self.forward(self.stub, self.pieces[i])
        finally:
            self.output = None
        # keyed by the micro-batch: torch may call this twice for the first one (shape inference)
        self.tallies[i] = (loss.total.detach().float(), loss.count.detach().float(), loss.aux)
        if self.scale is None:
            return loss.total
        # With a loss scale (fp16): the total over a count, so that the gradients entering the
        # loss graph, and their sums over a micro-batch's tokens (a bias's gradient), stay
        # within fp16 (the default engine divides each micro-batch by its own count). The
        # gradients of all micro-batches add up in .grad, so one count serves the whole step:
        # the first micro-batch's times their number (about the batch's), multiplied back into
        # the summed gradients. A micro-batch holding far more than its share can still
        # overflow; dynamic loss scaling then skips the step and halves the scale.
        if self.unit is None:
            self.unit = nonzero(loss.count.detach().float()) * self.microbatches
        return loss.total * (self.scale / self.unit)

    def stage_output(self, *args, **kwargs) -> Any:
        """What the model call in the loss function returns on the last stage: the stage's output
        for this micro-batch, shaped as the family's model returns it."""
        if self.output is None:
            raise RuntimeError(
                "ft.pipeline: the loss function called the model outside the last stage's loss"
            )
        return self.family.output(self.output, args, kwargs)

    def _stub(self, p_in: TensorDict, device) -> TensorDict:
        """The params the loss function's model call gets on the last stage: this rank's leaves,
        and for other ranks' keys zero-stride stand-ins (``ft.apply`` checks every key; the
        answered model reads none)."""
        mine = tree.to_flat(p_in)
        td = TensorDict({}, batch_size=[])
        for name, p in self.model.named_parameters():
            v = mine.get(name)
            if v is None:
                v = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
            td.set(tuple(name.split(".")), v)
        return td
