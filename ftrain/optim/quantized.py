"""8-bit optimizer state: AdamW with block-wise quantized moments, in pure torch.

Each moment of a large tensor is stored as one byte per element plus one fp32 scale per block of
``block_size`` elements (the block's largest magnitude), about 2.03 bytes per parameter for both
moments instead of 8. The byte is an index into a non-linear code: ``x = scale * (q / L) ** p``
(``p = 2`` for the signed first moment, ``p = 4`` for the non-negative second moment), which keeps
relative precision for the small values that dominate Adam's moments — the same reason
bitsandbytes uses a dynamic (exponent-coded) map rather than a linear one. Tensors smaller than
``min_8bit_size`` keep fp32 moments: for them the scales would cost more than they save.

Reference: Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization".
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ftrain import tree
from ftrain.optim.base import GradientTransformation, chain
from ftrain.optim.checks import check_lr, check_range, checked
from ftrain.optim.primitives import (
    add_decayed_weights,
    scale_by_learning_rate,
)

__all__ = [
    "scale_by_adam_8bit",
    "adamw8bit",
    "quantize_blockwise",
    "dequantize_blockwise",
    "CODE_LEAVES",
]

# The state leaves that hold codes of blocks of a whole flattened tensor (not shaped like it).
CODE_LEAVES = ("mu_q", "nu_q")

_SIGNED = (127, 2.0)  # levels, power for the first moment (int8)
_UNSIGNED = (255, 4.0)  # levels, power for the second moment (uint8)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)  # (n_blocks, block_size)


def quantize_blockwise(
    x: torch.Tensor, block_size: int = 256, *, signed: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``(codes, scales)``: int8 (signed) or uint8 codes of shape ``(n_blocks,
    block_size)`` and one fp32 scale (absmax) per block. Zero maps to zero exactly."""
    levels, power = _SIGNED if signed else _UNSIGNED
    b = _blocks(x.float(), block_size)
    scale = b.abs().amax(dim=1, keepdim=True)
    unit = (b.abs() / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(max=1.0)
    q = torch.round(unit.pow(1.0 / power) * levels)
    if signed:
        codes = (q * torch.sign(b)).to(torch.int8)
    else:
        codes = q.to(torch.uint8)
    return codes, scale.squeeze(1)


def dequantize_blockwise(
    codes: torch.Tensor, scales: torch.Tensor, like: torch.Tensor, *, signed: bool = True
) -> torch.Tensor:
    """The fp32 tensor shaped like ``like`` that ``(codes, scales)`` encode."""
    levels, power = _SIGNED if signed else _UNSIGNED
    q = codes.float()
    mag = (q.abs() / levels).pow(power) * scales.unsqueeze(1)
    x = mag * torch.sign(q) if signed else mag
    return x.reshape(-1)[: like.numel()].view(like.shape)


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    block_size: int = 256,
    min_8bit_size: int = 4096,
) -> GradientTransformation:
    """Adam's direction (as :func:`scale_by_adam`) with both moments stored in 8 bits per element
    for tensors of at least ``min_8bit_size`` elements.

    State per leaf: ``mu``/``nu`` fp32 tensors (small leaves), or ``mu_q`` (int8), ``mu_scale``,
    ``nu_q`` (uint8), ``nu_scale`` (fp32, one per block); and ``count``. The moments are dequantized,
    updated in fp32 and quantized again at every step; only the state is 8-bit.
    """
    if block_size < 1:
        raise ValueError(f"scale_by_adam_8bit(block_size={block_size}): must be >= 1.")

    def leaf_state(mu: torch.Tensor, nu: torch.Tensor) -> dict[str, torch.Tensor]:
        if mu.numel() < min_8bit_size:
            return {"mu": mu, "nu": nu}
        mu_q, mu_s = quantize_blockwise(mu, block_size, signed=True)
        nu_q, nu_s = quantize_blockwise(nu, block_size, signed=False)
        return {"mu_q": mu_q, "mu_scale": mu_s, "nu_q": nu_q, "nu_scale": nu_s}

    def moments(per_leaf: dict[str, dict[str, torch.Tensor]]) -> TensorDict:
        # Nested like the params, each leaf replaced by its moment tensors: moments[path][name].
        return tree.from_flat(
            {f"{k}{tree.SEP}{name}": t for k, d in per_leaf.items() for name, t in d.items()}
        )

    def init(params):
        per_leaf = {}
        for k, p in tree.to_flat(params).items():
            z = torch.zeros_like(p, dtype=torch.float32)
            per_leaf[k] = leaf_state(z, z)
        return TensorDict(
            {"count": torch.zeros((), dtype=torch.int64), "moments": moments(per_leaf)}, []
        )

    def update(updates, state, params=None, *, inplace=False):
        del params, inplace  # the codes are rewritten whole every step
        count = state["count"] + 1
        t = count.to(torch.float64)
        bc1 = (1 - b1**t).to(torch.float32)
        bc2_sqrt = (1 - b2**t).sqrt().to(torch.float32)
        out, per_leaf = [], {}
        for k, g in tree.to_flat(updates).items():
            m = state["moments"][tuple(k.split(tree.SEP))]
            g32 = g.float()  # the moment math is fp32 whatever the params' dtype
            if "mu" in m.keys():
                mu, nu = m["mu"], m["nu"]
            else:
                mu = dequantize_blockwise(m["mu_q"], m["mu_scale"], g32, signed=True)
                nu = dequantize_blockwise(m["nu_q"], m["nu_scale"], g32, signed=False)
            mu = torch.lerp(mu, g32, 1 - b1)
            nu = torch.addcmul(nu * b2, g32, g32, value=1 - b2)
            out.append((mu / bc1 / (nu.sqrt() / bc2_sqrt + eps)).to(g.dtype))
            per_leaf[k] = leaf_state(mu, nu)
        new_state = TensorDict({"count": count, "moments": moments(per_leaf)}, [])
        return tree.unflatten(updates, out), new_state

    return GradientTransformation(init, update)


@checked
def adamw8bit(
    learning_rate=1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask=None,
    *,
    block_size: int = 256,
    min_8bit_size: int = 4096,
) -> GradientTransformation:
    """AdamW whose moments take about 2 bytes per parameter (see :func:`scale_by_adam_8bit`).

    ``chain(scale_by_adam_8bit, add_decayed_weights, scale_by_learning_rate)``: the same
    composition as :func:`adamw`; its loss curve tracks AdamW's closely (tested on a GPT).
    """
    check_lr("adamw8bit", learning_rate)
    check_range("adamw8bit", "b1", b1, 0.0, 1.0)
    check_range("adamw8bit", "b2", b2, 0.0, 1.0)
    check_range("adamw8bit", "eps", eps, 0.0)
    check_range("adamw8bit", "weight_decay", weight_decay, 0.0)
    return chain(
        scale_by_adam_8bit(b1, b2, eps, block_size=block_size, min_8bit_size=min_8bit_size),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
