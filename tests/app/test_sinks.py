"""Metric sinks: TensorBoard events read back with tensorboard's own reader, a user's sink, and
the run's validation loss with its perplexity."""

import json
import math

import pytest

from ftrain.app.cli import parser
from ftrain.app.config import from_args
from ftrain.app.loop import train
from ftrain.app.run_folder import MetricsLog
from ftrain.app.sinks import Sink, TensorBoardSink, make_sinks

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_events(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_sink_writes_what_the_reader_reads(tmp_path):
    sink = TensorBoardSink(tmp_path)
    sink.log(1, {"loss": 2.5, "lr": 1e-3})
    sink.log(2, {"loss": 2.0, "lr": 2e-3, "val_loss": 2.25})
    sink.close()
    assert read_events(tmp_path) == {
        "train/loss": [(1, 2.5), (2, 2.0)],
        "train/lr": [(1, pytest.approx(1e-3)), (2, pytest.approx(2e-3))],
        "val/loss": [(2, 2.25)],
    }


def test_sinks_follow_the_protocol_and_bad_names_are_refused(tmp_path):
    assert isinstance(MetricsLog(tmp_path / "m.jsonl", 0), Sink)
    assert isinstance(TensorBoardSink(tmp_path / "tb"), Sink)
    assert make_sinks("jsonl", tmp_path) == []
    with pytest.raises(ValueError, match=r"--log must be one of \('jsonl', 'tensorboard'\)"):
        make_sinks("wandb", tmp_path)


class Recorder:
    """A user's sink: keeps what it is given."""

    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, step, scalars):
        self.logged.append((step, dict(scalars)))

    def close(self):
        self.closed = True


def test_a_run_logs_to_tensorboard_and_to_a_users_sink(tmp_path, tiny_run):
    out = tmp_path / "run"
    args = [*tiny_run, "--max-steps", "4", "--out", str(out), "--log", "tensorboard"]
    args += ["--eval-every", "2", "--eval-batches", "1"]
    cfg = from_args(parser().parse_args(["train", *args]))
    mine = Recorder()
    summary = train(cfg, sinks=[mine])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    vals = [(r["step"], r["val_loss"], r["val_perplexity"]) for r in records if "val_loss" in r]
    assert [s for s, _ in losses] == [1, 2, 3, 4] and [s for s, *_ in vals] == [2, 4]
    assert all(ppl == pytest.approx(math.exp(v), rel=1e-12) for _, v, ppl in vals)
    assert summary["val_perplexity"] == pytest.approx(math.exp(summary["val_loss"]))
    events = read_events(out / "tensorboard")
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in losses] == events["train/loss"]
    assert [(s, pytest.approx(p, rel=1e-6)) for s, _, p in vals] == events["val/perplexity"]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s"} <= events.keys()
    # the user's sink saw every line metrics.jsonl holds, and was closed
    assert mine.closed
    assert [{"step": s, **d} for s, d in mine.logged] == records


def test_a_missing_tensorboard_is_refused_before_the_run_builds(tmp_path, tiny_run, monkeypatch):
    import sys

    from ftrain.app import recipes

    def never(*a, **k):
        raise AssertionError("the recipe was built before --log was checked")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setattr(recipes.gpt, "build", never)
    cfg = from_args(parser().parse_args(["train", *tiny_run, "--out", str(tmp_path / "r"),
                                         "--log", "tensorboard"]))  # fmt: skip
    with pytest.raises(ImportError, match=r"pip install 'ftrain\[tensorboard\]'"):
        train(cfg)
