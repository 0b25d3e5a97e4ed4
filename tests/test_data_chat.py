"""Tests for ftrain.data.chat: conversations rendered with a chat template, and the loss mask on
the assistant's tokens, checked against where the replies are in the text."""

import numpy as np
import pytest

from ftrain import data

from _hf import IM_END, bpe_tokenizer

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "four."},
    {"role": "user", "content": "and hello?"},
    {"role": "assistant", "content": "hello world"},
]


def test_builtin_template_renders_as_documented():
    text = data.render_chat(data.ByteTokenizer(), CHAT[1:3])
    assert text == "<|user|>\nwhat is two plus two?<|end|>\n<|assistant|>\nfour.<|end|>\n"
    prompt = data.render_chat(data.ByteTokenizer(), CHAT[1:2], add_generation_prompt=True)
    assert prompt.endswith("<|end|>\n<|assistant|>\n")


def test_byte_mask_covers_each_reply_and_its_end_marker_only():
    tok = data.ByteTokenizer()
    ids, mask = data.encode_chat(tok, CHAT)
    text = data.render_chat(tok, CHAT)
    assert tok.decode(ids) == text
    want = np.zeros(len(text.encode()), dtype=bool)  # by hand: each reply + "<|end|>\n"
    for reply in ("four.", "hello world"):
        start = text.index(f"<|assistant|>\n{reply}") + len("<|assistant|>\n")
        want[start : start + len(reply) + len("<|end|>\n")] = True
    assert np.array_equal(mask, want)


def test_hf_tokenizer_mask_uses_its_template_and_offsets(tmp_path):
    pytest.importorskip("tokenizers")
    tok = data.load_tokenizer(bpe_tokenizer(tmp_path))
    ids, mask = data.encode_chat(tok, CHAT)
    assert ids.tolist() == tok.encode(data.render_chat(tok, CHAT))  # one encode of the whole
    said = tok.backend.decode(ids[mask].tolist(), skip_special_tokens=False)
    assert said == f"four.{IM_END}\nhello world{IM_END}\n"


def test_a_template_that_is_not_prefix_stable_is_refused():
    class Odd:
        chat_template = (
            "{{ messages | length }} {% for m in messages %}{{ m['content'] }}{% endfor %}"
        )

        def encode(self, text):
            return list(text.encode())

    with pytest.raises(ValueError, match="chat template does not render"):
        data.encode_chat(Odd(), CHAT)
