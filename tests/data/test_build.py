"""Tests for ftrain.data.build: token files, skipped sources, caching, tokenizers, and a rebuild
interrupted at each rename, which must never be taken for a whole build."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from ftrain import data
from ftrain.data.build import check_build, read_meta, smallest_dtype

TOK = data.ByteTokenizer()


def test_smallest_dtype_holds_every_id():
    assert smallest_dtype(TOK.vocab_size) == np.uint16
    assert [smallest_dtype(v) for v in (256, 65536, 65537)] == [np.uint8, np.uint16, np.uint32]
    assert smallest_dtype(2**32 + 1) == np.int64


def test_build_writes_each_document_then_eot(token_corpus, token_build, read_docs):
    _, texts = token_corpus
    docs = read_docs(token_build)
    assert len(docs) == len(texts)
    for doc, text in zip(docs, texts, strict=True):
        assert doc.dtype == np.uint16
        assert doc[-1] == TOK.eot_id
        assert doc[:-1].tolist() == list(text.encode("utf-8"))


def test_build_skips_and_counts_bad_files(token_corpus, token_build):
    meta = json.loads((token_build / "meta.json").read_text())
    assert meta["skipped"] == {"undecodable": 1, "unreadable": 1, "empty": 1, "invalid": 0}
    assert sorted(Path(f).name for f in meta["skipped_files"]) == [
        "empty.py",
        "latin1.py",
        "missing.py",
    ]
    summary = data.build_token_dataset(token_corpus[0], token_build, progress=False)
    assert summary.skipped == meta["skipped"]
    assert summary.num_docs == 40 and summary.dtype == "uint16"


def test_a_text_with_a_lone_surrogate_is_skipped_as_undecodable(tmp_path, read_docs):
    with pytest.raises(UnicodeEncodeError):
        TOK.encode("a\ud800")  # as the ByteTokenizer docstring says
    s = data.build_token_dataset([("ok", "hi"), ("bad", "a\ud800b")], tmp_path, progress=False)
    assert s.num_docs == 1 and s.skipped["undecodable"] == 1 and s.skipped_files == ("bad",)
    assert read_docs(tmp_path)[0].tolist() == [*b"hi", TOK.eot_id]


def test_build_is_cached_and_rebuilt_when_a_source_changes(tmp_path):
    src = tmp_path / "a.py"
    src.write_text("x = 1\n")
    out = tmp_path / "out"
    first = data.build_token_dataset([src], out, progress=False)
    stamp = (out / "tokens.bin").stat().st_mtime_ns
    again = data.build_token_dataset([src], out, progress=False)
    assert not first.cached and again.cached
    assert (out / "tokens.bin").stat().st_mtime_ns == stamp  # not rewritten
    src.write_text("x = 22\n")
    changed = data.build_token_dataset([src], out, progress=False)
    assert not changed.cached and changed.num_tokens == len("x = 22\n") + 1
    # a different tokenizer is a different build too
    other = data.build_token_dataset([src], out, _ListTokenizer(), progress=False)
    assert not other.cached


def test_build_texts_in_memory_and_empty_corpus(tmp_path):
    s = data.build_token_dataset([("a", "ab"), ("b", "c")], tmp_path / "m", progress=False)
    assert (s.num_docs, s.num_tokens) == (2, 5)
    with pytest.raises(ValueError, match="corpus is empty"):
        data.build_token_dataset([], tmp_path / "e", progress=False)
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="corpus is empty.*undecodable"):
        data.build_token_dataset([bad, ("blank", "")], tmp_path / "e", progress=False)
    with pytest.raises(TypeError, match="wrap it in a list"):
        data.build_token_dataset(str(bad), tmp_path / "e", progress=False)


class _ListTokenizer:
    """encode only: no vocab_size, no eot_id."""

    def encode(self, text):
        return [ord(c) for c in text]


class _BigTokenizer:
    vocab_size = 70_000
    eot_id = 69_999

    def encode(self, text):
        return [60_000 + ord(c) % 100 for c in text]


def test_build_with_other_tokenizers(tmp_path, read_docs):
    s = data.build_token_dataset([("a", "a€")], tmp_path / "l", _ListTokenizer(), progress=False)
    assert (s.eot_id, s.vocab_size, s.dtype) == (ord("€") + 1, ord("€") + 2, "uint16")
    assert read_docs(tmp_path / "l")[0].tolist() == [ord("a"), ord("€"), ord("€") + 1]
    s = data.build_token_dataset([("a", "xy")], tmp_path / "b", _BigTokenizer(), progress=False)
    assert s.dtype == "uint32" and read_docs(tmp_path / "b")[0][-1] == 69_999

    class Bad(_BigTokenizer):
        vocab_size = 100

    with pytest.raises(ValueError, match="produced id .* outside"):
        data.build_token_dataset([("a", "xy")], tmp_path / "x", Bad(), progress=False)


def test_a_failed_tokenizer_leaves_the_previous_build_whole(tmp_path):
    srcs = [("a", "some text")]
    data.build_token_dataset(srcs, tmp_path, progress=False)

    class Failing:
        def encode(self, text):
            raise RuntimeError("tokenizer failed")

    with pytest.raises(RuntimeError, match="tokenizer failed"):
        data.build_token_dataset([("b", "other")], tmp_path, Failing(), progress=False)
    assert data.build_token_dataset(srcs, tmp_path, progress=False).cached
    assert sorted(os.listdir(tmp_path)) == ["docs.npy", "meta.json", "tokens.bin"]


@pytest.mark.parametrize("point", [1, 2, 3], ids=["docs.npy", "tokens.bin", "meta.json"])
def test_a_rebuild_killed_at_each_rename_is_not_a_build(tmp_path, monkeypatch, point, read_docs):
    old, new = [("a", "old text")], [("a", "new and longer text"), ("b", "more")]
    data.build_token_dataset(old, tmp_path, progress=False)
    data.TokenDataset(tmp_path, 2, splits=(1, 0, 0))  # an index cache of the old build
    real, renamed = os.replace, []

    def dying(src, dst):
        renamed.append(Path(dst).name)
        if len(renamed) >= point:
            raise OSError("simulated crash")
        return real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", dying)
        with pytest.raises(OSError, match="simulated crash"):
            data.build_token_dataset(new, tmp_path, progress=False)
    assert renamed == ["docs.npy", "tokens.bin", "meta.json"][:point]
    # meta.json went first: the folder is no build (old index gone, no temporary file left)
    assert sorted(os.listdir(tmp_path)) == ["docs.npy", "tokens.bin"]
    assert check_build(tmp_path, read_meta(tmp_path)) == "meta.json is missing or not valid JSON"
    with pytest.raises(ValueError, match="meta.json is missing"):
        data.TokenDataset(tmp_path, 2)
    rebuilt = data.build_token_dataset(new, tmp_path, progress=False)
    assert not rebuilt.cached and check_build(tmp_path, read_meta(tmp_path)) is None
    assert [d.tolist() for d in read_docs(tmp_path)] == [
        [*text.encode(), TOK.eot_id] for _, text in new
    ]


def test_bad_data_is_counted_and_listed_with_file_and_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    src = tmp_path / "d.jsonl"
    src.write_text(
        "\n".join([json.dumps(good), "{bad", json.dumps({"x": 1}), json.dumps({"text": "t"})])
    )
    (tmp_path / "empty.jsonl").write_text("")
    s = data.build_token_dataset([src, tmp_path / "empty.jsonl"], tmp_path / "b", progress=False)
    assert s.num_docs == 2 and s.masked
    assert s.skipped == {"undecodable": 0, "unreadable": 0, "empty": 1, "invalid": 2}
    assert s.problems[0].startswith(f"{src}:2: not JSON")
    assert s.problems[1].startswith(f"{src}:3: missing field 'text', 'messages'")
    assert s.problems[2] == f"{tmp_path / 'empty.jsonl'}: the file is empty"
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["problems"] == list(s.problems) and meta["masked"]
    (tmp_path / "b" / "mask.bin").unlink()  # a masked build without its mask is not whole
    with pytest.raises(ValueError, match="mask.bin is missing"):
        data.TokenDataset(tmp_path / "b", 2, splits=(1, 0, 0))
    with pytest.raises(
        ValueError, match="corpus is empty.*the file is empty.*x.jsonl: No such file"
    ):
        data.build_token_dataset(
            [tmp_path / "empty.jsonl", (src.with_name("x.jsonl"))], tmp_path / "c", progress=False
        )
