"""Hugging Face model families for ``ft.pipeline``: how a stage of a GPT-2 or Llama runs."""

from __future__ import annotations

from ftrain.distributed.pipeline.cut import Family

__all__ = ["HF_FAMILIES"]

HF_FAMILIES: tuple[Family, ...] = ()
