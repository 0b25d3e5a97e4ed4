"""Data parallelism over ``torch.distributed``: DDP, ZeRO-1, ZeRO-2 and FSDP, exact and composable.

**Rule:** N processes, each given 1/N of the batch, take the same step as one process given the
whole batch. Gradients, loss totals and token counts are *summed* across processes and divided
once by the global count, so token-weighted losses stay exact however the padding falls.

What each strategy keeps and sends is tabled in ``ftrain.distributed.data_parallel.zero``; the
pieces (collectives, DTensor plumbing, state layouts, FSDP gathering) live in
``ftrain.distributed``. The optimizers of ``ftrain.optim`` run on sharded state unchanged: their
``torch._foreach_*`` math is elementwise, and DTensor makes every reduction in them global (the norm
in ``clip_by_global_norm``, ``metrics["grad_norm"]``, adafactor's statistics of a matrix whose rows
are split). Checked against ddp: ``sgd``, ``adam``, ``adamw``, ``lion`` and ``adamw8bit`` give the
same bits under zero1/zero2/fsdp; ``lamb`` and clipping agree to rounding (a norm summed over
shards); ``adafactor`` equals one process to 1e-5.

When gradients are reduced: ddp, zero1 and zero2 during the last micro-batch's backward, in
buckets of ``bucket_mb`` MiB (``ftrain.distributed.data_parallel.buckets``): the engine hands each
param's final local gradient (every micro-batch's sum) to the bucket reducer as soon as autograd
has it, and each full bucket's all-reduce (zero2: reduce-scatter) is started asynchronously, in
one order on every rank, while backward goes on; all are waited before the update, and the loss
total and count are all-reduced after backward (two floats). ``bucket_mb=None``, and every case
where the engine cannot hand the gradients over (below: fp16 loss scaling, a bf16/fp16 mean loss,
``ft.compile``, tensor parallelism, a replaced engine, ``ft.memory``'s fake tensors), reduce all of
them after backward, in one flat collective per dtype. ``fsdp`` reduce-scatters each block's
gradients as its backward ends.

Composition:

* ``ft.accumulate``: grads are reduced once per optimizer step, during (or after) the last
  micro-batch's backward (ddp, zero1, zero2). ``fsdp`` reduce-scatters each micro-batch's grads
  during its backward; the sum is the same.
* ``ft.checkpoint`` and ``ft.autocast`` compose in any order. Under autocast without checkpoint,
  ``fsdp`` keeps the bf16/fp16 *casts* of each block's weights for backward (autocast makes them);
  with ``ft.checkpoint`` nothing of them is kept.
* fp16 loss scaling: a step with non-finite gradients is skipped on every rank alike. ddp,
  zero1 and zero2's buckets get each gradient multiplied by its micro-batch's count as the
  engine hands it over (the engine's reweighting, the same values), so they reduce during
  backward as without a loss scale; ``fsdp`` keeps a reweighted backward's gradients local and
  reduce-scatters them once per step, after the engine reweights them.
* ``ft.compile`` works for ``ddp``, ``zero1`` and ``zero2`` (the collectives and DTensor break the
  graph; the gradients are reduced after backward: no hooks in a traced backward). It is refused
  for ``fsdp`` when the step is built, in either order: dynamo cannot trace the per-block
  gathering (saved-tensor hooks, gathers during backward).
* ``ft.offload(step, "optimizer+gradients")``, inside or outside: under ddp, zero1 and zero2 its
  host copies follow the buckets (each bucket's reduced gradients are handed on one bucket later,
  during backward; zero2's on a group that reduces host tensors, as under fsdp).
* ``ft.tensor_parallel`` on a ``("dp", "tp")`` mesh: ``ft.shard(step, strategy, mesh=mesh["dp"])``
  with any strategy, inside or outside ``tp(...)``, on a state laid out by
  ``ft.shard_state(tp.shard_state(state), strategy, mesh=mesh["dp"])``. Each tp piece is split
  again over ``dp`` along a dimension tensor parallelism does not split
  (``ftrain.distributed.data_parallel.dp_split``), so ``fsdp`` gathers exactly the piece the
  tensor-parallel forward computes with; a tp piece too small to split (a column-parallel bias)
  stays whole over ``dp`` and its gradient is all-reduced.
* ``ft.pipeline`` on a ``("dp", "pp", "tp")`` mesh: any strategy over ``mesh["dp"]``, on a
  state laid out by ``ft.shard_state(pp.shard_state(state), strategy, mesh=mesh["dp"])``. Under
  ``fsdp`` the pipeline's engine gathers its stages' params once per step, before its schedule
  interleaves the micro-batches, and this reduce phase reduce-scatters their summed gradients
  once (``ftrain.distributed.data_parallel.step_gather``); the per-block gathering then finds
  nothing split (docs/pipeline-parallel.md).
* The model must be called through ``ft.apply`` inside the loss (``fsdp`` gathers there).
* Randomness: each process folds its rank into the step's random stream, so dropout masks differ
  between ranks (as they would between the rows of one big batch), and a sharded run with dropout
  equals one process only in distribution, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from ftrain import rng, tree
from ftrain.apply import rewritten
from ftrain.distributed.collectives import all_reduce_flat
from ftrain.distributed.data_parallel import dp_split, fsdp
from ftrain.distributed.data_parallel.buckets import (
    BUCKET_MB,
    BucketReducer,
    Reduced,
    bucket_bytes,
)
from ftrain.distributed.data_parallel.zero import check_strategy, zero_optimizer
from ftrain.distributed.dtensor import is_dtensor, like, local, on_shards
from ftrain.distributed.launch import check_mesh, require_group
from ftrain.state import TrainState
from ftrain.step import AutogradEngine, Step, Transform
from ftrain.step.capabilities import (
    COMBINES_ROWS,
    DATA_PARALLEL,
    GATHERS_PARAMS,
    REDUCES_IN_BACKWARD,
    SAVED_TENSOR_HOOKS,
    SHARDED_PARAMS,
    SHARDED_STATE,
    UNTRACEABLE,
)

__all__ = ["Shard", "shard"]

_FSDP_UNTRACEABLE = (
    "torch.compile cannot trace fsdp's per-block gathering (saved-tensor hooks, gathers during "
    "backward). Use ft.compile(ft.shard(step, 'zero2')) (optimizer state and gradients sharded, "
    "params whole), or leave out ft.compile and run ft.shard(step, 'fsdp') eagerly."
)


@dataclasses.dataclass(frozen=True, eq=False)
class Shard(Transform):
    """Data parallelism across the processes of ``mesh`` (see :func:`shard`)."""

    strategy: str = "ddp"
    mesh: Any = None
    prefetch: bool = True
    bucket_mb: float | None = BUCKET_MB

    name = "shard"

    def __post_init__(self) -> None:
        check_strategy(self.strategy, "shard")
        if not isinstance(self.prefetch, bool):
            raise TypeError(
                f"ft.shard(step, {self.strategy!r}, prefetch=...): prefetch must be True or "
                f"False, got {self.prefetch!r}."
            )
        b = self.bucket_mb
        number = isinstance(b, (int, float)) and not isinstance(b, bool)
        if b is not None and not (number and math.isfinite(b) and b > 0):
            raise ValueError(
                f"ft.shard(step, {self.strategy!r}, bucket_mb=...): a number of MiB > 0 (the "
                f"gradients reduced in buckets during backward) or None (all of them reduced "
                f"after backward), got {b!r}."
            )
        require_group("shard")
        object.__setattr__(self, "mesh", check_mesh(self.mesh, "shard"))

    def capabilities(self):
        ranks = f"ranks {sorted(self.mesh.mesh.flatten().tolist())}"
        caps = {DATA_PARALLEL: ranks, COMBINES_ROWS: ""}
        if self.strategy != "ddp":
            caps[SHARDED_STATE] = self.strategy
        if self.strategy == "fsdp":
            caps.update(
                {
                    SHARDED_PARAMS: "fsdp",
                    GATHERS_PARAMS: "",
                    SAVED_TENSOR_HOOKS: "fsdp",
                    REDUCES_IN_BACKWARD: "",
                    UNTRACEABLE: _FSDP_UNTRACEABLE,
                }
            )
        return caps

    # -- building -----------------------------------------------------------------------------
    def optimizer(self, optimizer):
        if self.strategy == "ddp":
            return optimizer
        if self.strategy in ("zero1", "zero2"):
            return zero_optimizer(optimizer, self.mesh)
        return on_shards(optimizer)  # fsdp: the params, grads and state are all sharded

    def engine(self, engine):
        # ddp/zero1/zero2: the engine hands the final local gradients to buckets reduced during
        # backward (fsdp reduce-scatters per block itself; a replaced engine is left as it is)
        if self.strategy == "fsdp" or self.bucket_mb is None:
            return engine
        if not isinstance(engine, AutogradEngine):
            return engine
        size = bucket_bytes(self.bucket_mb)
        return engine.reducing(BucketReducer(self.strategy, self.mesh, size))

    def wrap(self, fn, stage: str):
        if stage != "eager":
            return fn

        def data_parallel(state, batch):
            self._check_layout(state)
            # dropout differs between ranks; the step's own seeding is restored when it ends
            rng.reseed(rng.step_seed(state, self.mesh.get_local_rank() + 1), _device(state))
            if self.strategy != "fsdp":
                return fn(state, batch)
            with fsdp.session(self.mesh, self.prefetch):
                return fn(state, batch)

        return data_parallel

    def forward(self, fn):
        if self.strategy != "fsdp":
            return fn
        gathered = rewritten(fn, self, "ft.shard(step, 'fsdp')")

        def fsdp_call(params, batch, state):
            with fsdp.saved_as_shards(self.mesh, self.prefetch):
                return gathered(params, batch, state)

        return fsdp_call

    def _check_layout(self, state: TrainState) -> None:
        """Refuse a state that ``shard_state`` did not lay out for this strategy (an unsharded
        fsdp state would otherwise train each rank on its own, silently)."""
        params = tree.leaves(state.params)
        opt = [t for t in tree.leaves(state.opt_state) if t.dim() > 0]
        if (params and self._sharded(params) != (self.strategy == "fsdp")) or (
            opt and self._sharded(opt) != (self.strategy != "ddp")
        ):
            call = f"ft.shard_state(state, {self.strategy!r})"
            if params and dp_split.is_tp_laid(params[0]):  # under ft.tensor_parallel
                call = f"ft.shard_state(tp.shard_state(state), {self.strategy!r}, mesh=mesh['dp'])"
            raise ValueError(
                f"ft.shard(step, {self.strategy!r}) got a state laid out for another strategy (or "
                f"not sharded). Call state = {call} once, after creating or loading it."
            )

    def _sharded(self, leaves) -> bool:
        # split over this mesh: a DTensor on it, or a tensor-parallel one split over its "dp"
        return any(dp_split.is_split(t, self.mesh) for t in leaves)

    # -- the model rewrite ft.apply runs under fsdp (apply's Rewrite protocol) -----------------
    def rewrite(self, module):
        """A copy of ``module`` that gathers each block's parameters from their shards."""
        return fsdp.gathering_copy(module, fsdp.current_session(self.mesh))

    def rewrite_key(self):
        """What the copy depends on: the step's session (a new copy for each step)."""
        return fsdp.current_session(self.mesh)

    # -- reduce -------------------------------------------------------------------------------
    def reduce(self, grads, sums):
        group = self.mesh.get_group()
        if isinstance(grads, Reduced) and grads.mesh is self.mesh:  # by the buckets, in backward
            sums = sums.clone()
            dist.all_reduce(sums, group=group)
            return grads, sums
        if self.strategy in ("ddp", "zero1"):  # one flat all-reduce of grads, total and count
            # a tensor-parallel grad (a DTensor on another mesh) is summed as its local piece
            plain = [local(g) if is_dtensor(g) else g for g in grads]
            *summed, total = all_reduce_flat([*plain, sums], group, in_place=False)
            return [like(s, g) for s, g in zip(summed, grads)], total
        sums = sums.clone()
        dist.all_reduce(sums, group=group)
        if self.strategy == "zero2":  # each rank keeps the sums of its own rows
            plain = [local(g) if is_dtensor(g) else g for g in grads]
            return dp_split.reduce_scatter(plain, grads, self.mesh), sums
        # fsdp: reduce-scattered in backward, except those left local for reweighting; and under
        # tensor parallelism those whole over dp (fsdp does not gather them) are all-reduced here
        out = dp_split.all_reduce_whole(grads, self.mesh)
        partial = [i for i, g in enumerate(grads) if dp_split.is_unreduced(g)]
        if not partial:
            return out, sums
        reduced = dp_split.reduce_scatter(
            [local(grads[i]) for i in partial], [grads[i] for i in partial], self.mesh
        )
        for i, g in zip(partial, reduced):
            out[i] = g
        return out, sums


