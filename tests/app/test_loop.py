"""The training loop (ftrain.app.loop): outputs, resume bit for bit, kill -9, Ctrl-C, evaluation,
and a config that train() resolves without changing."""

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain.app.cli import main, parser
from ftrain.app.config import from_args
from ftrain.app.loop import train, validation_loss
from ftrain.app.recipes import placement


def _flat(path):
    state = ft.load(ft.latest_checkpoint(path))
    return state.to_tensordict().flatten_keys(".")


def _config(args):
    return from_args(parser().parse_args(["train", *args]))


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, tiny_run):
    """12 steps == 6 steps + --resume to 12, with fp16 loss scaling, dropout, accumulation and a
    warmup-cosine schedule: every tensor of the final checkpoint, and the loader position."""
    common = [*tiny_run, "--precision", "fp16", "--dropout", "0.1", "--micro-batches", "2",
              "--warmup", "4", "--save-every", "3"]  # fmt: skip
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


def test_outputs_and_sample(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    args = [*tiny_run, "--max-steps", "4", "--out", str(out)]
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


def test_train_leaves_its_config_unchanged(tmp_path, tiny_run, monkeypatch):
    """train() resolves --global-batch-size into micro_batches, and records that in config.json
    and the checkpoint, without writing to the TrainConfig it was given."""
    cfg = _config([*tiny_run, "--max-steps", "1", "--global-batch-size", "12",
                   "--out", str(tmp_path / "run")])  # fmt: skip
    before = copy.deepcopy(cfg)
    summary = train(cfg)
    assert cfg == before and cfg.micro_batches == 1
    assert summary["step"] == 1 and summary["count"] == 12 * 32  # 3 micro-batches of 4 rows
    assert json.loads((tmp_path / "run" / "config.json").read_text())["micro_batches"] == 3
    saved = ft.load_meta(ft.latest_checkpoint(tmp_path / "run"))["extra"]["config"]
    # ... and the device, precision and matmul kernel that auto resolved to here (cpu, fp32 on a
    # CPU; a model this small: torch, untimed)
    assert saved == {**placement.resolve(before).to_dict(), "micro_batches": 3, "matmul": "torch"}
    assert (saved["device"], before.device) == (str(placement.resolve_device("auto")), "auto")
    # Under torchrun (WORLD_SIZE > 1) without --shard the run resolves to ddp; here torchrun's
    # other variables are missing, so it stops at joining the process group, with cfg unchanged.
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match="--shard ddp: .*torchrun"):
        train(cfg)
    assert cfg == before and cfg.shard == "none"


def test_global_batch_size_sets_micro_batches(tmp_path, tiny_run):
    out = tmp_path / "run"
    assert main(["train", *tiny_run, "--max-steps", "1", "--global-batch-size", "12",
                 "--out", str(out)]) == 0  # fmt: skip
    assert json.loads((out / "config.json").read_text())["micro_batches"] == 3
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["count"] == 12 * 32  # 12 rows of 32 targets in one optimizer step
    with pytest.raises(SystemExit, match="--global-batch-size 10 must be a multiple of"):
        main(["train", *tiny_run, "--global-batch-size", "10", "--out", str(tmp_path / "b")])


def test_evaluate_is_the_mean_token_loss_of_the_first_batches():
    torch.manual_seed(0)
    model = ft.models.GPT(ft.models.GPTConfig(vocab_size=11, seq_len=6, d_model=16, n_layer=1,
                                              n_head=2, dropout=0.5))  # fmt: skip
    rows = [{"input": torch.randint(0, 11, (6,)), "target": torch.randint(0, 11, (6,))}
            for _ in range(7)]  # fmt: skip
    cfg = _config(["--batch-size", "2", "--eval-batches", "3"])  # rows 0-5 in 3 batches
    params = ft.params_of(model)
    with torch.no_grad():
        model.eval()
        logits = model(torch.stack([r["input"] for r in rows[:6]]))
        want = F.cross_entropy(
            logits.flatten(0, 1), torch.stack([r["target"] for r in rows[:6]]).flatten()
        )
    model.train()
    got = validation_loss(model, params, rows, cfg)
    assert got == pytest.approx(float(want), rel=1e-5)  # eval mode: no dropout
    assert model.training  # the mode is restored
    assert validation_loss(model, params, rows, cfg) == got  # the same rows every time


