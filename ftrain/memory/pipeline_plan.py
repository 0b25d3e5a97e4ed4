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
  micro-batch's backward; on the last stage the micro-batch's loss is computed at once, as
  torch's schedules do.
* ``B``: backward from that loss (last stage) or from a received gradient shaped like the output;
  the params' gradients add up in the stage's leaves, as for real; the input's gradient is sent.
* ``I`` and ``W`` (zero-bubble schedules): the input and the weight half of a backward, by
  torch's own functions (``stage_backward_input`` / ``stage_backward_weight``, as its stage
  calls them), the activations and the weight half's intermediate gradients alive in between.

So the activations alive at once are those the schedule keeps (:func:`in_flight`): under GPipe
every micro-batch's until the backwards start, under 1F1B up to ``p - s`` on stage ``s`` of
``p``. What torch's runtime keeps besides is kept here too: the receive buffers its stages make
in their first step, one per micro-batch for the input and one for the output's gradient, and
keep; a tensor handed to the next stage on the same rank (the V-shaped schedule) in place of a
buffer; and each tensor sent, until the send is waited (1F1B: at the next send of its kind;
GPipe and the multi-stage runtime: at the end of the step). Not run: torch's shape inference in
the first step (one micro-batch's forward and backward, below the schedule's peak), and 1F1B's
warm-up keeping its first send until the cool-down (one boundary tensor more, on every rank but
the last).

This module is the adapter for torch's private pipelining APIs the planner uses:
``torch.distributed.pipelining._backward``'s two halves of a backward, and the actions of
``pipeline_order`` (``_Action``: ``computation_type``, ``stage_index``, ``microbatch_index``),
read by attribute.

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

# every schedule of ft.pipeline: whole forwards and backwards (F, B), or, zero-bubble, backward
# in an input and a weight half (I, W)
PLANNED = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv")

Action = tuple[str, int, int]  # (kind: "F", "B", "I" or "W", stage index, micro-batch)


