"""Chat conversations as tokens with a loss mask: the loss is on the assistant's tokens only.

    ids, mask = encode_chat(tokenizer, [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}])
    # mask[t] is True where token t is something the model should learn to say

The conversation is rendered to text with the tokenizer's chat template (``tokenizer.chat_template``,
a Jinja template as in a Hugging Face ``tokenizer_config.json``). Which template is explicit: a
tokenizer without the attribute (``ByteTokenizer``) uses the built-in one, a model tokenizer whose
``chat_template`` is None is refused (``DataError``), and :func:`with_chat_template`
chooses (``--chat-template model|builtin|FILE``). The built-in template:

    <|user|>                 one block per message: "<|" + role + "|>\\n" + content + "<|end|>\\n"
    What is 2 + 2?<|end|>    (plain characters: with the byte tokenizer they are bytes, not
    <|assistant|>            special tokens); the generation prompt is "<|assistant|>\\n"
    4.<|end|>

An assistant message's tokens are those of its span: from the end of the conversation before it,
rendered with the generation prompt, to the end of the conversation up to and including it. So the
mask covers the reply and what closes it (``<|end|>``, ``<|im_end|>``, ...), which the model must
learn to say to stop, and not the header that announces it. A ``prompt``/``completion`` record
(:func:`encode_completion`) is the prompt's text followed by the completion's, the loss on the
completion. Your data's role names map onto the template's with :func:`parse_chat_roles`
(``--chat-roles human=user,gpt=assistant``).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ftrain.data.documents import DataError

__all__ = [
    "BUILTIN_CHAT_TEMPLATE",
    "TEMPLATE_CHOICES",
    "TemplatedTokenizer",
    "empty_mask_error",
    "encode_chat",
    "encode_completion",
    "end_of_turn",
    "parse_chat_roles",
    "render_chat",
    "template_of",
    "with_chat_template",
]

# The built-in template in Jinja, as a tokenizer_config.json would hold it (render_chat uses it).
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# --chat-template: the model folder's template, the built-in one, or else a Jinja file's path.
TEMPLATE_CHOICES = ("model", "builtin")
ROLES = ("system", "user", "assistant", "tool")  # what templates expect


@functools.lru_cache(maxsize=8)  # a pure function of the template's text
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


class TemplatedTokenizer:
    """``tokenizer`` with the chat template ``template`` (everything else is the tokenizer's
    own: ``encode``, ``decode``, ``eot_id``, ...); its ``fingerprint`` names the template too, so
    a token cache is rebuilt when it changes. ``tokenizer`` is not changed."""

    def __init__(self, tokenizer: Any, template: str):
        self.tokenizer = tokenizer
        self.chat_template = template
        fp = str(getattr(tokenizer, "fingerprint", type(tokenizer).__qualname__))
        self.fingerprint = hashlib.sha256(f"{fp}|{template}".encode()).hexdigest()

    def __getattr__(self, name: str):  # encode, decode, vocab_size, eot_id, special_tokens, ...
        if name == "tokenizer":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __repr__(self) -> str:
        return f"with_chat_template({self.tokenizer!r}, ...)"


def with_chat_template(tokenizer: Any, choice: str | None) -> Any:
    """``tokenizer`` rendering chats with the template ``choice`` names (``--chat-template``):
    ``"model"`` its own (``tokenizer.chat_template``; an error if it has none), ``"builtin"``
    :data:`BUILTIN_CHAT_TEMPLATE`, another string the Jinja file at that path, ``None`` the
    tokenizer as it is (its own template; see :func:`template_of` for one without).

    Guarantees: ``tokenizer`` is not changed (a view is returned); the view's ``fingerprint``
    differs for each template, so a token build made with one is never reused for another.

    Raises:
        DataError: ``"model"`` for a tokenizer without a template, or a file that cannot be read;
            the message names ``--chat-template`` and its legal values.
    """
    if choice is None:
        return tokenizer
    if choice == "model":
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"--chat-template model: {_where(tokenizer)} has no chat template "
                "(tokenizer_config.json's chat_template, or chat_template.jinja); pass "
                "--chat-template builtin (ftrain's <|user|> template) or --chat-template FILE.jinja"
            )
        return tokenizer
    if choice == "builtin":
        return TemplatedTokenizer(tokenizer, BUILTIN_CHAT_TEMPLATE)
    try:
        return TemplatedTokenizer(tokenizer, Path(choice).read_text())
    except OSError as e:
        raise DataError(
            f"--chat-template {choice!r}: cannot read it ({e.strerror or e}); pass model (the "
            "model folder's template), builtin (ftrain's) or the path of a Jinja file"
        ) from None


def template_of(tokenizer: Any) -> str:
    """The chat template ``tokenizer`` renders with: its ``chat_template``, or the built-in one
    for a tokenizer without that attribute (``ByteTokenizer``, your own).

    Raises:
        DataError: a model tokenizer whose ``chat_template`` is None: nothing says how the model
            expects chats, so the choice is yours (``--chat-template builtin|FILE``).
    """
    if not hasattr(tokenizer, "chat_template"):
        return BUILTIN_CHAT_TEMPLATE
    if not tokenizer.chat_template:
        raise DataError(
            f"chat data needs a chat template, and {_where(tokenizer)} has none; choose one: "
            "--chat-template builtin (ftrain's <|user|> template, which the model then learns) "
            "or --chat-template FILE.jinja (in Python: ftrain.data.with_chat_template)"
        )
    return tokenizer.chat_template


def _where(tokenizer: Any) -> str:
    path = getattr(tokenizer, "path", None)
    return f"the model folder {str(path)!r}" if path is not None else repr(tokenizer)


def parse_chat_roles(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """``--chat-roles``: ``"human=user,gpt=assistant"`` as ``{"human": "user", "gpt":
    "assistant"}`` (a mapping is checked and returned as a dict; None gives ``{}``). Each target
    must be one of ``system``, ``user``, ``assistant``, ``tool``.

    Raises:
        DataError: a piece without ``=``, an empty name, or another target role.
    """
    if spec is None:
        return {}
    pairs = spec.items() if isinstance(spec, Mapping) else _pairs(spec)
    roles = {}
    for name, role in pairs:
        if not name or role not in ROLES:
            raise DataError(
                f"--chat-roles {spec!r}: {name}={role} maps a role onto {role!r}; give "
                f"NAME=ROLE pairs with ROLE one of {', '.join(ROLES)} (e.g. human=user,gpt=assistant)"
            )
        roles[name] = role
    return roles


def _pairs(spec: str) -> list[tuple[str, str]]:
    pairs = []
    for piece in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, role = piece.partition("=")
        if not eq:
            raise DataError(
                f"--chat-roles {spec!r}: {piece!r} is not NAME=ROLE; give pairs such as "
                "human=user,gpt=assistant"
            )
        pairs.append((name.strip(), role.strip()))
    return pairs


def empty_mask_error(
    seen: Mapping[str, int], roles: Mapping[str, str], other_skipped: int, problems: Sequence[str]
) -> DataError:
    """The refusal of chat data with nothing to learn (no message is the assistant's): the
    roles ``seen`` (renamed by ``roles``) with their counts, and the ``--chat-roles`` that
    names the speakers after the first two unknown roles, in the order they first appeared."""
    counts = ", ".join(f"{r} {n}" for r, n in sorted(seen.items(), key=lambda kv: -kv[1]))
    unknown = [r for r in seen if r not in ROLES]
    if len(unknown) >= 2:
        fix = f"--chat-roles {unknown[0]}=user,{unknown[1]}=assistant"
    elif unknown:
        fix = f"--chat-roles {unknown[0]}=assistant"
    else:
        fix = "--chat-roles NAME=assistant for the role that answers"
    given = f" after --chat-roles {dict(roles)}" if roles else ""
    more = f"; {other_skipped} more skipped, first: {list(problems[:2])}" if other_skipped else ""
    return DataError(
        f"the data's loss mask is empty: no chat has an 'assistant' message to learn, so "
        f"training would learn nothing (roles seen{given}: {counts}{more}). Name the role that "
        f"answers: {fix} (a prompt/completion record learns its completion)"
    )


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False
) -> str:
    """The text of ``messages`` in the tokenizer's chat template (:func:`template_of`: its
    ``chat_template``, the built-in one for a tokenizer without that attribute, an error for a
    model tokenizer without a template). The template sees ``messages``,
    ``add_generation_prompt`` and the tokenizer's ``special_tokens`` (``bos_token``,
    ``eos_token``, ...), as Hugging Face templates expect."""
    specials = getattr(tokenizer, "special_tokens", {}) or {}
    return _compiled(template_of(tokenizer)).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **specials
    )


def end_of_turn(tokenizer: Any) -> str:
    """The text the template puts after an assistant's reply to close its turn (``<|end|>`` for
    the built-in template, ``<|im_end|>`` for ChatML), trailing whitespace dropped; ``""`` when
    it puts nothing there. What a chat sample stops at."""
    reply = "\x00reply\x00"
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]
    text = render_chat(tokenizer, chat)
    return text[text.index(reply) + len(reply) :].strip() if reply in text else ""


def _assistant_spans(
    tokenizer: Any, messages: Sequence[dict[str, str]], train_from: int = 0
) -> tuple[str, list]:
    """The rendered conversation and the [start, end) character span of each assistant message
    from index ``train_from`` on."""
    text = render_chat(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from:
            continue
        head = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render_chat(tokenizer, messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(head)):
            raise ValueError(
                "encode_chat: the chat template does not render a conversation as the rendering "
                f"of its first messages followed by the rest (message {i}), so the assistant's "
                "tokens cannot be found; use a template that renders messages one after the other "
                "(as ChatML does), or give the data as 'text'"
            )
        spans.append((len(head), len(upto)))
    return text, spans


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, train_from: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The token ids of a rendered conversation (:func:`render_chat`) and its loss mask.

    Guarantees: ``ids`` are the tokenizer's ids of the whole rendered text (see
    :func:`encode_spans`). ``mask[t]`` (bool) is True exactly for the tokens whose characters
    overlap an assistant message's span (see the module docstring): True on what the model
    must learn to say, False on system and user turns and on the assistant headers. With
    ``train_from=k``, only the assistant messages from index k on (a conversational
    ``prompt``/``completion`` record: the completion's) are learned. A conversation without
    an assistant message there has an all-False mask.

    Raises:
        ValueError: the template renders a conversation differently from its prefixes, so the
            spans cannot be found (the message says what to do).
        DataError: a model tokenizer without a chat template (:func:`template_of`).
    """
    text, spans = _assistant_spans(tokenizer, messages, train_from)
    return encode_spans(tokenizer, text, spans)