def test_resume_without_a_checkpoint_starts_from_step_0(tmp_path, tiny_run, capsys):
    out = tmp_path / "run"
    assert main(["train", *tiny_run, "--max-steps", "2", "--out", str(out), "--resume"]) == 0
    assert "no checkpoint in" in capsys.readouterr().out
    assert int(ft.load(ft.latest_checkpoint(out)).step) == 2


def test_bias_flag_and_runs_saved_before_it(tmp_path, tiny_run, capsys):
    """--bias gives the Linears and LayerNorms biases (off by default). A checkpoint written before
    the flag existed (no `bias` in its saved config) was trained with biases: `sample` rebuilds
    that model, --resume continues it with biases, and --resume --no-bias is refused as a
    changed model, naming the flag."""
    off, on, old = tmp_path / "off", tmp_path / "on", tmp_path / "old"
    common = [*tiny_run, "--max-steps", "1"]
    assert main(["train", *common, "--out", str(off)]) == 0
    assert main(["train", *common, "--out", str(on), "--bias"]) == 0
    assert not [k for k in _flat(off).keys() if k.endswith("bias")]
    assert "params.blocks.0.attn.qkv.bias" in _flat(on).keys()

    latest = ft.latest_checkpoint(on)  # saved again as an older ftrain wrote it: no `bias`
    extra = ft.load_meta(latest)["extra"]
    config = {k: v for k, v in extra["config"].items() if k != "bias"}
    ft.save_checkpoint(old, ft.load(latest), extra={**extra, "config": config})
    capsys.readouterr()
    assert main(["sample", "--run", str(old), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["train", *common, "--max-steps", "2", "--out", str(old), "--resume", "--no-bias"])
    assert e.value.code == 2 and "--bias True -> False" in capsys.readouterr().err
    assert main(["train", *common, "--max-steps", "2", "--out", str(old), "--resume"]) == 0
    assert "params.blocks.0.attn.qkv.bias" in _flat(old).keys()


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


def test_kill_9_at_random_moments_always_leaves_a_resumable_checkpoint(tmp_path, tiny_run):
    out = tmp_path / "run"
    args = [*tiny_run, "--save-every", "1", "--keep", "2", "--out", str(out)]
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


def test_ctrl_c_saves_and_exits_cleanly(tmp_path, tiny_run):
    out = tmp_path / "run"
    proc = _spawn([*tiny_run, "--save-every", "0", "--max-steps", "100000", "--out", str(out)],
                  tmp_path)  # fmt: skip
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


def _train_and_stop_rank_0_at_its_first_log(cfg):
    """train() on one of two ranks; rank 0 gets a Ctrl-C while it logs its first step. Counts
    the object collectives (pickled, a host sync each) the loop makes."""
    import torch.distributed as dist

    import ftrain.app.run_folder

    rank = dist.get_rank()
    gathers, real_gather = [], dist.all_gather_object
    dist.all_gather_object = lambda *a, **kw: gathers.append(1) or real_gather(*a, **kw)
    write = ftrain.app.run_folder.MetricsLog.write

    def write_then_interrupt(self, record):
        write(self, record)
        os.kill(os.getpid(), signal.SIGINT)  # the loop's handler only sets its stop flag

    if rank == 0:
        ftrain.app.run_folder.MetricsLog.write = write_then_interrupt
    summary = train(cfg)
    return summary["step"], summary.get("interrupted", False), len(gathers)


def test_a_ctrl_c_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, tiny_run):
    """Every process stops after the same step (one that stopped alone would leave the others
    waiting in a collective); the per-step check is one all-reduce, not an object gather, and the
    saves gather nothing either (the data position is global, the same on every process)."""
    cfg = _config([*tiny_run, "--max-steps", "1000", "--save-every", "0", "--out",
                   str(tmp_path / "run")])  # fmt: skip
    ranks = ft.distributed.run_distributed(_train_and_stop_rank_0_at_its_first_log, 2, cfg)
    (step0, interrupted, gathers0), (step1, _, gathers1) = ranks
    assert step0 == step1 < 1000 and interrupted
    assert gathers0 == gathers1 == 0
    assert int(ft.load(ft.latest_checkpoint(tmp_path / "run")).step) == step0


