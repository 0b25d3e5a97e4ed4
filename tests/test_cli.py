"""The main job, end to end: `ftrain train` / `ftrain sample`, resume, kill -9, Ctrl-C, bad flags."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import ftrain as ft
from ftrain.cli import main
from ftrain.io import meta_checksum

TINY = [
    "--d-model", "32", "--n-layer", "2", "--n-head", "2", "--seq-len", "32", "--batch-size", "4",
    "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--log-every", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def _flat(path):
    state = ft.load(ft.latest_checkpoint(path))
    return state.to_tensordict().flatten_keys(".")


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, data_dir):
    """12 steps == 6 steps + --resume to 12, with fp16 loss scaling, dropout, accumulation and a
    warmup-cosine schedule: every tensor of the final checkpoint, and the loader position."""
    common = [*TINY, "--data-dir", data_dir, "--precision", "fp16", "--dropout", "0.1",
              "--micro-batches", "2", "--warmup", "4", "--save-every", "3"]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *common, "--max-steps", "12", "--out", str(a)]) == 0
    assert main(["train", *common, "--max-steps", "6", "--decay-steps", "12", "--out", str(b)]) == 0
    assert ft.latest_checkpoint(b).name == "checkpoint-6"
    assert main(["train", *common, "--max-steps", "12", "--out", str(b), "--resume"]) == 0
    ta, tb = _flat(a), _flat(b)
    assert sorted(ta.keys()) == sorted(tb.keys())
    assert "extra.loss_scale.scale" in ta.keys() and "rng" in ta.keys()
    for k in ta.keys():
        assert torch.equal(ta[k], tb[k]), k
    meta_a = ft.load_meta(ft.latest_checkpoint(a))["extra"]
    meta_b = ft.load_meta(ft.latest_checkpoint(b))["extra"]
    assert meta_a["loader"] == meta_b["loader"]
    # The log reads as one run and its losses agree step by step.
    la = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == list(range(1, 13))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
    assert (a / "loss.png").stat().st_size > 1000


def test_outputs_and_sample(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    args = [*TINY, "--data-dir", data_dir, "--max-steps", "4", "--out", str(out)]
    assert main(["train", *args, "--eval-every", "2", "--sample-tokens", "20"]) == 0
    printed = capsys.readouterr().out
    assert "--- sample ---" in printed
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "lr"} <= set(records[0])
    assert any("val_loss" in r for r in records)
    assert (out / "sample.txt").read_text().startswith("def ")
    assert main(["sample", "--run", str(out), "--prompt", "import ", "--max-new-tokens", "30"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("import ") and len(text) >= len("import ") + 10


def test_resume_refuses_changed_model_and_notes_other_changes(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    args = [*TINY, "--data-dir", data_dir, "--out", str(out)]
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


def test_bias_flag_and_runs_saved_before_it(tmp_path, data_dir, capsys):
    """--bias gives the Linears and LayerNorms biases (off by default). A checkpoint written before
    the flag existed (no `bias` in its saved config) was trained with biases: `sample` rebuilds
    that model, and --resume without --bias is refused as a changed model, naming the fix."""
    off, on = tmp_path / "off", tmp_path / "on"
    common = [*TINY, "--data-dir", data_dir, "--max-steps", "1"]
    assert main(["train", *common, "--out", str(off)]) == 0
    assert main(["train", *common, "--out", str(on), "--bias"]) == 0
    assert not [k for k in _flat(off).keys() if k.endswith("bias")]
    assert "params.blocks.0.attn.qkv.bias" in _flat(on).keys()

    meta_path = ft.latest_checkpoint(on) / "meta.json"  # as an older ftrain wrote it
    meta = json.loads(meta_path.read_text())
    del meta["extra"]["config"]["bias"]
    meta["meta_sha256"] = meta_checksum(meta)
    meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["sample", "--run", str(on), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["train", *common, "--max-steps", "2", "--out", str(on), "--resume"])
    assert e.value.code == 2 and "--bias True -> False" in capsys.readouterr().err
    assert main(["train", *common, "--max-steps", "2", "--out", str(on), "--resume", "--bias"]) == 0


def test_sample_with_an_empty_prompt_is_unconditional(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    args = [*TINY, "--data-dir", data_dir, "--max-steps", "1", "--out", str(out)]
    assert main(["train", *args]) == 0
    capsys.readouterr()
    assert main(["sample", "--run", str(out), "--prompt", "", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.strip("\n")  # some text (the start token is not printed)
    model = ft.models.GPT(ft.models.GPTConfig(seq_len=8, d_model=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(ValueError, match="T >= 1"):
        ft.models.generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def test_sample_from_a_damaged_checkpoint_is_a_message(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    args = [*TINY, "--data-dir", data_dir, "--max-steps", "1", "--out", str(out)]
    assert main(["train", *args]) == 0
    ckpt = ft.latest_checkpoint(out)
    for f in ckpt.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])  # truncated
    capsys.readouterr()
    assert main(["sample", "--run", str(ckpt), "--max-new-tokens", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftrain sample: ") and "Traceback" not in err


def test_config_file_and_flags(tmp_path, data_dir):
    cfg = tmp_path / "c.toml"
    cfg.write_text('max-steps = 2\nd_model = 48\nlr_schedule = "constant"\nweight_decay = 0.0\n')
    out = tmp_path / "run"
    assert main(["train", *TINY, "--config", str(cfg), "--d-model", "24", "--data-dir", data_dir,
                 "--out", str(out)]) == 0  # fmt: skip
    saved = json.loads((out / "config.json").read_text())
    assert saved["max_steps"] == 2 and saved["d_model"] == 24  # the flag beats the file
    assert saved["lr_schedule"] == "constant" and saved["weight_decay"] == 0.0
    assert ft.load(ft.latest_checkpoint(out)).params["wte", "weight"].shape[1] == 24


def test_global_batch_size_sets_micro_batches(tmp_path, data_dir):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--max-steps", "1", "--global-batch-size", "12", "--data-dir",
                 data_dir, "--out", str(out)]) == 0  # fmt: skip
    assert json.loads((out / "config.json").read_text())["micro_batches"] == 3
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["count"] == 12 * 32  # 12 rows of 32 targets in one optimizer step


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--max-steps", "zero"], "invalid int value"),
        (["--d-model", "30", "--n-head", "4"], "must be divisible by --n-head"),
        (["--optimizer", "adamm"], "--optimizer must be one of"),
        (["--max-steps", "0"], "--max-steps must be >= 1"),
        (["--frobnicate"], "unrecognized arguments"),
        (["--shard", "fsdp", "--compile"], "--compile cannot be combined with --shard fsdp"),
    ],
)
def test_bad_flags_get_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


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
    from ftrain.config import load_toml

    cfg = tmp_path / "c.toml"
    cfg.write_text("lr = 1\nweight_decay = 0\n")
    assert load_toml(cfg) == {"lr": 1.0, "weight_decay": 0.0}


def test_unwritable_out_is_an_error_before_training(tmp_path, data_dir):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit, match="cannot write to --out"):
        main(["train", *TINY, "--data-dir", data_dir, "--out", str(blocker / "run")])


def test_fresh_run_refuses_an_out_with_checkpoints(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    args = [*TINY, "--data-dir", data_dir, "--max-steps", "2", "--out", str(out)]
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


def _spawn(args, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "ftrain", "train", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, text=True,
    )  # fmt: skip


def _wait_for_checkpoint(out, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        if list(out.glob("checkpoint-*")):
            return
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


def test_kill_9_at_random_moments_always_leaves_a_resumable_checkpoint(tmp_path, data_dir):
    out = tmp_path / "run"
    args = [*TINY, "--data-dir", data_dir, "--save-every", "1", "--keep", "2", "--out", str(out)]
    rng = random.Random(0)
    last_step = 0
    for attempt in range(4):
        proc = _spawn(
            [*args, "--max-steps", "100000", *(["--resume"] if attempt else [])], tmp_path
        )
        _wait_for_checkpoint(out, proc)
        time.sleep(rng.uniform(0.5, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = ft.latest_checkpoint(out)
        assert latest is not None
        state = ft.load(latest)  # verifies every file's sha256
        assert int(state.step) >= last_step
        last_step = int(state.step)
    # and --resume continues from there to the end
    proc = _spawn([*args, "--max-steps", str(last_step + 2), "--resume"], tmp_path)
    text, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, text
    assert f"step {last_step})" in text
    assert int(ft.load(ft.latest_checkpoint(out)).step) == last_step + 2


def test_ctrl_c_saves_and_exits_cleanly(tmp_path, data_dir):
    out = tmp_path / "run"
    proc = _spawn([*TINY, "--data-dir", data_dir, "--save-every", "0", "--max-steps", "100000",
                   "--out", str(out)], tmp_path)  # fmt: skip
    t0 = time.time()
    while not (out / "metrics.jsonl").exists():  # training has started
        assert time.time() - t0 < 120 and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "interrupted at step" in text
    step = int(ft.load(ft.latest_checkpoint(out)).step)
    assert step >= 1 and f"interrupted at step {step}" in text


@pytest.mark.skipif(
    sys.platform != "linux" or __import__("platform").libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_keep_freed_memory_stops_page_faults_in_the_training_loop():
    """Page faults per step of a small GPT step after keep_freed_memory() (what `ftrain train`
    calls), in a fresh process: the heap keeps the step's activations, so after the first steps
    they are not faulted in again (a few dozen faults a step at most). With glibc's defaults the
    same loop usually takes hundreds a step (667 measured here), but how many depends on glibc's
    adaptive thresholds (sometimes none), so that side is not asserted."""
    script = """
import resource, torch
import ftrain as ft
from ftrain.models import GPT, GPTConfig
from ftrain.train import keep_freed_memory
assert keep_freed_memory()
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=257, seq_len=128, d_model=64, n_layer=2, n_head=2, bias=False))
opt = ft.optim.adamw(1e-3)
state = ft.TrainState.create(ft.params_of(model), opt)
loss = lambda p, b: ft.losses.cross_entropy(ft.apply(model, p, b[:, :-1]), b[:, 1:])
step = ft.train_step(loss, opt, donate=True)
batch = torch.randint(0, 257, (8, 129))
for _ in range(3):
    state, _ = step(state, batch)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    state, _ = step(state, batch)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
"""
    per_step = int(subprocess.check_output([sys.executable, "-c", script], text=True))
    assert per_step < 100