def encode_completion(
    tokenizer: Any, prompt: str, completion: str
) -> tuple[np.ndarray, np.ndarray]:
    """The ids of ``prompt + completion`` (no template: a ``prompt``/``completion`` record of
    plain strings) and a mask True on the completion's tokens only (:func:`encode_spans`)."""
    return encode_spans(tokenizer, prompt + completion, [(len(prompt), len(prompt + completion))])


def encode_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]):
    """The ids of ``text`` and a bool mask, True on the tokens that overlap a [start, end)
    character span of ``spans``.

    One ``encode`` call when the tokenizer has ``encode_with_offsets`` (the mask from each
    token's offsets); for one without, such as ``ByteTokenizer``, the text's pieces between span
    edges are encoded one by one, which is the same for a tokenizer that encodes pieces
    independently."""
    with_offsets = getattr(tokenizer, "encode_with_offsets", None)
    if with_offsets is not None:
        ids, offsets = with_offsets(text)
        off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)  # (n, 2): [start, end) of a token
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            mask |= (off[:, 0] < end) & (off[:, 1] > start)
        return np.asarray(ids, dtype=np.int64), mask
    cuts = sorted({0, len(text), *(c for span in spans for c in span)})
    ids, mask = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        piece = list(tokenizer.encode(text[lo:hi]))
        inside = any(start <= lo and hi <= end for start, end in spans)
        ids += piece
        mask += [inside] * len(piece)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
