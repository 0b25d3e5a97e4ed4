"""--resume's checks (ftrain.resume): the settings that fix the run, the global batch, a new
learning rate, and an older checkpoint's per-process data positions; each refused before a tensor
is loaded, naming the flag that fixes it."""

import json
from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain.cli import main, parser
from ftrain.config import TrainConfig, from_args
from ftrain.loop import train
from ftrain.resume import load_checked


def _flat(path):
    state = ft.load(ft.latest_checkpoint(path))
    return state.to_tensordict().flatten_keys(".")


def _config(args):
    return from_args(parser().parse_args(["train", *args]))


def test_an_older_checkpoints_per_process_positions_are_refused_before_loading():
    meta = {"extra": {"loaders": [{}, {}], "config": {}}, "tree": {}}
    like = ft.TrainState.create(ft.params_of(torch.nn.Linear(2, 2)), ft.optim.sgd(0.1))
    with pytest.raises(SystemExit, match=r"one data position per process.*Start a new --out"):
        load_checked(Path("/nonexistent/checkpoint-3"), meta, TrainConfig(), like, 1, True)


def test_resume_refuses_changed_model_and_notes_other_changes(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    args = [*tiny_run, "--out", str(out)]
    assert main(["train", *args, "--max-steps", "2"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", *args, "--max-steps", "3", "--resume", "--d-model", "64", "--seed", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--d-model 32 -> 64" in err and "--seed 0 -> 1" in err and "Traceback" not in err
    assert main(["train", *args, "--max-steps", "3", "--resume", "--lr", "0.001"]) == 0
    err = capsys.readouterr().err
    assert "note: --resume with changed settings" in err
    assert "--lr 0.003 -> 0.001" in err and "--max-steps 2 -> 3" in err


def test_resume_with_a_new_lr_continues_with_it(tmp_path, tiny_run, capsys):
    """--resume --lr X sets the peak learning rate held in the optimizer state: from the resumed
    step on, the logged lr (peak x the schedule's shape) is that of a run trained with X from the
    start, and one line on stderr says so. A checkpoint written before the peak was injected
    (the optimizer state without its `hyperparams` layer) resumes the same way."""
    common = [*tiny_run, "--warmup", "2", "--decay-steps", "6", "--save-every", "2"]
    a, b, old = tmp_path / "a", tmp_path / "b", tmp_path / "old"
    assert main(["train", *common, "--max-steps", "4", "--out", str(a), "--lr", "0.001"]) == 0
    assert main(["train", *common, "--max-steps", "2", "--out", str(b)]) == 0  # --lr 0.003
    state = ft.load(ft.latest_checkpoint(b))
    extra = ft.load_meta(ft.latest_checkpoint(b))["extra"]
    before = state.replace(opt_state=state.opt_state["inner_state"])
    ft.save_checkpoint(old, before, extra=extra)
    capsys.readouterr()
    assert main(["train", *common, "--max-steps", "4", "--out", str(b), "--resume",
                 "--lr", "0.001"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "--resume: --lr 0.003 -> 0.001: the optimizer continues with peak learning rate" in err
    assert err.count("--lr 0.003 -> 0.001") == 1  # said once, not also in the note
    lr = {d: [json.loads(x)["lr"] for x in (d / "metrics.jsonl").read_text().splitlines()]
          for d in (a, b)}  # fmt: skip
    assert lr[b][2:] == lr[a][2:] and lr[b][1] == pytest.approx(3 * lr[a][1], rel=1e-6)
    assert float(ft.load(ft.latest_checkpoint(b)).opt_state["hyperparams", "learning_rate"]) == 1e-3
    assert main(["train", *common, "--max-steps", "4", "--out", str(old), "--resume",
                 "--lr", "0.001"]) == 0  # fmt: skip
    ta, told = _flat(b), _flat(old)
    for k in ta.keys():
        assert torch.equal(ta[k], told[k]), k


def test_resume_refuses_another_global_batch(tmp_path, tiny_run):
    out = tmp_path / "run"
    assert main(["train", *tiny_run, "--max-steps", "1", "--out", str(out)]) == 0
    with pytest.raises(SystemExit, match=r"global batch is 4 rows.*--global-batch-size 4"):
        train(_config([*tiny_run, "--max-steps", "2", "--out", str(out), "--resume",
                       "--micro-batches", "2"]))  # fmt: skip
