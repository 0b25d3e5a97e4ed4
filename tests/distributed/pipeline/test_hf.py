"""ft.pipeline on Hugging Face models (ftrain.distributed.pipeline.hf): GPT-2 and Llama.

The stages chained by hand give the whole model's logits bitwise (one process, fast); two
pipeline processes train as one process does (fp32, 1e-5), under 1F1B and interleaved 1F1B, with
the head tied to the embedding (GPT-2, Llama) and untied (Llama). The models are tiny, built from
a config here (no downloads): width 32, 4 layers, so interleaving cuts 4 one-layer stages.
"""

from __future__ import annotations

import sys

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain.distributed.pipeline import family_of
from ftrain.distributed.pipeline.cut import cut, even_split, stage_module

from _hf import tiny_config
from _tiny import VOCAB, assert_trees_close, lm_batch

pytest.importorskip("transformers")

LENGTHS = (2, 5, 16, 16, 7, 1, 16, 9)  # valid targets per row: unequal counts per micro-batch
STEPS = 3
SCHEDULES = (("1f1b", {}), ("interleaved-1f1b", {"virtual": 2}))
VARIANTS = {
    "gpt2": [(s, None) for s, _ in SCHEDULES],
    "llama": [(s, tie) for tie in (False, True) for s, _ in SCHEDULES],
}


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


def _one_process(kind: str, tie: bool | None):
    model = tiny_hf(kind, tie=tie)
    state = ft.TrainState.create(ft.params_of(model), _opt())
    return _train(ft.train_step(hf_loss(model), _opt()), state)


def _pipelined(kind: str) -> dict:
    """On each of 2 processes: every variant of ``kind`` trained pipelined, its state put back
    together (``unshard_state``), its metrics, and how many params keys this rank held."""
    torch.set_num_threads(1)
    mesh = ft.distributed.pipeline.pp_mesh(pp=2)
    out = {}
    for schedule, tie in VARIANTS[kind]:
        model = tiny_hf(kind, tie=tie)
        pp = ft.pipeline(
            model, mesh, schedule=schedule, microbatches=4, **dict(SCHEDULES)[schedule]
        )
        state = pp.shard_state(ft.TrainState.create(ft.params_of(model), _opt()))
        held = len(ft.tree.paths(state.params))
        state, metrics = _train(pp(ft.train_step(hf_loss(model), _opt())), state)
        out[schedule, tie] = (pp.unshard_state(state), metrics, held)
    return out


@pytest.mark.slow  # two processes start and train 2 or 4 variants: 15-25 s on 2 cores
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_two_pipeline_processes_train_as_one_process(kind):
    ranks = ft.distributed.run_distributed(_pipelined, 2, kind)
    for schedule, tie in VARIANTS[kind]:
        ref_state, ref_metrics = _one_process(kind, tie)
        whole = len(ft.tree.paths(ref_state.params))
        for rank, out in enumerate(ranks):
            state, metrics, held = out[schedule, tie]
            assert held < whole, (schedule, tie, rank)  # each rank held only its stages
            assert_trees_close(state, ref_state, 1e-5)
            for got, want in zip(metrics, ref_metrics, strict=True):
                assert got == pytest.approx(want, rel=1e-5, abs=1e-5), (schedule, tie, rank)


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
