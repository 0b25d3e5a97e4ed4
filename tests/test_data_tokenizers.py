"""Tests for ftrain.data.tokenizers: ByteTokenizer."""

import numpy as np
import torch

from ftrain import data

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
