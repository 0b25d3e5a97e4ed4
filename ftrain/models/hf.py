"""Hugging Face ``transformers`` models: loaded from a local ``save_pretrained`` directory
(:func:`load_causal_lm`, what ``ftrain train --model-dir DIR`` trains) or built from a config
(:func:`tiny_gpt2`); never downloaded.

Needs the ``hf`` extra (``pip install 'ftrain[hf]'``); ``transformers`` is imported only when a
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

import os
from pathlib import Path

import torch
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


def load_causal_lm(
    model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The causal language model saved in ``model_dir`` by ``save_pretrained``, read from local
    files only (``local_files_only=True``: never the network, no remote code).

    Guarantees: the model is an ``AutoModelForCausalLM`` of the directory's ``config.json`` with
    the weights of its ``*.safetensors`` files (no pickle is read), in ``dtype`` (float32 by
    default: ftrain keeps params in float32 and lowers the forward with ``--precision``), in
    training mode, with the KV cache off (``config.use_cache = False``: generation turns it on
    per call). Call it as ``model(input_ids, position_ids=...).logits`` -> (B, T, vocab); train
    it through ``ft.apply(model, params, ...)`` with ``params = ft.params_of(model)``. Its
    tokenizer: ``ftrain.data.load_tokenizer(model_dir)``.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory, or lacks ``config.json`` or
            safetensors weights; the message names what is missing and how to write it.
        ImportError: ``transformers`` is not installed (``pip install 'ftrain[hf]'``).
    """
    path = Path(model_dir)
    check_model_dir(path)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError(
            f"load_causal_lm({str(path)!r}) needs transformers: pip install 'ftrain[hf]'"
        ) from e
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype, use_safetensors=True, trust_remote_code=False
    )
    model.config.use_cache = False
    return model.train()


def check_model_dir(path: str | os.PathLike) -> Path:
    """``path`` as a Path if it holds a ``save_pretrained`` model (``config.json`` and
    safetensors weights), else a FileNotFoundError that says what is missing (for ``--model-dir``)."""
    path = Path(path)
    fix = (
        "pass the folder that model.save_pretrained(folder) wrote (config.json + "
        "model.safetensors); ftrain reads local files only and never downloads"
    )
    if not path.is_dir():
        raise FileNotFoundError(f"--model-dir {str(path)!r} is not a directory; {fix}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model-dir {str(path)!r} has no config.json; {fix}")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"--model-dir {str(path)!r} has no *.safetensors weights (pickled *.bin weights are "
            f"not read); {fix}, or save with safe_serialization=True"
        )
    return path
