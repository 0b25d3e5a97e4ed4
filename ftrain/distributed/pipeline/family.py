"""What a model family is to ``ft.pipeline``: a :class:`Family` says where a model's blocks,
embeddings and head are and runs one stage of it (``ftrain.distributed.pipeline.cut`` holds the
built-in GPT's and finds a model's family; ``ftrain.distributed.pipeline.hf`` Hugging Face's).

A module of its own so that the families' modules import it and ``cut`` imports them, with no
import cycle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Family", "refuse_packed"]


@dataclasses.dataclass(frozen=True)
class Family:
    """How a model family runs one stage.

    Attributes:
        name: shown in messages.
        matches: whether a module is of this family.
        blocks: the dotted path of the ``nn.ModuleList`` of blocks (``"transformer.h"``).
        first: paths of the modules only the first stage runs (embeddings).
        last: paths of the modules only the last stage runs (final norm, head); a module whose
            weight is tied to a first-stage one (the head to the embedding) is kept by both.
        run: ``run(module, x, first, last) -> y``: one stage's forward on its pruned module:
            from token ids (``first``) or the previous stage's hidden states, through its
            blocks, to hidden states or (``last``) logits.
        output: ``output(y, args, kwargs)``: what the model call in the loss function
            returns on the last stage, given the stage's output ``y`` and the call's arguments
            (a Hugging Face model's output object; raises for arguments the stages do not
            honour, such as packed rows' positions).
        check: ``check(model)`` raises for a model the stage code cannot run exactly.
        last_reads: ``last_reads(model)``: first-stage modules whose parameters the last
            stage's code reads directly (the built-in GPT's tied head reads ``wte.weight``).
    """

    name: str
    matches: Callable[[nn.Module], bool]
    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    run: Callable[[nn.Module, torch.Tensor, bool, bool], torch.Tensor]
    output: Callable[[torch.Tensor, tuple, dict], Any]
    check: Callable[[nn.Module], None] = lambda model: None
    last_reads: Callable[[nn.Module], tuple[str, ...]] = lambda model: ()


def refuse_packed(kwargs: dict, family: str) -> None:
    """Raise when a model call passes what only a whole-model forward honours."""
    for name in ("position_ids", "attention_mask"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"ft.pipeline ({family}): the stages run causal attention over whole rows, so "
                f"the model call's {name}= is not honoured; train without --pack and without "
                "padding masks (pad targets with -100 instead), or without ft.pipeline."
            )
