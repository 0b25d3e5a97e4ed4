"""ftrain.models.sample: generate keeps the prompt, crops the context, samples within top_k,
follows its generator, and checks its arguments."""

from functools import partial

import pytest
import torch

from ftrain.models import generate

from _tiny import tiny_gpt
from _tiny import tokens as tiny_tokens

VOCAB = 37  # odd, shared by no other dimension: a shape mix-up shows
make = partial(tiny_gpt, vocab_size=VOCAB)  # make(seed=0, **config_overrides)
tokens = partial(tiny_tokens, vocab=VOCAB)  # tokens(rows=3, length=16, seed=1)


# --- sampling ------------------------------------------------------------------------------------


def test_generate_length_keeps_prompt_and_crops_context():
    model = make().eval()
    prompt = tokens(rows=2, length=5)
    out = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 25) and out.dtype == torch.long  # 25 > seq_len: the context is cropped
    assert torch.equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < VOCAB
    again = generate(model, prompt, 20, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_generate_respects_top_k():
    model = make().eval()
    prompt = tokens(rows=4, length=2)
    greedy = generate(model, prompt, 10, temperature=0.0)
    assert torch.equal(generate(model, prompt, 10, top_k=1), greedy)
    out = generate(model, prompt, 12, temperature=2.0, top_k=3, generator=torch.Generator())
    with torch.no_grad():
        logits = model(out[:, :-1])  # logits[:, t] predicted out[:, t + 1]
    top3 = logits[:, 1:].topk(3, dim=-1).indices  # the steps that sampled
    assert (top3 == out[:, 2:, None]).any(-1).all()
    wide = generate(model, prompt, 12, temperature=2.0, generator=torch.Generator())
    with torch.no_grad():
        top3 = model(wide[:, :-1])[:, 1:].topk(3, dim=-1).indices
    assert not (top3 == wide[:, 2:, None]).any(-1).all()  # without top_k, others do get sampled


def test_generate_warns_in_training_mode_and_checks_arguments():
    model = make().train()
    with pytest.warns(UserWarning, match="eval"):
        generate(model, tokens(length=2), 1)
    model.eval()
    with pytest.raises(ValueError, match="top_k"):
        generate(model, tokens(length=2), 1, top_k=0)
    with pytest.raises(ValueError, match="seq_len"):
        generate(torch.nn.Identity(), tokens(length=2), 1)


def test_docstring_examples_run():
    import doctest

    import ftrain.models.sample

    result = doctest.testmod(ftrain.models.sample)
    assert result.attempted > 0 and result.failed == 0


# --- stopping, chat replies and portable runs ----------------------------------------------------


class Scripted(torch.nn.Module):
    """A 'model' that says ``script`` after a prompt of ``start`` tokens, whatever the prompt:
    its logits put all weight on the script's next token (and it counts its calls)."""

    def __init__(self, script, start, vocab):
        super().__init__()
        self.script, self.start, self.vocab, self.calls = script, start, vocab, 0
        self.config = type("Config", (), {"seq_len": 4096})()

    def forward(self, idx):
        self.calls += 1
        nxt = self.script[min(idx.shape[1] - self.start, len(self.script) - 1)]
        return torch.nn.functional.one_hot(torch.full(idx.shape, nxt), self.vocab).float() * 50


def test_generate_stops_once_every_row_ended_with_a_stop_sequence():
    script = [3, 5, 6, 7, 8, 9]
    model = Scripted(script, start=2, vocab=VOCAB).eval()
    out = generate(model, torch.zeros(2, 2, dtype=torch.long), 10, temperature=0,
                   stop_sequences=[[5, 6], [30]])  # fmt: skip
    assert out[:, 2:].tolist() == [[3, 5, 6]] * 2 and model.calls == 3
    full = generate(model, torch.zeros(1, 2, dtype=torch.long), 6, temperature=0)
    assert full[0, 2:].tolist() == script  # without stops: every token asked for


def test_chat_reply_renders_the_template_and_stops_at_the_end_of_turn(tmp_path):
    """The prompt is the run's template with its generation prompt; the reply ends at ChatML's
    <|im_end|> (the junk after it is never generated), and comes back without it."""
    pytest.importorskip("tokenizers")
    import ftrain as ft
    from ftrain import data
    from ftrain.app.config import TrainConfig
    from ftrain.app.recipes.finetune import LoadedRun, chat_reply

    from _hf import CHATML, IM_END, bpe_tokenizer

    tok = data.load_tokenizer(bpe_tokenizer(tmp_path))
    turn = [{"role": "user", "content": "what is two plus two?"}]
    prompt = tok.encode(data.render_chat(tok, turn, add_generation_prompt=True))
    assert tok.decode(prompt).endswith("assistant\n")  # <|im_start|> is special: dropped
    script = [*tok.encode("two plus two is four."), *tok.encode(IM_END), *tok.encode(" junk")]
    model = Scripted(script, len(prompt), tok.vocab_size)
    loaded = LoadedRun(TrainConfig(), None, model, ft.params_of(model), tok, CHATML)
    reply = chat_reply(loaded, "what is two plus two?", 50, temperature=0)
    assert reply == "two plus two is four."
    assert 0 < len(script) - model.calls  # stopped before the junk


def test_a_run_records_its_model_and_travels(tmp_path, monkeypatch):
    """model.json (absolute path, sha256 of the weights) and chat_template.jinja; `ftrain sample`
    and `export` work from another directory, with --model-dir after the folder moved; a LoRA
    run refuses another base (sample and --resume); `sample --chat` and the default prompt."""
    import json
    import shutil

    pytest.importorskip("transformers")
    from ftrain.app.cli import main

    from _hf import CHATML, arithmetic_chats, tiny_hf_dir, write_jsonl

    monkeypatch.chdir(tmp_path)
    tiny_hf_dir(tmp_path / "m", "gpt2")
    write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats(20))
    flags = ["--model-dir", "m", "--data", "chats.jsonl", "--seq-len", "32", "--batch-size", "4",
             "--lora-rank", "2", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
             "--data-dir", "tokens", "--max-steps", "2", "--out", "run"]  # fmt: skip
    assert main(["train", *flags]) == 0
    recorded = json.loads((tmp_path / "run" / "model.json").read_text())
    assert recorded["model_dir"] == str(tmp_path / "m")
    assert set(recorded["weights_sha256"]) == {"model.safetensors"}
    assert (tmp_path / "run" / "chat_template.jinja").read_text() == CHATML
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # 'm' as given no longer resolves
    sample = ["sample", "--run", str(tmp_path / "run"), "--max-new-tokens", "3"]
    assert main([*sample, "--prompt", "hello"]) == 0
    shutil.move(tmp_path / "m", tmp_path / "moved")
    with pytest.raises(SystemExit, match="pass --model-dir DIR"):
        main([*sample, "--prompt", "hello"])
    assert main([*sample, "--prompt", "hello", "--model-dir", str(tmp_path / "moved")]) == 0
    assert (
        main([*sample, "--chat", "what is 2 plus 2?", "--model-dir", str(tmp_path / "moved")]) == 0
    )
    tiny_hf_dir(tmp_path / "other", "gpt2", seed=1)  # same shapes, other weights
    with pytest.raises(SystemExit, match="not those the run was trained from.*LoRA run's adapt"):
        main([*sample, "--model-dir", str(tmp_path / "other")])
    out = tmp_path / "hf"
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(out),
                 "--model-dir", str(tmp_path / "moved")]) == 0  # fmt: skip
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # --resume on other base weights: refused before a step
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(tmp_path / "moved")
    shutil.copytree(tmp_path / "other", tmp_path / "m")
    resumed = [*flags[:-2], "--out", "run", "--max-steps", "4", "--resume"]
    with pytest.raises(SystemExit, match="--resume: the weights in .* are not those"):
        main(["train", *resumed])


