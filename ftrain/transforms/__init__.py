"""Transforms: functions ``Step -> Step``, one module each."""

from ftrain.transforms.accumulate import accumulate
from ftrain.transforms.autocast import DynamicLossScale, StaticLossScale, autocast
from ftrain.transforms.checkpoint import checkpoint, find_blocks
from ftrain.transforms.compile import compile
from ftrain.transforms.ema import ema
from ftrain.transforms.shard import (
    STRATEGIES,
    local_bytes,
    shard,
    shard_state,
    track_gathered,
    unshard,
    unshard_state,
)

__all__ = [
    "STRATEGIES",
    "DynamicLossScale",
    "StaticLossScale",
    "accumulate",
    "autocast",
    "checkpoint",
    "compile",
    "ema",
    "find_blocks",
    "local_bytes",
    "shard",
    "shard_state",
    "track_gathered",
    "unshard",
    "unshard_state",
]
