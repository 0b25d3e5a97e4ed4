"""The training state as data: ``params_of``, ``buffers_of`` and ``TrainState``.

An ``nn.Module`` is used only as a *template*: its code runs, its tensors do not. The numbers live in
a nested ``TensorDict`` keyed by module path (``ft.apply`` runs the module's code on them), and
everything a run needs to resume is one :class:`TrainState`.
"""

from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict, TensorDictBase, tensorclass
from torch import nn

from ftrain import tree

__all__ = ["params_of", "buffers_of", "state_dict_of", "param_count", "TrainState"]


def params_of(module: nn.Module) -> TensorDict:
    """A detached copy of ``module``'s parameters as a nested TensorDict keyed by module path.

    ``blocks.0.attn.qkv.weight`` becomes ``params["blocks", "0", "attn", "qkv", "weight"]``. Tied
    parameters (one tensor under two names) appear once, under their first name, as in
    ``module.named_parameters()``. The copy shares nothing with the module: training it never
    changes the module, and changing the module never changes it.
    """
    _check_module(module, "params_of")
    return tree.from_flat({k: v.detach().clone() for k, v in module.named_parameters()})


def buffers_of(module: nn.Module) -> TensorDict:
    """A detached copy of ``module``'s buffers (running statistics, masks) as a nested TensorDict."""
    _check_module(module, "buffers_of")
    return tree.from_flat({k: v.detach().clone() for k, v in module.named_buffers()})


def state_dict_of(params: TensorDictBase) -> dict[str, torch.Tensor]:
    """``{"blocks.0.attn.qkv.weight": tensor, ...}``: params as a flat dict with the module's own
    names, ready for ``module.load_state_dict(..., strict=False)`` (strict=False because tied
    duplicates appear once). The tensors are shared, not copied."""
    return tree.to_flat(params)


def param_count(params: TensorDictBase) -> int:
    """The number of numbers in ``params``: the sum of every leaf's ``numel()`` (a tied parameter,
    given once by ``ft.params_of``, counts once; a sharded DTensor counts whole). The count to
    print first: ``print(f"{ft.param_count(state.params) / 1e6:.2f}M parameters")``. For a
    module, ``ftrain.models.num_params(module)``."""
    if not isinstance(params, TensorDictBase):
        raise TypeError(
            f"param_count(params): params must be a TensorDict (ft.params_of(module) or "
            f"state.params), got {type(params).__name__}."
            + (
                " For a module: ftrain.models.num_params(module)."
                if isinstance(params, nn.Module)
                else ""
            )
        )
    return sum(t.numel() for t in tree.leaves(params))


def _check_module(module: object, fn: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"ft.{fn}(module): expected an nn.Module, got {type(module).__name__}.")


@tensorclass
class TrainState:
    """The whole training state as one tensor pytree.

    Fields:
        params: nested TensorDict of fp32 parameters, keyed by module path.
        opt_state: the optimizer's state (TensorDict), from ``optimizer.init(params)``.
        step: 0-d int64, the number of steps taken. Lives on the CPU so reading it never waits for
            an accelerator.
        rng: 0-d int64 random key. With ``step`` it determines every random number a step draws.
        extra: TensorDict of state owned by transforms (fp16 loss scale, EMA of params, ...).

    Everything needed to resume bit-for-bit is in here; ``ft.save`` writes all of it.
    """

    params: TensorDict
    opt_state: TensorDict
    step: torch.Tensor
    rng: torch.Tensor
    extra: TensorDict

    def replace(self, **fields) -> TrainState:
        """A new TrainState with the named fields replaced wholesale and the others kept.

        Unlike ``TensorDict.replace``, which merges a nested TensorDict into the old one (so keys
        only the old one has would survive), ``state.replace(params=p).params`` holds exactly the
        keys of ``p``. Nothing is copied: the result holds the given TensorDicts and tensors and
        this state's other fields, as they are.
        """
        names = _STATE_FIELDS
        unknown = sorted(fields.keys() - set(names))
        if unknown:
            raise TypeError(
                f"TrainState.replace: {unknown} are not fields of TrainState; its fields are "
                f"{names}."
            )
        values = {name: fields[name] if name in fields else getattr(self, name) for name in names}
        return type(self)(**values, batch_size=self.batch_size, device=self.device)

    def to_device(self, device: str | torch.device) -> TrainState:
        """This state with ``params``, ``opt_state`` and ``extra`` on ``device``; ``step`` and
        ``rng`` stay on the CPU (a step reads them as Python ints every call: from host memory,
        never waiting for an accelerator). ``state.to(device)`` would move them too."""
        return self.replace(
            params=self.params.to(device),
            opt_state=self.opt_state.to(device),
            extra=self.extra.to(device),
        )

    @classmethod
    def create(cls, params: TensorDictBase, optimizer, *, seed: int = 0) -> TrainState:
        """A fresh state: ``params``, ``optimizer.init(params)``, step 0 and ``rng`` from ``seed``."""
        from ftrain.optim import GradientTransformation

        if not isinstance(params, TensorDictBase):
            raise TypeError(
                "TrainState.create(params, ...): params must be a TensorDict; "
                "use ft.params_of(module)."
            )
        if not isinstance(optimizer, GradientTransformation):
            raise TypeError(
                "TrainState.create(params, optimizer): optimizer must be an "
                f"ftrain.optim.GradientTransformation (e.g. ftrain.optim.adamw(3e-4)), got "
                f"{type(optimizer).__name__}."
            )
        if not isinstance(seed, int):
            raise TypeError(f"TrainState.create(seed=...): seed must be an int, got {seed!r}.")
        return cls(
            params=params,
            opt_state=optimizer.init(params),
            step=torch.zeros((), dtype=torch.int64),
            rng=torch.tensor(seed, dtype=torch.int64),
            extra=TensorDict({}, batch_size=[]),
            batch_size=[],
        )


# TrainState's field names, read once (``dataclasses.fields`` of a tensorclass is not traceable
# by dynamo, and ft.compile traces replace() inside user transforms such as ft.ema).
_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainState))