def test_sample_defaults_to_a_chat_turn_on_a_chat_model(tmp_path, monkeypatch, capsys):
    """A byte-level GPT trained on chats records the built-in template: its end-of-run sample
    and `ftrain sample` without a prompt answer a chat turn, not 'def ' continued."""
    import ftrain.app.recipes.finetune as finetune
    from ftrain.app.cli import main
    from ftrain.app.recipes.finetune import DEFAULT_CHAT
    from ftrain.data import BUILTIN_CHAT_TEMPLATE

    from _hf import arithmetic_chats, write_jsonl

    chats = write_jsonl(tmp_path / "c.jsonl", arithmetic_chats(20))
    run = tmp_path / "run"
    flags = ["--d-model", "32", "--n-layer", "1", "--n-head", "2", "--seq-len", "64",
             "--batch-size", "2", "--eval-every", "0", "--sample-tokens", "4", "--no-progress",
             "--data", str(chats), "--data-dir", str(tmp_path / "tokens"), "--max-steps", "1"]  # fmt: skip
    assert main(["train", *flags, "--out", str(run)]) == 0
    assert (run / "sample.txt").read_text().startswith(f"user: {DEFAULT_CHAT}\nassistant: ")
    assert (run / "chat_template.jinja").read_text() == BUILTIN_CHAT_TEMPLATE
    asked = []
    real = finetune.chat_reply

    def spy(loaded, message, *args, **kwargs):  # the real reply, and which message it answered
        asked.append(message)
        return real(loaded, message, *args, **kwargs)

    monkeypatch.setattr(finetune, "chat_reply", spy)
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--max-new-tokens", "4", "--seed", "1"]) == 0
    assert asked == [DEFAULT_CHAT]
    with pytest.raises(SystemExit):  # a prompt to continue or a message to answer, not both
        main(["sample", "--run", str(run), "--prompt", "def ", "--chat", "hi"])
    assert not capsys.readouterr().out.startswith("def ")
