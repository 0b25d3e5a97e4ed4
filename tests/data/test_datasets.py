"""Tests for ftrain.data.datasets: TokenDataset (Megatron-style windows, splits, epochs, index
cache) and DocumentDataset, against the build's documents read by hand."""

import json

import numpy as np
import pytest
import torch

from ftrain import data


def _stream(docs: list[np.ndarray], ds: data.TokenDataset) -> np.ndarray:
    """Reference: the split's documents joined in the dataset's document order, built by hand."""
    docs = docs[ds.doc_range.start : ds.doc_range.stop]
    return np.concatenate([docs[int(d)] for d in ds._doc_idx]).astype(np.int64)


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_token_dataset_samples_are_windows_of_the_joined_stream(token_build, seq_len, read_docs):
    ds = data.TokenDataset(token_build, seq_len, seed=3, splits=(1, 0, 0))
    stream = _stream(read_docs(token_build), ds)
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


def test_token_dataset_is_deterministic_by_seed_and_cached(token_build):
    a = data.TokenDataset(token_build, 16, seed=1)
    files = sorted((token_build / "index").glob("train-L16-seed1-*"))
    assert len(files) == 3
    stamps = [f.stat().st_mtime_ns for f in files]
    b = data.TokenDataset(token_build, 16, seed=1)
    assert [f.stat().st_mtime_ns for f in files] == stamps  # loaded, not rebuilt
    c = data.TokenDataset(token_build, 16, seed=2)
    same = all(torch.equal(a[i]["input"], b[i]["input"]) for i in range(len(a)))
    differs = any(not torch.equal(a[i]["input"], c[i]["input"]) for i in range(len(a)))
    assert same and differs
    # a damaged cache file is rebuilt, to the same content
    expected = [a[i]["input"] for i in range(len(a))]
    del a, b  # they map the file we are about to damage
    files[0].write_bytes(b"garbage")
    d = data.TokenDataset(token_build, 16, seed=1)
    assert all(torch.equal(x, d[i]["input"]) for i, x in enumerate(expected))


def test_token_dataset_indexes_enough_epochs(token_build):
    one = data.TokenDataset(token_build, 32, seed=0)
    need = 2 * len(one) + 5
    ds = data.TokenDataset(token_build, 32, seed=0, num_samples=need)
    assert ds.num_epochs == 3 and len(ds) >= need
    n_docs = len(ds.doc_range)
    epochs = ds._doc_idx.reshape(3, n_docs)
    assert all(sorted(e.tolist()) == list(range(n_docs)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])  # a new document order each epoch
    assert np.array_equal(np.sort(ds._shuffle_idx), np.arange(len(ds)))
    with pytest.raises(ValueError, match="not both"):
        data.TokenDataset(token_build, 32, num_epochs=2, num_samples=10)


def test_token_dataset_splits(token_build):
    ranges = data.split_ranges(40, (969, 30, 1))
    assert [len(r) for r in ranges.values()] == [39, 1, 0]  # 38.76, 1.2, 0.04 rounded
    train = data.TokenDataset(token_build, 4, split="train")
    valid = data.TokenDataset(token_build, 4, split="valid")
    assert train.doc_range == range(0, 39) and valid.doc_range == range(39, 40)
    with pytest.raises(ValueError, match="split 'test' is empty"):
        data.TokenDataset(token_build, 4, split="test")
    test = data.TokenDataset(token_build, 4, split="test", splits=(8, 1, 1))
    assert test.doc_range == range(36, 40)
    with pytest.raises(ValueError, match="split must be one of"):
        data.TokenDataset(token_build, 4, split="validation")


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


def test_token_dataset_pickles_without_its_tokens(token_build):
    import pickle  # only to check that process workers can receive a dataset

    ds = data.TokenDataset(token_build, 8)
    ds[0]  # opens the memory map
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000  # file names and the small document index, not the data
    again = pickle.loads(blob)
    assert torch.equal(again[5]["input"], ds[5]["input"])


# -- DocumentDataset -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_len", [1, 5, 1000])
def test_document_dataset_pieces_cover_each_document(token_corpus, token_build, max_len, read_docs):
    ds = data.DocumentDataset(token_build, max_len, splits=(1, 0, 0))
    docs = read_docs(token_build)
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


def test_packed_rows_restart_positions_where_each_document_starts(tmp_path):
    texts = [("a", "ab"), ("b", "cdef"), ("c", "g" * 30)]
    data.build_token_dataset(texts, tmp_path, progress=False)
    ds = data.TokenDataset(tmp_path, 12, seed=0, pack=True, splits=(1, 0, 0))
    plain = data.TokenDataset(tmp_path, 12, seed=0, splits=(1, 0, 0))
    eot = data.ByteTokenizer().eot_id
    for i in range(len(ds)):
        ex = ds[i]
        assert torch.equal(ex["input"], plain[i]["input"])  # the same samples
        assert torch.equal(ex["target"], plain[i]["target"])
        x, pos = ex["input"], ex["position_ids"]
        # by hand: 0 at the row start and at every end-of-document input, else one more
        for t in range(len(x)):
            want = 0 if t == 0 or x[t] == eot else int(pos[t - 1]) + 1
            assert int(pos[t]) == want, (i, t, pos)
    assert data.restarting_positions([3, 4, 2]).tolist() == [0, 1, 0, 1, 2, 3, 0, 1]


def test_a_chat_build_masks_the_targets_that_are_not_the_assistants(tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [{"messages": chat}, {"text": "plain"}]))
    s = data.build_token_dataset([src], tmp_path / "b", progress=False)
    assert s.masked and s.num_docs == 2
    tok = data.ByteTokenizer()
    ids, mask = data.encode_chat(tok, chat)
    stream = np.concatenate([ids, [tok.eot_id], tok.encode_array("plain"), [tok.eot_id]])
    predicted = np.concatenate([mask, [mask[-1]], np.ones(len("plain") + 1, dtype=bool)])
    docs = data.DocumentDataset(tmp_path / "b", max_len=1000, splits=(1, 0, 0))
    ex = docs[0]
    assert ex["input"].tolist() == stream[: len(ids)].tolist()
    want = np.where(predicted[1 : len(ids) + 1], stream[1 : len(ids) + 1], -100)
    assert ex["target"].tolist() == want.tolist()
    assert (docs[1]["target"] != -100).all()  # a text document: every token predicted
    rows = data.TokenDataset(tmp_path / "b", len(stream) - 1, splits=(1, 0, 0))
    r = rows[0]  # the whole stream in one sample (in the shuffled document order)
    chat_first = int(r["input"][0]) == ord("<")  # then its first token is never a target
    assert int((r["target"] == -100).sum()) == int((~predicted).sum()) - chat_first
