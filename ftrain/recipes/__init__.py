"""Recipes: Python functions that build what a run trains from its settings (a ``TrainConfig``).

    from ftrain.recipes import gpt
    recipe = gpt.build(cfg)        # model, composed step, initial state, loader, validation set

A recipe is plain code, not configuration: a new model, dataset or composition of transforms is a
new function, so the command line does not grow a flag for each. ``gpt`` is the built-in one that
``ftrain train`` runs (a byte-level GPT on the Python standard library); ``hf`` trains a Hugging
Face model from a folder (``ftrain train --model-dir DIR``).
"""

from pathlib import Path

import ftrain as ft
from ftrain.recipes import gpt, hf

__all__ = ["for_config", "gpt", "hf", "sample"]


def for_config(cfg):
    """The recipe module that trains ``cfg``: ``hf`` with ``--model-dir``, else ``gpt``. Both
    have ``build(cfg, rank=, world=, quiet=)`` and ``sample_text(model, params, prompt, n, ...)``."""
    return hf if cfg.model_dir else gpt


def sample(
    run: str | Path,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int = 0,
) -> str:
    """``ftrain sample``: the recipe's ``sample_text`` from the newest valid checkpoint of the run
    folder ``run`` (or the checkpoint folder ``run``), with the model its saved settings describe
    (the built-in GPT, or the ``--model-dir`` folder's) and the params ``gpt.eval_params`` gives."""
    latest, cfg = gpt.run_config(run)
    recipe = for_config(cfg)
    model, params = recipe.build_model(cfg), gpt.eval_params(cfg, ft.load(latest))
    return recipe.sample_text(
        model, params, prompt, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
    )