def _device(state: TrainState) -> torch.device:
    return tree.first_leaf(state.params).device


def shard(
    step: Step,
    strategy: str = "ddp",
    mesh: Any = None,
    *,
    prefetch: bool = True,
    bucket_mb: float | None = BUCKET_MB,
) -> Step:
    """Data parallelism across the processes of ``mesh`` (default: all of them).

    Every process calls the step with its own share of the global batch and a state laid out by
    ``ft.shard_state`` with the same ``strategy``; each gets the same new state (its shards of
    it) and the same metrics (``loss`` and ``count`` over the global batch). See the module
    docstring for how it composes.

    Args:
        step: an ``ft.Step`` (``accumulate``, ``checkpoint`` and ``autocast`` may come before or
            after; ``compile`` after, except for ``fsdp``).
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"fsdp"``.
        mesh: a 1-D ``DeviceMesh``; default ``ft.distributed.default_mesh()``. Under
            ``ft.tensor_parallel``: ``mesh["dp"]`` of its mesh.
        prefetch: ``fsdp`` only (the others gather nothing): start each block's all-gather
            while the block before it computes, and in backward the next regather and each
            block's reduce-scatter while the next block's backward runs (async collectives;
            ``ftrain.distributed.data_parallel.fsdp``). The same bits either way; the cost is
            one more block's whole params alive at a time, which ``ft.memory`` counts. On by
            default, as FSDP2 prefetches: on a GPU the collectives run beside the compute; on
            gloo/CPU they share the cores with it (benchmarks/RESULTS.md: the measured ratio).
        bucket_mb: ``ddp``, ``zero1`` and ``zero2`` (fsdp reduces per block): reduce the
            gradients during the last micro-batch's backward, in buckets of about this many MiB
            (torch DDP's ``bucket_cap_mb``), each bucket's all-reduce (zero2: reduce-scatter)
            started as soon as backward has produced all of its gradients, so that on a GPU
            the communication runs beside the rest of the backward
            (``ftrain.distributed.data_parallel.buckets``). ``None``: one reduction of all
            gradients after backward; so do gradients that fill one bucket (nothing could
            overlap: one flat collective costs less). The same bits either way on 2 ranks (a
            sum of two values per element); with more ranks the backend may add in another
            order per bucket.
            Where the engine cannot hand the gradients over during backward (``ft.compile``,
            tensor parallelism, a transform of yours with
            a ``reduce`` hook applied inside ``ft.shard``) they are reduced after backward, as
            with ``None``. A param some rank does not use delays its bucket and the later ones
            to the end of backward; a step that raised during backward leaves the ranks out of
            step (``ftrain.distributed.data_parallel.buckets``).

    **Invariant:** N processes each given 1/N of the batch (any split, any padding) give the same
    state as one process given the whole batch: fp32, 1e-5 relative after several steps, for every
    strategy and with ``accumulate``/``checkpoint``/``autocast`` composed (differences are the
    order of floating-point sums). ``bucket_mb`` changes only when ddp/zero1/zero2 reduce: on 2
    ranks the state and metrics are bitwise those of ``bucket_mb=None``.

    Raises at build time: no process group (launch with torchrun and call
    ``ft.distributed.init()``), an unknown strategy, a mesh that is not 1-D, shard applied twice,
    shard after ``ft.compile`` (and ``fsdp`` with ``ft.compile`` in either order), a
    ``bucket_mb`` that is not a number > 0 or None. At the first
    call: a state that ``ft.shard_state`` did not lay out for ``strategy``.
    """
    return Shard(strategy, mesh, prefetch, bucket_mb)(step)
