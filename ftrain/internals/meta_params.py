"""A module built with its parameters on the ``meta`` device and its buffers real.

``torch.device("meta")`` puts everything on meta, buffers included; a model whose forward needs
buffers computed in its constructor (rotary frequencies, causal masks) could then not run as the
template of ``ft.apply``. :func:`params_on_meta` moves only the parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["params_on_meta"]


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside the block, each parameter a module registers goes to the ``meta`` device (its
    shape, dtype and ``requires_grad`` kept, no memory), right as it is registered, so that the
    constructor's initializers run on meta tensors; buffers are made as usual. Ties made after
    registration (``lm_head.weight = wte.weight``) stay ties. Not thread-safe: it swaps
    ``nn.Module.register_parameter`` for the extent of the block."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
