"""The settings a run saved, and ``--resume``'s: the run's own, with the flags given over them.

    ftrain train --out runs/a --resume              # the run's settings, as it saved them
    ftrain train --out runs/a --resume --lr 1e-3    # ... with one changed (printed: --lr a -> b)

A run saves its settings in every checkpoint (and in ``config.json``);
``ftrain.app.config.from_args`` reads them back here (:func:`resumed_values`) before any data or
model is built, so a bare ``--resume`` continues the run as it was (model, data, LoRA, packing,
learning rate, precision, logging), a flag given overrides its setting, and a setting that fixes the
run (:data:`RESUME_FIXED`) given with another value is refused by name. Where the run trains is the
resuming machine's choice (:data:`RESOLVED_HERE`, :func:`rehome`).

This module reads only files (``ftrain.io``): ``ftrain.app.config`` and ``ftrain.app.resume`` import
it.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrain.app.settings_file import check_settings
from ftrain.io import CheckpointError, list_checkpoints, load_meta

__all__ = [
    "RESOLVED_HERE",
    "RESUME_FIXED",
    "flag_name",
    "rehome",
    "resumed_values",
    "run_settings",
    "saved_config",
]

# Settings that fix the model, the data or the random stream: a run cannot continue exactly
# with another value. The others (lr, max_steps, logging, ...) may change on --resume.
RESUME_FIXED = ("seed", "seq_len", "d_model", "n_layer", "n_head", "bias", "n_experts", "top_k",
                "batch_size", "data_dir", "model_dir", "data", "pack", "lora_rank", "lora_alpha",
                "lora_targets", "chat_roles", "chat_template")  # fmt: skip
# Where the run trains is the resuming machine's choice: a run recorded on a GPU resumes (or is
# configured again with --config) on a CPU-only machine and the other way round (rehome); a
# change is only noted.
RESOLVED_HERE = ("device", "precision", "tf32")
_PATHS = ("data", "data_dir", "model_dir")  # compared as the folders they name
# How the processes of one launch share the work: any layout continues any other, so a resumed
# run on another number of processes takes these from its flags (the global batch is kept).
_LAYOUT = ("shard", "tp", "pp", "pp_schedule", "pp_microbatches", "sequence_parallel")
# Settings added after checkpoints were first written, with the value those runs had.
_BEFORE_ADDED = {"bias": True}


def flag_name(name: str) -> str:
    """The command-line flag of a ``TrainConfig`` field, without its dashes:
    ``flag_name("d_model") == "d-model"`` (``--d-model``)."""
    return name.replace("_", "-")


def saved_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The run settings saved in a checkpoint's ``meta`` (``ft.load_meta``), ``{}`` if none; a
    setting that did not exist when it was written gets the value runs had then (``bias``: True),
    not today's default."""
    saved = meta["extra"].get("config", {})
    return {**_BEFORE_ADDED, **saved} if saved else {}


