"""The Hugging Face recipe: your causal language model, from a ``save_pretrained`` folder.

    ftrain train --model-dir M --data chats.jsonl --max-steps 200          # loss on the replies
    ftrain train --model-dir M --data docs/ --pack --seq-len 512            # documents packed
    ftrain sample --run runs/a --prompt "Once"

    from ftrain.app.recipes import hf
    recipe = hf.build(TrainConfig(model_dir="M", data="chats.jsonl"))   # as gpt.build

``ftrain train --model-dir`` runs this recipe instead of ``ftrain.app.recipes.gpt``: the model is
``ftrain.models.load_causal_lm(M)`` and the text is encoded with ``ftrain.data.load_tokenizer(M)``
(local files only). Everything else is the GPT recipe's: the data build and loader, the
optimizer, the schedule and the one composition of transforms (``gpt.build_step``), so every flag
applies. The GPT's shape flags (``--d-model``, ``--n-layer``, ...) do not: the folder's
``config.json`` fixes the model.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

import ftrain as ft
from ftrain import data
from ftrain.app.config import TrainConfig
from ftrain.app.recipes import gpt, placement, rows, startup
from ftrain.models import empty_causal_lm, load_causal_lm
from ftrain.models.hf import check_model_dir, weight_files

__all__ = [
    "born_model_and_params",
    "build",
    "build_model",
    "check_model",
    "context_length",
    "make_loss_fn",
    "sample_text",
]


def build(cfg: TrainConfig, *, rank: int = 0, world: int = 1, quiet: bool = False) -> gpt.Recipe:
    """As :func:`ftrain.app.recipes.gpt.build`, for the model in ``cfg.model_dir``. Every check
    (the folder, the tokenizer, ``--seq-len`` against the model's context, ``--pack`` against
    its forward) runs here, before the first step. The model goes to ``cfg.device`` (resolved:
    ``auto`` is the GPU when there is one), as its state and batches do."""
    cfg = placement.resolve(cfg)
    check_model_dir(cfg.model_dir)  # the folder first: then its tokenizer, then the model
    tokenizer = data.load_tokenizer(cfg.model_dir)
    params = None
    if gpt.born_sharded(cfg, world) and cfg.tp <= 1:  # each process reads its rows only
        model, params = born_model_and_params(cfg, tokenizer, quiet)
    if params is None:
        model = build_model(cfg, tokenizer).to(cfg.device)
    built = rows.build(cfg, rank=rank, world=world, quiet=quiet, tokenizer=tokenizer)
    cfg = rows.with_length(cfg, built.train, world)  # --epochs N -> max_steps, before the schedule
    opt = gpt.build_optimizer(cfg)
    state = gpt.build_state(cfg, model, opt, params)
    step = gpt.build_step(cfg, model, opt, loss_fn=make_loss_fn(model, cfg.loss_fp32))
    placement.release_params(model)  # the state holds the params: the template's go to meta
    about = startup.summary(cfg, built, state, world)
    return gpt.Recipe(model, step, step.init_extra(state), built.loader, built.valid, cfg, about)


def context_length(model: nn.Module) -> int | None:
    """The longest sequence the model's config allows (``max_position_embeddings`` or GPT-2's
    ``n_positions``), or None when the config says nothing."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def born_model_and_params(cfg: TrainConfig, tokenizer, quiet: bool):
    """Under ``--shard fsdp`` on several processes: the template (``empty_causal_lm``: params on
    meta, buffers on ``cfg.device``), checked as :func:`build_model` checks it, and this
    process's fsdp rows of each weight read from the folder's files (``ft.distributed.
    sharded_params_from_files``), the model never whole. Files that do not name the module's
    parameters give ``(None, None)``: the caller loads whole, then shards (said once)."""
    model = check_model(
        cfg, empty_causal_lm(cfg.model_dir, attn_implementation=cfg.attn_implementation), tokenizer
    )
    for module in model.modules():  # the template's buffers (rotary tables...) where it runs
        for name, b in module.named_buffers(recurse=False):
            setattr(module, name, b.to(cfg.device))
    try:
        return model, ft.distributed.sharded_params_from_files(model, weight_files(cfg.model_dir))
    except ft.distributed.NotLaidOut as e:
        if not quiet:
            print(f"ftrain train: note: --model-dir {cfg.model_dir}: {e}; each process loads "
                  "the whole model, then keeps its shards", flush=True)  # fmt: skip
        return None, None


def build_model(cfg: TrainConfig, tokenizer=None) -> nn.Module:
    """The model of ``cfg.model_dir`` (``load_causal_lm``: float32, training mode), checked
    against the run (:func:`check_model`)."""
    model = load_causal_lm(cfg.model_dir, attn_implementation=cfg.attn_implementation)
    return check_model(cfg, model, tokenizer)


def check_model(cfg: TrainConfig, model: nn.Module, tokenizer=None) -> nn.Module:
    """``model`` checked against the run: ``--seq-len`` within its context, its vocabulary
    holding the tokenizer's ids, and ``--pack`` only for a model whose forward takes
    ``position_ids``. Returns ``model``."""
    limit = context_length(model)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(
            f"--seq-len {cfg.seq_len} is longer than the context of the model in --model-dir "
            f"{cfg.model_dir!r} ({limit} positions); pass --seq-len {limit} or less"
        )
    vocab = model.get_input_embeddings().weight.shape[0]
    if tokenizer is not None and tokenizer.vocab_size > vocab:
        raise ValueError(
            f"--model-dir {cfg.model_dir!r}: its tokenizer has {tokenizer.vocab_size} tokens but "
            f"the model's embedding only {vocab}; save the tokenizer the model was trained with "
            "beside it (or resize the model's embeddings before save_pretrained)"
        )
    if cfg.pack and "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"--pack: {type(model).__name__} (in --model-dir {cfg.model_dir!r}) takes no "
            "position_ids, which keep a packed row's documents apart; drop --pack"
        )
    return model


def make_loss_fn(model: nn.Module, fp32: bool = True):
    """Token cross-entropy of the model's logits against the batch's targets (already shifted by
    the dataset; -100 is not predicted), as an ``ft.Loss``; ``fp32`` is
    ``ft.losses.cross_entropy``'s. A packed batch's ``position_ids`` go to the model, which then
    keeps attention within documents."""

    def loss_fn(params, batch):
        packed = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        logits = ft.apply(model, params, batch["input"], **packed).logits
        return ft.losses.cross_entropy(logits, batch["target"], fp32=fp32)

    return loss_fn


def sample_text(
    model: nn.Module,
    params,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """``prompt`` and ``max_new_tokens`` tokens generated from ``params`` with the model's code and
    the tokenizer of the folder it was loaded from (``model.name_or_path``); the same ``seed``
    gives the same text, and ``model`` itself is not changed."""
    tok = data.load_tokenizer(model.name_or_path)
    ids = torch.tensor([tok.encode(prompt) or [tok.eot_id]], dtype=torch.long)
    seq_len = context_length(model) or ids.shape[1] + max_new_tokens
    out = gpt.generate_from(model, params, ids, max_new_tokens, temperature=temperature,
                            top_k=top_k, seed=seed, seq_len=seq_len)  # fmt: skip
    return prompt + tok.decode(out[0, ids.shape[1] :].tolist())
