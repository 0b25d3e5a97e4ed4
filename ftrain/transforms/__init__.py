"""Transforms: each a class on the ``ft.Transform`` protocol and a function ``Step -> Step``."""

from ftrain.transforms.accumulate import Accumulate, accumulate
from ftrain.transforms.autocast import Autocast, DynamicLossScale, StaticLossScale, autocast
from ftrain.transforms.compile import Compile, compile
from ftrain.transforms.dp_sgd import DpSgd, dp_sgd
from ftrain.transforms.ema import Ema, ema
from ftrain.transforms.lora import Lora, lora, merge_lora
from ftrain.transforms.offload import Offload, OffloadGradients, offload, offloaded
from ftrain.transforms.pipeline import Pipeline, pipeline
from ftrain.transforms.recompute import Checkpoint, checkpoint
from ftrain.transforms.shard import Shard, shard
from ftrain.transforms.tensor_parallel import TensorParallel, tensor_parallel
from ftrain.transforms.vmap import Vmap, vmap
from ftrain.transforms.wrap import Wrap, wrap

__all__ = [
    "Accumulate",
    "Autocast",
    "Checkpoint",
    "Compile",
    "DpSgd",
    "DynamicLossScale",
    "Ema",
    "Lora",
    "Offload",
    "OffloadGradients",
    "Pipeline",
    "Shard",
    "StaticLossScale",
    "TensorParallel",
    "Vmap",
    "Wrap",
    "accumulate",
    "autocast",
    "checkpoint",
    "compile",
    "dp_sgd",
    "ema",
    "lora",
    "merge_lora",
    "offload",
    "offloaded",
    "pipeline",
    "shard",
    "tensor_parallel",
    "vmap",
    "wrap",
]
