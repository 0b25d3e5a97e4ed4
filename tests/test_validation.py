"""Validation you choose (ftrain.data.plan_split, ftrain.app.recipes.rows): --eval-data,
--val-fraction, --epochs, a small corpus that trains with validation off, the startup summary."""

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ftrain as ft
from ftrain import data
from ftrain.app.cli import main
from ftrain.app.config import TrainConfig
from ftrain.app.loop import train
from ftrain.app.recipes import gpt, rows

L, B = 16, 4  # --seq-len, --batch-size
TINY = dict(d_model=16, n_layer=1, n_head=2, seq_len=L, batch_size=B, sample_tokens=0,
            progress=False, log_every=1, device="cpu")  # fmt: skip


def _text(n_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefgh ij\n") for _ in range(n_bytes))


def _build(tmp_path, texts):
    out = tmp_path / "build"
    data.build_token_dataset([(f"d{i}", t) for i, t in enumerate(texts)], out, progress=False)
    return out


@pytest.mark.parametrize("fraction", [None, 0.1, 0.5])
@pytest.mark.parametrize("n_docs", [1, 2, 5, 17, 20])
def test_any_small_corpus_splits_into_disjoint_rows_or_turns_validation_off(
    tmp_path, n_docs, fraction
):
    """Every token is in train or valid, never both, each side holds a row; or validation is off
    and every document trains (1..20 documents of 10..60 bytes, rows of 16)."""
    rng = random.Random(n_docs)
    texts = [_text(rng.randint(10, 60), i) for i in range(n_docs)]
    path = _build(tmp_path, texts)
    total = sum(len(t) + 1 for t in texts)  # bytes + the end-of-document id
    plan = data.plan_split(path, L, fraction)
    train_ds = data.TokenDataset(path, L, **plan.train)
    if plan.valid is None:
        assert plan.how == "off" and plan.reason and train_ds.tokens_per_epoch == total
        return
    valid = data.TokenDataset(path, L, **plan.valid)
    assert train_ds.tokens_per_epoch + valid.tokens_per_epoch <= total
    assert min(train_ds.tokens_per_epoch, valid.tokens_per_epoch) >= L + 1
    if plan.how == "tokens":  # the stream cut once: train before, valid after
        assert plan.train["token_range"][1] == plan.valid["token_range"][0]
        assert train_ds.tokens_per_epoch + valid.tokens_per_epoch == total
    else:
        assert set(train_ds.doc_range).isdisjoint(valid.doc_range)


def test_a_fraction_of_one_document_validates_on_its_last_tokens(tmp_path):
    """--val-fraction on 1 document: cut by tokens; the validation rows read exactly the last
    round(F * tokens) tokens of the text, and the training rows never read them."""
    text = _text(399)
    path = _build(tmp_path, [text])
    ids = list(text.encode()) + [data.ByteTokenizer().eot_id]  # 400 tokens
    plan = data.plan_split(path, L, 0.25)
    assert plan.how == "tokens" and plan.valid["token_range"] == (300, 400)
    valid = data.TokenDataset(path, L, **plan.valid)
    rows_read = sorted(valid[i]["input"].tolist() for i in range(len(valid)))
    expected = sorted(ids[300 + j * L : 300 + j * L + L] for j in range(len(valid)))
    assert rows_read == expected and len(valid) == (100 - 1) // L
    train_ds = data.TokenDataset(path, L, **plan.train)
    assert len(train_ds) == (300 - 1) // L
    head = bytes(ids[:300])  # every training row (input and its last target) is read from here
    for i in range(len(train_ds)):
        r = train_ds[i]
        assert bytes(r["input"].tolist() + r["target"][-1:].tolist()) in head


def test_a_small_text_file_trains_with_validation_off_and_a_warning(tmp_path, capsys):
    """`ftrain train --data notes.txt` on 1 document: no crash, also with --eval-every 0 (then no
    warning), and the startup summary says validation is off."""
    notes = tmp_path / "notes.txt"
    notes.write_text(_text(500))
    common = ["--d-model", "16", "--n-layer", "1", "--seq-len", str(L), "--batch-size", str(B),
              "--sample-tokens", "0", "--no-progress", "--data", str(notes), "--max-steps", "2",
              "--data-dir", str(tmp_path / "tok"), "--device", "cpu"]  # fmt: skip
    assert main(["train", *common, "--eval-every", "1", "--out", str(tmp_path / "a")]) == 0
    captured = capsys.readouterr()
    assert "warning: validation off: the default split" in captured.err
    assert "--eval-data PATH" in captured.err and "Traceback" not in captured.err
    assert "validation off:" in captured.out and "1 document, 501 tokens" in captured.out
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert not any("val_loss" in json.loads(x) for x in lines)
    assert main(["train", *common, "--eval-every", "0", "--out", str(tmp_path / "b")]) == 0
    assert "validation off" not in capsys.readouterr().err


def test_eval_data_gives_the_loss_on_exactly_that_data(tmp_path):
    """--eval-data dev.txt: the run's validation loss equals the mean token cross-entropy of the
    trained params over dev.txt's bytes cut into rows by hand (F.cross_entropy, not ft.evaluate);
    all of --data trains."""
    (tmp_path / "train.txt").write_text(_text(300, 1))
    dev = _text(5 * L, 2)  # 5 * L bytes + eot: exactly 5 rows of L + 1 tokens
    (tmp_path / "dev.txt").write_text(dev)
    cfg = TrainConfig(**TINY, data=str(tmp_path / "train.txt"), eval_data=str(tmp_path / "dev.txt"),
                      data_dir=str(tmp_path / "tok"), max_steps=3, eval_every=3, eval_batches=4,
                      out=str(tmp_path / "run"))  # fmt: skip
    summary = train(cfg)
    state = ft.load(ft.latest_checkpoint(tmp_path / "run"))
    ids = torch.tensor(list(dev.encode()) + [data.ByteTokenizer().eot_id])
    x = torch.stack([ids[j * L : j * L + L] for j in range(5)])  # (5, L)
    y = torch.stack([ids[j * L + 1 : j * L + L + 1] for j in range(5)])  # (5, L)
    model = gpt.build_model(cfg).eval()
    missing, _ = model.load_state_dict(state.params.flatten_keys(".").to_dict(), strict=False)
    assert not missing  # (strict=False: the tied output weight is given once)
    with torch.no_grad():
        logits = model(x)
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
    assert summary["val_loss"] == pytest.approx(expected, rel=1e-5)
    recipe = gpt.build(cfg, quiet=True)
    assert "(--eval-data" in recipe.summary and "1 document, 81 tokens" in recipe.summary
    assert "data: --data" in recipe.summary and "1 document, 301 tokens" in recipe.summary


@pytest.mark.parametrize("epochs", [1, 3])
def test_epochs_sets_the_step_count_and_the_schedule_follows(tmp_path, epochs):
    """--epochs N: ceil(N * rows in the training split / rows per step) steps, counted from the
    text's length; the cosine schedule ends at the last of them."""
    (tmp_path / "t.txt").write_text(_text(700))  # 701 tokens: (701 - 1) // 16 = 43 rows
    cfg = TrainConfig(**TINY, data=str(tmp_path / "t.txt"), data_dir=str(tmp_path / "tok"),
                      epochs=epochs, warmup=2, eval_every=0, out=str(tmp_path / "run"))  # fmt: skip
    expected = math.ceil(epochs * ((701 - 1) // L) / B)
    recipe = gpt.build(cfg, quiet=True)
    assert recipe.cfg.max_steps == expected and recipe.cfg.epochs is None
    schedule = gpt.build_schedule(recipe.cfg)
    assert float(schedule(torch.tensor(expected))) == pytest.approx(cfg.lr / 10)
    assert f"{expected} steps = {expected * B / 43:.2f} epochs" in recipe.summary
    if epochs == 1:
        summary = train(cfg)
        assert summary["step"] == expected
        saved = json.loads((tmp_path / "run" / "config.json").read_text())
        assert saved["max_steps"] == expected and saved["epochs"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--epochs", "2", "--max-steps", "5"],
            "--epochs 2 and --max-steps 5 both set the run's length; pass one",
        ),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
        (["--eval-data", "nowhere.txt"], "--eval-data 'nowhere.txt' does not exist"),
        (["--eval-data", ".", "--val-fraction", "0.1"], "both choose the validation data"),
    ],
)
def test_conflicting_or_bad_validation_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def test_data_shorter_than_a_row_is_a_usage_error_naming_seq_len(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("tiny")
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(tmp_path / "t.txt"), "--data-dir", str(tmp_path / "tok"),
              "--seq-len", str(L), "--no-progress", "--out", str(tmp_path / "r")])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and "5 tokens" in err and "lower --seq-len to 4" in err


