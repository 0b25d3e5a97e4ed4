"""ftrain.io: checkpoints and run folders, committed atomically.

atomic       commit a directory or a file so that a kill leaves the old or the new one whole
layout       how a TrainState maps onto tensor files and a JSON tree
meta         meta.json: its checksum, the sha256 of every tensor file
tensorfile   a safetensors file written one tensor at a time, hashed on the way
checkpoint   save / load / verify one checkpoint directory (safetensors + JSON, no pickle)
sharded      each process writes its own pieces + one index
reshard      any checkpoint, whole or sharded, read onto any world size and layout
background   SaveHandle: a save written from a background thread
saver        Saver: one background save at a time, each waiting for the one before
consolidate  whole-tensor params from any checkpoint, in Hugging Face's (sharded) layout
runs         checkpoint-<step>/ folders of a run: save, prune, find the newest that verifies
"""

from ftrain.io import atomic
from ftrain.io.background import SaveHandle
from ftrain.io.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    load,
    load_meta,
    meta_checksum,
    save,
    verify_checkpoint,
)
from ftrain.io.consolidate import consolidate
from ftrain.io.runs import latest_checkpoint, list_checkpoints, save_checkpoint
from ftrain.io.saver import Saver

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "SaveHandle",
    "Saver",
    "atomic",
    "consolidate",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "load_meta",
    "meta_checksum",
    "save",
    "save_checkpoint",
    "verify_checkpoint",
]