def rehome(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's recorded settings for this machine: a GPU ``device`` (``cuda:N``, resolved where
    the run started) becomes ``auto`` (this machine's GPU, or its LOCAL_RANK's, or the CPU when
    it has none), ``cpu`` stays; ``precision`` stays where the device kind does, else ``auto``
    (fp32 on the CPU), except ``fp16``, whose loss scale is part of the state. The rest as
    recorded."""
    device = saved.get("device")
    if not isinstance(device, str) or not device.startswith("cuda"):
        return saved
    from ftrain.app.recipes.placement import resolve_device

    out = {**saved, "device": "auto"}
    if resolve_device("auto").type != "cuda" and out.get("precision") != "fp16":
        out.pop("precision", None)  # auto: fp32 on the CPU
    return out


def run_settings(
    out: str | Path, hints: Mapping[str, Any]
) -> tuple[dict[str, Any], Path, int | None] | None:
    """The settings the run in ``out`` saved, where they were read and on how many processes
    it ran: its newest checkpoint's (the state ``--resume`` continues; one that cannot be read
    is passed over), else its ``config.json`` (a run stopped before its first checkpoint; the
    number of processes unknown: None); None when it has neither.

    Settings not in ``hints`` (the known ones and their types) are dropped (a newer version's),
    and so are ``out``, ``resume`` and ``config`` (not settings of the run); a value of the
    wrong type is a ``ValueError`` naming the file; a recorded GPU is re-resolved here
    (:func:`rehome`)."""
    saved, where, world = None, None, None
    for path in reversed(list_checkpoints(out)):
        try:
            meta = load_meta(path)
            saved, where, world = saved_config(meta), path, meta["extra"].get("world_size")
        except (CheckpointError, OSError, ValueError, KeyError):
            continue
        if saved:
            break
    if not saved and (Path(out) / "config.json").is_file():
        where = Path(out) / "config.json"
        try:
            saved = json.loads(where.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--resume: cannot read {where}: {e}") from None
    if not saved:
        return None
    keep = set(hints) - {"out", "resume", "config"}
    saved = check_settings(
        {k: v for k, v in saved.items() if k in keep}, hints, f"--resume {where}"
    )
    return rehome(saved), where, world


def resumed_values(
    out: str | Path, given: dict[str, Any], hints: Mapping[str, Any]
) -> dict[str, Any]:
    """The settings of ``--resume`` in ``out``: the run's saved ones (:func:`run_settings`) with
    ``given`` (the flags typed and the ``--config`` file's keys) over them. Raising or lowering
    ``--max-steps`` keeps the learning-rate schedule's length (``decay_steps`` = the run's
    ``max_steps``) unless ``--decay-steps`` is given. ``given`` alone when ``out`` holds no run.

    **Invariant:** the result differs from the saved settings only in keys of ``given``, in
    ``decay_steps`` as said, and on another number of processes than the run's in its layout
    (``--shard``, ``--tp`` as flagged) with its global batch kept; a setting of :data:`RESUME_FIXED` given with another value is a
    ``ValueError`` naming each (saved -> new), raised before any data is built."""
    found = run_settings(out, hints)
    if found is None:  # nothing saved: the loop starts from step 0 and says so
        return given
    saved, where, world = found
    if world != int(os.environ.get("WORLD_SIZE", "1")):  # another launch: its own layout
        saved = _relaid(saved, world, given)
    fixed = [
        f"--{flag_name(k)} {saved[k]!r} -> {v!r}"
        for k, v in given.items()
        if k in RESUME_FIXED and k in saved and not _same(k, saved[k], v)
    ]
    if fixed:
        raise ValueError(
            f"--resume: these settings differ from the run's ({where}) and would not continue "
            f"the same run: {', '.join(fixed)} (saved -> new); drop them (--resume takes the "
            "run's own), or train into another --out for a new run"
        )
    values = {**saved, **given}
    steps_changed = "max_steps" in given and given["max_steps"] != saved.get("max_steps")
    shaped = values.get("lr_schedule") != "constant" and not _warms_up_itself(
        values.get("optimizer", "adamw")
    )
    if steps_changed and shaped and "decay_steps" not in given and saved.get("decay_steps") is None:
        values["decay_steps"] = saved.get("max_steps")  # the schedule keeps its length
    return values


def _relaid(saved: dict[str, Any], world: int | None, given: dict[str, Any]) -> dict[str, Any]:
    """``saved`` for a launch of another number of processes than the run's (``world``; None:
    unknown): the layout (:data:`_LAYOUT`) as the flags say, and the global batch kept
    (``global_batch_size``, from which the loop sets the micro-batches for this launch)."""
    out = {k: v for k, v in saved.items() if k not in _LAYOUT}
    if world and "micro_batches" not in given and out.get("global_batch_size") is None:
        data_parallel = world // (saved.get("tp", 1) * saved.get("pp", 1))
        rows = saved.get("batch_size", 1) * saved.get("micro_batches", 1) * data_parallel
        out["global_batch_size"] = rows
    return out


def _same(key: str, a: Any, b: Any) -> bool:
    if key in _PATHS and a is not None and b is not None:
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def _warms_up_itself(optimizer: str) -> bool:
    """Whether the ``--optimizer`` takes ``warmup_steps`` (schedule-free: no decay schedule)."""
    from ftrain.optim import OPTIMIZERS

    make = OPTIMIZERS.get(optimizer)
    return make is not None and "warmup_steps" in inspect.signature(make).parameters
