"""What a run is about to do, printed by ``ftrain train`` before the first step, after the line
of ``placement.describe`` (device, precision, kernels), which it prints before building anything:

    ftrain train: device cpu (AMD EPYC, 2 threads); precision fp32; ...    (placement.describe)
    ftrain train: data: --data data/: 203 documents, 8,609 tokens
      training: 8 rows x 64 tokens per step, 16.8 steps per epoch; 30 steps = 1.79 epochs
      validation: 23 documents, 996 tokens (the last documents of the data)
      params: 8,192 trainable, 37,760 frozen (LoRA rank 8 adapters; the model's own frozen)

(docs/finetune.md's LoRA run of a tiny GPT-2.)
"""

from __future__ import annotations

from typing import Any

import ftrain as ft
from ftrain.app.config import TrainConfig
from ftrain.app.recipes import rows

__all__ = ["summary"]

_HOW = {
    "documents": "the last documents of the data",
    "tokens": "the last tokens of the data: too few documents to split by document",
    "eval-data": "--eval-data",
}


def summary(cfg: TrainConfig, built: rows.Rows, state: ft.TrainState, world: int = 1) -> str:
    """The startup summary of the resolved ``cfg``'s run (lines, no trailing newline): the
    training data (documents, tokens), rows per step, steps per epoch and the epochs the run
    covers, the validation rows or why validation is off, and the trainable and frozen params
    (LoRA's frozen base). The device and precision are ``placement.describe``'s line, which
    ``ftrain train`` prints before building anything (so it shows before a long tokenization).

    **Invariant:** every number is read from the datasets and the state the run trains with,
    not from the settings' defaults (the test recounts them from the data)."""
    train, valid = built.train, built.valid
    what = f"--data {cfg.data}" if cfg.data else "the Python standard library"
    per_epoch = rows.steps_per_epoch(cfg, train, world)
    covers = cfg.max_steps / per_epoch if per_epoch else float("inf")
    if valid is None:
        validation = f"validation off: {built.off.replace('seq_len', '--seq-len')}"
    else:
        where = _HOW[built.how] + (f" {cfg.eval_data}" if built.how == "eval-data" else "")
        validation = f"validation: {_amount(valid)} ({where})"
    trainable = ft.param_count(state.params)
    frozen = ft.param_count(state.extra["lora", "base"]) if "lora" in state.extra.keys() else 0
    lora = f" (LoRA rank {cfg.lora_rank} adapters; the model's own frozen)" if frozen else ""
    return "\n".join([
        f"ftrain train: data: {what}: {_amount(train)}",
        f"  training: {rows.rows_per_step(cfg, world)} rows x {cfg.seq_len} tokens per step, "
        f"{per_epoch:.1f} steps per epoch; {cfg.max_steps} steps = {covers:.2f} epochs",
        f"  {validation}",
        f"  params: {trainable:,} trainable, {frozen:,} frozen{lora}",
    ])  # fmt: skip


def _amount(ds: Any) -> str:
    n = len(ds.doc_range)
    return f"{n:,} document{'s' if n != 1 else ''}, {ds.tokens_per_epoch:,} tokens"
