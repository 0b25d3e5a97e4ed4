"""benchmarks/pipeline.py: its schedule replay gives Megatron-LM's bubble for equal stages, and
``--quick`` runs end to end (2 processes, tiny GPT), writing nothing."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("pipeline_bench", ROOT / "benchmarks/pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_losses(order, last):
    """``order`` with the loss after each forward of the last stage."""
    out = []
    for kind, stage, mb in order:
        out.append((kind, stage, mb))
        if kind == "F" and stage == last:
            out.append(("L", stage, mb))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replay_of_equal_stages_gives_the_theory(schedule):
    """p = 2, m = 4, a backward twice a forward: GPipe (all forwards, then all backwards) and
    1F1B (one forward ahead on rank 0) both idle (p - 1) / (m + p - 1) = 1/5 of the time."""
    bench = _bench()
    m = 4
    if schedule == "gpipe":
        orders = [[("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)] for s in (0, 1)]
    else:
        rank0 = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3),
                 ("B", 0, 2), ("B", 0, 3)]  # fmt: skip
        rank1 = [x for i in range(m) for x in (("F", 1, i), ("B", 1, i))]
        orders = [rank0, rank1]
    orders = [_with_losses(o, last=1) for o in orders]
    cost = [{("F", s): 1.0, ("B", s): 2.0, ("L", s): 0.0} for s in (0, 1)]
    bubbles = bench.replay(orders, cost, last=1)
    assert bubbles == pytest.approx([0.2, 0.2])
    assert bench.theory(schedule, 2, m) == pytest.approx(0.2)
    assert bench.theory("interleaved-1f1b", 2, m) == pytest.approx(1 / 9)


def test_replay_refuses_orders_that_wait_on_each_other():
    bench = _bench()
    orders = [[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("L", 1, 0), ("B", 1, 0)]]
    cost = [{("F", 0): 1.0, ("B", 0): 1.0}, {("F", 1): 1.0, ("L", 1): 0.0, ("B", 1): 1.0}]
    with pytest.raises(RuntimeError, match="wait on each other"):
        bench.replay(orders, cost, last=1)


def test_quick_run_measures_every_schedule_and_writes_nothing():
    results = ROOT / "benchmarks" / "RESULTS.md"
    before = results.read_text()
    proc = subprocess.run(
        [sys.executable, "benchmarks/pipeline.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results.read_text() == before
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[1].isdigit():
            rows[cells[0]] = cells
    assert set(rows) == set(_bench().VIRTUAL)
    for name, (_, v, theory, equal, replayed, wall, _, kept, _) in rows.items():
        assert float(theory) == pytest.approx(1 / (int(v) * 4 + 1), abs=5e-4)  # p = 2, m = 4
        assert 0 <= float(replayed) < 1 and float(wall) < 1
        if "zero" in name or name == "zbv":  # weight gradients fill part of the bubble
            assert float(equal) < float(theory) - 0.02, name
        else:  # torch's orders, replayed with equal stages, meet Megatron-LM's formula
            assert float(equal) == pytest.approx(float(theory), abs=2e-3), name
        kept_per_rank = [float(k) for k in kept.split(" / ")]
        # each rank keeps its stages' share; together (the tied embedding twice) the whole model
        assert len(kept_per_rank) == 2 and all(k < 0.8 for k in kept_per_rank)
        assert sum(kept_per_rank) >= 1
    gpipe0, one_f_one_b0 = (float(rows[s][8].split(" / ")[0]) for s in ("gpipe", "1f1b"))
    assert gpipe0 > 1.5 * one_f_one_b0  # GPipe keeps all 4 micro-batches, 1F1B at most 2
