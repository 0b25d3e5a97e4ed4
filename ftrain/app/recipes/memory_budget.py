"""``ftrain train --memory-budget 4GiB``: the built-in recipe's settings fitted with ``ft.fit``.

The model is built on the ``meta`` device and the step planned on fake tensors, so fitting costs
seconds and no memory, before anything is allocated for real.
"""

from __future__ import annotations

import dataclasses

import torch

import ftrain as ft
from ftrain.app.config import TrainConfig
from ftrain.app.recipes import gpt, placement
from ftrain.memory.fit import fit
from ftrain.memory.report import FitReport, parse_bytes

__all__ = ["fit_config", "budget_bytes"]


def budget_bytes(budget: str, device: str | torch.device | None = None) -> int:
    """``--memory-budget``: a size (``"4GiB"``), or ``"auto"``: the free memory of the CUDA
    ``device`` the run trains on (default: the current one; there is no free-memory figure to
    trust for a CPU process)."""
    if budget == "auto":
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if device is None or torch.device(device).type != "cuda":
            raise ValueError(
                f"--memory-budget auto reads the free memory of the GPU the run trains on, and "
                f"this run trains on {device or 'the CPU'}; give a size, e.g. --memory-budget 4GiB"
            )
        return torch.cuda.mem_get_info(device)[0]
    return parse_bytes(budget, "--memory-budget")


def fit_config(cfg: TrainConfig) -> tuple[TrainConfig, FitReport]:
    """``cfg`` with ``micro_batches``, ``batch_size``, ``checkpoint_policy``, ``precision`` (and,
    when sharded, ``shard``) chosen by :func:`ftrain.fit` so that a step fits
    ``cfg.memory_budget`` bytes per process. The rows of one optimizer step per process,
    ``batch_size x micro_batches``, stay as they were: only how they are split changes. Nothing
    fits: ``SystemExit`` with ``ft.fit``'s message."""
    budget = budget_bytes(cfg.memory_budget, placement.resolve_device(cfg.device))
    rows = cfg.batch_size * cfg.micro_batches
    with torch.device("meta"):
        model = gpt.build_model(cfg)
    opt = gpt.build_optimizer(cfg)
    step = gpt.build_step(cfg, model, opt)
    params = ft.params_of(model)
    batch = {
        k: torch.empty(rows, cfg.seq_len, dtype=torch.long, device="meta")
        for k in ("input", "target")
    }
    counts = tuple(k for k in (1, 2, 4, 8, 16, 32, 64) if rows % k == 0)
    precisions = ("fp32", "bf16") if cfg.precision != "fp16" else ("fp16",)
    try:
        _, report = fit(step, params, batch, budget, micro_batches=counts, precisions=precisions)
    except MemoryError as e:  # the command's message and exit status, not a traceback
        raise SystemExit(f"ftrain train: --memory-budget {cfg.memory_budget}: {e}") from None
    c = report.chosen
    new = dataclasses.replace(
        cfg,
        micro_batches=c.micro_batches,
        batch_size=rows // c.micro_batches,
        checkpoint_policy=c.policy,
        precision=c.precision,
        shard=c.strategy or cfg.shard,
    )
    return new, report
