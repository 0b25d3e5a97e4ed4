"""Tests for ftrain.data.tokenizers: ByteTokenizer and load_tokenizer (a model directory's)."""

import json

import numpy as np
import pytest
import torch

from ftrain import data

from _hf import CHATML, EOS, IM_END, bpe_tokenizer

TOK = data.ByteTokenizer()


def test_byte_tokenizer_round_trips():
    text = "héllo\n\t€ 🙂 \x00"
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    assert TOK.decode(torch.tensor(ids + [TOK.eot_id])) == text  # eot dropped
    assert TOK.decode([0xC3]) == "\ufffd"  # a cut multi-byte char does not raise
    assert np.array_equal(TOK.encode_array(text), ids)
    assert (TOK.vocab_size, TOK.eot_id) == (257, 256)  # bytes and eot: uint16 token files


def test_load_tokenizer_reads_tokenizer_json_and_config(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    folder = bpe_tokenizer(tmp_path / "m")
    tok = data.load_tokenizer(folder)
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))  # the library itself
    text = "the quick brown fox says hello"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(torch.tensor(tok.encode(text) + [tok.eot_id])) == text  # eos dropped
    assert np.array_equal(tok.encode_array(text), tok.encode(text))
    assert tok.eot_id == ref.token_to_id(EOS)
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    assert tok.chat_template == CHATML
    ids, offsets = tok.encode_with_offsets(IM_END + "hi")
    assert ids[0] == ref.token_to_id(IM_END) and offsets[0] == (0, len(IM_END))
    before = tok.fingerprint
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "{{ messages }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    changed = data.load_tokenizer(folder)
    assert changed.chat_template == "{{ messages }}" and changed.fingerprint != before


def test_load_tokenizer_errors_name_the_folder_and_the_fix(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json.*save_pretrained"):
        data.load_tokenizer(tmp_path)
    folder = bpe_tokenizer(tmp_path / "m")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token.*'<nope>'"):
        data.load_tokenizer(folder)
