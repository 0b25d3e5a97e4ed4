"""ft.memory of a pipelined step: the planner runs each rank's actions of torch's schedule locally.

Fast: this rank's actions read from torch's own action lists (built here on stand-in stages: the
lists depend only on the sizes), and how many micro-batches each rank holds at once, against the
schedules' formulas. Slow (``conftest.py``'s ``memory_ranks``, 2 gloo processes, pp = 2): the
predicted peak of each rank against the real step's measured one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining.schedules import _Action, get_schedule_class

from ftrain.distributed.pipeline.cut import stage_ranks
from ftrain.distributed.pipeline.runner import SCHEDULES, SINGLE_STAGE, V_SHAPED
from ftrain.memory.pipeline_plan import PLANNED, in_flight, rank_actions

from _memory_ranks import PIPELINED

SIZES = [(p, m) for p in (2, 4) for m in (p, 2 * p, 3 * p)]


def torch_orders(schedule: str, p: int, m: int, v: int) -> dict[int, list]:
    """torch's action list of every pipeline rank, from the schedule built on stand-ins of its
    stages (rank 0's; a schedule lists every rank's actions when it is made)."""
    cls = get_schedule_class(SCHEDULES[schedule])
    if schedule in SINGLE_STAGE:
        return cls(SimpleNamespace(num_stages=p), n_microbatches=m).pipeline_order
    stages = [
        SimpleNamespace(num_stages=v * p, stage_index=i, group_size=p, group_rank=0,
                        is_first=i == 0, is_last=i == v * p - 1, submod=torch.nn.Linear(1, 1))
        for i in placed(schedule, p, v)[0]
    ]  # fmt: skip
    return cls(stages, n_microbatches=m).pipeline_order


def placed(schedule: str, p: int, v: int) -> list[list[int]]:
    """The stages of each rank, as ft.pipeline places them."""
    return stage_ranks(p, v, schedule in V_SHAPED)


def per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE else 2


@pytest.mark.parametrize("schedule", PLANNED)
@pytest.mark.parametrize("p,m", SIZES)
def test_each_stage_runs_every_micro_batch_forward_then_backward(schedule, p, m):
    """Each stage of each rank: every micro-batch's forward once, then its backward once,
    whole (B) or in an input half and then a weight half (I, W: zero-bubble)."""
    v = per_rank(schedule)
    orders = torch_orders(schedule, p, m, v)
    for r in range(p):
        actions = rank_actions(orders[r], schedule in SINGLE_STAGE)
        assert {s for _, s, _ in actions} == set(placed(schedule, p, v)[r])
        for s in {s for _, s, _ in actions}:
            mine = [(kind, i) for kind, st, i in actions if st == s]
            for i in range(m):
                kinds = [kind for kind, j in mine if j == i]
                assert kinds in (["F", "B"], ["F", "I", "W"]), (r, s, i, kinds)
            assert len(mine) in (2 * m, 3 * m), (r, s, mine)


@pytest.mark.parametrize("p,m", SIZES)
def test_micro_batches_alive_at_once_follow_each_schedules_formula(p, m):
    """GPipe holds all m; 1F1B p - r on rank r (its warm-up forwards); Interleaved 1F1B with v
    stages per rank Megatron-LM's warm-up, (v - 1) p + 2 (p - 1 - r), plus the forward of its
    first 1F1B pair, at most all v m; looped BFS runs every forward before any backward."""
    v = 2
    expected = {  # the zero-bubble schedules: no closed form here
        "gpipe": [m] * p,
        "1f1b": [min(m, p - r) for r in range(p)],
        "interleaved-1f1b": [min(v * m, (v - 1) * p + 2 * (p - 1 - r) + 1) for r in range(p)],
        "looped-bfs": [v * m] * p,
    }
    for schedule, want in expected.items():
        orders = torch_orders(schedule, p, m, per_rank(schedule))
        got = [in_flight(rank_actions(orders[r], schedule in SINGLE_STAGE)) for r in range(p)]
        assert got == want, schedule


def test_a_micro_batch_stays_alive_until_its_weight_half():
    """Zero-bubble: the input half of a backward sends the input's gradient, but the
    activations stay until the weight half (torch's weight half starts from them)."""
    order = [_Action.from_str(a) for a in ("0F0", "0I0", "0F1", "0W0", "0I1", "0W1")]
    assert in_flight(rank_actions(order, single_stage=False)) == 2


def test_an_action_the_planner_does_not_run_is_refused_naming_the_schedules():
    with pytest.raises(ValueError, match="interleaved-zero-bubble"):
        rank_actions([_Action.from_str("0SEND_F0")], single_stage=False)


# -- 2 gloo ranks, pp = 2 (conftest.py's memory_ranks) ----------------------------------------------


@pytest.mark.parametrize("schedule", PIPELINED)
def test_pipelined_peak_within_10_percent_on_each_rank(memory_ranks, schedule):
    """Each rank's own prediction (its stages' params, gradients, optimizer state and the
    activations its schedule keeps) against the peak of the real step, measured in its first
    call (when torch's stages make their receive buffers)."""
    for out in memory_ranks:
        predicted, measured, alive = out["pipeline"][schedule]
        assert abs(predicted / measured - 1) < 0.10, (schedule, predicted, measured)
    first, last = (out["pipeline"][schedule][2] for out in memory_ranks)
    if schedule == "gpipe":
        assert first == last == 4
    if schedule == "1f1b":
        assert (first, last) == (2, 1)


def test_planning_a_pipeline_sends_nothing_and_leaves_its_step_as_it_was(memory_ranks):
    assert [out["pipeline alone"] for out in memory_ranks] == [3.0, 3.0]
    for out in memory_ranks:
        planned, fresh = out["pipeline after planning"]
        assert planned == fresh  # the step after planning: bitwise that of one never planned


def test_a_pipeline_under_fsdp_is_refused_not_planned_wrong(memory_ranks):
    for out in memory_ranks:
        assert "not planned" in out["pipeline fsdp"] and "'zero2'" in out["pipeline fsdp"]
