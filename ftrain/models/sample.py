"""Autoregressive sampling from a language model.

>>> import torch
>>> from ftrain.models import GPT, GPTConfig, generate
>>> model = GPT(GPTConfig(seq_len=8, d_model=16, n_layer=1, n_head=2)).eval()
>>> prompt = torch.zeros(1, 3, dtype=torch.long)
>>> generate(model, prompt, 5, generator=torch.Generator().manual_seed(0)).shape
torch.Size([1, 8])
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    *,
    seq_len: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
) -> torch.Tensor:
    """Extend token ids ``idx`` (B, T) by ``max_new_tokens`` sampled tokens; returns (B, T + n).

    Each step feeds the last ``seq_len`` tokens (default ``model.config.seq_len``) to ``model``,
    which must map (B, t) ids to (B, t, vocab) logits (or an object with ``.logits``, as Hugging
    Face models return), and samples the next token from ``softmax(logits[:, -1] / temperature)``
    restricted to the ``top_k`` most likely tokens. ``temperature=0`` is greedy decoding.
    ``stop_sequences`` (lists of ids, e.g. the end-of-turn token's) end generation early, once
    every row's new tokens end with one of them (a row that ended before the others goes on
    being sampled: cut each row at its first stop).

    Guarantees: the prompt is returned unchanged as the first T columns; every sampled token is
    among the ``top_k`` highest logits at its step; with the same ``generator`` state the output is
    the same. The model is not modified: put it in ``eval()`` mode first (a warning fires if it is
    in training mode, where dropout would make the samples noisier). Runs under ``no_grad``; each
    step recomputes the whole context (no KV cache), so it costs O(n * seq_len) forward tokens.
    """
    if seq_len is None:
        seq_len = getattr(getattr(model, "config", None), "seq_len", None)
        if seq_len is None:
            raise ValueError(
                "generate: cannot tell the model's context length; pass seq_len=... "
                "(it is read from model.config.seq_len when the model has one)."
            )
    if idx.ndim != 2 or idx.size(1) == 0:
        raise ValueError(
            f"generate: idx must be (B, T) token ids with T >= 1, got shape {tuple(idx.shape)}; "
            "to sample unconditionally, start from a start/end-of-document token."
        )
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 0.")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0 (0 is greedy).")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k={top_k} must be >= 1, or None for the full vocabulary.")
    if model.training:
        warnings.warn(
            "generate: the model is in training mode, so dropout is active while sampling; "
            "call model.eval() first.",
            stacklevel=3,  # point at the caller, past the no_grad wrapper
        )
    stops = [list(s) for s in stop_sequences if len(s)]
    ended = [False] * idx.size(0)
    start = idx.size(1)
    for _ in range(max_new_tokens):
        out = model(idx[:, -seq_len:])  # crop the context to the position table
        logits = getattr(out, "logits", out)[:, -1, :]  # (B, vocab): the last position only
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if temperature == 0:
            idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)  # (B, vocab)
            idx_next = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, idx_next], dim=1)  # (B, T + 1)
        if stops:
            tails = idx[:, start:].tolist()  # a host sync per token: only when stopping
            ended = [e or any(t[-len(s) :] == s for s in stops) for e, t in zip(ended, tails)]
            if all(ended):
                break
    return idx
