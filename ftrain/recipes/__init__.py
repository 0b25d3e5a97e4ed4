"""Recipes: Python functions that build what a run trains from its settings (a ``TrainConfig``).

    from ftrain.recipes import gpt
    recipe = gpt.build(cfg)        # model, composed step, initial state, loader, validation set

A recipe is plain code, not configuration: a new model, dataset or composition of transforms is a
new function, so the command line does not grow a flag for each. ``gpt`` is the built-in one that
``ftrain train`` runs (a byte-level GPT on the Python standard library); ``hf`` trains a Hugging
Face model from a folder (``ftrain train --model-dir DIR``).
"""

from ftrain.recipes import gpt, hf

__all__ = ["for_config", "gpt", "hf"]


def for_config(cfg):
    """The recipe module that trains ``cfg``: ``hf`` with ``--model-dir``, else ``gpt``. Both
    have ``build(cfg, rank=, world=, quiet=)`` and ``sample_text(model, params, prompt, n, ...)``."""
    return hf if cfg.model_dir else gpt
