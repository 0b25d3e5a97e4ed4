"""Tests for ftrain.app.recipes.hf: `ftrain train --model-dir M --data D` trains a Hugging Face
model read from a folder, on chats whose loss is on the assistant's tokens, packed or not,
resumable."""

import json
import os
import subprocess
import sys

import pytest
import torch

import ftrain as ft
from ftrain import data
from ftrain.app.cli import main
from ftrain.app.config import TrainConfig

from _hf import EOS, IM_END, arithmetic_chats, tiny_hf_dir, write_jsonl

pytest.importorskip("transformers")

from ftrain.app.recipes import hf  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny GPT-2 and a tiny Llama folder, and a chat JSONL with two bad lines."""
    root = tmp_path_factory.mktemp("hf")
    d = write_jsonl(
        root / "chats.jsonl", [*arithmetic_chats(), "{oops", {"prompt": "no text field"}]
    )
    return tiny_hf_dir(root / "gpt2", "gpt2"), tiny_hf_dir(root / "llama", "llama"), d


def _flags(model, data_path, tmp_path, *more):
    return [
        "--model-dir", str(model), "--data", str(data_path), "--seq-len", "32",
        "--batch-size", "8", "--lr", "3e-3", "--warmup", "2", "--log-every", "1",
        "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
        "--data-dir", str(tmp_path / "tokens"), "--out", str(tmp_path / "run"), *more,
    ]  # fmt: skip


def _losses(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_ftrain_train_model_dir_on_chat_jsonl_lowers_the_loss(folders, tmp_path):
    gpt2, _, chats = folders
    proc = subprocess.run(
        [sys.executable, "-m", "ftrain", "train", *_flags(gpt2, chats, tmp_path, "--max-steps", "20")],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5, losses
    # the build said what it skipped, with file and line
    assert "skipped 2 document(s) (invalid 2)" in proc.stderr
    assert f"{chats}:61: not JSON" in proc.stderr and f"{chats}:62: missing field" in proc.stderr
    assert (
        main(
            [
                "sample",
                "--run",
                str(tmp_path / "run"),
                "--prompt",
                "what is",
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )


def test_packed_llama_run_resumes_bit_exactly(folders, tmp_path):
    _, llama, chats = folders
    assert main(["train", *_flags(llama, chats, tmp_path / "a", "--pack", "--max-steps", "6")]) == 0
    b = ["train", *_flags(llama, chats, tmp_path / "b", "--pack", "--save-every", "3")]
    assert main(b + ["--max-steps", "3", "--decay-steps", "6"]) == 0  # to stop early, resume
    assert main(b + ["--max-steps", "6", "--resume"]) == 0
    one, two = (
        ft.load(tmp_path / "a" / "run" / "checkpoint-6"),
        ft.load(tmp_path / "b" / "run" / "checkpoint-6"),
    )
    for x, y in zip(ft.tree.leaves(one.params), ft.tree.leaves(two.params), strict=True):
        assert torch.equal(x, y)
    assert _losses(tmp_path / "a" / "run")[-3:] == _losses(tmp_path / "b" / "run")[-3:]


def test_only_the_assistants_tokens_get_a_gradient(folders, tmp_path):
    gpt2, _, _ = folders
    tok = data.load_tokenizer(gpt2)
    chat = arithmetic_chats(1)[0]["messages"]
    data.build_token_dataset(
        [write_jsonl(tmp_path / "one.jsonl", [{"messages": chat}])],
        tmp_path / "b",
        tok,
        progress=False,
    )
    ex = data.DocumentDataset(tmp_path / "b", max_len=512, splits=(1, 0, 0))[0]
    batch = {k: v[None] for k, v in ex.items()}
    model = hf.build_model(TrainConfig(model_dir=str(gpt2), seq_len=32))
    params = ft.params_of(model)
    logits = []  # the logits of the forward, kept to read their gradient
    hook = model.lm_head.register_forward_hook(lambda m, i, out: logits.append(out))
    try:
        loss = hf.make_loss_fn(model)(params.apply(lambda p: p.requires_grad_()), batch)
        (grad,) = torch.autograd.grad(loss.total, logits)
    finally:
        hook.remove()
    learned = grad[0].abs().sum(-1) > 0  # (T,): positions whose prediction is trained
    said = tok.backend.decode(
        batch["input"][0, 1:].tolist() + [tok.eot_id], skip_special_tokens=False
    )
    targets = ex["input"][1:].tolist() + [tok.eot_id]  # the token each position predicts
    got = tok.backend.decode(
        [t for t, on in zip(targets, learned.tolist()) if on], skip_special_tokens=False
    )
    assert got == f"0 plus 0 is 0.{IM_END}\n{EOS}", (got, said)
    assert 0 < int(learned.sum()) < len(learned) // 2


def test_build_model_checks_the_run_against_the_folder(folders, tmp_path):
    gpt2, _, _ = folders
    with pytest.raises(ValueError, match="--seq-len 100 is longer than the context.*--seq-len 64"):
        hf.build_model(TrainConfig(model_dir=str(gpt2), seq_len=100))
    with pytest.raises(FileNotFoundError, match="--model-dir .*no config.json"):
        hf.build(TrainConfig(model_dir=str(tmp_path)))


def _train_each(cfgs):
    from ftrain.app.loop import train

    return [train(cfg)["step"] for cfg in cfgs]


def _config(args):
    from ftrain.app.cli import parser
    from ftrain.app.config import from_args

    return from_args(parser().parse_args(["train", *args]))


def _built_on_this_rank(cfg):
    """What hf.build made: are the params this process's rows (DTensors), the template's params
    on meta and its buffers real?"""
    from ftrain.distributed.dtensor import is_dtensor

    recipe = hf.build(cfg, rank=torch.distributed.get_rank(), world=2, quiet=True)
    rows = all(is_dtensor(t) for t in ft.tree.leaves(recipe.state.params))
    return (
        rows,
        all(p.is_meta for p in recipe.model.parameters()),
        any(b.is_meta for b in recipe.model.buffers()),
    )


def test_fsdp_on_two_processes_reads_each_ones_rows_and_equals_one_process(folders, tmp_path):
    """`--model-dir M --shard fsdp` on 2 processes: each reads only its rows of the weights
    (the template's params on meta) and the run logs one process's losses (to 1e-5), with
    `--lora-rank 2` too (the frozen base read as rows)."""
    _, llama, chats = folders

    def cfg(name, *more):
        flags = _flags(llama, chats, tmp_path / name, "--max-steps", "3", "--batch-size", "2",
                       "--global-batch-size", "4", *more)  # fmt: skip
        return _config(flags)

    built = ft.distributed.run_distributed(_built_on_this_rank, 2, cfg("built", "--shard", "fsdp"))
    assert built == [(True, True, False)] * 2
    ft.distributed.run_distributed(
        _train_each,
        2,
        [cfg("fsdp", "--shard", "fsdp"), cfg("lora", "--shard", "fsdp", "--lora-rank", "2")],
    )
    for name, more in (("fsdp", ()), ("lora", ("--lora-rank", "2"))):
        from ftrain.app.loop import train

        train(cfg(name + "-one", *more))
        got, want = _losses(tmp_path / name / "run"), _losses(tmp_path / (name + "-one") / "run")
        assert len(got) == len(want) == 3
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (name, got, want)
