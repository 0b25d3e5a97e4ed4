"""Recipes: Python functions that build what a run trains from its settings (a ``TrainConfig``).

    from ftrain.app.recipes import gpt
    recipe = gpt.build(cfg)        # model, composed step, initial state, loader, validation set

A recipe is plain code, not configuration: a new model, dataset or composition of transforms is a
new function, so the command line does not grow a flag for each. ``gpt`` is the built-in one that
``ftrain train`` runs (a byte-level GPT on the Python standard library); ``hf`` trains a Hugging
Face model from a folder (``ftrain train --model-dir DIR``).
"""

from pathlib import Path

from ftrain.app.recipes import gpt, hf

__all__ = ["for_config", "gpt", "hf", "sample"]


def for_config(cfg):
    """The recipe module that trains ``cfg``: ``hf`` with ``--model-dir``, else ``gpt``. Both
    have ``build(cfg, rank=, world=, quiet=)`` and ``sample_text(model, params, prompt, n, ...)``."""
    return hf if cfg.model_dir else gpt


def sample(
    run: str | Path,
    prompt: str | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int = 0,
    *,
    chat: str | None = None,
    model_dir: str | None = None,
) -> str:
    """``ftrain sample``: the recipe's ``sample_text`` from the newest valid checkpoint of the run
    folder ``run`` (or the checkpoint folder ``run``), with the model its saved settings describe
    (the built-in GPT, or the ``--model-dir`` folder's: ``model_dir`` points elsewhere) and the
    params ``gpt.eval_params`` gives; ``chat``: the reply to that user message. See
    ``ftrain.app.recipes.finetune.sample``."""
    from ftrain.app.recipes import finetune

    return finetune.sample(run, prompt, max_new_tokens, temperature, top_k, seed, chat=chat,
                           model_dir=model_dir)  # fmt: skip
