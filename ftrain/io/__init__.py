"""ftrain.io: checkpoints and run folders, committed atomically.

atomic       commit a directory or a file so that a kill leaves the old or the new one whole
layout       how a TrainState maps onto tensor files and a JSON tree
checkpoint   save / load / verify one checkpoint directory (safetensors + JSON, no pickle)
runs         checkpoint-<step>/ folders of a run: save, prune, find the newest that verifies
"""

from ftrain.io import atomic
from ftrain.io.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    load,
    load_meta,
    meta_checksum,
    save,
    verify_checkpoint,
)
from ftrain.io.runs import latest_checkpoint, list_checkpoints, save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "atomic",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "load_meta",
    "meta_checksum",
    "save",
    "save_checkpoint",
    "verify_checkpoint",
]
