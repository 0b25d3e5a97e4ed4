"""The settings (ftrain.app.config): one flag per field, TOML files with the same keys, type
checks."""

import argparse
import dataclasses
import json

import pytest
import torch

import ftrain as ft
from ftrain.app.cli import main
from ftrain.app.config import TrainConfig, add_arguments, flag_name, from_args, load_toml


def test_every_field_has_its_flag_and_flags_beat_defaults_only_when_given():
    p = argparse.ArgumentParser()
    add_arguments(p)
    for f in dataclasses.fields(TrainConfig):
        value = [] if isinstance(f.default, bool) else [str(1 if f.default is None else f.default)]
        assert f.name in vars(p.parse_args([f"--{flag_name(f.name)}", *value])), f.name
    assert vars(p.parse_args([])) == {}  # unset flags leave the defaults (or the file's values)
    assert flag_name("d_model") == "d-model" and flag_name("seed") == "seed"
    cfg = from_args(p.parse_args(["--d-model", "64", "--no-bias", "--lr", "1e-3"]))
    assert cfg == dataclasses.replace(TrainConfig(), d_model=64, bias=False, lr=1e-3)


def test_config_file_and_flags(tmp_path, tiny_run):
    cfg = tmp_path / "c.toml"
    cfg.write_text('max-steps = 2\nd_model = 48\nlr_schedule = "constant"\nweight_decay = 0.0\n')
    out = tmp_path / "run"
    assert main(["train", *tiny_run, "--config", str(cfg), "--d-model", "24",
                 "--out", str(out)]) == 0  # fmt: skip
    saved = json.loads((out / "config.json").read_text())
    assert saved["max_steps"] == 2 and saved["d_model"] == 24  # the flag beats the file
    assert saved["lr_schedule"] == "constant" and saved["weight_decay"] == 0.0
    assert ft.load(ft.latest_checkpoint(out)).params["wte", "weight"].shape[1] == 24


def test_unknown_config_key_is_refused(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("d_modle = 48\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(cfg)])
    assert "unknown setting 'd_modle'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, message",
    [
        ('max_steps = "3"', "max_steps must be an int, got max_steps = '3' (a str)"),
        ("max_steps = 2.5", "max_steps must be an int, got max_steps = 2.5"),
        ('resume = "no"', "resume must be a bool (true or false, unquoted), got resume = 'no'"),
        ("precision = 16", "precision must be a str"),
        ("seed = true", "seed must be an int, got seed = True (a bool)"),
        ("lr = false", "lr must be a float, got lr = False"),
    ],
)
def test_config_values_of_the_wrong_type_are_usage_errors(tmp_path, line, message, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(line + "\n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_config_float_accepts_an_int(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("lr = 1\nweight_decay = 0\n")
    assert load_toml(cfg) == {"lr": 1.0, "weight_decay": 0.0}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "0"], "--tp must be an int >= 1"),
        (["--tp", "2", "--compile"], "--tp 2 cannot be combined with --compile"),
        (["--tp", "2", "--lora-rank", "4"], "--tp 2 cannot be combined with --lora-rank"),
        (["--sequence-parallel"], "--sequence-parallel splits the sequence over the --tp"),
        (["--tp", "2", "--seq-len", "15", "--sequence-parallel"], "--tp 2, --seq-len 15"),
        (
            ["--tp", "2", "--optimizer", "adamw8bit"],
            "cannot be combined with --optimizer adamw8bit",
        ),
    ],
)
def test_tp_flags_that_do_not_compose_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pp", "0"], "--pp must be an int >= 1"),
        (["--pp", "2", "--offload", "optimizer"], "--pp 2 cannot be combined with --offload"),
        (["--pp", "2", "--compile"], "--pp 2 cannot be combined with --compile"),
        (["--pp", "2", "--tp", "2", "--sequence-parallel"], "cannot be combined with --sequence"),
        (["--pp", "2", "--pack"], "--pp 2 cannot be combined with --pack"),
        (["--pp", "2", "--pp-schedule", "nope"], "--pp-schedule: invalid choice: 'nope'"),
        (["--pp", "4", "--pp-microbatches", "2"], "--pp-microbatches 2 is fewer than the --pp 4"),
        (["--pp", "2", "--batch-size", "6"], "--batch-size 6 must be a multiple of"),
    ],
)
def test_pp_flags_that_do_not_compose_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_pp_composes_with_every_shard_strategy(strategy):
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--pp", "2", "--shard", strategy, "--batch-size", "8"]))
    cfg.validate()
    assert (cfg.pp, cfg.shard) == (2, strategy)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_tp_composes_with_every_shard_strategy(strategy):
    """--tp with each --shard strategy (over the data-parallel groups) passes validation."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--tp", "2", "--shard", strategy]))
    cfg.validate()  # raises ValueError for a combination that is refused
    assert (cfg.tp, cfg.shard) == (2, strategy)


def test_sequence_parallel_with_a_llama_model_dir_is_refused_before_any_build(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SystemExit) as e:
        main(["train", "--tp", "2", "--sequence-parallel", "--model-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "model_type 'llama'" in err and "Drop --sequence-parallel" in err


def test_a_runs_config_json_is_a_config_file(tmp_path, tiny_run):
    """`--config runs/a/config.json` (JSON: nulls, every key the run recorded) configures a new
    run with the same settings; only where it writes differs."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *tiny_run, "--max-steps", "2", "--lr", "0.01", "--out", str(a)]) == 0
    assert main(["train", "--config", str(a / "config.json"), "--out", str(b)]) == 0
    ja, jb = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert ja["decay_steps"] is None and ja["lr"] == 0.01
    assert {k: v for k, v in ja.items() if k not in ("out", "config")} == {
        k: v for k, v in jb.items() if k not in ("out", "config")
    }
    assert jb["config"] == str(a / "config.json") and jb["out"] == str(b)


