"""``ftrain train --resume``: the run's own settings, whether a checkpoint continues this run,
and its state.

    ftrain train --out runs/a --resume              # the run's settings, as it saved them
    ftrain train --out runs/a --resume --lr 1e-3    # ... with one changed (printed: --lr a -> b)

A resumed run is the same run: it takes the settings the run saved (:func:`resumed_values`; flags
given override them), and those that fix the model, the data or the random stream
(:data:`RESUME_FIXED`) and the global batch cannot change. It may run on another number of
processes (the sample order is global), on another machine (:data:`RESOLVED_HERE`) and with
another learning rate (set in the optimizer state). Every check runs before data or a tensor is
loaded and names the flag that fixes it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import ftrain as ft
from ftrain.app import run_folder
from ftrain.app.config import TrainConfig
from ftrain.app.recipes import gpt
from ftrain.app.run_settings import (
    RESOLVED_HERE,
    RESUME_FIXED,
    flag_name,
    resumed_values,
    run_settings,
)

__all__ = [
    "RESOLVED_HERE",
    "RESUME_FIXED",
    "check_global_batch",
    "check_resumed_config",
    "load_checked",
    "resumed_values",
    "run_settings",
]


def load_checked(
    latest: Path,
    meta: dict,
    cfg: TrainConfig,
    like: ft.TrainState,
    world: int,
    main: bool,
    pipeline: Any = None,
) -> ft.TrainState:
    """The state of the checkpoint ``latest`` (whose metadata is ``meta``) laid out as ``like``
    (this process's stages of ``pipeline``, under ``--pp``: a collective), once it is known to
    continue the run ``cfg`` on ``world`` processes; with ``cfg.lr`` as its peak learning rate.
    Raises ``SystemExit`` naming what differs and the flag that fixes it; notes (on the main
    process) go to stderr."""
    if len(meta["extra"].get("loaders", [])) > 1:  # per-process positions: an older ftrain's
        raise SystemExit(
            f"ftrain train: --resume: {latest} holds one data position per process, from an "
            "ftrain whose sample order depended on the number of processes; this one cannot "
            "continue it. Start a new --out from its state (ft.load) instead."
        )
    saved = run_folder.saved_config(meta)
    check_global_batch(cfg, saved, meta, world)
    check_resumed_config(cfg, saved, main)
    state = _load_state(latest, meta, like, saved, pipeline)
    if "lr" in saved and saved["lr"] != cfg.lr:
        state = gpt.set_peak_lr(state, cfg.lr)
        if main:
            print(
                f"ftrain train: --resume: --lr {saved['lr']!r} -> {cfg.lr!r}: the optimizer "
                f"continues with peak learning rate {cfg.lr!r} (its schedule keeps its shape and "
                "position)",
                file=sys.stderr,
            )
    return state


def _load_state(
    latest: Path, meta: dict, like: ft.TrainState, saved: dict, pipeline: Any
) -> ft.TrainState:
    """The checkpoint's state. A checkpoint written before the recipe injected its peak learning
    rate holds the optimizer's state without the ``inject_hyperparams`` layer: it is loaded as
    that inner state and wrapped, with the peak it was trained with."""
    if "hyperparams" in meta["tree"]["opt_state"]:
        return ft.load(latest, like=like, pipeline=pipeline)
    inner_like = like.replace(opt_state=like.opt_state["inner_state"])
    inner = ft.load(latest, like=inner_like, pipeline=pipeline)
    opt_state = like.opt_state.clone()
    opt_state["count"] = inner.step.clone()  # the updates applied so far
    opt_state["hyperparams", "learning_rate"].fill_(saved.get("lr", 0.0))
    opt_state["inner_state"] = inner.opt_state
    return inner.replace(opt_state=opt_state)


def check_global_batch(cfg: TrainConfig, saved: dict, meta: dict, world: int) -> None:
    """A resumed run may have another number of processes (the sample order is global), but the
    same global batch: refuse another one, naming the flag that keeps it. ``world`` counts the
    processes that split the batch (under ``--tp`` / ``--pp``, the processes / (tp x pp))."""
    split = saved.get("tp", 1) * saved.get("pp", 1)
    was = meta["extra"].get("world_size", 1) // split  # data-parallel processes
    then = saved.get("batch_size", cfg.batch_size) * saved.get("micro_batches", 1) * was
    now = cfg.batch_size * cfg.micro_batches * world
    if then != now:
        raise SystemExit(
            f"ftrain train: --resume: the checkpoint's global batch is {then} rows a step "
            f"({saved.get('micro_batches', 1)} micro-batch(es) x {was} process(es)), this run's "
            f"is {now} ({cfg.micro_batches} x {world}); the run would not continue as it would "
            f"have. Pass --global-batch-size {then} (micro-batches are then set for {world} "
            "process(es))."
        )


_NOT_COMPARED = ("out", "resume", "config", "progress")


def check_resumed_config(cfg: TrainConfig, saved: dict[str, Any], main: bool) -> None:
    """On --resume: a setting of RESUME_FIXED that differs from the checkpoint's is a usage error
    (exit 2) naming each, saved and new value; other changes get a one-line note on stderr."""
    now = cfg.to_dict()
    diff = {
        k: (saved[k], now[k])
        for k in now
        if k in saved and k not in _NOT_COMPARED and saved[k] != now[k]
    }
    fixed = [f"--{flag_name(k)} {a!r} -> {b!r}" for k, (a, b) in diff.items() if k in RESUME_FIXED]
    if fixed:
        print(
            f"ftrain train: error: --resume: these settings differ from the checkpoint's and "
            f"would not continue the same run: {', '.join(fixed)} (saved -> new); drop them "
            "(ftrain train --resume takes the run's own), or train into another --out",
            file=sys.stderr,
        )
        raise SystemExit(2)
    here = [f"--{flag_name(k)} {a!r} -> {b!r}" for k, (a, b) in diff.items() if k in RESOLVED_HERE]
    if here and main:
        print(
            f"ftrain train: note: --resume on this machine: {', '.join(here)} (the state "
            "continues from the checkpoint; only where and in what precision the step runs "
            "changes)",
            file=sys.stderr,
        )
    # A changed --lr is set in the optimizer state, and said so, by load_checked.
    changed = {
        k: f"--{flag_name(k)} {a!r} -> {b!r}"
        for k, (a, b) in diff.items()
        if k != "lr" and k not in RESOLVED_HERE
    }
    steps, decay = diff.get("max_steps"), diff.get("decay_steps")
    if steps and decay and decay == (None, steps[0]):  # resumed_values kept the schedule's length
        del changed["decay_steps"]
        changed["max_steps"] += (
            f" (the learning-rate schedule keeps its length: --decay-steps {steps[0]}, as the "
            f"run had it; pass --decay-steps {steps[1]} to stretch it over the new steps)"
        )
    if changed and main:
        print(
            "ftrain train: note: --resume with changed settings: " + ", ".join(changed.values()),
            file=sys.stderr,
        )
