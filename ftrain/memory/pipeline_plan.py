"""``ft.memory`` of a pipelined step: this rank's part of the schedule, run here on fake tensors.

A pipelined step's engine drives ``torch.distributed.pipelining``'s schedule, whose sends and
receives wait for the other pipeline ranks. The planner runs the step with a
:class:`LocalSchedule` in the schedule's place (``Runner.with_schedule``): it takes this rank's
actions in the order torch's schedule lists them (``schedule.pipeline_order[rank]``, read by
:func:`rank_actions`) and runs each with the stage's own code, the step's forward hooks and loss
function included, as the real step does:

* ``F`` (stage, micro-batch): the stage's forward. The first stage reads the micro-batch's rows of
  the input, any other a received buffer shaped like the previous stage's output
  (:func:`stage_inputs`). The output and what the forward saved for backward stay alive until the
  micro-batch's ``B``; on the last stage the micro-batch's loss is computed at once, as torch's
  schedules do.
* ``B``: backward from that loss (last stage) or from a received gradient shaped like the output;
  the params' gradients add up in the stage's leaves, as for real; the input's gradient is sent
  (dropped).

So the activations alive at once are those the schedule keeps (:func:`in_flight`): under GPipe
every micro-batch's until the backwards start, under 1F1B up to ``p - s`` on stage ``s`` of
``p``. What torch's ``PipelineStage`` allocates besides is allocated here too: in its first step,
a receive buffer per micro-batch for its input and one for its output's gradient, kept from then
on. Modeled, not run: the sends (a sent tensor is dropped at once, where the backend holds it
until the send is waited: a boundary tensor or two more) and torch's shape inference in the first
step (one micro-batch's forward and backward, below the schedule's peak).

Nothing is sent, so one rank may plan alone. The step's collectives besides (the loss totals over
the pipeline, a tied embedding's gradient, the norm) run on fake tensors, which torch's meta
kernels answer without sending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ftrain import tree
from ftrain.distributed.pipeline.cut import cut, stage_module
from ftrain.distributed.pipeline.runner import SINGLE_STAGE, Stage
from ftrain.memory.tracker import fake_mode, unfaked
from ftrain.transforms.pipeline import Pipeline

__all__ = [
    "PLANNED",
    "rank_actions",
    "in_flight",
    "stage_inputs",
    "LocalSchedule",
    "planned_pipeline",
]

# the schedules whose actions are whole forwards and backwards (F, B); the zero-bubble ones
# split backward into input and weight halves (I, W), which the planner does not run
PLANNED = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")

Action = tuple[str, int, int]  # (kind: "F" or "B", stage index, micro-batch)


def rank_actions(order: Sequence[Any], single_stage: bool) -> list[Action]:
    """One rank's computations from torch's action list ``order`` (``pipeline_order[rank]``), in
    order: ``(kind, stage, micro-batch)``, idle slots and the gradient reduction left out.

    A single-stage schedule (GPipe, 1F1B) runs from code written out by hand, its list only
    describing it, and each stage runs its forwards, and its backwards, in micro-batch order:
    numbered here in the order they run (torch 2.13's 1F1B list numbers the last rank's forwards
    from 1). A multi-stage schedule runs its list as it is."""
    out: list[Action] = []
    for action in order:
        if action is None:
            continue
        kind = action.computation_type.value
        if kind in ("REDUCE_GRAD", "UNSHARD", "RESHARD"):
            continue
        if kind not in ("F", "B"):
            raise ValueError(
                f"ft.memory: the schedule's action {action} ({kind}) is not a whole forward or "
                f"backward; the planner runs the schedules {', '.join(PLANNED)}."
            )
        out.append((kind, action.stage_index, action.microbatch_index))
    if single_stage:
        seen: dict[tuple[str, int], int] = {}
        numbered = []
        for kind, stage, _ in out:
            i = seen.get((kind, stage), 0)
            seen[kind, stage] = i + 1
            numbered.append((kind, stage, i))
        out = numbered
    return out


def in_flight(actions: Sequence[Action]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once, over all the stages of
    ``actions`` (a pair of stage and micro-batch each): how many micro-batches' activations the
    rank holds together at most."""
    alive: set[tuple[int, int]] = set()
    most = 0
    for kind, stage, mb in actions:
        if kind == "F":
            alive.add((stage, mb))
            most = max(most, len(alive))
        else:
            alive.discard((stage, mb))
    return most


def stage_inputs(pipe: Pipeline, batch: Any) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """For every stage but the first, the shape (less its rows) and dtype of what it receives:
    the previous stage's output, found by running the stages' code on fake tensors of the
    ``meta`` device (shapes only, no data; a Hugging Face model sees them as traced) on one row
    of ``batch``'s input."""
    x = pipe.inputs(batch)
    stages = cut(list(pipe.blocks_per_stage))[:-1]
    bodies = [stage_module(pipe.model, pipe.family, stage)[0] for stage in stages]
    out = {}
    with fake_mode(), torch.no_grad():
        x = torch.empty((1, *x.shape[1:]), dtype=x.dtype, device="meta")
        for stage, body in zip(stages, bodies):
            x = pipe.family.run(body, x, stage.first, stage.last)
            out[stage.index + 1] = (tuple(x.shape[1:]), x.dtype)
    return out