def test_a_gpu_runs_config_json_is_resolved_again_here(tmp_path):
    """A run's recorded GPU (`cuda:0`, bf16) becomes `auto` on the machine that reads it: on
    a CPU-only one, the CPU in fp32 (an fp16 run keeps fp16: its loss scale is state)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"device": "cuda:0", "precision": "bf16", "lr": 0.01}))
    got = load_toml(path)
    assert got["device"] == "auto" and got["lr"] == 0.01
    if not torch.cuda.is_available():
        assert "precision" not in got
        cfg = from_args(argparse.Namespace(config=str(path)))
        assert (cfg.device, cfg.precision) == ("auto", "auto")
        path.write_text(json.dumps({"device": "cuda:1", "precision": "fp16"}))
        assert load_toml(path) == {"device": "auto", "precision": "fp16"}


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("c.json", '{"d_model": 32, "flash_mlp": true}', "unknown setting 'flash_mlp'"),
        ("c.json", '{"d_model": 32,}', "not valid JSON"),
        ("c.json", "[1, 2]", "a JSON table of settings expected"),
        ("c.txt", '{"seed": null}', "seed must be an int, got seed = None"),
        ("c.toml", "[model]\nd_model = 3\n", "unknown setting 'model'"),
        ("c.toml", "d_model = \n", "not valid TOML"),
        ("c.toml", "out = 3", 'out must be a str (a string is "quoted"), got out = 3'),
        ("c.toml", "config = 'x.toml'", "unknown setting 'config'"),
        ("missing.toml", None, "--config {path}: no such file"),
        ("folder", "", "--config {path}: cannot read it"),
    ],
)
def test_every_config_file_problem_is_one_usage_line(tmp_path, name, text, message, capsys):
    path = tmp_path / name
    if name == "folder":
        path.mkdir()
    elif text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("ftrain train: error:"))
    assert line.startswith(f"ftrain train: error: --config {path}: ")
    assert message.format(path=path) in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-steps", "99999999999999999999"], "--max-steps 99999999999999999999 is out of"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--dropout", "nan"], "--dropout must be in [0, 1), got nan"),
        (["--resume"], "--resume continues the run in --out: pass --out RUN"),
    ],
)
def test_values_that_would_fail_mid_run_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_a_runs_saved_setting_of_the_wrong_type_is_one_usage_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"lr": "fast", "d_model": 32}')
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(tmp_path), "--resume"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert f"error: --resume {tmp_path / 'config.json'}: lr must be a float" in err
