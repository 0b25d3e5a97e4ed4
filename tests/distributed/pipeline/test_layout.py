"""A pipelined state's layout on one process: what keep_stages keeps, and the whole checkpoint tree
whole_tree merges from the parts' trees (gather_stages and the checkpoints, collectives, are
checked against the whole state by tests/transforms/test_pipeline.py on 2, 4 and 8 ranks)."""

from __future__ import annotations

import json

import torch

import ftrain as ft
from ftrain.distributed.pipeline.layout import keep_stages, param_of, whole_tree
from ftrain.io.state_files import tree_of

from _tiny import tiny_gpt

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


def test_the_parts_trees_merge_into_the_whole_tree_in_its_order():
    """Interleaved stages (rank 0: blocks 0 and 2; rank 1: blocks 1 and 3, the final norm and the
    tied embedding): their trees merge into the whole state's, in its order (a clip's empty
    state included), whichever rank is listed first and with replicas listed again."""
    model = tiny_gpt(n_layer=4)
    keys = {k: i for i, (k, _) in enumerate(model.named_parameters())}
    opt = ft.optim.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(1e-3))
    state = ft.TrainState.create(ft.params_of(model), opt)

    def part(*prefixes: str) -> dict:
        mine = {k for k in keys if k.startswith(prefixes)}
        fields = ("params", "opt_state", "extra")
        return tree_of(
            state.replace(**{f: keep_stages(getattr(state, f), mine, keys) for f in fields})
        )

    first = part("wte.", "wpe.", "blocks.0.", "blocks.2.")
    last = part("wte.", "blocks.1.", "blocks.3.", "ln_f.")
    whole = json.dumps(tree_of(state))
    assert json.dumps(first) != whole
    for trees in ([first, last], [last, first], [first, first, last, last]):
        assert json.dumps(whole_tree(trees, keys)) == whole
