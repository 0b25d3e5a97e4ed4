"""Hugging Face models pipelined, for ``tests/distributed/pipeline/test_hf.py`` and the 4-rank
pipeline run (``_pipeline_ranks.on_four_ranks``): a tiny GPT-2 or Llama built from a config here
(no downloads; width 32, 4 layers), trained 3 clipped-AdamW steps pipelined and on one process.
"""

from __future__ import annotations

import torch

import ftrain as ft

from _hf import tiny_config
from _tiny import VOCAB, lm_batch

LENGTHS = (2, 5, 16, 16, 7, 1, 16, 9)  # valid targets per row: unequal counts per micro-batch
STEPS = 3


def tiny_hf(kind: str, *, tie: bool | None = None, attn: str = "sdpa", seed: int = 0):
    """A tiny ``kind`` model ("gpt2": head tied; "llama": ``tie`` chooses) of 4 layers over the
    vocabulary of ``_tiny``'s batches, with attention implementation ``attn``, seeded."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, VOCAB)
    config.num_hidden_layers = 4
    if tie is not None:
        config.tie_word_embeddings = tie
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def hf_loss(model):
    """As ``ftrain.app.recipes.hf`` trains a model: the logits of the ids, token cross-entropy."""

    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"]).logits  # (B, T, V)
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


def _opt():
    return ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(1e-3, weight_decay=0.1))


def _train(step, state):
    metrics = []
    for i in range(STEPS):
        state, m = step(state, lm_batch(8, seed=100 + i, lengths=LENGTHS))
        metrics.append({k: float(m[k]) for k in ("loss", "count", "grad_norm")})
    return state, metrics


def one_process(kind: str, tie: bool | None):
    """``(state, metrics)`` after :data:`STEPS` steps of the whole model on one process."""
    model = tiny_hf(kind, tie=tie)
    state = ft.TrainState.create(ft.params_of(model), _opt())
    return _train(ft.train_step(hf_loss(model), _opt()), state)


def pipelined(mesh, kind: str, schedule: str, tie: bool | None) -> tuple:
    """On each process of ``mesh``: ``kind`` trained pipelined under ``schedule`` (4
    micro-batches; several stages per rank where the schedule takes them), its state put back
    together (``unshard_state``), its metrics, and how many params keys this rank held."""
    model = tiny_hf(kind, tie=tie)
    pp = ft.pipeline(model, mesh, schedule=schedule, microbatches=4)
    state = pp.shard_state(ft.TrainState.create(ft.params_of(model), _opt()))
    held = len(ft.tree.paths(state.params))
    state, metrics = _train(pp(ft.train_step(hf_loss(model), _opt())), state)
    return pp.unshard_state(state), metrics, held
