"""The `ftrain` command (ftrain.app.cli): argparse, usage errors and exit codes of `train` and
`sample`.

What a run does is tested in test_loop.py; the run folder in test_rundir.py; settings and TOML
files in test_config.py.
"""

import pytest
import torch

import ftrain as ft
from ftrain.app.cli import main, parser


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--offload", "gpu"], "argument --offload: invalid choice: 'gpu'"),
        (["--max-steps", "zero"], "invalid int value"),
        (["--d-model", "30", "--n-head", "4"], "must be divisible by --n-head"),
        (["--optimizer", "adamm"], "--optimizer must be one of"),
        (["--max-steps", "0"], "--max-steps must be >= 1"),
        (["--warmup", "50", "--max-steps", "30"], "--warmup 50 >= --max-steps 30: the whole run"),
        (["--warmup", "9", "--decay-steps", "9"], "--warmup 9 >= --decay-steps 9"),
        (["--frobnicate"], "unrecognized arguments"),
        (["--data", "no/such.jsonl"], "--data 'no/such.jsonl' does not exist; pass a text file"),
        (["--model-dir", "no/such"], "--model-dir 'no/such' is not a directory; pass the folder"),
        (
            ["--shard", "fsdp", "--compile"],
            "--compile cannot be combined with --shard fsdp (torch.compile cannot trace fsdp's "
            "per-block gathering",
        ),
    ],
)
def test_bad_flags_get_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_run_shorter_than_the_default_warmup_is_warned_about(capsys):
    """--max-steps 30 with the default --warmup 50: the run is all warmup, which is said (a typed
    --warmup that long is refused above); a run longer than the warmup says nothing."""
    import argparse

    from ftrain.app.config import add_arguments, from_args

    train = argparse.ArgumentParser()
    add_arguments(train)
    cfg = from_args(train.parse_args(["--max-steps", "30"]))
    assert cfg.warmup == 50 and cfg.max_steps == 30  # the settings stay as given
    assert "--warmup 50 >= --max-steps 30: the whole run is warmup" in capsys.readouterr().err
    from_args(train.parse_args(["--max-steps", "60"]))
    assert "warmup" not in capsys.readouterr().err


def test_a_bad_setting_is_reported_by_the_train_command(capsys):
    """Settings checked after parsing (TrainConfig's own checks) get the usage of `ftrain train`."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--max-steps", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: ftrain train ")
    assert "ftrain train: error: --max-steps must be >= 1" in err


@pytest.mark.parametrize(
    "argv", [["--max-new-tokens", "0"], ["--temperature", "-1"], ["--top-k", "-1"]]
)
def test_bad_sample_flags_get_usage_errors(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sample", "--run", str(tmp_path), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens >= 1" in err and "Traceback" not in err


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args([])
    assert e.value.code == 2 and "{train,sample,consolidate,export}" in capsys.readouterr().err


def test_sample_from_a_damaged_checkpoint_is_a_message(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    assert main(["train", *tiny_run, "--max-steps", "1", "--out", str(out)]) == 0
    ckpt = ft.latest_checkpoint(out)
    for f in ckpt.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])  # truncated
    capsys.readouterr()
    assert main(["sample", "--run", str(ckpt), "--max-new-tokens", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftrain sample: ") and "Traceback" not in err


def test_fresh_run_refuses_an_out_with_checkpoints(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    args = [*tiny_run, "--max-steps", "2", "--out", str(out)]
    assert main(["train", *args]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", *args, "--max-steps", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(out) in err and "--resume" in err and "another --out" in err
    assert "Traceback" not in err
    assert ft.latest_checkpoint(out).name == "checkpoint-2"  # the old run is untouched
    assert main(["train", *args, "--max-steps", "3", "--resume"]) == 0


def test_lengths_and_losses_are_in_tokens_or_bytes_by_tokenizer(
    tmp_path, tiny_run, monkeypatch, capsys
):
    """--seq-len and --sample-tokens count tokens (bytes for the byte-level GPT); loss.png's axis
    says nats per byte for the built-in GPT, per token for a tokenizer's model."""
    from matplotlib.axes import Axes

    from ftrain.app import run_folder

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "--seq-len SEQ_LEN context length in tokens (bytes for the built-in" in text
    assert "--sample-tokens SAMPLE_TOKENS tokens to generate at the end" in text
    labels = []
    monkeypatch.setattr(Axes, "set_ylabel", lambda self, label, **kw: labels.append(label))
    assert main(["train", *tiny_run, "--max-steps", "1", "--out", str(tmp_path / "run")]) == 0
    run_folder.plot_losses([{"step": 1, "loss": 2.0}], tmp_path / "t.png", unit="token")
    assert labels == ["loss (nats per byte)", "loss (nats per token)"]


def test_offload_trains_with_the_optimizer_state_on_the_host(tmp_path, tiny_run):
    """--offload optimizer+gradients: the step is built with ft.offload, 2 steps train, and the
    state's optimizer tensors (the one the recipe hands the loop and the one saved) are on the
    CPU; a config file with a bad value is refused by name."""
    from ftrain.app.config import TrainConfig, from_args
    from ftrain.app.recipes import gpt

    args = [*tiny_run, "--max-steps", "2", "--offload", "optimizer+gradients"]
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 0
    saved = ft.load(ft.latest_checkpoint(tmp_path / "run"))
    assert int(saved.step) == 2
    assert ft.load_meta(ft.latest_checkpoint(tmp_path / "run"))["extra"]["config"]["offload"] == (
        "optimizer+gradients"
    )
    recipe = gpt.build(from_args(parser().parse_args(["train", *args])), quiet=True)
    assert recipe.step.names[-1] == "offload"
    for state in (saved, recipe.state):
        leaves = ft.tree.leaves(state.opt_state)
        assert leaves and all(t.device == torch.device("cpu") for t in leaves)
    with pytest.raises(ValueError, match=r"--offload must be one of \('none', 'optimizer'"):
        TrainConfig(offload="gradients").validate()