class LocalSchedule:
    """The planner's stand-in for torch's schedule on one rank (see the module docstring):
    ``step(*args, target=...)`` as torch's, running ``actions`` on this rank's ``stages``.

    Args:
        stages: this rank's stages (``Runner.with_schedule`` gives them).
        loss_fn: the runner's loss of a micro-batch, ``loss_fn(output, rows)``.
        actions: this rank's :func:`rank_actions`.
        microbatches: into how many micro-batches a batch goes.
        inputs: :func:`stage_inputs`.
        sends_held: ``"step"``: every tensor sent stays alive until the step ends (torch's
            multi-stage runtime waits for its sends there, and GPipe keeps their works until
            then); ``"next"``: until the next send of its kind (1F1B).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        actions: Sequence[Action],
        microbatches: int,
        inputs: dict[int, tuple[tuple[int, ...], torch.dtype]],
        sends_held: str = "step",
    ):
        self.sends_held = sends_held
        self.stages = {s.cut.index: s for s in stages}
        self.loss_fn = loss_fn
        self.actions = list(actions)
        self.microbatches = microbatches
        self.inputs = inputs
        # (stage, micro-batch) -> its receive buffers, made at the first step and kept, as
        # torch's stages keep theirs: the input (the previous stage's output) and the gradient
        # of the output (the next stage's input's)
        self.received: dict[tuple[int, int], torch.Tensor] = {}
        self.received_grads: dict[tuple[int, int], torch.Tensor] = {}

    def _buffers(self, rows: int) -> None:
        for index, stage in self.stages.items():
            device = tree.first_leaf(stage.bound).device
            for i in range(self.microbatches):
                if not stage.cut.first:
                    tail, dtype = self.inputs[index]
                    buffer = torch.empty((rows, *tail), dtype=dtype, device=device)
                    self.received[index, i] = buffer.requires_grad_()
                if not stage.cut.last:
                    tail, dtype = self.inputs[index + 1]
                    self.received_grads[index, i] = torch.empty(
                        (rows, *tail), dtype=dtype, device=device
                    )

    def step(self, *args: torch.Tensor, target: torch.Tensor, return_outputs: bool = True):
        m = self.microbatches
        rows = target.shape[0] // m
        firsts = list(torch.tensor_split(args[0], m)) if args else []
        if not self.received and not self.received_grads:
            self._buffers(rows)
        cache: dict[tuple[int, int], tuple] = {}
        sent: dict[str, list[torch.Tensor]] = {"F": [], "B": []}  # alive until waited
        for kind, index, i in self.actions:
            stage = self.stages[index]
            if kind == "F":
                x = firsts[i] if stage.cut.first else self.received[index, i]
                out = stage(x)
                loss = None
                if stage.cut.last:  # the loss of the micro-batch's rows, at once
                    with unfaked():
                        mine = torch.arange(i * rows, (i + 1) * rows)
                    loss = self.loss_fn(out, mine)
                else:
                    self._send(sent["F"], out.detach())
                cache[index, i] = (x, out, loss)
                continue
            x, out, loss = cache.pop((index, i))
            if loss is not None:
                torch.autograd.backward(loss)
            else:
                torch.autograd.backward(out, grad_tensors=self.received_grads[index, i])
            if x.requires_grad:  # the input's gradient, sent to the previous stage
                self._send(sent["B"], x.grad)
                x.grad = None
            del x, out, loss
        return None

    def _send(self, held: list[torch.Tensor], t: torch.Tensor) -> None:
        if self.sends_held == "next":
            held.clear()
        held.append(t)


def planned_pipeline(pipe: Pipeline, batch: Any) -> tuple[Pipeline, int]:
    """``pipe`` as the planner runs it: its runner driving a :class:`LocalSchedule` of this
    rank's actions (its stages shared with ``pipe``'s, nothing else changed), and
    :func:`in_flight` of those actions."""
    if pipe.schedule not in PLANNED:
        raise ValueError(
            f"ft.memory: a pipelined step under schedule={pipe.schedule!r} splits backward into "
            "input and weight halves, which the planner does not run; plan it under one of "
            f"{', '.join(repr(s) for s in PLANNED)} (the same stages; zero-bubble keeps about "
            "1F1B's activations)."
        )
    runner = pipe.runner
    actions = rank_actions(
        runner.schedule.pipeline_order[runner.rank], pipe.schedule in SINGLE_STAGE
    )
    inputs = stage_inputs(pipe, batch)

    def local(stages, loss_fn):
        held = "next" if pipe.schedule == "1f1b" else "step"
        return LocalSchedule(stages, loss_fn, actions, pipe.microbatches, inputs, held)

    return dataclasses.replace(pipe, runner=runner.with_schedule(local)), in_flight(actions)
