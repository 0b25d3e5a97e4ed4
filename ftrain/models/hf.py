"""Hugging Face ``transformers`` models built from a local config (no download).

Needs the ``dev`` extra (``pip install -e '.[dev]'``); ``transformers`` is imported only when a
function here is called, so ``import ftrain.models`` works without it.

Train one with the loss as a sum and its count, in Hugging Face's convention (labels not shifted,
-100 on padding), so that ``ft.accumulate`` and ``ft.shard`` stay exact::

    model = tiny_gpt2()
    def loss_fn(params, batch):
        out = ft.apply(model, params, batch["input_ids"], attention_mask=batch["attention_mask"])
        return ft.losses.causal_lm(out.logits, batch["labels"])

Returning the model's own ``out.loss`` (a token mean) instead is taken as a mean over rows, which
padding makes wrong under ``ft.accumulate``; the step warns (``ft.losses.ScalarLossWarning``).
"""

from __future__ import annotations

import torch.nn as nn


def tiny_gpt2(
    vocab_size: int = 257,
    n_positions: int = 128,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 2,
    *,
    dropout: float = 0.0,
) -> nn.Module:
    """A freshly initialized ``transformers.GPT2LMHeadModel``, built offline from a ``GPT2Config``.

    Defaults match ftrain's byte-level data: 257 tokens, id 256 (end of document) as BOS/EOS.
    ``dropout`` sets the residual, embedding and attention dropout. The KV cache is off
    (``use_cache=False``) since it is only useful for generation. Call it as
    ``model(input_ids).logits`` -> (B, T, vocab_size); its loss for ftrain is
    ``ft.losses.causal_lm(logits, labels)``. Note: its lm head is tied to the token
    embedding (``transformer.wte.weight`` is ``lm_head.weight``).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        use_cache=False,
    )
    return GPT2LMHeadModel(config)
