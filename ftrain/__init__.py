"""ftrain: functional training for PyTorch.

A training step is a pure function ``step(state, batch) -> (state, metrics)``; transforms turn a
step into a step::

    import ftrain as ft
    step = ft.train_step(loss_fn, ft.optim.adamw(3e-4))
    step = ft.accumulate(ft.checkpoint(ft.autocast(step)), micro_batches=4)
    state, metrics = step(state, batch)
"""

from ftrain import data, distributed, losses, models, optim, rng, tree
from ftrain.apply import apply
from ftrain.distributed import shard_state, unshard_state
from ftrain.evaluate import evaluate
from ftrain.internals.version import __version__ as __version__
from ftrain.io import (
    CheckpointError,
    SaveHandle,
    Saver,
    consolidate,
    latest_checkpoint,
    list_checkpoints,
    load,
    load_meta,
    save,
    save_checkpoint,
)
from ftrain.losses import Loss
from ftrain.memory import FitReport, MemoryReport, fit, memory
from ftrain.per_example import per_example_grads
from ftrain.stack import stack, unstack
from ftrain.state import TrainState, buffers_of, param_count, params_of, state_dict_of
from ftrain.step import Gradients, Step, Transform, train_step
from ftrain.transforms import (
    accumulate,
    autocast,
    checkpoint,
    compile,
    dp_sgd,
    ema,
    lora,
    merge_lora,
    offload,
    pipeline,
    shard,
    tensor_parallel,
    vmap,
    wrap,
)

__all__ = [
    "CheckpointError",
    "Loss",
    "SaveHandle",
    "Saver",
    "consolidate",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "load_meta",
    "save",
    "save_checkpoint",
    "shard",
    "shard_state",
    "tensor_parallel",
    "unshard_state",
    "accumulate",
    "autocast",
    "checkpoint",
    "compile",
    "ema",
    "dp_sgd",
    "per_example_grads",
    "Step",
    "Transform",
    "Gradients",
    "rng",
    "tree",
    "TrainState",
    "apply",
    "buffers_of",
    "evaluate",
    "param_count",
    "losses",
    "optim",
    "params_of",
    "state_dict_of",
    "data",
    "distributed",
    "models",
    "train_step",
    "wrap",
    "stack",
    "unstack",
    "vmap",
    "memory",
    "fit",
    "MemoryReport",
    "FitReport",
    "lora",
    "merge_lora",
    "offload",
    "pipeline",
]
