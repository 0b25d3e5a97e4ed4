"""The rows a run trains and validates on, and the run's length in steps.

    ftrain train --data notes.txt                         # a small file: validation off, a warning
    ftrain train --data notes/ --val-fraction 0.1         # the last tenth validates
    ftrain train --data train.jsonl --eval-data dev.jsonl --epochs 3

    from ftrain.app.recipes import rows
    r = rows.build(cfg)                   # r.loader, r.train, r.valid (None: off), r.off (why)
    cfg = rows.with_length(cfg, r.train)  # --epochs N -> max_steps

``--data`` (or the standard library) and ``--eval-data`` are tokenized once each into their own
cache (``ftrain.app.recipes.corpus``); ``ftrain.data.plan_split`` cuts the first into training and
validation rows, so a corpus too small to validate on trains with validation off and says why.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import NamedTuple

import torch

import ftrain as ft
from ftrain import data
from ftrain.app.config import TrainConfig
from ftrain.app.model_parallel import data_parallel, model_parallel
from ftrain.app.recipes import corpus, placement

__all__ = ["Rows", "build", "rows_per_step", "steps_per_epoch", "with_length"]


class Rows(NamedTuple):
    """What :func:`build` gives."""

    loader: data.Loader  # this process's batches of one global batch: endless, resumable
    train: data.TokenDataset  # the training rows (one epoch indexed; the loader repeats them)
    valid: data.TokenDataset | None  # the validation rows, or None: validation off
    off: str  # why validation is off ("" when it is on)
    how: str  # "documents", "tokens", "eval-data" or "off"


def build(
    cfg: TrainConfig, *, rank: int = 0, world: int = 1, quiet: bool = False, tokenizer=None
) -> Rows:
    """The token builds of ``cfg.data`` (default: the standard library) and ``cfg.eval_data``
    (made once with ``tokenizer``, default bytes, then cached), cut as ``data.plan_split`` says
    (``--val-fraction``; with ``--eval-data`` all of ``--data`` trains), and the train loader
    for process ``rank`` of ``world``.

    **Invariant:** a build too small for validation never fails: validation is off (``valid``
    None), every document trains, and unless ``--val-fraction 0`` or ``--eval-every 0`` said so,
    a one-line warning on stderr names the flags that give validation data. A build shorter than
    one row (``--seq-len`` + 1 tokens) is a ``ValueError`` naming ``--seq-len`` and ``--data`` (or
    ``--eval-data``; a ``DataError``), raised before anything trains.

    In a process group, rank 0 builds (or finds the caches) while the others wait, then every
    process opens the builds (two writers of one folder would race on its files), so the folders
    must be ones all processes see (one machine, or a shared filesystem); a failure on rank 0
    stops every rank (the others with a ``RuntimeError`` quoting it)."""
    cfg = placement.resolve(cfg)  # the batches go to cfg.device, pinned and prefetched
    path = corpus.cache_dir(cfg)
    eval_path = corpus.eval_cache_dir(cfg) if cfg.eval_data else None

    def make() -> None:
        _build_tokens(cfg, corpus.sources(cfg), path, tokenizer, quiet)
        if eval_path is not None:
            _build_tokens(cfg, data.data_files(cfg.eval_data), eval_path, tokenizer, quiet)

    _on_rank0(make, rank, world)
    fraction = 0.0 if cfg.eval_data else cfg.val_fraction
    plan = _plan(path, cfg, fraction, f"--data {cfg.data!r}" if cfg.data else "the corpus")
    open_ = dict(seq_len=cfg.seq_len, seed=cfg.seed, pack=cfg.pack)
    train = data.TokenDataset(path, **open_, **plan.train)
    if eval_path is not None:
        _plan(eval_path, cfg, 0.0, f"--eval-data {cfg.eval_data!r}")  # at least one row
        valid, off, how = data.TokenDataset(eval_path, **open_, splits=(1, 0, 0)), "", "eval-data"
    else:
        valid = data.TokenDataset(path, **open_, **plan.valid) if plan.valid else None
        off, how = plan.reason, plan.how
    if valid is None and not quiet and cfg.eval_every and cfg.val_fraction != 0:
        print(
            f"ftrain train: warning: validation off: {_flags(off)}; every document trains. Pass "
            "--eval-data PATH, or --val-fraction F (cut by tokens when the documents are few); "
            "--val-fraction 0 silences this",
            file=sys.stderr,
        )
    # one global sample order for every number of processes: this process takes its stride of it
    # (under --tp / --pp the processes of a group share one stride: rank = dp * (tp x pp) + ...)
    loader = data.loader(train, cfg.batch_size * cfg.micro_batches, seed=cfg.seed, infinite=True,
                         num_workers=cfg.num_workers, rank=rank // model_parallel(cfg),
                         world_size=data_parallel(cfg, world), device=cfg.device)  # fmt: skip
    return Rows(loader, train, valid, off, how)


def _plan(path, cfg: TrainConfig, fraction: float | None, what: str) -> data.SplitPlan:
    """``data.plan_split`` with its one error (a build shorter than a row) naming the flags, as
    a ``DataError`` (``ftrain train`` reports it as a usage error)."""
    try:
        return data.plan_split(path, cfg.seq_len, fraction)
    except ValueError as e:
        raise data.DataError(f"{what}: {_flags(str(e))}") from None


def _flags(text: str) -> str:
    return text.replace("seq_len", "--seq-len")


def rows_per_step(cfg: TrainConfig, world: int = 1) -> int:
    """Rows of one optimizer step over all processes (the tp x pp processes of a group share
    rows)."""
    return cfg.batch_size * cfg.micro_batches * data_parallel(cfg, world)


def steps_per_epoch(cfg: TrainConfig, train: data.TokenDataset, world: int = 1) -> float:
    """Optimizer steps in one pass over ``train``'s rows (the loader's epoch: ``len(train)``)."""
    return len(train) / rows_per_step(cfg, world)


def with_length(cfg: TrainConfig, train: data.TokenDataset, world: int = 1) -> TrainConfig:
    """``cfg`` with ``--epochs N`` turned into ``max_steps``: the fewest steps that read
    ``N * len(train)`` rows (at least 1), ``epochs`` then None, so the run, its schedule and its
    checkpoints all see one length. Without ``--epochs``, ``cfg`` as it is."""
    if cfg.epochs is None:
        return cfg
    steps = max(1, math.ceil(cfg.epochs * len(train) / rows_per_step(cfg, world)))
    return dataclasses.replace(cfg, max_steps=steps, epochs=None)


def _build_tokens(cfg: TrainConfig, sources, path, tokenizer, quiet: bool) -> None:
    # chats rendered with --chat-template (default: the tokenizer's), roles renamed by --chat-roles
    tokenizer = data.with_chat_template(tokenizer or data.ByteTokenizer(), cfg.chat_template)
    summary = data.build_token_dataset(sources, path, tokenizer, progress=not quiet,
                                       chat_roles=cfg.chat_roles)  # fmt: skip
    if not quiet:
        corpus.report_build(summary)  # what it skipped, and why


def _on_rank0(make, rank: int, world: int) -> None:
    """``make()`` here alone, or in a process group on rank 0 while the others wait for it; rank
    0's failure is sent to them in place of the go-ahead, so that every rank stops with it."""
    if world == 1 or not ft.distributed.is_initialized():
        make()
        return
    failure = None
    if rank == 0:
        try:
            make()
        except Exception as e:
            failure = e
    box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    torch.distributed.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0] is not None:
        raise RuntimeError(f"the token build on rank 0 failed: {box[0]}")