def _train_each(cfgs):
    return [train(cfg)["step"] for cfg in cfgs]


def _losses(out):
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_resume_on_another_number_of_processes_continues_the_same_run(tmp_path, tiny_run):
    """The sample order is global and the checkpoint reshards: a 2-process fsdp run stopped at
    step 3 and resumed on 1 process gives the uninterrupted 2-process run's losses (to 1e-5), and
    a 1-process run stopped at step 3 and resumed on 2 processes the uninterrupted 1-process
    run's. The global batch (4 rows) is kept by --global-batch-size."""
    common = [*tiny_run, "--batch-size", "2", "--global-batch-size", "4", "--decay-steps", "6",
              "--save-every", "0"]  # fmt: skip

    def cfg(out, steps, *more):
        return _config([*common, "--out", str(tmp_path / out), "--max-steps", str(steps), *more])

    ft.distributed.run_distributed(
        _train_each, 2, [cfg("full2", 6, "--shard", "fsdp"), cfg("part2", 3, "--shard", "fsdp")]
    )
    assert ft.load_meta(ft.latest_checkpoint(tmp_path / "part2"))["format_version"] == 2
    for args in (("part2", 6, "--resume"), ("full1", 6), ("part1", 3)):
        train(cfg(*args))
    ft.distributed.run_distributed(_train_each, 2, [cfg("part1", 6, "--shard", "fsdp", "--resume")])
    for resumed, reference in (("part2", "full2"), ("part1", "full1")):
        got, want = _losses(tmp_path / resumed), _losses(tmp_path / reference)
        assert sorted(got) == sorted(want) == list(range(1, 7))
        for step in want:
            assert abs(got[step] - want[step]) <= 1e-5, (resumed, step, got[step], want[step])
    # the 1- and 2-process runs are the same run too
    assert max(abs(a - b) for a, b in zip(_losses(tmp_path / "full1").values(),
                                          _losses(tmp_path / "full2").values())) <= 1e-5  # fmt: skip


def test_lora_with_fsdp_equals_one_process_and_resumes_on_one(tmp_path, tiny_run):
    """`ftrain train --lora-rank 2 --shard fsdp` on 2 processes (the frozen base born as each
    process's rows, the adapters and their optimizer state sharded) logs the losses of one
    process given the same global batch (to 1e-5); its step-3 checkpoint resumed on one process
    continues the same run."""
    common = [*tiny_run, "--lora-rank", "2", "--lr", "1e-2", "--batch-size", "2",
              "--global-batch-size", "4", "--decay-steps", "6", "--save-every", "3"]  # fmt: skip
    assert_two_processes_equal_one_and_resume_on_one(
        tmp_path, common, full=["--shard", "fsdp"], part=["--shard", "fsdp"]
    )


def test_tp_run_equals_one_process_and_resumes_on_one(tmp_path, tiny_run):
    """`ftrain train --tp 2` on 2 processes (the GPT's matrices split, the same rows on both)
    logs the 1-process run's losses (to 1e-5), evaluating and saving on the way; its step-3
    checkpoint (a run with --sequence-parallel), resumed on 1 process, continues the same run."""
    common = [*tiny_run, "--decay-steps", "6", "--save-every", "3", "--eval-every", "3"]
    assert_two_processes_equal_one_and_resume_on_one(
        tmp_path, common, full=["--tp", "2"], part=["--tp", "2", "--sequence-parallel"]
    )


