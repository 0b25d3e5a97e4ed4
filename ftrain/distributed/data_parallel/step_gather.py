"""fsdp's params gathered once for a whole step: for an engine that runs many micro-batches
interleaved (``ft.pipeline``'s schedules).

**Rule:** :func:`gather_for_step` gives the params with each one fsdp keeps split over ``dp``
gathered whole over ``dp`` (one all-gather per dtype, as fsdp's own gathers move them; a
tensor-parallel one back to its ``tp`` layout, as under ddp), and
:func:`unreduced_grads` turns the gradients of those whole tensors, summed over every
micro-batch of the step, into ``Partial`` DTensors laid out as their shards: ``ft.shard``'s
reduce phase then reduce-scatters each of them once (``dp_split.reduce_scatter``), the same sums
its per-block gathering would have landed on the shards. The optimizer update and the state at
rest stay on the shards.

Why not fsdp's own gathering (``ftrain.distributed.data_parallel.fsdp``): it gathers a block
for one micro-batch's forward and again for its backward, and keeps track of one micro-batch at
a time, while a pipeline schedule runs the forwards of several micro-batches before their
backwards; and gathering per micro-batch would multiply the traffic by their number. So, as
torchtitan runs FSDP under its pipelines (no resharding after forward), a pipelined step gathers
its stages' params once, at its start, and reduce-scatters their gradients once, at its end.

The cost: while the step runs, this process holds its stages' whole params (beside their
shards) and whole gradients, as ``zero2`` does; between steps, and during the optimizer update,
only the shards (``1/dp`` of params, gradients and optimizer state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from ftrain import tree
from ftrain.distributed.data_parallel import dp_split
from ftrain.distributed.dtensor import is_dtensor, local

__all__ = ["gather_for_step", "unreduced_grads"]


def gather_for_step(params: TensorDict, mesh) -> TensorDict:
    """``params`` with every tensor split over ``mesh`` (the ``dp`` mesh; fsdp's layout, tensor
    parallel or not) whole over it, as ddp lays it out: a plain whole tensor, or under tensor
    parallelism the DTensor of its ``tp`` layout (``dp_split.unsplit``). The rest (whole over
    ``dp`` already: ddp's, ZeRO's, a tensor-parallel bias) are the same objects. A collective
    over ``mesh`` when any is split; without one, ``params`` itself."""
    values, tdef = tree.flatten(params)
    split = [i for i, t in enumerate(values) if dp_split.is_split(t, mesh)]
    if not split:
        return params
    out = list(values)
    with torch.no_grad():
        whole = dp_split.unsplit([values[i] for i in split], mesh)
    for i, w in zip(split, whole):
        out[i] = w
    return tdef.unflatten(out)


def unreduced_grads(grads: Sequence[torch.Tensor], params: TensorDict, mesh) -> list[torch.Tensor]:
    """``grads`` (of :func:`gather_for_step`'s params, in ``params``' leaf order: this process's
    own sums), each one of a tensor split over ``mesh`` as a ``Partial`` DTensor over ``dp`` laid
    out as its shard in ``params`` (reduced later, once, by ``ft.shard``'s reduce phase); the
    rest as given."""
    values = tree.leaves(params)
    return [
        dp_split.unreduced(local(g) if is_dtensor(g) else g, p, mesh)
        if dp_split.is_split(p, mesh)
        else g
        for g, p in zip(grads, values)
    ]
