"""A pipelined state's layout on one process: what keep_stages keeps (gather_stages, a collective,
is checked against the whole state by tests/transforms/test_pipeline.py on 2, 4 and 8 ranks)."""

from __future__ import annotations

import torch

import ftrain as ft
from ftrain.distributed.pipeline.layout import keep_stages, param_of

KEYS = {"wte.weight": 0, "blocks.0.w": 1, "blocks.1.w": 2}


def test_a_rank_keeps_its_params_their_moments_and_every_counter():
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(1e-3))
    params = ft.tree.from_flat({k: torch.randn(2, 3) for k in KEYS})
    state = opt.init(params)
    kept = keep_stages(state, {"wte.weight", "blocks.1.w"}, KEYS)
    paths = ft.tree.paths(kept)
    assert not [p for p in paths if p.endswith("blocks.0.w")]
    assert [p for p in paths if p.endswith("blocks.1.w")] and [p for p in paths if "count" in p]
    assert list(kept.keys()) == list(state.keys())  # the clip's empty state stays, in its place
    for p in paths:  # the same tensors, not copies
        assert kept[tuple(p.split("."))] is state[tuple(p.split("."))]


def test_the_params_key_a_path_ends_with():
    assert param_of("1.mu.blocks.0.w", KEYS) == "blocks.0.w"
    assert param_of("1.count", KEYS) is None
