"""ft.pipeline: pp ranks (and dp x pp ranks under ft.shard) equal one process holding the model.

The ranks run in session fixtures (``_pipeline_ranks.py``): 2 processes (pp = 2: every
schedule, donation, an untied head, accumulate + checkpoint + bf16, fp16, a checkpoint of the
stages' pieces resumed on another schedule, the errors) and 4 (pp = 4, dp 2 x pp 2 with ddp,
zero1, zero2 and fsdp, pp 2 x tp 2, each saving its stages' pieces; one such checkpoint loaded
onto pp 4, dp 2 x pp 2, pp 2 x tp 2 and plain dp). Each returns the whole state
(``pp.unshard_state``) and each step's metrics, compared here with one process; the checkpoints
are loaded here on one process.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import ftrain as ft
from ftrain.distributed.pipeline.cut import cut, even_split, family_of, stage_module
from ftrain.distributed.pipeline.runner import refusal
from ftrain.io.sharded import leaves
from ftrain.io.state_files import tree_of
from tests._pipeline_ranks import ALL, CONFIGS, EIGHT, FOUR, FP16, SCHEDULES, reference
from tests._tiny import assert_trees_close, lm_batch, max_tree_diff, tiny_gpt

TOL = 1e-5  # fp32, 3 AdamW steps: the bound; measured at most 5e-6


def assert_equal_to_one_process(got: list[dict], config: str, **kw) -> None:
    want, metrics = reference(config, **kw)
    for r, out in enumerate(got):  # every rank: the whole state and the global metrics
        assert_trees_close(out["state"], want, TOL)
        for step, (m, w) in enumerate(zip(out["metrics"], metrics)):
            for k in ("loss", "count", "grad_norm", "lr", "skipped"):
                if k in w:
                    assert m[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), (r, step, k)


@pytest.mark.parametrize("schedule", ALL)
def test_every_schedule_equals_one_process(pipeline_two_ranks, schedule):
    if schedule not in SCHEDULES:
        pytest.skip(f"torch {torch.__version__}: {refusal(schedule, 'gloo')}")
    assert_equal_to_one_process([r[f"schedule {schedule}"] for r in pipeline_two_ranks], "plain")


@pytest.mark.parametrize("config", [c for c in CONFIGS if c not in ("plain", "sgd", *FP16)])
def test_compositions_equal_one_process(pipeline_two_ranks, config):
    assert_equal_to_one_process([r[config] for r in pipeline_two_ranks], config)


@pytest.mark.parametrize("config", FP16)
def test_fp16_equals_one_process_to_fp16_rounding(pipeline_two_ranks, config):
    """fp16 gradients round at the magnitude the loss was scaled to, and the pipeline divides
    the losses by another count than one process does (one for the step, not one per
    micro-batch), so the two differ by fp16 rounding. Bound: every one-process fp16 run (1, 2, 4
    micro-batches) lies within eps of the fp32 run, measured here; the pipeline's run is one
    more such run, so it lies within 2 eps of one process's. No step is skipped that one
    process does not skip."""
    assert_within_fp16_rounding([out[config] for out in pipeline_two_ranks], config)


def assert_within_fp16_rounding(runs: list[dict], config: str) -> None:
    """Each of ``runs`` (one per process) within 2 eps of one process's fp16 run and of the fp32
    run, eps being the farthest any one-process fp16 run (1, 2, 4 or 8 micro-batches) lies from
    the fp32 run; the same steps skipped and the same loss scale."""
    fp32, _ = reference("sgd")
    want, metrics = reference(config)
    ones = [want, *(reference(config, micro_batches=k)[0] for k in (1, 2))]
    eps = max(max_tree_diff(r.params, fp32.params) for r in ones)
    assert 0 < eps < 1e-3
    for got in runs:
        assert max_tree_diff(got["state"].params, want.params) <= 2 * eps
        assert max_tree_diff(got["state"].params, fp32.params) <= 2 * eps
        assert [m["skipped"] for m in got["metrics"]] == [m["skipped"] for m in metrics]
        assert got["state"].extra["loss_scale", "scale"] == want.extra["loss_scale", "scale"]


def test_each_rank_holds_its_stages_and_the_tied_embedding(pipeline_two_ranks):
    first, last = (r["schedule 1f1b"]["keys"] for r in pipeline_two_ranks)
    assert "wte.weight" in first and "wte.weight" in last  # the head reads it on the last stage
    assert "blocks.0.attn.qkv.weight" in first and "blocks.0.attn.qkv.weight" not in last
    assert "blocks.3.attn.qkv.weight" in last and "ln_f.weight" in last
    assert "wpe.weight" in first and "wpe.weight" not in last
    model = tiny_gpt(n_layer=4)
    whole = {k for k, _ in model.named_parameters()}
    assert set(first) | set(last) == whole


def test_a_checkpoint_resumes_on_another_schedule(pipeline_two_ranks):
    want, _ = reference("plain")
    for r in pipeline_two_ranks:
        assert_trees_close(r["resumed"]["state"], want, TOL)


def assert_bitwise(got: ft.TrainState, want: ft.TrainState) -> None:
    """The same tree (order and empty TensorDicts included) and every tensor bit for bit."""
    assert json.dumps(tree_of(got)) == json.dumps(tree_of(want))
    for (key, a), (_, b) in zip(leaves(got), leaves(want)):
        assert a.dtype == b.dtype and torch.equal(a, b), key


def test_a_checkpoint_of_the_stages_pieces_is_the_whole_state_on_one_process(
    pipeline_two_ranks, tmp_path
):
    """Each rank wrote its own stages' tensors (the tied embedding and the counters once); one
    process loads the whole state, bitwise the gathered one, and consolidates its params."""
    out = pipeline_two_ranks[0]["resumed"]
    assert_bitwise(ft.load(out["path"]), out["saved"])
    assert_bitwise(ft.load(out["path"], like=out["saved"]), out["saved"])
    meta = ft.load_meta(out["path"])
    assert meta["format_version"] == 2 and meta["world_size"] == 2
    files = {k: [p["file"][:10] for p in e["pieces"]] for k, e in meta["index"].items()}
    assert files["params.blocks.0.attn.qkv.weight"] == ["rank-00000"]
    assert files["opt_state.1.0.mu.blocks.3.attn.qkv.weight"] == ["rank-00001"]
    assert files["params.wte.weight"] == files["step"] == ["rank-00000"]
    ft.consolidate(out["path"], tmp_path / "export")
    params = safetensors.torch.load_file(tmp_path / "export" / "model.safetensors")
    whole = out["saved"].params
    assert sorted(params) == sorted(ft.tree.paths(whole))
    for key, t in zip(ft.tree.paths(whole), ft.tree.leaves(whole)):
        assert torch.equal(params[key], t), key


def test_a_checkpoint_loads_onto_another_schedules_stages(pipeline_two_ranks):
    """A checkpoint of pp 2 x 1F1B's pieces, and a whole one, loaded onto interleaved 1F1B's
    stages (each rank reading its own): bitwise the whole state laid out by ``shard_state``."""
    for r in pipeline_two_ranks:
        out = r["resumed"]
        assert_bitwise(out["loaded"], out["laid out"])
        assert_bitwise(out["from whole"], out["laid out"])


def test_errors_at_the_first_call_name_the_fix(pipeline_two_ranks):
    errors = pipeline_two_ranks[0]["errors"]
    assert "6 rows" in errors["rows"] and "multiple of microbatches" in errors["rows"]
    assert "shard_state" in errors["twice"] and "whole model" in errors["twice"]
    assert "pp.shard_state(state)" in errors["whole"]


def test_a_pipelined_load_that_fails_on_one_rank_fails_on_every_rank(pipeline_two_ranks):
    for out in pipeline_two_ranks:
        message = out["errors"]["one rank"]
        assert message.startswith("ft.load: rank 1: ") and "not-here" in message


@pytest.mark.parametrize("schedule", FOUR)
def test_four_stages_equal_one_process(pipeline_four_ranks, schedule):
    assert_equal_to_one_process(
        [r[f"pp4 {schedule}"] for r in pipeline_four_ranks], "plain", n_layer=8
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_data_parallel_times_pipeline_equals_one_process(pipeline_four_ranks, strategy):
    assert_equal_to_one_process([r[f"dp2 pp2 {strategy}"] for r in pipeline_four_ranks], "plain")


def test_fsdp_under_a_pipeline_composes_with_accumulate_checkpoint_and_bf16(pipeline_four_ranks):
    """fsdp's stage params gathered once for the step, with 2 accumulated pieces, recomputed
    blocks and bf16 forwards: the one process's 8 micro-batches of one row."""
    got = [r["dp2 pp2 fsdp composed"] for r in pipeline_four_ranks]
    assert_equal_to_one_process(got, "composed")


