"""Whole-tensor params from any checkpoint, whole or sharded: :func:`consolidate`.

    ft.consolidate("runs/a/checkpoint-1200", "export/")   # export/model.safetensors
    ftrain consolidate --run runs/a --out export/           # the same, from the newest checkpoint

Past ``max_shard_size`` bytes the params are split in Hugging Face's sharded layout::

    export/model-00001-of-00003.safetensors ... model-00003-of-00003.safetensors
    export/model.safetensors.index.json   # {"metadata": {"total_size": N}, "weight_map": {...}}

Each file is an ordinary state dict (keys are module paths), so ``module.load_state_dict`` loads
it, and ``transformers``' ``from_pretrained`` reads the layout. One whole tensor is in memory at a
time, read from the pieces of a sharded checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from ftrain.internals.units import parse_bytes
from ftrain.io import atomic, reshard, tensorfile
from ftrain.io.checkpoint import load_meta
from ftrain.io.runs import latest_checkpoint
from ftrain.io.state_files import CheckpointError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "consolidate"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def consolidate(
    path: str | os.PathLike, out: str | os.PathLike, *, max_shard_size: int | str = "5GB"
) -> list[Path]:
    """Write the params of the checkpoint ``path`` as whole tensors to the directory ``out``.

    ``path`` is a checkpoint directory (whole or sharded, by any number of processes) or a run
    folder (its newest checkpoint that verifies). Every file read is verified (sha256) first.
    The params go to ``out/model.safetensors``, or, if they exceed ``max_shard_size`` bytes, to
    ``model-0000k-of-0000n.safetensors`` files of at most that size each (a tensor larger than
    the limit gets a file of its own) plus ``model.safetensors.index.json`` mapping each name to
    its file, as Hugging Face writes them. Keys are module paths: ``module.load_state_dict``
    loads each file (``strict=False`` across files of a split). ``out`` is committed atomically
    (it may not hold anything but such files). Returns the tensor files written, in order.
    Runs in one process; holds one whole tensor at a time. A LoRA run's checkpoint (adapters
    only) is refused with the ``ftrain export`` command that merges it.
    """
    limit = parse_bytes(max_shard_size, "max_shard_size")
    path = Path(path)
    if path.is_dir() and not (path / "meta.json").exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"ft.consolidate: no checkpoint in {path} that verifies.")
        path = latest
    meta = load_meta(path)
    if "lora" in meta["tree"].get("extra", {}):  # params: adapters, which load into no model
        raise ValueError(
            f"ft.consolidate: {path} is a LoRA run's checkpoint: its params are the adapters "
            "(the frozen base is the model's own weights, not saved), which no model loads. "
            f"Write the merged model with: ftrain export --run {path} --out {out} (or add "
            "--adapter for a PEFT adapter folder)"
        )
    index = reshard.index_of(meta)
    names = [k for k in index if k.startswith("params.")]
    groups, size = [[]], 0
    for key in names:
        n = reshard.nbytes(index[key])
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_out(out)
    total = len(groups)
    files = (
        [SINGLE_FILE]
        if total == 1
        else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
    )
    weight_map = {}
    with atomic.write_dir(out) as tmp, contextlib.ExitStack() as stack:
        reader = reshard.Reader(path, meta, stack)
        for file, keys in zip(files, groups):
            specs = {k.removeprefix("params."): reshard.dtype_shape(index[k]) for k in keys}
            tensorfile.write_lazy(tmp / file, specs, lambda name: reader.whole(f"params.{name}"))
            weight_map.update(dict.fromkeys(specs, file))
        if total > 1:
            index_json = {
                "metadata": {"total_size": sum(reshard.nbytes(index[k]) for k in names)},
                "weight_map": weight_map,
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index_json, indent=2))
    return [out / f for f in files]


def _check_out(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise CheckpointError(f"ft.consolidate: {out} exists and is not a directory.")
    keep = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
    foreign = sorted(e.name for e in out.iterdir() if not keep.fullmatch(e.name))
    if foreign:
        raise CheckpointError(
            f"ft.consolidate: refusing to replace {out}: it holds {foreign[:5]}, which "
            "consolidate did not write. Choose a new directory, or delete it yourself."
        )