def test_pp_run_equals_one_process_and_resumes_on_one(tmp_path, tiny_run):
    """`ftrain train --pp 2` on 2 processes (one block each, the same rows on both, 1F1B) logs
    the 1-process run's losses (to 1e-5), evaluating and saving checkpoints on the way, each
    process writing its own stage's pieces; its step-3 checkpoint (a GPipe run), resumed on 1
    process, continues the same run."""
    common = [*tiny_run, "--decay-steps", "6", "--save-every", "3", "--eval-every", "3"]
    assert_two_processes_equal_one_and_resume_on_one(
        tmp_path, common, full=["--pp", "2"], part=["--pp", "2", "--pp-schedule", "gpipe"]
    )
    meta = ft.load_meta(tmp_path / "full" / "checkpoint-6")
    assert meta["format_version"] == 2 and len(meta["files"]) == 2
    pieces = meta["index"]["params.blocks.1.attn.qkv.weight"]["pieces"]
    assert [p["file"] for p in pieces] == ["rank-00001-of-00002.safetensors"]  # the last stage's


def assert_two_processes_equal_one_and_resume_on_one(tmp_path, common, *, full, part):
    """Two processes run ``common + full`` for 6 steps and ``common + part`` for 3 (saving at
    step 3); one process runs ``common`` for 6 steps and resumes the 3-step run to 6. Both the
    2-process run and the resumed one log the one-process losses at every step (to 1e-5)."""

    def cfg(out, steps, *more):
        return _config([*common, "--out", str(tmp_path / out), "--max-steps", str(steps), *more])

    ft.distributed.run_distributed(_train_each, 2, [cfg("full", 6, *full), cfg("part", 3, *part)])
    train(cfg("one", 6))
    train(cfg("part", 6, "--resume"))
    want = _losses(tmp_path / "one")
    for run in ("full", "part"):
        got = _losses(tmp_path / run)
        assert sorted(got) == list(range(1, 7))
        assert max(abs(got[s] - want[s]) for s in want) <= 1e-5, run


def test_tp_or_pp_with_fsdp_over_the_dp_groups_equals_one_process(tmp_path, tiny_run):
    """`ftrain train --tp 2 --shard fsdp` on 4 processes (matrices split over tp, the params,
    grads and optimizer state split again over the 2 data-parallel groups) logs the losses of one
    process given the same global batch (to 1e-5), and saves a sharded checkpoint on the way.
    `--pp 2 --shard fsdp`, run next in the same processes (each stage's state split over the 2
    groups), logs them too, and its checkpoint (each stage's fsdp shards written by the processes
    holding them) resumed on one process takes the 4th step of the one-process run. (One process
    is the reference: `--tp 2` and `--pp 2` with ddp equal it too, by the tests above.)"""
    common = [*tiny_run, "--batch-size", "2", "--global-batch-size", "4", "--decay-steps", "3",
              "--save-every", "3", "--max-steps", "3"]  # fmt: skip

    def cfg(out, *more):
        return _config([*common, "--out", str(tmp_path / out), *more])

    pp = cfg("pp", "--pp", "2", "--pp-microbatches", "2", "--shard", "fsdp")
    ft.distributed.run_distributed(
        _train_each, 4, [cfg("fsdp", "--tp", "2", "--shard", "fsdp"), pp]
    )
    train(cfg("one", "--max-steps", "4"))
    train(cfg("pp", "--max-steps", "4", "--resume"))  # one process, from the pipeline's pieces
    want = _losses(tmp_path / "one")
    for run, steps in (("fsdp", [1, 2, 3]), ("pp", [1, 2, 3, 4])):
        got = _losses(tmp_path / run)
        assert sorted(got) == steps
        assert max(abs(got[s] - want[s]) for s in steps) <= 1e-5, run
    # resumed, not restarted: the one process logged step 4 alone, after the pipeline's 3
    assert len((tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()) == 4
    saved = ft.load_meta(tmp_path / "pp" / "checkpoint-3")
    assert saved["format_version"] == 2 and len(saved["files"]) == 4  # each process its pieces
    assert ft.load_meta(ft.latest_checkpoint(tmp_path / "fsdp"))["format_version"] == 2
