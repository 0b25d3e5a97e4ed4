"""DP-SGD (Abadi et al. 2016): clip each example's gradient, sum, add Gaussian noise, average.

Two hooks of the public protocol. The ``engine`` hook swaps in :class:`ClippedSumEngine`, which
computes per-example gradients of each micro-batch (``ftrain.per_example``), clips each to
``l2_norm_clip`` in global L2 norm over all params and sums them; the count is the number of
examples. The step's reduce and its one division then give ``sum of clipped gradients / number of
examples`` over the whole batch (summed across processes under ``ft.shard``, over micro-batches
under ``ft.accumulate``). The ``gradients`` hook, which runs once per optimizer step after that
division, adds ``N(0, (noise_multiplier * l2_norm_clip)**2) / count`` to every gradient element,
drawn from ``ftrain.rng``'s counter-based stream of ``(state.rng, state.step)``: the same numbers
on every process, so the noise is added once in total, not once per rank.

Conventions follow Opacus's ``DPOptimizer`` (``clip_and_accumulate``, ``add_noise``,
``scale_grad`` with ``loss_reduction="mean"``): the clip factor is
``min(1, l2_norm_clip / (norm + 1e-6))``; the noise's standard deviation is ``noise_multiplier *
l2_norm_clip`` on the *sum*; the sum plus noise is divided by the batch size. One difference:
Opacus divides by the *expected* batch size (its Poisson sampling makes the real one vary),
ftrain by the number of examples the step got; for batches of a fixed size they are equal.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from ftrain import rng, tree
from ftrain.distributed.dtensor import dtensor, from_local, is_dtensor, redistribute
from ftrain.per_example import example_grads
from ftrain.state import TrainState
from ftrain.step import Gradients, Grads, Step, Transform
from ftrain.step.capabilities import REPLACES_ENGINE, TORCH_FUNC_GRADIENTS, WEIGHS_ROWS
from ftrain.step.engine import Forward, add_aux, nonzero

__all__ = ["DpSgd", "dp_sgd", "ClippedSumEngine", "NOISE_STREAM"]

NOISE_STREAM = 0x64705F6E  # "dp_n": the salt of this transform's stream within a step
EPS = 1e-6  # added to each example's norm before dividing, as Opacus does


@dataclasses.dataclass(frozen=True)
class ClippedSumEngine:
    """A gradient engine: the sum over examples of each example's gradient clipped to
    ``l2_norm_clip`` in global L2 norm; ``count`` is the number of examples, ``total`` the sum of
    their loss values. Its aux metrics add ``clipped``, the fraction of examples whose norm
    exceeded the bound (on this process)."""

    l2_norm_clip: float

    def __call__(
        self,
        forward: Forward,
        params: TensorDict,
        pieces: Sequence[Any],
        scale: torch.Tensor | None,
    ) -> Grads:
        grads: list[torch.Tensor] | None = None
        total = clipped = torch.zeros((), dtype=torch.float32)
        n = 0
        aux: dict[str, torch.Tensor] = {}
        for piece in pieces:
            each = example_grads(lambda p, b: forward(p, b)[0], params, piece, scale)
            g = each.grads
            if scale is not None:  # clip what the step will see after its division by the scale
                g = [x / scale for x in g]
            rows = each.values.shape[0]
            norms = torch.stack([x.reshape(rows, -1).norm(2, dim=1) for x in g], dim=1)
            norms = norms.norm(2, dim=1)  # [rows]: each example's norm over all params
            factor = (self.l2_norm_clip / (norms + EPS)).clamp(max=1.0)
            summed = [torch.tensordot(factor.to(x.dtype), x, dims=1) for x in g]
            if scale is not None:  # the step divides by count * scale
                summed = [x * scale for x in summed]
            grads = summed if grads is None else [a + b for a, b in zip(grads, summed)]
            total = total.to(norms.device) + each.values.sum()
            clipped = clipped.to(norms.device) + (norms > self.l2_norm_clip).sum()
            n += rows
            add_aux(aux, {k: v.mean() for k, v in each.aux.items()}, len(pieces))
        assert grads is not None  # a step has at least one piece
        count = torch.tensor(n, device=total.device)
        aux["clipped"] = clipped / max(n, 1)
        return Grads(grads, total, count, aux, True)


@dataclasses.dataclass(frozen=True, eq=False)
class DpSgd(Transform):
    """DP-SGD's clipping (the ``engine`` hook) and noise (the ``gradients`` hook); see
    :func:`dp_sgd`."""

    l2_norm_clip: float
    noise_multiplier: float

    name = "dp_sgd"

    def __post_init__(self) -> None:
        for arg, low, strict in (("l2_norm_clip", 0.0, True), ("noise_multiplier", 0.0, False)):
            v = getattr(self, arg)
            bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            if bad or (v <= low if strict else v < low):
                legal = "a finite number > 0" if strict else "a finite number >= 0"
                raise ValueError(f"ft.dp_sgd({arg}={v!r}): must be {legal}.")

    def capabilities(self):
        # WEIGHS_ROWS: every example counts once, so a plain scalar loss per row is what it means
        return {TORCH_FUNC_GRADIENTS: "", REPLACES_ENGINE: "per-example clipping", WEIGHS_ROWS: ""}

    def engine(self, engine):
        return ClippedSumEngine(float(self.l2_norm_clip))

    def gradients(self, g: Gradients, state: TrainState) -> Gradients:
        if self.noise_multiplier == 0:
            return g
        # the step already divided the clipped sum by the count: divide the noise by it too
        count = nonzero(g.metrics["count"].float())
        std = self.noise_multiplier * self.l2_norm_clip / count
        key = rng.fold_in(rng.fold_in(state.rng, state.step), NOISE_STREAM)
        leaves, tdef = tree.flatten(g.grads)
        noisy = [x + _noise(rng.fold_in(key, i), x, std) for i, x in enumerate(leaves)]
        return g._replace(grads=tdef.unflatten(noisy), metrics={**g.metrics, "noise_std": std})


def _noise(key: torch.Tensor, like: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``std`` times standard normal numbers of ``like``'s shape, laid out as ``like`` (a
    sharded gradient gets its own shard of the same whole-tensor noise on every process)."""
    if not is_dtensor(like):
        z = rng.normal(key, like.shape, dtype=like.dtype, device=like.device)
        return z * std.to(like.device, like.dtype)
    d = dtensor()
    mesh = like.device_mesh
    z = rng.normal(key, like.shape, dtype=like.dtype, device=like.to_local().device)
    z = z * std.to(z.device, z.dtype)
    whole = from_local(z, mesh, (d.Replicate(),) * mesh.ndim, z.shape, z.stride())
    return redistribute(whole, mesh, like.placements)


