"""Tensor-parallel plans: placements per parameter, pieces per rank, and the bad-input errors."""

import pytest
import torch
from torch import nn

from ftrain.distributed.tensor_parallel.plans import (
    Colwise,
    Divide,
    Rowwise,
    Split,
    check_mesh_shape,
    gpt_plan,
    hf_gpt2_plan,
    hf_llama_plan,
    join_pieces,
    local_piece,
    plan_for,
    resolve_divisions,
    resolve_plan,
)
from ftrain.models import GPT, GPTConfig


def _gpt(**kw):
    cfg = dict(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=2)
    return GPT(GPTConfig(**{**cfg, **kw}))


def test_gpt_plan_places_the_block_matrices():
    splits = resolve_plan(_gpt(), gpt_plan(), 2)
    assert splits["blocks.1.attn.qkv.weight"] == Split(0, 3)
    assert splits["blocks.1.attn.qkv.bias"] == Split(0, 3)
    assert splits["blocks.0.attn.proj.weight"] == Split(1)
    assert splits["blocks.0.attn.proj.bias"] == Split(None)
    assert splits["blocks.0.mlp.fc.weight"] == Split(0)
    assert splits["blocks.0.mlp.proj.weight"] == Split(1)
    for whole in ("wte.weight", "wpe.weight", "blocks.0.ln_1.weight", "ln_f.bias"):
        assert splits[whole] == Split(None)
    assert set(splits) == {n for n, _ in _gpt().named_parameters()}


def test_pieces_keep_fused_heads_together_and_join_back():
    t = torch.arange(12.0).reshape(12, 1)  # q = 0..3, k = 4..7, v = 8..11
    fused = Split(0, 3)
    assert local_piece(t, fused, 0, 2).flatten().tolist() == [0, 1, 4, 5, 8, 9]
    assert local_piece(t, fused, 1, 2).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    w = torch.randn(4, 6)
    for split in (fused, Split(0), Split(1), Split(None)):
        if split.dim is not None and w.shape[split.dim] % (split.chunks * 2):
            continue
        pieces = [local_piece(w, split, r, 2) for r in range(2)]
        assert torch.equal(join_pieces(pieces, split), w)
    assert torch.equal(join_pieces([local_piece(t, fused, r, 2) for r in range(2)], fused), t)


def test_split_gpt_matches_the_column_and_row_parallel_sums():
    # Megatron's identity: colwise then rowwise on pieces, summed over ranks, is the whole MLP.
    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(3, 8)
    want = proj(torch.relu(fc(x)))
    splits = resolve_plan(nn.Sequential(fc, proj), {"0": Colwise(), "1": Rowwise()}, 2)
    got = proj.bias.clone()
    for r in range(2):
        w1, b1 = (local_piece(p, splits[f"0.{n}"], r, 2) for n, p in fc.named_parameters())
        w2 = local_piece(proj.weight, splits["1.weight"], r, 2)
        got = got + torch.relu(x @ w1.T + b1) @ w2.T
    torch.testing.assert_close(got, want)


def test_hf_plans_resolve_on_tiny_models():
    from transformers import AutoModelForCausalLM

    from tests._hf import tiny_config

    gpt2 = AutoModelForCausalLM.from_config(tiny_config("gpt2", 50))
    s = resolve_plan(gpt2, hf_gpt2_plan(), 2)
    # Conv1D stores (in, out): columns split dim 1, rows split dim 0
    assert s["transformer.h.0.attn.c_attn.weight"] == Split(1, 3)
    assert s["transformer.h.0.attn.c_attn.bias"] == Split(0, 3)
    assert s["transformer.h.1.mlp.c_proj.weight"] == Split(0)
    llama = AutoModelForCausalLM.from_config(tiny_config("llama", 50))
    s = resolve_plan(llama, hf_llama_plan(), 2)
    assert s["model.layers.0.self_attn.k_proj.weight"] == Split(0)
    assert s["model.layers.1.mlp.down_proj.weight"] == Split(1)
    assert s["model.norm.weight"] == Split(None)


def test_bad_plans_are_clear_errors():
    with pytest.raises(ValueError, match="names no module"):
        resolve_plan(_gpt(), {"blocks.*.attention.qkv": Colwise()}, 2)
    with pytest.raises(ValueError, match="not divisible by 6"):
        resolve_plan(_gpt(d_model=33, n_head=3), gpt_plan(), 2)  # 99 = 3 x 33
    with pytest.raises(ValueError, match="not divisible by 3"):
        resolve_plan(_gpt(), {"blocks.*.mlp.fc": Colwise()}, 3)
    with pytest.raises(ValueError, match="nn.Linear"):
        resolve_plan(_gpt(), {"blocks.*.ln_1": Colwise()}, 2)
    with pytest.raises(TypeError, match="Colwise"):
        resolve_plan(_gpt(), {"blocks.*.mlp.fc": "colwise"}, 2)
    with pytest.raises(ValueError, match="named by both"):
        resolve_plan(_gpt(), {"blocks.*.mlp.fc": Colwise(), "blocks.0.mlp.f?": Rowwise()}, 2)


def test_mesh_shape_must_match_the_world():
    assert check_mesh_shape({"dp": 2, "tp": 2}, 4) == {"dp": 2, "tp": 2}
    with pytest.raises(ValueError, match="has 6 processes but the world has 4"):
        check_mesh_shape({"dp": 3, "tp": 2}, 4)
    with pytest.raises(ValueError, match="int >= 1"):
        check_mesh_shape({"tp": 0}, 4)


def test_divided_head_counts_are_checked_against_the_tp_size():
    assert resolve_divisions(_gpt(n_head=4), gpt_plan(), 2)["blocks.1.attn"] == {"n_head": 2}
    with pytest.raises(ValueError, match=r"n_head = 2 is not divisible by tp=4"):
        resolve_plan(_gpt(n_head=2), gpt_plan(), 4)  # every width divides by 4, the heads do not
    with pytest.raises(ValueError, match="no int attribute 'heads'"):
        resolve_plan(_gpt(), {"blocks.*.attn": Divide("heads")}, 2)
    with pytest.raises(ValueError, match="name one or more attributes"):
        Divide()


def test_plan_for_picks_the_provided_plans_and_says_how_to_write_one():
    from transformers import AutoModelForCausalLM

    from tests._hf import tiny_config

    assert plan_for(_gpt()) == gpt_plan()
    assert plan_for(AutoModelForCausalLM.from_config(tiny_config("llama", 50))) == hf_llama_plan()
    with pytest.raises(ValueError, match="Write one"):
        plan_for(nn.Linear(2, 2))