def test_the_summary_counts_trainable_and_frozen_params_under_lora(tmp_path):
    (tmp_path / "t.txt").write_text(_text(400))
    cfg = TrainConfig(**TINY, data=str(tmp_path / "t.txt"), data_dir=str(tmp_path / "tok"),
                      lora_rank=2, val_fraction=0.2, max_steps=5)  # fmt: skip
    recipe = gpt.build(cfg, quiet=True)
    model = gpt.build_model(cfg)
    frozen = sum(p.numel() for p in model.parameters())
    adapters = sum(t.numel() for t in recipe.state.params.values(True, True))
    assert f"params: {adapters:,} trainable, {frozen:,} frozen (LoRA rank 2" in recipe.summary
    # 1 document: cut by tokens, 80 of its 401 validate
    assert "validation: 1 document, 80 tokens (the last tokens" in recipe.summary
    per_epoch = rows.steps_per_epoch(recipe.cfg, data.TokenDataset(
        recipe.valid.path, L, token_range=(0, 321)))  # fmt: skip
    assert f"{per_epoch:.1f} steps per epoch" in recipe.summary
    assert np.isclose(per_epoch, ((321 - 1) // L) / B)


def test_a_token_range_outside_the_build_is_refused_with_its_bounds(tmp_path):
    path = _build(tmp_path, [_text(40)])  # 41 tokens
    for bad in [(5, 5), (0, 42), (-1, 10)]:
        with pytest.raises(
            ValueError, match=r"token_range must be \(lo, hi\) with 0 <= lo < hi <= 41"
        ):
            data.TokenDataset(path, 4, token_range=bad)
