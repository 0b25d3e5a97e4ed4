"""ftrain export: the built-in GPT as GPT-2, a Hugging Face model with LoRA merged, the byte
tokenizer, and the command on a run; each loaded back with transformers' Auto classes."""

import pytest
import torch

import ftrain as ft
from ftrain import tree
from ftrain.data import ByteTokenizer

from _hf import arithmetic_chats, tiny_hf_dir, write_jsonl
from _tiny import lm_batch, tiny_gpt

transformers = pytest.importorskip("transformers")
from ftrain.app.export import byte_tokenizer, export_gpt, export_hf  # noqa: E402
from ftrain.transforms.lora import join_base  # noqa: E402


def perturbed(model, seed=0):
    """The model's params plus noise: zero biases and unit norms would hide a mapping mistake."""
    g = torch.Generator().manual_seed(seed)
    return ft.params_of(model).apply(lambda t: t + 0.05 * torch.randn(t.shape, generator=g))


@pytest.mark.parametrize(
    "kw",
    [{}, {"bias": False, "tie_weights": False, "d_ff": 40, "norm_eps": 1e-6}],
    ids=["tied, biases", "untied, no biases, d_ff, eps"],
)
def test_the_gpt_loads_as_gpt2_with_the_same_logits(tmp_path, kw):
    model = tiny_gpt(vocab_size=257, **kw)
    params = perturbed(model)
    export_gpt(model, params, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(hf).__name__ == "GPT2LMHeadModel"
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    assert (hf(x).logits - ft.apply(model, params, x)).abs().max() <= 1e-5


def test_a_moe_gpt_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"mixture-of-experts GPT \(n_experts=2\)"):
        export_gpt(tiny_gpt(vocab_size=257, n_experts=2), ft.params_of(tiny_gpt()), tmp_path)