def dp_sgd(step: Step, l2_norm_clip: float, noise_multiplier: float) -> Step:
    """DP-SGD: each example's gradient clipped to ``l2_norm_clip`` in global L2 norm, summed,
    Gaussian noise of standard deviation ``noise_multiplier * l2_norm_clip`` added to the sum,
    divided by the number of examples (Abadi et al. 2016; Opacus's conventions, see the module
    docstring). The optimizer then gets that average, as it would the mean gradient.

    An *example* is a row of the batch (dim 0 of every tensor), given to the loss function as a
    batch of one; its loss is ``total / count`` of what the loss function returns for it (a token
    loss: the mean over the example's tokens), so every example weighs the same, whatever its
    number of tokens (a plain scalar loss gets no ``ScalarLossWarning`` here: weighting by rows is
    the definition). ``metrics["loss"]`` is the mean of the examples' losses; ``grad_norm`` the
    norm of the clipped average before noise; ``clipped`` the fraction of examples whose gradient
    was clipped (this process's, under ``ft.shard``); ``noise_std`` the standard deviation of the
    noise in the averaged gradient, ``noise_multiplier * l2_norm_clip / count`` (absent when
    ``noise_multiplier`` is 0).

    The noise is drawn from ``fold_in(fold_in(state.rng, state.step), NOISE_STREAM)``: the same
    state and batch give the same step. It is added once per optimizer step (under
    ``ft.accumulate``, after the last micro-batch) and once in total under ``ft.shard`` (every
    process draws the same numbers after the reduction). The noise is only as secret as ``state.rng``: use a
    secret seed for a release with a privacy claim (docs/privacy.md). Privacy accounting (epsilon from the
    noise multiplier, the sampling rate and the number of steps) is not part of this transform.

    Composes with ``ft.accumulate`` (memory: one copy of the params per example of a
    micro-batch), ``ft.autocast`` (fp16's loss scale is divided out before clipping; one
    example's gradient is larger than a batch mean, so a dynamic scale may skip a few more first
    steps while it backs off) and ``ft.shard`` with ``"ddp"``, ``"zero1"`` or ``"zero2"``. Refused when the step is built:
    ``ft.checkpoint`` and ``ft.shard(..., "fsdp")`` (torch.func refuses saved-tensor hooks), a
    transform applied before it that sets its own gradient engine, and bad arguments. The model
    must be traceable by ``torch.func`` (no BatchNorm in training mode: use GroupNorm).

    **Invariant:** with ``noise_multiplier=0``, the update is that of Opacus's clipped and
    averaged gradient for the same model and batch (fp32, 1e-5); the noise's measured standard
    deviation matches ``noise_multiplier * l2_norm_clip / count``; under ``ft.accumulate``
    without noise it equals the whole batch.
    """
    return DpSgd(l2_norm_clip, noise_multiplier)(step)
