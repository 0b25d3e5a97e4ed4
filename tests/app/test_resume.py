"""--resume (ftrain.app.resume, ftrain.app.run_settings): the run's own settings continue it (a bare
`ftrain train --out RUN --resume` equals the uninterrupted run), flags given override them and are
printed; the settings that fix the run, the global batch, and an older checkpoint's per-process
data positions are refused, naming the flag; the matmul kernel is recorded and reused."""

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch

import ftrain as ft
from ftrain.app import run_folder
from ftrain.app.cli import main, parser
from ftrain.app.config import TrainConfig, from_args
from ftrain.app.loop import train
from ftrain.app.resume import load_checked


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


# -- the bare `ftrain train --out RUN --resume` ---------------------------------------------------


def _interrupt_after(monkeypatch, step: int) -> None:
    """Ctrl-C (SIGINT to this process) once metrics.jsonl has the line of ``step``: the loop's
    handler sets its flag and the run stops after that step, saving a checkpoint."""
    write = run_folder.MetricsLog.write

    def write_then_interrupt(self, record):
        write(self, record)
        if record.get("step") == step and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(run_folder.MetricsLog, "write", write_then_interrupt)


def _interrupted_and_resumed(tmp_path, monkeypatch, capsys, flags, stop=3):
    """Train ``flags`` uninterrupted into a/, and into b/ stopped by Ctrl-C after step ``stop``
    and continued with the command its message prints (the bare --resume); returns a and b."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *flags, "--out", str(a)]) == 0
    with monkeypatch.context() as m:
        _interrupt_after(m, stop)
        capsys.readouterr()
        assert main(["train", *flags, "--out", str(b)]) == 130
    command = capsys.readouterr().out.split("Continue with: ")[1].split()
    assert command == ["ftrain", "train", "--out", str(b), "--resume"]
    assert ft.latest_checkpoint(b).name == f"checkpoint-{stop}"
    assert main(command[1:]) == 0
    return a, b


def _assert_same_run(a, b):
    ta, tb = _flat(a), _flat(b)
    assert sorted(ta.keys()) == sorted(tb.keys())
    for k in ta.keys():
        assert torch.equal(ta[k], tb[k]), k
    la, lb = (
        [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b)
    )
    assert [r["step"] for r in lb] == [r["step"] for r in la]
    assert [r["loss"] for r in lb] == [r["loss"] for r in la]
    assert [r["lr"] for r in lb] == [r["lr"] for r in la]


def test_a_bare_resume_of_an_interrupted_run_equals_the_uninterrupted_run(
    tmp_path, tiny_run, monkeypatch, capsys
):
    """Ctrl-C at step 3 of 6, then `ftrain train --out RUN --resume` with no other flag: the
    run's own settings (here none of them defaults: lr, schedule, warmup, dropout, micro-batches,
    weight decay, precision) continue it, to the same params, losses and learning rates."""
    flags = [*tiny_run, "--max-steps", "6", "--lr", "0.01", "--lr-schedule", "linear",
             "--warmup", "2", "--dropout", "0.1", "--micro-batches", "2", "--weight-decay", "0",
             "--precision", "bf16", "--save-every", "100"]  # fmt: skip
    a, b = _interrupted_and_resumed(tmp_path, monkeypatch, capsys, flags)
    _assert_same_run(a, b)
    assert "changed settings" not in capsys.readouterr().err  # nothing was overridden
    saved = json.loads((b / "config.json").read_text())
    assert saved["lr"] == 0.01 and saved["precision"] == "bf16" and saved["resume"] is True


def test_a_bare_resume_of_a_lora_run_on_a_packed_hf_model(tmp_path, monkeypatch, capsys):
    """The same for `--model-dir` (a tiny Llama) with LoRA, --pack and chat data."""
    pytest.importorskip("transformers")
    from tests._hf import arithmetic_chats, tiny_hf_dir, write_jsonl

    model_dir = tiny_hf_dir(tmp_path / "llama", "llama")
    chats = write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats(24))
    flags = ["--model-dir", str(model_dir), "--data", str(chats), "--pack", "--seq-len", "32",
             "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--log-every", "1",
             "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--lora-rank", "4",
             "--data-dir", str(tmp_path / "tokens"), "--max-steps", "6", "--save-every", "100"]  # fmt: skip
    a, b = _interrupted_and_resumed(tmp_path, monkeypatch, capsys, flags)
    _assert_same_run(a, b)
    assert "base" not in ft.load(ft.latest_checkpoint(b)).extra["lora"].keys()


def test_resume_overrides_are_printed_and_fixed_settings_refused_before_any_data(
    tmp_path, tiny_run, monkeypatch, capsys
):
    """A flag given with --resume overrides the saved setting and is printed; raising
    --max-steps keeps the schedule's length (said so); a setting that fixes the run is refused,
    naming it, before the data is built."""
    out = tmp_path / "run"
    flags = [*tiny_run, "--max-steps", "4", "--warmup", "1", "--out", str(out)]
    assert main(["train", *flags]) == 0
    capsys.readouterr()
    import ftrain.app.recipes.gpt

    def no_data(*args, **kwargs):
        raise AssertionError("the data was built before the refusal")

    with monkeypatch.context() as m:
        m.setattr(ftrain.app.recipes.gpt, "build_data", no_data)
        with pytest.raises(SystemExit) as e:
            main(["train", "--out", str(out), "--resume", "--seq-len", "64", "--lr", "1e-3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "ftrain train: error: --resume: " in err and "--seq-len 32 -> 64" in err
    assert "Traceback" not in err
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "6", "--lr", "1e-3"]) == 0
    err = capsys.readouterr().err
    assert "--lr 0.003 -> 0.001" in err
    assert "--max-steps 4 -> 6 (the learning-rate schedule keeps its length: --decay-steps 4" in err
    lr = [json.loads(x)["lr"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lr[4:] == pytest.approx([1e-4, 1e-4])  # cosine's end (lr / 10) past its length


def test_the_run_records_the_matmul_kernel_and_a_resume_reuses_it_untimed(
    tmp_path, tiny_run, monkeypatch, capsys
):
    """--matmul auto is resolved once (a tiny model: torch, untimed) and recorded; a run whose
    timing chose onednn records it, says it first, and a bare --resume builds with it, never
    timing again."""
    import ftrain.app.recipes.gpt
    import ftrain.models.onednn
    from ftrain.app.recipes import gpt
    from ftrain.models import Linear

    def no_timing(*args, **kwargs):
        raise AssertionError("timed")

    monkeypatch.setattr(ftrain.models.onednn, "time_linears", no_timing)
    small, chosen = tmp_path / "small", tmp_path / "chosen"
    assert main(["train", *tiny_run, "--max-steps", "1", "--out", str(small)]) == 0
    assert json.loads((small / "config.json").read_text())["matmul"] == "torch"
    assert "matmul torch" in capsys.readouterr().out
    with monkeypatch.context() as m:  # as if this CPU timed oneDNN faster for the run's shapes
        m.setattr(ftrain.app.recipes.gpt, "choose_matmul", lambda config, rows: "onednn")
        args = [*tiny_run, "--max-steps", "2", "--decay-steps", "4", "--out", str(chosen)]
        assert main(["train", *args]) == 0
    assert json.loads((chosen / "config.json").read_text())["matmul"] == "onednn"
    assert ft.load_meta(ft.latest_checkpoint(chosen))["extra"]["config"]["matmul"] == "onednn"
    capsys.readouterr()
    monkeypatch.setattr(ftrain.app.recipes.gpt, "choose_matmul", no_timing)
    assert main(["train", "--out", str(chosen), "--resume", "--max-steps", "4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("ftrain train: device") and "matmul oneDNN" in first
    _, cfg = gpt.run_config(chosen)
    assert cfg.matmul == "onednn" and isinstance(gpt.build_model(cfg).blocks[0].attn.qkv, Linear)
    assert gpt.resolve_matmul(dataclasses.replace(cfg, matmul="auto", model_dir="m")).matmul == (
        "torch"
    )  # a --model-dir model's linears are its own


def _kernel_each_rank_builds(cfg):
    """Train ``cfg`` with rank 0's timing answering onednn and rank 1's torch; returns the
    matmul each rank built its model with."""
    import torch.distributed as dist

    import ftrain.app.recipes.gpt

    rank = dist.get_rank()
    ftrain.app.recipes.gpt.choose_matmul = lambda config, rows: ("onednn", "torch")[rank]
    built, build_model = [], ftrain.app.recipes.gpt.build_model
    ftrain.app.recipes.gpt.build_model = lambda cfg: built.append(cfg.matmul) or build_model(cfg)
    train(cfg)
    return built


def test_every_rank_builds_with_rank_0s_matmul_kernel(tmp_path, tiny_run):
    """Under torchrun rank 0 resolves --matmul auto and every process builds with its answer,
    even where its own timing would differ (the kernels agree only to float32 rounding)."""
    cfg = _config([*tiny_run, "--max-steps", "1", "--out", str(tmp_path / "run")])
    built = ft.distributed.run_distributed(_kernel_each_rank_builds, 2, cfg)
    assert built == [["onednn"], ["onednn"]]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["matmul"] == "onednn"