def test_the_byte_tokenizer_encodes_and_decodes_as_ftrains(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = ByteTokenizer()
    for text in ["héllo wörld", "  def f(x):\n\treturn x  # 🙂", "\x00\x7f ÿ€", ""]:
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text)
        assert tok.decode(ids) == text
    assert tok.eos_token_id == tok.bos_token_id == ours.eot_id == 256
    assert tok.decode([104, 105, 256], skip_special_tokens=True) == "hi"


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_hf_model_with_lora_merged_loads_with_the_same_logits(tmp_path, name):
    if name == "gpt2":
        model = ft.models.hf.tiny_gpt2(vocab_size=64, n_positions=16, n_embd=32)
        targets = ["c_attn", "c_proj"]
    else:
        model, targets = tiny_llama(), ["q_proj", "v_proj", "down_proj"]

    def loss_fn(params, batch):
        return ft.losses.cross_entropy(ft.apply(model, params, batch["input"]).logits,
                                       batch["target"])  # fmt: skip

    opt = ft.optim.adamw(1e-2)
    lora = ft.lora(model, rank=2, alpha=4, targets=targets)
    step = lora(ft.train_step(loss_fn, opt))
    state = lora.init_state(ft.params_of(model), opt)
    for i in range(3):
        state, _ = step(state, lm_batch(4, seed=i))
    merged = ft.merge_lora(state)
    export_hf(model, merged, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    x = lm_batch(2, seed=9)["input"]
    adapted = ft.apply(model, lora.merged(state.params, state), x).logits
    assert (loaded(x).logits - adapted).abs().max() <= 1e-5
    assert (adapted - model(x).logits).abs().max() > 1e-3  # the adapters changed the model
    with pytest.raises(KeyError, match=r"do not match .*missing.* unexpected \['[\w.]*lora_A'"):
        export_hf(model, state.params, tmp_path / "adapters-only")


def test_ftrain_export_of_a_lora_run(tmp_path, tiny_run):
    """`ftrain export` of the built-in GPT trained with LoRA: the merged model as GPT-2."""
    from ftrain.app.cli import main
    from ftrain.app.config import TrainConfig
    from ftrain.app.recipes import gpt

    run, out = tmp_path / "run", tmp_path / "hf"
    args = [*tiny_run, "--max-steps", "3", "--lora-rank", "2", "--lr", "0.05", "--warmup", "0"]
    assert main(["train", *args, "--out", str(run)]) == 0
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    state = ft.load(ft.latest_checkpoint(run))
    assert "base" not in state.extra["lora"].keys()  # the checkpoint: adapters, not the base
    model = gpt.build_model(TrainConfig(d_model=32, n_layer=2, n_head=2, seq_len=32))
    merged = ft.merge_lora(join_base(state, ft.params_of(model)))  # the base: the seed's init
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    x = lm_batch(2, vocab=257, length=32)["input"]
    assert (loaded(x).logits - ft.apply(model, merged, x)).abs().max() <= 1e-5
    assert not torch.equal(merged["blocks", "0", "attn", "qkv", "weight"],
                           ft.params_of(model)["blocks", "0", "attn", "qkv", "weight"])  # fmt: skip
    with pytest.raises(SystemExit, match="not a LoRA run of a --model-dir model"):
        main(["export", "--run", str(run), "--out", str(tmp_path / "ad"), "--adapter"])


def test_export_refuses_a_run_without_checkpoints(tmp_path):
    from ftrain.app.cli import main

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no checkpoint in"):
        main(["export", "--run", str(tmp_path / "empty"), "--out", str(tmp_path / "hf")])


# -- a --model-dir run with LoRA, exported ------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_model_dir_lora_lowers_the_loss_resumes_and_exports(tmp_path, kind):
    """`ftrain train --model-dir M --data D.jsonl --lora-rank 4` lowers the loss, resumes bit for
    bit, and `ftrain export` writes a folder that loads with the merged model's logits."""
    import json

    from ftrain.app.cli import main

    model_dir = tiny_hf_dir(tmp_path / kind, kind)
    chats = write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats())
    flags = ["--model-dir", str(model_dir), "--data", str(chats), "--seq-len", "32",
             "--batch-size", "8", "--lr", "1e-2", "--warmup", "2", "--log-every", "1",
             "--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--lora-rank", "4",
             "--data-dir", str(tmp_path / "tokens"), "--save-every", "10"]  # fmt: skip
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *flags, "--max-steps", "20", "--out", str(a)]) == 0
    records = map(json.loads, (a / "metrics.jsonl").read_text().splitlines())
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.2, losses
    assert main(["train", *flags, "--max-steps", "10", "--decay-steps", "20", "--out", str(b)]) == 0
    assert main(["train", *flags, "--max-steps", "20", "--out", str(b), "--resume"]) == 0
    ta = ft.load(ft.latest_checkpoint(a)).to_tensordict().flatten_keys(".")
    tb = ft.load(ft.latest_checkpoint(b)).to_tensordict().flatten_keys(".")
    assert sorted(ta.keys()) == sorted(tb.keys())
    assert all(torch.equal(ta[k], tb[k]) for k in ta.keys())
    out = tmp_path / "hf"
    assert main(["export", "--run", str(a), "--out", str(out)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    state = ft.load(ft.latest_checkpoint(a))
    merged = ft.merge_lora(join_base(state, ft.params_of(model)))
    x = torch.tensor([tok("what is 3 plus 3?")["input_ids"]])
    want = ft.apply(model, merged, x).logits
    assert (loaded(x).logits - want).abs().max() <= 1e-5
    # the checkpoint holds the adapters and their optimizer state, not the frozen base
    leaves = state.to_tensordict().flatten_keys(".").values()
    saved = sum(t.numel() * t.element_size() for t in leaves)
    adapters = sum(t.numel() * t.element_size() for t in tree.to_flat(state.params).values())
    assert "base" not in state.extra["lora"].keys()
    assert 3 * adapters <= saved <= 3 * adapters + 4096, (saved, adapters)  # + adamw's 2 moments
    # the adapters as a PEFT folder: peft loads them onto the base with ftrain's logits
    peft = pytest.importorskip("peft")
    assert main(["export", "--run", str(a), "--out", str(tmp_path / "ad"), "--adapter"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "ad").iterdir()
    }
    base_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base_model, tmp_path / "ad").eval()(x).logits
    assert (adapted - want).abs().max() <= 1e-5
    assert (want - model(x).logits).abs().max() > 1e-3  # the adapters changed the model
    # consolidate of a LoRA run refuses, naming the command that merges
    with pytest.raises(SystemExit):
        main(["consolidate", "--run", str(a), "--out", str(tmp_path / "c")])


def test_a_bf16_model_without_a_template_needs_one_chosen_and_its_export_keeps_all(
    tmp_path, capsys
):
    """A bf16 folder with use_cache on and no chat template: chat data is refused until
    --chat-template names one (a usage error naming the flag); the export then has the base's
    dtype, its use_cache and the chosen template, which apply_chat_template renders."""
    import json

    from ftrain.app.cli import main
    from ftrain.data import BUILTIN_CHAT_TEMPLATE, ByteTokenizer, render_chat
    from ftrain.models.hf import saved_dtype

    folder = tiny_hf_dir(tmp_path / "m", "llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(folder)
    chats = write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats(20))
    run = tmp_path / "run"
    flags = ["train", "--model-dir", str(folder), "--data", str(chats), "--seq-len", "32",
             "--batch-size", "4", "--max-steps", "1", "--eval-every", "0", "--sample-tokens", "0",
             "--no-progress", "--data-dir", str(tmp_path / "tokens"), "--out", str(run)]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "has none; choose one: --chat-template builtin" in err
    assert main([*flags, "--chat-template", "builtin"]) == 0
    out = tmp_path / "hf"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert saved_dtype(folder) == saved_dtype(out) == torch.bfloat16
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.use_cache is True and loaded.dtype == torch.bfloat16
    chat = arithmetic_chats(1)[0]["messages"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == BUILTIN_CHAT_TEMPLATE
    assert tok.apply_chat_template(chat, tokenize=False) == render_chat(ByteTokenizer(), chat)
    # a full fine-tune's checkpoint holds every weight: another folder is a note, not a refusal
    other = tiny_hf_dir(tmp_path / "other", "llama", seed=1)
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "hf2"),
                 "--model-dir", str(other)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "are not those the run was trained from" in err and "only the folder's config" in err