def rank_actions(order: Sequence[Any], single_stage: bool) -> list[Action]:
    """One rank's computations from torch's action list ``order`` (``pipeline_order[rank]``), in
    order: ``(kind, stage, micro-batch)``, idle slots and the gradient reduction left out.

    A single-stage schedule (GPipe, 1F1B) runs from code written out by hand, its list only
    describing it, and each stage runs its forwards, and its backwards, in micro-batch order:
    numbered here in the order they run (torch 2.13's 1F1B list numbers the last rank's forwards
    from 1). A multi-stage schedule runs its list as it is.

    **Invariant:** each stage of the rank has every micro-batch once as ``F`` and after it once
    as ``B``, or as ``I`` and then ``W`` (``tests/memory/test_pipeline_plan.py``, every schedule
    at pp = 2 and 4)."""
    out: list[Action] = []
    for action in order:
        if action is None:
            continue
        kind = action.computation_type.value
        if kind in ("REDUCE_GRAD", "UNSHARD", "RESHARD"):
            continue
        if kind not in ("F", "B", "I", "W"):
            raise ValueError(
                f"ft.memory: the schedule's action {action} ({kind}) is none the planner runs "
                f"(a forward, a backward or its input or weight half); it plans {PLANNED}."
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
    """The most micro-batches forwarded and not yet backwarded at once (the weight half done,
    under a zero-bubble schedule), over all the stages of ``actions`` (a pair of stage and
    micro-batch each): how many micro-batches' activations the rank holds together at most.

    **Invariant:** on rank ``r`` of ``p`` with ``m`` micro-batches, GPipe's all ``m``, 1F1B's
    ``min(m, p - r)``, interleaved 1F1B's (``v`` stages per rank) Megatron-LM's warm-up
    ``(v - 1) p + 2 (p - 1 - r)`` plus one, looped BFS's ``v m``."""
    alive: set[tuple[int, int]] = set()
    most = 0
    for kind, stage, mb in actions:
        if kind == "F":
            alive.add((stage, mb))
            most = max(most, len(alive))
        elif kind in ("B", "W"):
            alive.discard((stage, mb))
    return most


def stage_inputs(pipe: Pipeline, batch: Any) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """For every stage but the first, the shape (less its rows) and dtype of what it receives:
    the previous stage's output, found by running the stages' code on fake tensors of the
    ``meta`` device (shapes only, no data; a Hugging Face model sees them as traced) on one row
    of ``batch``'s input. **Invariant:** nothing is allocated but shapes (``meta``)."""
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
        cache: dict[tuple[int, int], tuple] = {}  # forward -> backward: input, output, loss
        halves: dict[tuple[int, int], tuple] = {}  # input half -> weight half (zero-bubble)
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
                elif index + 1 in self.stages:  # the next stage is here: handed over (V shape)
                    self.received[index + 1, i] = out.detach().requires_grad_()
                else:
                    self._send(sent["F"], out.detach())
                cache[index, i] = (x, out, loss)
                continue
            if kind == "W":
                weights_backward(stage, *halves.pop((index, i)))
                continue
            x, out, loss = cache.pop((index, i))
            outputs, grads = (
                ((loss,), None) if loss is not None else ((out,), (self.received_grads[index, i],))
            )
            if kind == "B":
                torch.autograd.backward(outputs, grad_tensors=grads)
                grad = x.grad if x.requires_grad else None
                x.grad = None
            else:  # "I": the input's gradient now, the weights' at the "W"
                grad, groups = input_backward(stage, outputs, grads, x)
                halves[index, i] = (outputs, grads, x, groups)
            if grad is None:
                continue
            if index - 1 in self.stages:  # the previous stage is here: handed over (V shape)
                self.received_grads[index - 1, i] = grad
            else:  # the input's gradient, sent to the previous stage
                self._send(sent["B"], grad)
            del x, out, loss, grad
        return None

    def _send(self, held: list[torch.Tensor], t: torch.Tensor) -> None:
        if self.sends_held == "next":
            held.clear()
        held.append(t)


def input_backward(stage: Stage, outputs: tuple, grads: tuple | None, x: torch.Tensor):
    """A zero-bubble schedule's input half of a backward, as torch's stage runs it: the
    input's gradient (None on the first stage, which defers all of its backward to the weight
    half) and what the weight half needs (torch's ``stage_backward_input``)."""
    if stage.cut.first:
        return None, None
    from torch.distributed.pipelining._backward import stage_backward_input

    grads_in, groups = stage_backward_input(list(outputs), grads, [x], stage.parameters())
    return grads_in[0], groups


def weights_backward(stage: Stage, outputs: tuple, grads: tuple | None, x, groups) -> None:
    """The weight half (``stage_backward_weight``), or on the first stage its whole backward."""
    if stage.cut.first:
        torch.autograd.backward(outputs, grad_tensors=grads)
        return
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(stage.parameters(), groups)


def planned_pipeline(pipe: Pipeline, batch: Any) -> tuple[Pipeline, int]:
    """``pipe`` as the planner runs it: its runner driving a :class:`LocalSchedule` of this
    rank's actions (its stages shared with ``pipe``'s, nothing else changed), and
    :func:`in_flight` of those actions.

    **Invariant:** ``ft.memory`` of the step under it is within 10% of the peak of the real
    step's first call on each rank (pp = 2: GPipe, 1F1B, interleaved zero-bubble in
    ``tests/memory/test_pipeline_plan.py``; every schedule at pp = 2 and 4 within 1% in
    ``benchmarks/pipeline_memory.py``), it sends nothing, and ``pipe``'s own steps after it are
    bitwise those of a pipeline never planned."""
    runner = pipe.runner
    actions = rank_actions(
        runner.schedule.pipeline_order[runner.rank], pipe.schedule in SINGLE_STAGE
    )
    inputs = stage_inputs(pipe, batch)

    def local(stages, loss_fn):
        held = "next" if pipe.schedule == "1f1b" else "step"
        return LocalSchedule(stages, loss_fn, actions, pipe.microbatches, inputs, held)

    return dataclasses.replace(pipe, runner=runner.with_schedule(local)), in_flight(actions)
