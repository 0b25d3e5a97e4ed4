"""Chat conversations as tokens with a loss mask: the loss is on the assistant's tokens only.

    ids, mask = encode_chat(tokenizer, [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}])
    # mask[t] is True where token t is something the model should learn to say

The conversation is rendered to text with the tokenizer's chat template (``tokenizer.chat_template``,
a Jinja template as in a Hugging Face ``tokenizer_config.json``), or, for a tokenizer without one
(``ByteTokenizer``), with the built-in template:

    <|user|>                 one block per message: "<|" + role + "|>\\n" + content + "<|end|>\\n"
    What is 2 + 2?<|end|>    (plain characters: with the byte tokenizer they are bytes, not
    <|assistant|>            special tokens); the generation prompt is "<|assistant|>\\n"
    4.<|end|>

An assistant message's tokens are those of its span: from the end of the conversation before it,
rendered with the generation prompt, to the end of the conversation up to and including it. So the
mask covers the reply and what closes it (``<|end|>``, ``<|im_end|>``, ...), which the model must
learn to say to stop, and not the header that announces it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BUILTIN_CHAT_TEMPLATE", "encode_chat", "render_chat"]

# The built-in template in Jinja, as a tokenizer_config.json would hold it (render_chat uses it).
BUILTIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@functools.lru_cache(maxsize=8)  # a pure function of the template's text
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False
) -> str:
    """The text of ``messages`` in the tokenizer's chat template (``tokenizer.chat_template``),
    or in ``BUILTIN_CHAT_TEMPLATE`` when the tokenizer has none. The template sees
    ``messages``, ``add_generation_prompt`` and the tokenizer's ``special_tokens``
    (``bos_token``, ``eos_token``, ...), as Hugging Face templates expect."""
    template = getattr(tokenizer, "chat_template", None) or BUILTIN_CHAT_TEMPLATE
    specials = getattr(tokenizer, "special_tokens", {}) or {}
    return _compiled(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **specials
    )


def _assistant_spans(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[str, list]:
    """The rendered conversation and the [start, end) character span of each assistant message."""
    text = render_chat(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
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
    tokenizer: Any, messages: Sequence[dict[str, str]]
) -> tuple[np.ndarray, np.ndarray]:
    """The token ids of a rendered conversation (:func:`render_chat`) and its loss mask.

    Guarantees: ``ids`` are the tokenizer's ids of the whole rendered text (one ``encode`` call
    when the tokenizer has ``encode_with_offsets``; for one without, such as ``ByteTokenizer``,
    the text's pieces are encoded one by one, which is the same for a tokenizer that encodes
    pieces independently). ``mask[t]`` (bool) is True exactly for the tokens whose characters
    overlap an assistant message's span (see the module docstring): True on what the model
    must learn to say, False on system and user turns and on the assistant headers.

    Raises:
        ValueError: the template renders a conversation differently from its prefixes, so the
            spans cannot be found (the message says what to do).
    """
    text, spans = _assistant_spans(tokenizer, messages)
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
