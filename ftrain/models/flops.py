"""Parameter and FLOP counts, for model-FLOPs utilization (MFU).

    >>> from ftrain.models import GPTConfig, flops_per_token
    >>> cfg = GPTConfig()  # d=128, L=4, T=128, V=257, dense
    >>> flops_per_token(cfg) == 6 * (4 * (4 * 128**2 + 2 * 128 * 512) + 128 * 257) + 12 * 4 * 128 * 128
    True

MFU = tokens/s * flops_per_token(config) / peak FLOP/s of the hardware.
"""

from __future__ import annotations

import torch.nn as nn

from ftrain.models.gpt import GPTConfig


def num_params(model: nn.Module) -> int:
    """Number of scalar parameters of ``model``; a tensor shared by two modules counts once."""
    return sum(p.numel() for p in model.parameters())


def matmul_params_per_token(config: GPTConfig) -> int:
    """Weights of the matmuls one token passes through in a forward pass (N in 6N).

    Per block: attention ``qkv`` and ``proj`` (4 d^2), the feed-forward the token uses
    (2 d d_ff for the dense MLP; ``top_k`` experts of 2 d d_ff plus the router's d E for MoE);
    then the lm head (d V), counted whether or not it is tied to the embedding, since it is a matmul
    either way. Embedding lookups (no matmul), biases and LayerNorms (negligible) are left out.
    """
    d, L = config.d_model, config.n_layer
    if config.n_experts == 0:
        ffn = 2 * d * config.ff_dim
    else:
        ffn = config.top_k * 2 * d * config.ff_dim + d * config.n_experts
    return L * (4 * d * d + ffn) + d * config.vocab_size


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token (forward + backward): ``6 N + 12 L d T``.

    ``N = matmul_params_per_token(config)``: each weight costs a multiply-add (2 FLOPs) forward and
    twice that backward, so 6 FLOPs per weight per token. ``12 L d T`` is attention itself: per
    layer, ``q k^T`` and ``att v`` each take 2 d T FLOPs per token forward (x3 for training), with
    ``T = seq_len`` (default ``config.seq_len``). This is the estimate of the PaLM paper (appendix
    B) and nanoGPT's ``estimate_mfu``; it counts the full T x T score matrix although causal
    attention needs only half, and it ignores activation recomputation (checkpointing adds a
    forward, but MFU conventionally does not count it).
    """
    T = config.seq_len if seq_len is None else seq_len
    return 6 * matmul_params_per_token(config) + 12 * config.n_layer * config.d_model * T
