"""The run folder (ftrain.app.run_folder): --out checks, config.json, the saved settings of a
checkpoint, metrics.jsonl trimmed on resume, and the loss-curve PNG."""

import json
from pathlib import Path

import pytest

from ftrain.app import run_folder
from ftrain.app.cli import main
from ftrain.app.config import TrainConfig


def test_check_out_refuses_a_fresh_run_into_a_folder_with_checkpoints(tmp_path):
    out = tmp_path / "run"
    run_folder.check_out(TrainConfig(out=str(out)))  # no folder yet
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    run_folder.check_out(TrainConfig(out=str(out)))  # a folder without checkpoints
    for step in (1, 2, 3, 4):
        (out / f"checkpoint-{step}").mkdir()
    with pytest.raises(ValueError) as e:
        run_folder.check_out(TrainConfig(out=str(out)))
    message = str(e.value)
    assert f"--out {out}" in message and "checkpoint-1, checkpoint-2, checkpoint-3, ..." in message
    assert "--resume" in message and "another --out" in message
    run_folder.check_out(TrainConfig(out=str(out), resume=True))  # continuing it is the point
    run_folder.check_out(TrainConfig())  # no --out: a new dated folder


def test_prepare_out_creates_the_folder_or_a_dated_one(tmp_path, monkeypatch):
    out = run_folder.prepare_out(TrainConfig(out=str(tmp_path / "a" / "b")))
    assert out == tmp_path / "a" / "b" and out.is_dir() and not list(out.iterdir())
    monkeypatch.chdir(tmp_path)
    dated = run_folder.prepare_out(TrainConfig())
    assert dated.parent == Path("runs") and dated.is_dir()  # runs/<date-time>, under the cwd
    assert len(dated.name) == len("20260101-120000") and dated.name[8] == "-"


def test_unwritable_out_is_an_error_before_training(tmp_path, tiny_run):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit, match="cannot write to --out"):
        main(["train", *tiny_run, "--out", str(blocker / "run")])
    with pytest.raises(SystemExit, match=f"cannot write to --out {blocker / 'run'}: "):
        run_folder.prepare_out(TrainConfig(out=str(blocker / "run")))


def test_write_config_and_saved_config(tmp_path):
    cfg = TrainConfig(d_model=48, lr_schedule="wsd", out=str(tmp_path))
    run_folder.write_config(tmp_path, cfg)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg.to_dict()
    assert run_folder.saved_config({"extra": {"config": cfg.to_dict()}}) == cfg.to_dict()
    assert run_folder.saved_config({"extra": {}}) == {}  # a checkpoint saved without settings
    old = {k: v for k, v in cfg.to_dict().items() if k != "bias"}  # saved before --bias existed
    assert run_folder.saved_config({"extra": {"config": old}}) == {**old, "bias": True}


def test_metrics_log_reads_as_one_run_after_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = run_folder.MetricsLog(path, 0)
    for step in range(1, 6):
        log.write({"step": step, "loss": 1.0 / step})
    log.write({"step": 4, "val_loss": 0.5})
    assert [r["step"] for r in log.records()] == [1, 2, 3, 4, 5, 4]

    resumed = run_folder.MetricsLog(path, 3)  # the checkpoint is at step 3: later lines are dropped
    assert resumed.records() == [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    resumed.write({"step": 4, "loss": 0.2})
    assert [r["step"] for r in resumed.records()] == [1, 2, 3, 4]

    fresh = run_folder.MetricsLog(path, 0)  # a fresh run starts an empty log
    assert not path.exists() and fresh.records() == []


def test_plot_losses_writes_a_png_and_leaves_pyplot_alone(tmp_path):
    import matplotlib
    import matplotlib.pyplot as plt

    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    records = [{"step": s, "loss": 3.0 / s} for s in range(1, 11)] + [{"step": 10, "val_loss": 0.4}]
    run_folder.plot_losses(records, tmp_path / "loss.png")
    data = (tmp_path / "loss.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert matplotlib.get_backend() == backend and plt.get_fignums() == figures
