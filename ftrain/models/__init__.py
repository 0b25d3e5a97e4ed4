"""Models for ftrain: a nanoGPT-style GPT (``gpt``) with an optional mixture-of-experts feed-forward
(``moe``), sampling, FLOP counts, and ``Linear``, an ``nn.Linear`` whose CPU float32 matmuls run in
oneDNN (``onednn``).

Any ``nn.Module`` works with ftrain; these are the ones the ``ftrain`` command and the tests use.
"""

from ftrain.models.flops import flops_per_token, matmul_params_per_token, num_params
from ftrain.models.gpt import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    choose_matmul,
    document_mask,
)
from ftrain.models.hf import empty_causal_lm, load_causal_lm, tiny_gpt2
from ftrain.models.moe import MoE
from ftrain.models.onednn import Linear, faster_linear, linear, onednn_linear_available
from ftrain.models.sample import generate

__all__ = [
    "GPT",
    "GPTConfig",
    "choose_matmul",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "MoE",
    "empty_causal_lm",
    "document_mask",
    "generate",
    "num_params",
    "flops_per_token",
    "matmul_params_per_token",
    "tiny_gpt2",
    "load_causal_lm",
    "Linear",
    "linear",
    "onednn_linear_available",
    "faster_linear",
]