def test_fsdp_under_a_pipeline_with_fp16_loss_scaling_equals_one_process_to_fp16_rounding(
    pipeline_four_ranks,
):
    """fp16 with a dynamic loss scale under dp 2 x pp 2 fsdp: the engine reweights each
    micro-batch's gradients after its backward, so fsdp's reduce phase reduce-scatters the
    stages' sums once; within :func:`assert_within_fp16_rounding`'s bound of one process."""
    assert_within_fp16_rounding([r["dp2 pp2 fsdp fp16"] for r in pipeline_four_ranks], "fp16")


def test_fsdp_under_a_pipeline_keeps_half_the_state_at_rest(pipeline_four_ranks):
    """Between steps each process holds 1/dp of its stages' params and optimizer state: about
    half of what ddp keeps, less than zero2 (whose params stay whole)."""
    for r in pipeline_four_ranks:
        ddp, zero2, fsdp = (r[f"dp2 pp2 {s}"]["bytes"] for s in ("ddp", "zero2", "fsdp"))
        assert 0.45 * ddp < fsdp < 0.55 * ddp
        assert fsdp < 0.8 * zero2


def test_tensor_parallel_stages_equal_one_process(pipeline_four_ranks):
    """pp 2 x tp 2: each stage's matrices split over its tp pair (interleaved 1F1B)."""
    assert_equal_to_one_process([r["pp2 tp2"] for r in pipeline_four_ranks], "plain")


