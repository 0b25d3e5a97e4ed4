"""Tests for ftrain.app.recipes.corpus: the sources of a run and where their token cache lives."""

import io
from pathlib import Path

from ftrain import data
from ftrain.app.config import TrainConfig
from ftrain.app.recipes import corpus


def test_cache_dir_is_named_by_data_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("FTRAIN_CACHE", str(tmp_path))
    assert corpus.cache_dir(TrainConfig()) == tmp_path / "stdlib"  # as before --data
    assert corpus.cache_dir(TrainConfig(data_dir="x", data="d.jsonl")) == Path("x")
    a = corpus.cache_dir(TrainConfig(data="d.jsonl"))
    b = corpus.cache_dir(TrainConfig(data="d.jsonl", model_dir="m"))
    c = corpus.cache_dir(TrainConfig(data="e.jsonl"))
    assert a.parent == tmp_path and a.name.startswith("d.jsonl-")
    assert len({a, b, c, corpus.cache_dir(TrainConfig(model_dir="m"))}) == 4
    assert a == corpus.cache_dir(TrainConfig(data=str(Path("d.jsonl").resolve())))


def test_sources_and_the_skip_report(tmp_path):
    (tmp_path / "a.txt").write_text("hi")
    assert corpus.sources(TrainConfig(data=str(tmp_path))) == [tmp_path / "a.txt"]
    assert corpus.sources(TrainConfig()) == data.corpora.python_stdlib()
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "ok"}\n[1]\n')
    s = data.build_token_dataset([bad], tmp_path / "t", progress=False)
    out = io.StringIO()
    corpus.report_build(s, file=out)
    assert out.getvalue().startswith(
        "ftrain train: the data build skipped 1 document(s) (invalid 1)"
    )
    assert f"{bad}:2: a list, not an object" in out.getvalue()
    quiet = io.StringIO()
    corpus.report_build(
        data.build_token_dataset([tmp_path / "a.txt"], tmp_path / "u", progress=False), file=quiet
    )
    assert quiet.getvalue() == ""
