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

import hashlib
import importlib.util
import json
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


# --attn-implementation: the attention kernels transformers offers (flash_attention_2 needs the
# flash-attn package and a CUDA GPU).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def load_causal_lm(
    model_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> nn.Module:
    """The causal language model saved in ``model_dir`` by ``save_pretrained``, read from local
    files only (``local_files_only=True``: never the network, no remote code, and
    none of the layer kernels transformers 5 fetches from the Hub by default).

    Guarantees: the model is an ``AutoModelForCausalLM`` of the directory's ``config.json`` with
    the weights of its ``*.safetensors`` files (no pickle is read), in ``dtype`` (float32 by
    default: ftrain keeps params in float32 and lowers the forward with ``--precision``), in
    training mode, with the KV cache off (``config.use_cache = False``: generation turns it on
    per call), with the attention kernel ``attn_implementation`` (:data:`ATTN_IMPLEMENTATIONS`;
    None: transformers' default). Call it as ``model(input_ids, position_ids=...).logits`` ->
    (B, T, vocab); train
    it through ``ft.apply(model, params, ...)`` with ``params = ft.params_of(model)``. Its
    tokenizer: ``ftrain.data.load_tokenizer(model_dir)``.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory, or lacks ``config.json`` or
            safetensors weights; the message names what is missing and how to write it.
        ImportError: ``transformers`` is not installed (``pip install 'ftrain[hf]'``).
        ValueError: an ``attn_implementation`` that is not offered or not installed.
    """
    path, transformers = _checked("load_causal_lm", model_dir, attn_implementation)
    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if hasattr(transformers.PreTrainedModel, "use_kernels"):  # transformers 5: on by default
        attn["use_kernels"] = False  # the model's own modules, not kernels from the Hub
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype, use_safetensors=True, trust_remote_code=False,
        **attn,
    )  # fmt: skip
    model.config.use_cache = False
    return model.train()


def empty_causal_lm(
    model_dir: str | os.PathLike, *, attn_implementation: str | None = None
) -> nn.Module:
    """The model of ``model_dir``'s ``config.json`` with its parameters on the ``meta`` device
    (no memory, no weights read) and its buffers real: a template for ``ft.apply`` whose params
    come from elsewhere (``ft.distributed.sharded_params_from_files``: each process's rows).
    Otherwise as :func:`load_causal_lm`: the same class and parameter names, float32, training
    mode, the KV cache off, ``attn_implementation``; local files only, no remote code."""
    from ftrain.internals.meta_params import params_on_meta

    path, transformers = _checked("empty_causal_lm", model_dir, attn_implementation)
    config = transformers.AutoConfig.from_pretrained(
        path, local_files_only=True, trust_remote_code=False
    )
    attn = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn)
    model.config.use_cache = False
    return model.train()


def _checked(fn: str, model_dir, attn_implementation):
    """``(path, transformers)`` for ``fn(model_dir)``: the folder and the attention kernel
    checked (their errors), ``transformers`` imported (an ImportError naming the extra)."""
    path = Path(model_dir)
    check_model_dir(path)
    check_attn_implementation(attn_implementation)
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"{fn}({str(path)!r}) needs transformers: pip install 'ftrain[hf]'"
        ) from e
    return path, transformers


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


def check_attn_implementation(name: str | None, model_dir: str | None = "") -> None:
    """Refuse an ``--attn-implementation`` that cannot run: not one of
    :data:`ATTN_IMPLEMENTATIONS`, ``flash_attention_2`` without the ``flash_attn`` package, or
    any of them without a ``--model-dir`` (pass ``model_dir=None`` to check that; the built-in
    GPT always runs ``scaled_dot_product_attention``). A ValueError naming the flag and the fix."""
    if name is None:
        return
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"--attn-implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, got {name!r}"
        )
    if model_dir is None:
        raise ValueError(
            f"--attn-implementation {name} applies to a --model-dir model; the built-in GPT "
            "always runs torch's scaled_dot_product_attention (flash attention on a GPU): drop it"
        )
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "--attn-implementation flash_attention_2 needs the flash-attn package, which is not "
            "installed (pip install flash-attn, on a CUDA machine); use --attn-implementation "
            "sdpa, which runs flash attention kernels through torch where it can"
        )


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The ``*.safetensors`` weight files of a model folder, sorted by name."""
    return sorted(Path(model_dir).glob("*.safetensors"))


def weights_sha256(model_dir: str | os.PathLike) -> dict[str, str]:
    """``{file name: sha256}`` of the folder's weight files: the model's identity, whatever its
    path. Reads every byte once (about a second per GB)."""
    digests = {}
    for f in weight_files(model_dir):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        digests[f.name] = h.hexdigest()
    return digests


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F64": torch.float64}  # fmt: skip


def saved_dtype(model_dir: str | os.PathLike) -> torch.dtype:
    """The floating dtype the folder's weights are stored in (the most common one among its
    tensors, read from the safetensors headers only); float32 if it has none."""
    counts: dict[torch.dtype, int] = {}
    for f in weight_files(model_dir):
        with open(f, "rb") as fh:  # safetensors: 8-byte little-endian length, then JSON
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            dtype = _SAFETENSORS_DTYPES.get(info.get("dtype")) if name != "__metadata__" else None
            if dtype is not None:
                counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=counts.get) if counts else torch.float32


def saved_use_cache(model_dir: str | os.PathLike) -> bool:
    """The folder's ``config.json`` ``use_cache`` (True when it says nothing, as transformers
    reads it); what an export writes back, since :func:`load_causal_lm` turns it off."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("use_cache", True))
