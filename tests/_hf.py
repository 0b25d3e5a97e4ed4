"""Tiny Hugging Face model directories, built offline for the tests (no hub, ever).

    tok_dir = bpe_tokenizer(tmp_path / "m")                 # tokenizer.json + tokenizer_config.json
    model_dir = tiny_hf_dir(tmp_path / "m", "llama")        # + config.json + model.safetensors

The tokenizer is a byte-level BPE trained here with ``tokenizers`` on ``CORPUS``, with the ChatML
special tokens and chat template; the model is a freshly initialized GPT-2 or Llama of width 32
whose vocabulary is the tokenizer's. Both are what ``ftrain train --model-dir`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML: what many chat models use. The assistant's turn ends with <|im_end|>, which it learns.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "a stitch in time saves nine; the early bird catches the worm.",
    "user: what is two plus two? assistant: two plus two is four.",
    "def add(a, b):\n    return a + b\n",
    "hello world, hello tokenizer, hello model.",
] * 20


def bpe_tokenizer(folder: str | Path, vocab_size: int = 320) -> Path:
    """Train a byte-level BPE on ``CORPUS`` and save it in ``folder`` as a model directory's
    tokenizer (``tokenizer.json``, and ``tokenizer_config.json`` with the special tokens and the
    ChatML chat template). Returns ``folder``. Deterministic for a given tokenizers version."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": EOS, "bos_token": EOS, "pad_token": EOS, "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tiny_config(kind: str, vocab_size: int, *, n_positions: int = 64):
    """A ``GPT2Config`` or ``LlamaConfig`` (``kind`` "gpt2" or "llama") of width 32, 2 layers,
    no dropout, no KV cache; BOS and EOS are id 0, the tokenizer's ``<|endoftext|>``."""
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if kind == "llama":
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=n_positions,
            use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    raise ValueError(f"tiny_config: kind must be 'gpt2' or 'llama', got {kind!r}")


def tiny_hf_dir(folder: str | Path, kind: str = "gpt2", *, seed: int = 0) -> Path:
    """A model directory as ``save_pretrained`` writes it: the BPE tokenizer of
    :func:`bpe_tokenizer` and a freshly initialized tiny ``kind`` model ("gpt2" or "llama") of
    the tokenizer's vocabulary, seeded by ``seed``. Returns ``folder``."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    folder = bpe_tokenizer(folder)
    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab))
    model.save_pretrained(folder)
    return folder


def arithmetic_chats(n: int = 60) -> list[dict]:
    """``n`` one-turn chats (a user's sum, the assistant's answer): data a tiny model learns."""
    return [
        {"messages": [
            {"role": "user", "content": f"what is {i} plus {i}?"},
            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
        ]}
        for i in range(n)
    ]  # fmt: skip


def write_jsonl(path: str | Path, records: list) -> Path:
    """``records`` one JSON value a line (a str record is written as it is: a bad line)."""
    path = Path(path)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def packed_and_alone(logits_fn, example: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-token losses of a packed row (``example`` from ``TokenDataset(..., pack=True)``) run
    as one row, and the same tokens' losses when each document of the row (each run of positions
    from 0) runs alone; and the number of documents. ``logits_fn(input (1, t), position_ids or
    None) -> (1, t, vocab)``."""
    import torch.nn.functional as F

    x, y, pos = example["input"], example["target"], example["position_ids"]
    with torch.no_grad():
        packed = F.cross_entropy(logits_fn(x[None], pos[None])[0], y, reduction="none")
        starts = [*(pos == 0).nonzero().flatten().tolist(), len(x)]
        alone = torch.cat([
            F.cross_entropy(logits_fn(x[a:b][None], None)[0], y[a:b], reduction="none")
            for a, b in zip(starts[:-1], starts[1:])
        ])  # fmt: skip
    return packed, alone, len(starts) - 1
