"""Tests for ftrain.data.documents: text files, folders, JSON Lines and Parquet as documents, bad
data reported with its file and line."""

import json

import pytest

from ftrain import data

from _hf import write_jsonl


def _docs(path):
    return list(data.read_documents(path))


def test_jsonl_text_and_chat_records_and_bad_lines_with_their_line(tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [{"text": "one"}, {"messages": chat}, "{not json", {"txt": "x"}, [1, 2], {"text": 3},
         {"messages": [{"role": "user"}]}, {"text": ""}, {"messages": []}],
    )  # fmt: skip
    f.write_text(f.read_text() + "\n   \n")  # blank lines are not documents
    docs = _docs(f)
    assert [d.name for d in docs] == [f"{f}:{n}" for n in range(1, 10)]
    assert (docs[0].text, docs[0].skip) == ("one", None)
    assert docs[1].messages == tuple(chat) and docs[1].text is None
    want = [
        ("invalid", "not JSON"),
        (
            "invalid",
            "missing field 'text', 'messages', 'conversations' or 'prompt' and "
            "'completion' (keys: ['txt'])",
        ),
        ("invalid", "a list, not an object"),
        ("invalid", "'text' is a int"),
        ("invalid", "messages[0] 'content' is missing, not a string"),
        ("empty", "''"),
        ("empty", "'messages' is an empty list"),
    ]
    for doc, (reason, problem) in zip(docs[2:], want, strict=True):
        assert doc.skip == reason and problem in doc.problem, doc


def test_sharegpt_prompt_completion_and_text_parts_read_as_messages(tmp_path):
    """ShareGPT's from/value (human, gpt: user, assistant), a content of text parts joined,
    prompt/completion strings (completion as text) and lists (messages, the prompt's counted)."""
    share = [
        {"from": "system", "value": "s"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "bot", "value": "x"},
    ]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    image = [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}]
    asked, said = [{"role": "user", "content": "q"}], [{"role": "assistant", "content": "r"}]
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"conversations": share}, {"messages": parts}, {"messages": image},
        {"prompt": "2+2=", "completion": "4"}, {"prompt": asked, "completion": said},
        {"prompt": "p", "completion": said}, {"prompt": "p", "completion": ""},
        {"conversations": [{"from": "human"}]},
    ])  # fmt: skip
    docs = _docs(f)
    roles = [(m["role"], m["content"]) for m in docs[0].messages]
    assert roles == [("system", "s"), ("user", "hi"), ("assistant", "hello"), ("bot", "x")]
    assert docs[1].messages == ({"role": "user", "content": "ab"},)
    assert docs[2].skip == "invalid" and "not {'type': 'text'" in docs[2].problem
    assert (docs[3].prompt, docs[3].text, docs[3].messages) == ("2+2=", "4", None)
    assert docs[4].messages == (*asked, *said) and docs[4].train_from == 1
    assert docs[5].skip == "invalid" and "both be strings or both lists" in docs[5].problem
    assert docs[6].skip == "empty"
    assert docs[7].skip == "invalid" and "conversations[0] 'value' is missing" in docs[7].problem


def test_parquet_conversations_and_prompt_completion_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    share = [[{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]]
    pq.write_table(pa.table({"conversations": share}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"prompt": ["a"], "completion": ["b"]}), tmp_path / "p.parquet")
    (chat,) = _docs(tmp_path / "c.parquet")
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    (pc,) = _docs(tmp_path / "p.parquet")
    assert (pc.prompt, pc.text) == ("a", "b")


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028, U+0085 or a form feed unescaped: the record stays one
    document, and the line numbers count newlines; CRLF line ends are read too."""
    f = tmp_path / "d.jsonl"
    texts = ["a\u2028b", "c\x85d\x0ce", "f"]
    f.write_bytes("\r\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts).encode())
    docs = _docs(f)
    assert [(d.name, d.text, d.skip) for d in docs] == [
        (f"{f}:{n}", t, None) for n, t in enumerate(texts, start=1)
    ]


def test_text_files_folders_and_empty_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / ".hidden").write_text("no")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    files = data.data_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "a.txt", "empty.jsonl", "latin.txt", "sub/b.md",
    ]  # fmt: skip
    assert data.data_files(tmp_path / "a.txt") == [tmp_path / "a.txt"]
    assert _docs(files[0])[0].text == "alpha"
    [empty] = _docs(files[1])
    assert (empty.skip, empty.problem) == ("empty", "the file is empty")
    [latin] = _docs(files[2])
    assert latin.skip == "undecodable" and "not UTF-8" in latin.problem
    with pytest.raises(FileNotFoundError, match="--data .*does not exist"):
        data.data_files(tmp_path / "nope")
    (tmp_path / "void").mkdir()
    with pytest.raises(FileNotFoundError, match="folder without files"):
        data.data_files(tmp_path / "void")


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    pq.write_table(pa.table({"text": ["x", None, "z"]}), tmp_path / "t.parquet")
    pq.write_table(pa.table({"messages": [chat]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    t = _docs(tmp_path / "t.parquet")
    assert [d.text for d in t] == ["x", None, "z"]
    assert t[1].name == f"{tmp_path / 't.parquet'}:1" and t[1].skip == "invalid"
    assert _docs(tmp_path / "c.parquet")[0].messages == tuple(chat)
    [b] = _docs(tmp_path / "b.parquet")
    assert (
        b.skip == "invalid"
        and "no 'text', 'messages', 'conversations' or 'prompt' and" in b.problem
    )
    [bad] = _docs(tmp_path / "bad.parquet")
    assert bad.skip == "unreadable"
