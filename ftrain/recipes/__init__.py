"""Recipes: Python functions that build what a run trains from its settings (a ``TrainConfig``).

    from ftrain.recipes import gpt
    recipe = gpt.build(cfg)        # model, composed step, initial state, loader, validation set

A recipe is plain code, not configuration: a new model, dataset or composition of transforms is a
new function, so the command line does not grow a flag for each. ``gpt`` is the built-in one that
``ftrain train`` runs (a byte-level GPT on the Python standard library).
"""

from ftrain.recipes import gpt

__all__ = ["gpt"]
