"""Where a model is cut into pipeline stages, and each stage's own module.

**Rule:** a stage is a run of consecutive blocks (the model's repeated layers), the first stage
also holding what comes before them (embeddings) and the last what comes after (final norm,
head). Stages are cut at block boundaries only, evenly by default (earlier stages take the
remainder), or where the caller says (the number of blocks of each stage).

A stage's module is a pruned copy of the model: the blocks of other stages and the parts of the
other ends removed, parameters on the ``meta`` device (the step gives them as data, as
``ft.apply`` does everywhere), buffers copied. So the names of its parameters are the model's own
(``blocks.3.attn.qkv.weight``), and every rewrite that finds modules by name or by class
(``ft.checkpoint``'s blocks, a tensor-parallel plan) finds them there. A parameter tied across
stages (a GPT's embedding reused by its head) is held by both stages and keeps the model's key.

What a stage runs is the model family's own code, chosen by :func:`family_of` (the built-in GPT,
Hugging Face GPT-2 and Llama); a family is three module lists and a function, so another model
family is a :class:`Family` away.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

# Family and refuse_packed live in their own module, which the families' modules (hf.py) import
# without importing this one (families() imports them: no cycle); kept here under their names.
from ftrain.distributed.pipeline.family import Family, refuse_packed

__all__ = [
    "Family",
    "GPT_FAMILY",
    "families",
    "family_of",
    "refuse_packed",
    "blocks_of",
    "even_split",
    "check_split",
    "stage_ranks",
    "StageCut",
    "cut",
    "stage_module",
]


def _gpt_run(m: nn.Module, x: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
    if first:  # (B, T) token ids -> (B, T, d)
        pos = torch.arange(x.shape[1], device=x.device)
        x = m.drop(m.wte(x) + m.wpe(pos))
    for block in m.blocks:
        x, _ = block(x, None)
    if last:  # (B, T, d) -> (B, T, vocab)
        x = m.ln_f(x)
        x = m.head_matmul(x, m.wte.weight) if m.lm_head is None else m.lm_head(x)
    return x


def _gpt_output(y: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    refuse_packed(kwargs, "ftrain GPT")
    return (y, {}) if kwargs.get("return_aux") else y


def _gpt_check(model: nn.Module) -> None:
    if model.config.n_experts:
        raise ValueError(
            "ft.pipeline: a mixture-of-experts GPT (n_experts > 0) adds each block's balance "
            "loss to the loss, which the stages do not pass on; pipeline a dense GPT."
        )


def _is_gpt(module: nn.Module) -> bool:
    from ftrain.models.gpt import GPT

    return isinstance(module, GPT)


GPT_FAMILY = Family(
    name="ftrain GPT",
    matches=_is_gpt,
    blocks="blocks",
    first=("wte", "wpe", "drop"),
    last=("ln_f", "lm_head"),
    run=_gpt_run,
    output=_gpt_output,
    check=_gpt_check,
    last_reads=lambda model: ("wte",) if model.lm_head is None else (),
)


def families() -> tuple[Family, ...]:
    """The families :func:`family_of` knows, tried in order: the built-in GPT, then Hugging
    Face's (``ftrain.distributed.pipeline.hf``; transformers is imported only to match them)."""
    from ftrain.distributed.pipeline.hf import HF_FAMILIES

    return (GPT_FAMILY, *HF_FAMILIES)


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` that runs ``model``'s stages; raises naming the supported ones."""
    known = families()
    for family in known:
        if family.matches(model):
            return family
    names = ", ".join(f.name for f in known)
    raise ValueError(
        f"ft.pipeline: no stage code for a {type(model).__name__} (supported: {names}). "
        "Pass family=ft.distributed.pipeline.Family(...) for your model."
    )


def _get(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def blocks_of(model: nn.Module, family: Family) -> nn.ModuleList:
    blocks = _get(model, family.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            f"ft.pipeline: {type(model).__name__}.{family.blocks} is not an nn.ModuleList of "
            f"blocks ({family.name}'s layout)."
        )
    return blocks


def even_split(n_blocks: int, n_stages: int) -> list[int]:
    """Blocks per stage, as even as they go (earlier stages take one more)."""
    per, extra = divmod(n_blocks, n_stages)
    return [per + (1 if s < extra else 0) for s in range(n_stages)]


def check_split(
    split: Sequence[int] | Sequence[Sequence[str]], n_blocks: int, n_stages: int, blocks: str
) -> list[int]:
    """Blocks per stage from ``split``: the counts themselves, or each stage's blocks by module
    name (``[["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]``, ``blocks`` the path of their
    list), in order. Raises unless every stage gets at least one block and each block is in one
    stage, in the model's order."""
    split = list(split)
    if split and all(not isinstance(s, (int, str)) for s in split):  # names per stage
        names = [f"{blocks}.{i}" for i in range(n_blocks)]
        given = [n for stage in split for n in stage]
        if given != names:
            raise ValueError(
                f"ft.pipeline(stages=...): name every block of {blocks} once, in order, each "
                f"stage a run of them ({names[:2]}... for the first); got {given[:4]}..."
            )
        split = [len(stage) for stage in split]
    if (
        len(split) != n_stages
        or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in split)
        or sum(split) != n_blocks
    ):
        raise ValueError(
            f"ft.pipeline(stages={split!r}): give the number of blocks of each of the "
            f"{n_stages} stages, each at least 1, summing to the model's {n_blocks} blocks "
            f"(e.g. {even_split(n_blocks, n_stages)}), or leave stages out for an even cut."
        )
    return split


def stage_ranks(pp: int, per_rank: int, v_shape: bool) -> list[list[int]]:
    """The stages each pipeline rank runs: looped (rank r holds r, r + pp, ...), or for the
    V-shaped schedules (zero-bubble V) r and 2 pp - 1 - r."""
    if v_shape:
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + k * pp for k in range(per_rank)] for r in range(pp)]


@dataclasses.dataclass(frozen=True)
class StageCut:
    """One stage: its index among ``n`` stages and its blocks (indices into the model's list)."""

    index: int
    n: int
    blocks: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.n - 1


def cut(split: Sequence[int]) -> list[StageCut]:
    """The stages of a model cut ``split`` (blocks per stage)."""
    out, start = [], 0
    for s, k in enumerate(split):
        out.append(StageCut(s, len(split), tuple(range(start, start + k))))
        start += k
    return out


def stage_module(model: nn.Module, family: Family, stage: StageCut) -> tuple[nn.Module, dict]:
    """A pruned copy of ``model`` for ``stage`` (see the module's rule), and the map from each of
    its parameter names to the model's key for that tensor (``ft.params_of``'s name: the first of
    a tied group). ``model`` is not modified and no parameter's data is copied."""
    key_of: dict[int, str] = {}
    for name, p in model.named_parameters():  # one name per tensor: the first, as params_of
        key_of[id(p)] = name
    memo: dict[int, object] = {}
    orig: dict[int, str] = {}
    for p in model.parameters():
        stand_in = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        memo[id(p)] = stand_in
        orig[id(stand_in)] = key_of[id(p)]
    module = copy.deepcopy(model, memo)
    blocks = blocks_of(module, family)
    kept = nn.ModuleList()
    # under their model indices, so the parameter names are the model's (blocks.3...)
    for i in stage.blocks:
        kept._modules[str(i)] = blocks[i]
    *parent, leaf = family.blocks.split(".")
    setattr(_get(module, ".".join(parent)) if parent else module, leaf, kept)
    tied = _tied_to_first(model, family)
    drop = [] if stage.first else list(family.first)
    if not stage.last:
        drop += list(family.last)
    for path in drop:
        if stage.last and path in tied:
            continue  # the head's weight, tied to this embedding: the last stage needs it
        *parent, leaf = path.split(".")
        owner = _get(module, ".".join(parent)) if parent else module
        if owner is not None and getattr(owner, leaf, None) is not None:
            setattr(owner, leaf, None)
    names = {n: orig[id(p)] for n, p in module.named_parameters()}
    # its forward: the stage's code (a subclass made here, so rewrites that copy the module
    # keep it, and isinstance checks on the model's class still hold)
    cls = type(module)
    module.__class__ = type(f"{cls.__name__}Stage", (cls,), {"forward": _stage_forward})
    module.pipeline_stage = (family, stage.first, stage.last)
    return module, names


def _stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    family, first, last = self.pipeline_stage
    return family.run(self, x, first, last)


def _tied_to_first(model: nn.Module, family: Family) -> set[str]:
    """The first-stage modules the last stage needs too: those holding a parameter that a
    last-stage module also holds (a head tied to the embedding), and the family's own."""
    last = set()
    for path in family.last:
        m = _get(model, path)
        if m is not None:
            last |= {id(p) for p in m.parameters()}
    out = set(family.last_reads(model))
    for path in family.first:
        m = _get(model, path)
        if m is not None and any(id(p) in last for p in m.parameters()):
            out.add(path)
    return out
