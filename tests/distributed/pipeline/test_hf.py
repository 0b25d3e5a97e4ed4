"""ft.pipeline on Hugging Face models (ftrain.distributed.pipeline.hf): GPT-2 and Llama.

The stages chained by hand give the whole model's logits bitwise (one process, fast). Pipelined
processes train as one process does (fp32, 1e-5): two processes (one spawn for both models)
under every schedule this torch runs over gloo, the head tied to the embedding (GPT-2, Llama) and
untied (Llama); four (pp = 4, the 4-rank pipeline run of ``_pipeline_ranks``) under 1F1B, one
layer per stage. The models are tiny, built from a config here (no downloads): width 32, 4
layers, so the schedules with several stages per rank cut 4 one-layer stages at pp = 2.
"""

from __future__ import annotations

import sys

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain.distributed.pipeline import family_of
from ftrain.distributed.pipeline.cut import cut, even_split, stage_module

from _pipeline_hf import one_process, pipelined, tiny_hf
from _pipeline_ranks import SCHEDULES
from _tiny import VOCAB, assert_trees_close, lm_batch

pytest.importorskip("transformers")

# (model, schedule, tie): GPT-2 (tied) under every schedule; Llama tied under every schedule and
# untied under one schedule of each kind (one stage per rank, several)
VARIANTS = [("gpt2", s, None) for s in SCHEDULES]
VARIANTS += [("llama", s, True) for s in SCHEDULES]
VARIANTS += [("llama", s, False) for s in ("1f1b", "interleaved-1f1b")]


def _on_two_ranks() -> dict:
    torch.set_num_threads(1)
    mesh = ft.distributed.pipeline.pp_mesh(pp=2)
    return {v: pipelined(mesh, *v) for v in VARIANTS}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Every variant on each of 2 processes: one spawn, both models (about 30 s on 2 cores)."""
    return ft.distributed.run_distributed(_on_two_ranks, 2, timeout=400)


def assert_trains_as_one_process(ranks: list, kind: str, tie: bool | None, key) -> None:
    ref_state, ref_metrics = one_process(kind, tie)
    whole = len(ft.tree.paths(ref_state.params))
    for rank, out in enumerate(ranks):
        state, metrics, held = out[key]
        assert held < whole, (key, rank)  # each rank held only its stages
        assert_trees_close(state, ref_state, 1e-5)
        for got, want in zip(metrics, ref_metrics, strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (key, rank)


@pytest.mark.parametrize("kind,schedule,tie", VARIANTS)
def test_two_pipeline_processes_train_as_one_process(two_ranks, kind, schedule, tie):
    assert_trains_as_one_process(two_ranks, kind, tie, (kind, schedule, tie))


@pytest.mark.parametrize("kind,tie", [("gpt2", None), ("llama", False)])
def test_four_pipeline_processes_train_as_one_process(pipeline_four_ranks, kind, tie):
    """pp = 4 (one layer per stage): GPT-2's tied embedding held by the first and the last of
    four ranks; Llama's head untied."""
    assert_trains_as_one_process(pipeline_four_ranks, kind, tie, f"hf {kind} pp4")


@pytest.mark.parametrize(
    "kind,tie,attn",
    [("gpt2", None, "sdpa"), ("gpt2", None, "eager"), ("llama", False, "sdpa"),
     ("llama", True, "sdpa"), ("llama", False, "eager")],
)  # fmt: skip
@pytest.mark.parametrize("n_stages", [2, 4])
def test_stages_chained_by_hand_give_the_whole_models_logits(kind, tie, attn, n_stages):
    model = tiny_hf(kind, tie=tie, attn=attn)
    family = family_of(model)
    assert family.name == {"gpt2": "HF GPT-2", "llama": "HF Llama"}[kind]
    params = ft.params_of(model)
    flat = dict(params.flatten_keys(".").items())
    x = lm_batch(3, seed=1)["input"]
    whole = ft.apply(model, params, x).logits
    h = x
    for stage in cut(even_split(4, n_stages)):
        body, names = stage_module(model, family, stage)
        p = TensorDict({tuple(k.split(".")): flat[key] for k, key in names.items()}, batch_size=[])
        h = ft.apply(body, p, h)  # ids -> hidden states -> ... -> logits
    assert torch.equal(h, whole)


def test_the_model_call_refuses_what_the_stages_do_not_compute():
    output = family_of(tiny_hf("llama")).output
    logits, ids = torch.zeros(2, 5, VOCAB), torch.zeros(2, 5, dtype=torch.long)
    assert output(logits, (ids,), {"use_cache": False}).logits is logits
    assert output(logits, (), {"input_ids": ids, "return_dict": False})[0] is logits
    for kwargs, match in [
        ({"attention_mask": torch.ones(2, 5)}, "attention_mask= is not honoured"),
        ({"position_ids": torch.arange(5)[None]}, "position_ids= is not honoured"),
        ({"labels": ids}, "ft.losses.causal_lm"),
        ({"inputs_embeds": torch.zeros(2, 5, 32)}, "inputs_embeds= is not honoured"),
    ]:
        with pytest.raises(ValueError, match=match):
            output(logits, (ids,), kwargs)
    with pytest.raises(ValueError, match="inputs"):
        output(logits, (ids[:, :4],), {})


def test_a_llama_whose_config_runs_fewer_layers_is_refused():
    model = tiny_hf("llama")
    model.config.num_hidden_layers = 3
    with pytest.raises(ValueError, match="num_hidden_layers=3"):
        family_of(model).check(model)


def test_matching_never_imports_transformers(monkeypatch):
    model = tiny_hf("gpt2")
    monkeypatch.delitem(sys.modules, "transformers")  # as if it were never imported
    with pytest.raises(ValueError, match="no stage code for a GPT2LMHeadModel"):
        family_of(model)
    assert "transformers" not in sys.modules
