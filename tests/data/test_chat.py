"""Tests for ftrain.data.chat: conversations rendered with a chat template, and the loss mask on
the assistant's tokens, checked against where the replies are in the text."""

import numpy as np
import pytest

from ftrain import data

from _hf import IM_END, bpe_tokenizer, write_jsonl

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


# -- data that cannot train silently: roles, records, templates ----------------------------------

SHAREGPT_ROLES = [
    [{"role": "human", "content": f"what is {i} plus {i}?"}, {"role": "gpt", "content": f"{2 * i}"}]
    for i in range(3)
]


def test_chats_with_nothing_to_learn_are_refused_with_the_roles_seen_and_the_fix(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in SHAREGPT_ROLES])
    with pytest.raises(data.DataError) as e:
        data.build_token_dataset([f], tmp_path / "b", progress=False)
    assert "loss mask is empty" in str(e.value)
    assert "roles seen: human 3, gpt 3" in str(e.value)
    assert "--chat-roles human=user,gpt=assistant" in str(e.value)
    assert not (tmp_path / "b" / "meta.json").exists()  # nothing half-written
    # the named fix trains exactly the conversations written with the template's roles
    s = data.build_token_dataset([f], tmp_path / "b", progress=False,
                                 chat_roles="human=user,gpt=assistant")  # fmt: skip
    renamed = [[{**m, "role": {"human": "user", "gpt": "assistant"}[m["role"]]} for m in c]
               for c in SHAREGPT_ROLES]  # fmt: skip
    want = [data.encode_chat(data.ByteTokenizer(), c) for c in renamed]
    tokens = np.fromfile(tmp_path / "b" / "tokens.bin", dtype=np.uint16)
    mask = np.fromfile(tmp_path / "b" / "mask.bin", dtype=np.uint8).astype(bool)
    eot = data.ByteTokenizer().eot_id
    assert tokens.tolist() == [t for ids, _ in want for t in [*ids.tolist(), eot]]
    assert mask.tolist() == [b for _, m in want for b in [*m.tolist(), bool(m[-1])]]
    assert s.num_docs == 3 and s.masked and mask.any()


def test_a_chat_without_an_assistant_turn_is_skipped_and_listed(tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    lone = {"messages": [{"role": "user", "content": "only a question"}]}
    f = write_jsonl(tmp_path / "c.jsonl", [good, lone])
    s = data.build_token_dataset([f], tmp_path / "b", progress=False)
    assert s.num_docs == 1 and s.skipped["empty"] == 1
    assert s.problems == (f"{f}:2: no assistant message to learn (roles: user)",)


def test_prompt_completion_learns_the_completion_only():
    tok = data.ByteTokenizer()
    ids, mask = data.encode_completion(tok, "2 + 2 = ", "4, of course")
    assert tok.decode(ids) == "2 + 2 = 4, of course"
    assert tok.decode(ids[mask]) == "4, of course" and not mask[: len("2 + 2 = ")].any()


def test_prompt_completion_with_a_bpe_tokenizer_masks_by_offsets(tmp_path):
    pytest.importorskip("tokenizers")
    tok = data.load_tokenizer(bpe_tokenizer(tmp_path))
    ids, mask = data.encode_completion(tok, "user: what is two plus two?", " two plus two is four.")
    assert ids.tolist() == tok.encode("user: what is two plus two? two plus two is four.")
    offsets = tok.encode_with_offsets(tok.decode(ids.tolist()))[1]
    cut = len("user: what is two plus two?")
    assert mask.tolist() == [end > cut for _, end in offsets]  # the tokens past the prompt
    assert 0 < mask.sum() < len(mask)


def test_conversational_prompt_completion_learns_the_completions_turns_only():
    tok = data.ByteTokenizer()
    msgs = CHAT[1:]  # user, assistant, user, assistant
    _, all_turns = data.encode_chat(tok, msgs)
    ids, last = data.encode_chat(tok, msgs, train_from=3)
    text = data.render_chat(tok, msgs)
    assert tok.decode(ids[last]) == "hello world<|end|>\n"
    assert tok.decode(ids[all_turns]) == "four.<|end|>\nhello world<|end|>\n"
    assert text.endswith("hello world<|end|>\n")


def test_a_model_tokenizer_without_a_template_is_refused_until_one_is_chosen(tmp_path):
    pytest.importorskip("tokenizers")
    import json

    folder = bpe_tokenizer(tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = data.load_tokenizer(folder)
    with pytest.raises(data.DataError, match=r"has none; choose one: --chat-template builtin"):
        data.encode_chat(tok, CHAT)
    with pytest.raises(data.DataError, match=r"--chat-template model: the model folder .* has no"):
        data.with_chat_template(tok, "model")
    builtin = data.with_chat_template(tok, "builtin")
    assert data.render_chat(builtin, CHAT[1:3]) == data.render_chat(data.ByteTokenizer(), CHAT[1:3])
    assert builtin.fingerprint != tok.fingerprint and tok.chat_template is None  # a view
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert data.render_chat(data.with_chat_template(tok, str(jinja)), CHAT[1:2]) == (
        "[user] what is two plus two?\n"
    )
    with pytest.raises(data.DataError, match=r"--chat-template 'nope.jinja': cannot read it"):
        data.with_chat_template(tok, "nope.jinja")
    # the data build refuses such chats before writing anything, naming the flag
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(data.DataError, match="--chat-template"):
        data.build_token_dataset([f], tmp_path / "b", tok, progress=False)


def test_end_of_turn_is_what_closes_a_reply(tmp_path):
    assert data.end_of_turn(data.ByteTokenizer()) == "<|end|>"
    pytest.importorskip("tokenizers")
    assert data.end_of_turn(data.load_tokenizer(bpe_tokenizer(tmp_path))) == IM_END


@pytest.mark.parametrize(
    "spec, message",
    [("human", "is not NAME=ROLE"), ("human=person", "maps a role onto 'person'"),
     ("=user", "maps a role onto")],
)  # fmt: skip
def test_chat_roles_are_checked(spec, message):
    assert data.parse_chat_roles("human = user, gpt=assistant") == {
        "human": "user", "gpt": "assistant",
    }  # fmt: skip
    with pytest.raises(data.DataError, match=message):
        data.parse_chat_roles(spec)


def test_ftrain_train_refuses_unmapped_roles_then_trains_with_chat_roles(
    tmp_path, tiny_run, capsys
):
    """The command: a usage error (exit 2) before any step, naming the roles and the flag; the
    flag it names trains on the replies (a nonzero count of learned tokens every step)."""
    import json

    from ftrain.app.cli import main

    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in SHAREGPT_ROLES * 10])
    out = tmp_path / "run"
    args = ["train", *tiny_run, "--data", str(f), "--data-dir", str(tmp_path / "tokens"),
            "--max-steps", "2", "--out", str(out)]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "ftrain train: error: the data's loss mask is empty" in err
    assert "roles seen: human 30, gpt 30" in err and "human=user,gpt=assistant" in err
    assert not list(out.glob("checkpoint-*"))
    assert main([*args, "--chat-roles", "human=user,gpt=assistant"]) == 0
    counts = [
        json.loads(line)["count"] for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(counts) == 2 and min(counts) > 0