@pytest.mark.parametrize(
    "run", ["dp2 pp2 ddp", "dp2 pp2 zero1", "dp2 pp2 zero2", "dp2 pp2 fsdp", "pp2 tp2"]
)
def test_each_rank_saves_its_stages_pieces_and_one_process_loads_the_whole(
    pipeline_four_ranks, run
):
    """Under ft.shard over dp and tensor parallelism, each rank writes only pieces of its own
    stages (no gather to any rank; a replica written once): one process loads the whole state,
    bitwise the gathered one."""
    out = pipeline_four_ranks[0][run]
    assert_bitwise(ft.load(out["path"]), out["state"])
    meta = ft.load_meta(out["path"])
    tp = 2 if "tp2" in run else 1

    def stages(key: str) -> set[int]:  # the pp coordinates of the ranks that wrote its pieces
        return {(int(p["file"][5:10]) // tp) % 2 for p in meta["index"][key]["pieces"]}

    for prefix in ("params.", "opt_state.1.0.mu."):  # a param and its moment
        assert stages(f"{prefix}blocks.0.attn.qkv.weight") == {0}
        assert stages(f"{prefix}blocks.3.attn.qkv.weight") == {1}
    writers = {p["file"] for e in meta["index"].values() for p in e["pieces"]}
    assert len(writers) == (2 if run == "dp2 pp2 ddp" else 4)  # ddp's dp replicas write nothing


@pytest.mark.parametrize("layout", ["pp4", "dp2 pp2 zero2", "dp2 pp2 fsdp", "pp2 tp2", "dp4 zero1"])
def test_a_dp_x_pp_checkpoint_loads_onto_any_layout(pipeline_four_ranks, layout):
    """dp 2 x pp 2 (zero1)'s checkpoint loaded onto 4 stages, interleaved dp 2 x pp 2 under zero2,
    dp 2 x pp 2 under fsdp, pp 2 x tp 2, and zero1 over 4 processes without a pipeline: gathered again, bitwise the
    state it saved."""
    want = pipeline_four_ranks[0]["dp2 pp2 zero1"]["state"]
    for r in pipeline_four_ranks:
        assert_bitwise(r[f"onto {layout}"]["state"], want)


def test_resumed_on_another_pipeline_size_continues_the_same_run(pipeline_four_ranks):
    """The dp 2 x pp 2 checkpoint (3 steps) resumed on pp 4 takes the 4th step of one process."""
    want, _ = reference("plain", steps=4)
    for r in pipeline_four_ranks:
        assert_trees_close(r["onto pp4"]["next"], want, TOL)


@pytest.mark.parametrize("run", ["dp2 pp2 tp2", "dp2 pp2 tp2 fsdp"])
def test_the_3d_mesh_equals_one_process(pipeline_eight_ranks, run):
    """dp 2 x pp 2 x tp 2 on 8 processes, zero1 over dp; and fsdp over dp (each stage's tp
    pieces gathered over dp once per step)."""
    assert_equal_to_one_process([r[run] for r in pipeline_eight_ranks], "plain", **EIGHT)


# -- one process: the cut ------------------------------------------------------------------------


def test_stages_run_in_order_give_the_models_logits():
    model = tiny_gpt(n_layer=4, tie_weights=True)
    params = ft.params_of(model)
    x = lm_batch(3, seed=2)["input"]
    family = family_of(model)
    h = x
    for stage in cut([1, 2, 1]):
        body, names = stage_module(model, family, stage)
        h = ft.apply(
            body, ft.tree.from_flat({n: params[tuple(k.split("."))] for n, k in names.items()}), h
        )
    torch.testing.assert_close(h, ft.apply(model, params, x), rtol=0, atol=0)


def test_even_split_gives_earlier_stages_the_remainder():
    assert even_split(10, 4) == [3, 3, 2, 2]
    assert even_split(4, 4) == [1, 1, 1, 1]


def test_the_template_is_left_as_it_was():
    model = tiny_gpt(n_layer=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    body, _ = stage_module(model, family_of(model), cut([2, 2])[1])
    assert all(p.device.type == "meta" for p in body.parameters())
    assert body.wpe is None and len(body.blocks) == 2
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(model.blocks) == 4 and model.wpe is not None


def test_a_step_without_process_group_is_refused():
    with pytest.raises(RuntimeError, match="pipeline"):
        ft.pipeline(tiny_gpt(), None)


def test_fsdp_composes_and_another_mesh_is_refused_with_the_reason():
    from ftrain.step import capabilities as c

    class Declares(ft.Transform):
        def __init__(self, name, caps):
            self.name, self.caps = name, caps

        def capabilities(self):
            return self.caps

    pipe = Declares("pipeline", {c.PIPELINES: "pp=2", c.DATA_PARALLEL_OVER: "ranks [0, 2]"})
    same = Declares(
        "tensor_parallel", {c.SPLITS_MATRICES: "", c.DATA_PARALLEL_OVER: "ranks [0, 2]"}
    )
    other = Declares("tensor_parallel", {c.SPLITS_MATRICES: "", c.DATA_PARALLEL_OVER: "ranks [0]"})
    fsdp = Declares("shard", {c.GATHERS_PARAMS: "", c.SHARDED_PARAMS: "fsdp"})
    c.check_combination([pipe, same])  # one mesh: they compose
    c.check_combination([fsdp, pipe])  # its engine gathers fsdp's shards once per step
    with pytest.raises(ValueError, match="same mesh"):
        c.check_combination([pipe, other])


def test_stages_by_counts_or_by_block_names():
    from ftrain.distributed.pipeline.cut import check_split

    assert check_split([3, 1], 4, 2, "blocks") == [3, 1]
    names = [["blocks.0", "blocks.1", "blocks.2"], ["blocks.3"]]
    assert check_split(names, 4, 2, "blocks") == [3, 1]
    with pytest.raises(ValueError, match="each at least 1"):
        check_split([4, 0], 4, 2, "blocks")
    with pytest.raises(ValueError, match="name every block of blocks once, in order"):
        check_split([["blocks.0", "blocks.2"], ["blocks.1", "blocks.3"]], 4, 2, "blocks")
