"""Run folders: ``checkpoint-<step>/`` checkpoints, the newest ``keep`` kept, resumed from the newest
one that verifies::

    path = ft.latest_checkpoint("runs/gpt")           # None on a fresh run
    if path is not None:
        state = ft.load(path, like=state)             # refuses a checkpoint of another model
        loader.load_state_dict(ft.load_meta(path)["extra"]["loader"])
    ...
    ft.save_checkpoint("runs/gpt", state, keep=3, extra={"loader": loader.state_dict()})

Each checkpoint is written and pruned atomically (:mod:`ftrain.io.atomic`), so a run killed at any
moment resumes from a whole checkpoint, and never from a partly written or partly deleted one under
a checkpoint name. One process writes a run folder at a time: under ``torchrun`` that is rank 0.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ftrain.io import atomic
from ftrain.io.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    Snapshot,
    snapshot,
    verify_checkpoint,
)
from ftrain.state import TrainState

__all__ = ["latest_checkpoint", "list_checkpoints", "save_checkpoint"]

_RUN_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def save_checkpoint(
    run_dir: str | os.PathLike,
    state: TrainState | Snapshot,
    *,
    keep: int | None = 3,
    extra: Mapping | None = None,
    group: Any = None,
    pipeline: Any = None,
) -> Path:
    """Save ``state`` to ``run_dir/checkpoint-<step>/`` and keep the newest ``keep`` checkpoints.

    Same guarantees as :func:`~ftrain.io.checkpoint.save` (atomic, verified, no pickle). Before
    writing, what interrupted saves left in ``run_dir`` is cleaned up. After writing, the
    checkpoints beyond the ``keep`` with the highest steps are deleted (each renamed away first, so
    a kill mid-delete leaves no half checkpoint under a checkpoint name); the one just written is
    always kept. ``keep=None`` keeps all. Returns the path written.

    A sharded state (or ``Snapshot`` of one, as ``ft.Saver`` passes) is saved by every process
    of ``group`` (default: all) together, and rank 0 alone tidies and prunes the run folder;
    so is a pipelined one, given its ``pipeline`` (see :func:`~ftrain.io.checkpoint.save`).
    """
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(
            f"ft.save_checkpoint(keep=...): keep must be an int >= 1 or None, got {keep!r}."
        )
    if isinstance(state, Snapshot) and extra is not None:
        raise ValueError(
            "ft.save_checkpoint(snapshot, extra=...): a Snapshot carries its extra already; pass "
            "extra to ftrain.io.checkpoint.snapshot(state, extra) instead."
        )
    run_dir = Path(run_dir)
    snap = state if isinstance(state, Snapshot) else snapshot(state, extra, pipeline=pipeline)
    main = snap.plan is None or dist.get_rank(group) == 0
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in {lo.target for lo in _run_leftovers(run_dir)}:
            atomic.recover(run_dir / name)
    path = snap.write(run_dir / f"checkpoint-{snap.step}", group)
    if main and keep is not None:
        older = [p for p in list_checkpoints(run_dir) if p != path]
        for stale in older[: max(0, len(older) + 1 - keep)]:
            atomic.delete_dir(stale)
    return path


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-<step>`` directories in ``run_dir`` by step, oldest first (unverified)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [
        (int(m[1]), entry)
        for entry in run_dir.iterdir()
        if (m := _RUN_CHECKPOINT.fullmatch(entry.name)) and entry.is_dir()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint in ``run_dir`` that verifies, or None if there is none.

    Each candidate, newest step first, is verified as ``load`` would (meta.json checksum, every
    file present with its sha256). A broken one is passed over with a :class:`CheckpointWarning`
    naming it and why; so is what an interrupted save left (a ``.tmp-``/``.del-`` directory). If a
    save was interrupted while replacing ``checkpoint-<step>``, the previous version
    (``checkpoint-<step>.old-<token>``) is a candidate in its place.
    """
    run_dir = Path(run_dir)
    candidates = {int(p.name.split("-")[1]): p for p in list_checkpoints(run_dir)}
    for lo in _run_leftovers(run_dir):
        step = int(_RUN_CHECKPOINT.fullmatch(lo.target)[1])
        if lo.kind == "old" and step not in candidates:
            candidates[step] = lo.path
            continue
        warnings.warn(
            f"{lo.path} was left by an interrupted checkpoint save or delete; ignoring it (the "
            "next ft.save_checkpoint removes it).",
            CheckpointWarning,
            stacklevel=2,
        )
    for step in sorted(candidates, reverse=True):
        path = candidates[step]
        try:
            verify_checkpoint(path)
        except (CheckpointError, KeyError, TypeError, OSError) as e:
            warnings.warn(f"skipping checkpoint {path}: {e}", CheckpointWarning, stacklevel=2)
            continue
        return path
    return None


def _run_leftovers(run_dir: Path) -> list[atomic.Leftover]:
    """Leftovers of checkpoints in ``run_dir``, by name."""
    return [lo for lo in atomic.find_leftovers(run_dir) if _RUN_CHECKPOINT.fullmatch(lo.target)]
