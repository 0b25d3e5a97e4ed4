"""ftrain.data tokens: ByteTokenizer, build_token_dataset, TokenDataset, DocumentDataset, corpora."""

import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from ftrain import data
from ftrain.data.tokens import smallest_dtype

TOK = data.ByteTokenizer()


def _text(rng: random.Random, n: int) -> str:
    words = ["def", "return", "x", "élan", "€", "self", "\n", "    ", "import", "🙂", "=", "(", ")"]
    return " ".join(rng.choice(words) for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[Path], list[str]]:
    """40 UTF-8 files of varied length, plus one undecodable, one empty and one missing file."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    paths, texts = [], []
    for i in range(40):
        text = _text(rng, rng.choice([3, 20, 80, 300]))
        p = root / f"doc{i:02d}.py"
        p.write_text(text, encoding="utf-8")
        paths.append(p)
        texts.append(text)
    (root / "latin1.py").write_bytes("café = 1\n".encode("latin-1"))
    (root / "empty.py").write_text("")
    bad = [root / "latin1.py", root / "empty.py", root / "missing.py"]
    return paths[:20] + bad + paths[20:], texts


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("built")
    data.build_token_dataset(corpus[0], out, progress=False)
    return out


def _docs(path: Path) -> list[np.ndarray]:
    meta = json.loads((path / "meta.json").read_text())
    tokens = np.fromfile(path / "tokens.bin", dtype=meta["dtype"])
    offsets = np.load(path / "docs.npy")
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


# -- tokenizer -----------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_and_fits_uint16():
    text = "héllo\n\t€ 🙂 \x00"
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text
    assert TOK.decode(torch.tensor(ids + [TOK.eot_id])) == text  # eot dropped
    assert TOK.decode([0xC3]) == "\ufffd"  # a cut multi-byte char does not raise
    assert np.array_equal(TOK.encode_array(text), ids)
    assert (TOK.vocab_size, TOK.eot_id) == (257, 256)
    assert smallest_dtype(TOK.vocab_size) == np.uint16
    assert [smallest_dtype(v) for v in (256, 65536, 65537)] == [np.uint8, np.uint16, np.uint32]


# -- build -------------------------------------------------------------------------------------


def test_build_writes_each_document_then_eot(corpus, built):
    _, texts = corpus
    docs = _docs(built)
    assert len(docs) == len(texts)
    for doc, text in zip(docs, texts, strict=True):
        assert doc.dtype == np.uint16
        assert doc[-1] == TOK.eot_id
        assert doc[:-1].tolist() == list(text.encode("utf-8"))


def test_build_skips_and_counts_bad_files(corpus, built):
    meta = json.loads((built / "meta.json").read_text())
    assert meta["skipped"] == {"undecodable": 1, "unreadable": 1, "empty": 1}
    assert sorted(Path(f).name for f in meta["skipped_files"]) == [
        "empty.py",
        "latin1.py",
        "missing.py",
    ]
    summary = data.build_token_dataset(corpus[0], built, progress=False)
    assert summary.skipped == meta["skipped"]
    assert summary.num_docs == 40 and summary.dtype == "uint16"


def test_a_text_with_a_lone_surrogate_is_skipped_as_undecodable(tmp_path):
    with pytest.raises(UnicodeEncodeError):
        TOK.encode("a\ud800")  # as the ByteTokenizer docstring says
    s = data.build_token_dataset([("ok", "hi"), ("bad", "a\ud800b")], tmp_path, progress=False)
    assert s.num_docs == 1 and s.skipped["undecodable"] == 1 and s.skipped_files == ("bad",)
    assert _docs(tmp_path)[0].tolist() == [*b"hi", TOK.eot_id]


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


def test_build_with_other_tokenizers(tmp_path):
    s = data.build_token_dataset([("a", "a€")], tmp_path / "l", _ListTokenizer(), progress=False)
    assert (s.eot_id, s.vocab_size, s.dtype) == (ord("€") + 1, ord("€") + 2, "uint16")
    assert _docs(tmp_path / "l")[0].tolist() == [ord("a"), ord("€"), ord("€") + 1]
    s = data.build_token_dataset([("a", "xy")], tmp_path / "b", _BigTokenizer(), progress=False)
    assert s.dtype == "uint32" and _docs(tmp_path / "b")[0][-1] == 69_999

    class Bad(_BigTokenizer):
        vocab_size = 100

    with pytest.raises(ValueError, match="produced id .* outside"):
        data.build_token_dataset([("a", "xy")], tmp_path / "x", Bad(), progress=False)


# -- TokenDataset --------------------------------------------------------------------------------


def _stream(built: Path, ds: data.TokenDataset) -> np.ndarray:
    """Reference: the split's documents joined in the dataset's document order, built by hand."""
    docs = _docs(built)[ds.doc_range.start : ds.doc_range.stop]
    return np.concatenate([docs[int(d)] for d in ds._doc_idx]).astype(np.int64)


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_token_dataset_samples_are_windows_of_the_joined_stream(built, seq_len):
    ds = data.TokenDataset(built, seq_len, seed=3, splits=(1, 0, 0))
    stream = _stream(built, ds)
    n_docs = len(ds.doc_range)
    assert sorted(ds._doc_idx.tolist()) == list(range(n_docs))  # one epoch: each document once
    assert len(ds) == (len(stream) - 1) // seq_len
    starts = []
    for i in range(len(ds)):
        ex = ds[i]
        assert ex["input"].dtype == torch.int64 and ex["input"].shape == (seq_len,)
        assert torch.equal(ex["input"][1:], ex["target"][:-1])
        window = np.concatenate([ex["input"].numpy(), ex["target"][-1:].numpy()])
        start = int(ds._shuffle_idx[i]) * seq_len
        assert np.array_equal(window, stream[start : start + seq_len + 1])
        starts.append(start)
    # every window start once: every token after the first is predicted exactly once per epoch
    assert sorted(starts) == list(range(0, len(ds) * seq_len, seq_len))


def test_token_dataset_is_deterministic_by_seed_and_cached(built):
    a = data.TokenDataset(built, 16, seed=1)
    files = sorted((built / "index").glob("train-L16-seed1-*"))
    assert len(files) == 3
    stamps = [f.stat().st_mtime_ns for f in files]
    b = data.TokenDataset(built, 16, seed=1)
    assert [f.stat().st_mtime_ns for f in files] == stamps  # loaded, not rebuilt
    c = data.TokenDataset(built, 16, seed=2)
    same = all(torch.equal(a[i]["input"], b[i]["input"]) for i in range(len(a)))
    differs = any(not torch.equal(a[i]["input"], c[i]["input"]) for i in range(len(a)))
    assert same and differs
    # a damaged cache file is rebuilt, to the same content
    expected = [a[i]["input"] for i in range(len(a))]
    del a, b  # they map the file we are about to damage
    files[0].write_bytes(b"garbage")
    d = data.TokenDataset(built, 16, seed=1)
    assert all(torch.equal(x, d[i]["input"]) for i, x in enumerate(expected))


def test_token_dataset_indexes_enough_epochs(built):
    one = data.TokenDataset(built, 32, seed=0)
    need = 2 * len(one) + 5
    ds = data.TokenDataset(built, 32, seed=0, num_samples=need)
    assert ds.num_epochs == 3 and len(ds) >= need
    n_docs = len(ds.doc_range)
    epochs = ds._doc_idx.reshape(3, n_docs)
    assert all(sorted(e.tolist()) == list(range(n_docs)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])  # a new document order each epoch
    assert np.array_equal(np.sort(ds._shuffle_idx), np.arange(len(ds)))
    with pytest.raises(ValueError, match="not both"):
        data.TokenDataset(built, 32, num_epochs=2, num_samples=10)


def test_token_dataset_splits(built):
    ranges = data.split_ranges(40, (969, 30, 1))
    assert [len(r) for r in ranges.values()] == [39, 1, 0]  # 38.76, 1.2, 0.04 rounded
    train = data.TokenDataset(built, 4, split="train")
    valid = data.TokenDataset(built, 4, split="valid")
    assert train.doc_range == range(0, 39) and valid.doc_range == range(39, 40)
    with pytest.raises(ValueError, match="split 'test' is empty"):
        data.TokenDataset(built, 4, split="test")
    test = data.TokenDataset(built, 4, split="test", splits=(8, 1, 1))
    assert test.doc_range == range(36, 40)
    with pytest.raises(ValueError, match="split must be one of"):
        data.TokenDataset(built, 4, split="validation")


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
@pytest.mark.parametrize("splits", [(969, 30, 1), (1, 1, 1), (8, 0, 2)])
def test_split_ranges_cover_every_document_once(n, splits):
    ranges = list(data.split_ranges(n, splits).values())
    assert [i for r in ranges for i in r] == list(range(n))
    if n >= 100:  # proportional to the weights, to within a document of rounding
        for r, w in zip(ranges, splits, strict=True):
            assert abs(len(r) - n * w / sum(splits)) <= 1


def test_token_dataset_refuses_seq_len_longer_than_the_corpus(tmp_path):
    data.build_token_dataset([("a", "abc"), ("b", "de")], tmp_path, progress=False)
    assert len(data.TokenDataset(tmp_path, 6, splits=(1, 0, 0))) == 1  # 7 tokens: one sample
    with pytest.raises(ValueError, match="seq_len=7 is longer than split 'train'.*7 tokens"):
        data.TokenDataset(tmp_path, 7, splits=(1, 0, 0))
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        data.TokenDataset(tmp_path, 0)


def test_token_dataset_refuses_an_index_that_does_not_match_its_token_file(tmp_path):
    srcs = [("a", "hello world"), ("b", "more text here")]
    out = tmp_path / "d"
    data.build_token_dataset(srcs, out, progress=False)
    tokens = out / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-4])  # truncated token file
    with pytest.raises(ValueError, match="tokens.bin holds .* bytes.*build_token_dataset"):
        data.TokenDataset(out, 4)
    # the builder sees the damage and rebuilds, after which the dataset opens again
    assert not data.build_token_dataset(srcs, out, progress=False).cached
    assert len(data.TokenDataset(out, 4)) > 0
    # a document index that was swapped out
    np.save(out / "docs.npy", np.array([0, 3, 27], dtype=np.int64))
    with pytest.raises(ValueError, match="docs.npy does not match the checksum"):
        data.TokenDataset(out, 4)
    data.build_token_dataset(srcs, out, progress=False)
    # same size, same checksum, but the tokens moved: documents no longer end with eot
    raw = np.fromfile(tokens, dtype=np.uint16)
    np.roll(raw, 1).tofile(tokens)
    with pytest.raises(ValueError, match="does not end with eot"):
        data.DocumentDataset(out, 4)
    (out / "meta.json").unlink()
    with pytest.raises(ValueError, match="meta.json is missing"):
        data.TokenDataset(out, 4)


def test_token_dataset_pickles_without_its_tokens(built):
    import pickle  # only to check that process workers can receive a dataset

    ds = data.TokenDataset(built, 8)
    ds[0]  # opens the memory map
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # file names and the small document index, not the data
    again = pickle.loads(blob)
    assert torch.equal(again[5]["input"], ds[5]["input"])


# -- DocumentDataset -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_len", [1, 5, 1000])
def test_document_dataset_pieces_cover_each_document(corpus, built, max_len):
    ds = data.DocumentDataset(built, max_len, splits=(1, 0, 0))
    docs = _docs(built)
    got: list[list[int]] = [[] for _ in docs]
    doc_of = np.repeat(np.arange(len(docs)), [-(-(len(d) - 1) // max_len) for d in docs])
    assert len(ds) == len(doc_of)
    for i in range(len(ds)):
        ex = ds[i]
        n = int(ds.lengths[i])
        assert 1 <= n <= max_len and ex["input"].shape == ex["target"].shape == (n,)
        assert torch.equal(ex["input"][1:], ex["target"][:-1])
        d = int(doc_of[i])
        if not got[d]:
            got[d].append(int(ex["input"][0]))
        got[d].extend(ex["target"].tolist())
    assert all(g == d.tolist() for g, d in zip(got, docs, strict=True))


# -- corpora ---------------------------------------------------------------------------------------


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


def test_real_stdlib_corpus(tmp_path):
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
    for doc, text in zip(_docs(tmp_path / "small"), texts, strict=True):
        assert TOK.decode(doc) == text
    full = data.build_token_dataset(files, tmp_path / "full", progress=False)
    assert full.seconds < 30 and full.num_tokens > 1_000_000
    valid = data.TokenDataset(tmp_path / "full", 128, seed=0, split="valid")
    train = data.TokenDataset(tmp_path / "full", 128, seed=0, split="train")
    assert len(valid.doc_range) == round(0.03 * full.num_docs) and len(valid) > 100
    assert 10 < len(train) / len(valid) < 100  # about 969:30 of the tokens, as of the documents
    code = TOK.decode(valid[0]["input"])
    assert len(code) > 0
