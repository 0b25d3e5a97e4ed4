"""Tests for ftrain.data.corpora: the standard-library corpus, listed and built."""

import sysconfig
from pathlib import Path

from ftrain import data

TOK = data.ByteTokenizer()


def test_python_stdlib_lists_the_standard_library():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = data.corpora.python_stdlib()
    assert files == data.corpora.python_stdlib()  # a fixed order
    assert len(files) > 300 and all(f.suffix == ".py" and f.is_file() for f in files)
    rel = [f.relative_to(stdlib).parts for f in files]
    assert not any(
        "site-packages" in p or "test" in p[:-1] or p[-1].startswith("test_") for p in rel
    )
    assert stdlib / "os.py" in files
    assert files != sorted(files)  # hashed order: splits sample the whole library
    everything = data.corpora.python_stdlib(include_tests=True)
    assert set(files) < set(everything)


def test_real_stdlib_corpus(tmp_path, read_docs):
    """The built-in corpus builds in seconds; valid split is non-empty; samples decode to source."""
    files = data.corpora.python_stdlib()
    small = files[:60]
    s = data.build_token_dataset(small, tmp_path / "small", progress=False)
    texts = []
    for f in small:
        t = f.read_bytes().decode("utf-8")
        if t:
            texts.append(t)
    assert s.num_docs == len(texts) and s.num_tokens == sum(len(t.encode()) + 1 for t in texts)
    for doc, text in zip(read_docs(tmp_path / "small"), texts, strict=True):
        assert TOK.decode(doc) == text
    full = data.build_token_dataset(files, tmp_path / "full", progress=False)
    assert full.seconds < 30 and full.num_tokens > 1_000_000
    valid = data.TokenDataset(tmp_path / "full", 128, seed=0, split="valid")
    train = data.TokenDataset(tmp_path / "full", 128, seed=0, split="train")
    assert len(valid.doc_range) == round(0.03 * full.num_docs) and len(valid) > 100
    assert 10 < len(train) / len(valid) < 100  # about 969:30 of the tokens, as of the documents
    code = TOK.decode(valid[0]["input"])
    assert len(code) > 0
