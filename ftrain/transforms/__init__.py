"""Transforms: functions ``Step -> Step``, one module each."""

from ftrain.transforms.accumulate import accumulate
from ftrain.transforms.autocast import DynamicLossScale, StaticLossScale, autocast
from ftrain.transforms.checkpoint import checkpoint, find_blocks
from ftrain.transforms.compile import compile
from ftrain.transforms.ema import ema

__all__ = [
    "DynamicLossScale",
    "StaticLossScale",
    "accumulate",
    "autocast",
    "checkpoint",
    "compile",
    "ema",
    "find_blocks",
]
