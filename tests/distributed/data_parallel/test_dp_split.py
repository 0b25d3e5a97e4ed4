"""zero1/zero2/fsdp over the ``dp`` dimension under tensor parallelism (``dp_split``).

One spawn of 4 gloo ranks (2 dp x 2 tp) trains a tiny GPT with each strategy, composed with
accumulate + checkpoint (fsdp also with sequence parallelism) and with bf16 autocast, saves an
fsdp x tp state, measures bytes per rank and collects the errors for a wrong mesh and a state
not laid out over dp. Each rank returns whole (unsharded) states, compared here against one
process given the whole batch.
"""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from ftrain.distributed import local_bytes
from ftrain.distributed.tensor_parallel.plans import gpt_plan
from ftrain.testing import run_distributed
from tests._tiny import assert_trees_close, lm_batch, lm_loss, max_tree_diff, tiny_gpt

STEPS, ROWS = 3, 8


def _step(opt, compose, model):
    step = ft.train_step(lm_loss(model), opt)
    if compose == "fp32":  # accumulate + checkpoint
        step = ft.accumulate(ft.checkpoint(step), 2)
    elif compose == "bf16":
        step = ft.accumulate(ft.checkpoint(ft.autocast(step, dtype=torch.bfloat16)), 2)
    elif compose == "fp16":  # loss scaling: fsdp leaves the grads unreduced for the reweighting
        step = ft.autocast(step, dtype=torch.float16)
    return step


def _opt(compose):
    if compose == "muon":  # Newton-Schulz on each whole matrix: gathered over dp and tp
        return ft.optim.muon_adamw(0.02, 1e-3, weight_decay=0.1, mask=ft.optim.decay_mask)
    if compose == "adafactor":  # row/column statistics of matrices split over dp and tp
        return ft.optim.adafactor(1e-2)
    # sgd under bf16: adamw's update (about +-lr for any gradient) would amplify bf16 rounding of
    # a gradient that is zero up to rounding (the k-projection bias) into an lr-sized difference
    return ft.optim.sgd(0.1) if compose == "bf16" else ft.optim.adamw(1e-3)


def _one_process(compose=None):
    model = tiny_gpt(n_layer=2)
    opt = _opt(compose)
    step, state = _step(opt, compose, model), ft.TrainState.create(ft.params_of(model), opt)
    for i in range(STEPS):
        state, _ = step(state, lm_batch(ROWS, seed=i))
    return state


def _train(
    strategy, compose=None, *, inner=False, path=None, layout_only=False, sp=False, prefetch=True
):
    """``STEPS`` steps on the 2 x 2 mesh: tensor parallel over tp, ``strategy`` over dp.
    ``inner``: shard wrapped inside tensor_parallel (the other order). ``layout_only``: the
    fresh state as laid out, no step. ``sp``: with sequence parallelism over tp."""
    model, opt = tiny_gpt(n_layer=2), _opt(compose)
    state = ft.TrainState.create(ft.params_of(model), opt)
    mesh = ft.distributed.tp_mesh(2)
    dp = mesh["dp"]
    tp = ft.tensor_parallel(model, gpt_plan(), mesh, sequence_parallel=sp)
    step = _step(opt, compose, model)
    if inner:
        step = tp(ft.shard(step, strategy, mesh=dp, prefetch=prefetch))
    else:
        step = ft.shard(tp(step), strategy, mesh=dp, prefetch=prefetch)
    state = ft.shard_state(tp.shard_state(step.init_extra(state)), strategy, mesh=dp)
    if layout_only:
        return state
    share = ROWS // dp.size()
    for i in range(STEPS):
        batch = lm_batch(ROWS, seed=i)
        mine = {k: v[dp.get_local_rank() * share :][:share] for k, v in batch.items()}
        state, metrics = step(state, mine)
    if path is not None:
        ft.save(state, path)
    return ft.unshard_state(state)


def _four_ranks(path):
    out = {s: _train(s) for s in ("zero1", "zero2")}
    out["fsdp"] = _train("fsdp", path=path)
    out["fsdp no prefetch"] = _train("fsdp", prefetch=False)
    out["fsdp fp32 no prefetch"] = _train("fsdp", "fp32", prefetch=False)
    out["fsdp inner"] = _train("fsdp", inner=True)
    out["fsdp fp32"] = _train("fsdp", "fp32")
    out["zero2 fp32"] = _train("zero2", "fp32")
    out["fsdp sp fp32"] = _train("fsdp", "fp32", sp=True)  # norm grads summed over tp and dp
    out["fsdp bf16"] = _train("fsdp", "bf16")
    out["fp16"] = {s: _train(s, "fp16") for s in ("ddp", "fsdp")}
    out["muon"] = {s: _train(s, "muon") for s in ("ddp", "fsdp")}
    try:
        out["adafactor"] = _train("fsdp", "adafactor")
    except NotImplementedError as e:  # torch 2.11's DTensor: said by ft.shard, checked below
        out["adafactor"] = str(e)
    laid = {s: _train(s, layout_only=True) for s in ("ddp", "fsdp")}
    out["bytes"] = {s: local_bytes(state) for s, state in laid.items()}
    out["loaded"] = ft.unshard_state(ft.load(path, like=laid["fsdp"]))  # onto fsdp x tp
    model = tiny_gpt(n_layer=2)
    mesh = ft.distributed.tp_mesh(2)
    tp = ft.tensor_parallel(model, gpt_plan(), mesh)
    state = tp.shard_state(ft.TrainState.create(ft.params_of(model), ft.optim.sgd(0.1)))
    adamw_state = tp.shard_state(ft.TrainState.create(ft.params_of(model), ft.optim.adamw(1e-3)))
    cases = {  # fsdp over every process instead of the dp dimension
        "wrong mesh": lambda: ft.shard(
            tp(ft.train_step(lm_loss(model), ft.optim.sgd(0.1))), "fsdp"
        ),
        "wrong state mesh": lambda: ft.shard_state(state, "fsdp"),
        "not over dp": lambda: ft.shard(  # tp.shard_state'd only: its fix names both calls
            tp(ft.train_step(lm_loss(model), ft.optim.adamw(1e-3))), "zero2", mesh=mesh["dp"]
        )(adamw_state, lm_batch(2)),
    }
    for name, make in cases.items():
        try:
            make()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dpsplit") / "ckpt")
    return path, run_distributed(_four_ranks, 4, path)


def test_zero_and_fsdp_over_dp_equal_one_process(four):
    _, ranks = four
    want = _one_process()
    for name in ("zero1", "zero2", "fsdp", "fsdp inner"):
        for r in ranks:  # every rank holds the same whole state
            assert max_tree_diff(r[name].params, ranks[0][name].params) == 0, name
        assert max_tree_diff(ranks[0][name].params, want.params) <= 1e-5, name
        assert max_tree_diff(ranks[0][name].opt_state, want.opt_state) <= 1e-5, name


def test_prefetch_under_tensor_parallelism_changes_no_bit(four):
    """fsdp's gathers and reduce-scatters of tensor-parallel pieces, issued ahead (async), send
    the same buffers as the blocking ones: the same bits, alone and with the fp32 composition."""
    _, ranks = four
    for r in ranks:
        for on, off in (("fsdp", "fsdp no prefetch"), ("fsdp fp32", "fsdp fp32 no prefetch")):
            assert max_tree_diff(r[on].params, r[off].params) == 0, on
            assert max_tree_diff(r[on].opt_state, r[off].opt_state) == 0, on


def test_fsdp_over_dp_composes_with_accumulate_checkpoint_and_bf16(four):
    _, ranks = four
    want = _one_process("fp32")
    for name in ("fsdp fp32", "zero2 fp32", "fsdp sp fp32"):
        assert max_tree_diff(ranks[0][name].params, want.params) <= 1e-5, name
    # bf16: the row-parallel partial sums are rounded before they are added, and the dp ranks'
    # gradients are summed from bf16-computed halves (one process rounds each whole sum once)
    assert max_tree_diff(ranks[0]["fsdp bf16"].params, _one_process("bf16").params) <= 1e-3


def test_fp16_loss_scaling_under_fsdp_over_dp_equals_ddp_over_dp(four):
    # fsdp leaves the grads unreduced (Partial over dp) for the loss scale's reweighting, and
    # ft.shard's reduce then reduce-scatters them: the same sums as ddp's all-reduce
    _, ranks = four
    fp16 = ranks[0]["fp16"]
    assert max_tree_diff(fp16["fsdp"].params, fp16["ddp"].params) <= 1e-6
    assert (
        max_tree_diff(fp16["fsdp"].params, ft.params_of(tiny_gpt(n_layer=2))) > 1e-4
    )  # it trained


def test_muon_on_fsdp_over_dp_pieces_equals_muon_under_ddp_over_dp(four):
    # the optimizers run on the pieces unchanged: Muon's matrices are gathered whole (DTensor)
    _, ranks = four
    muon = ranks[0]["muon"]
    assert max_tree_diff(muon["fsdp"].params, muon["ddp"].params) <= 1e-6


def test_fsdp_x_tp_save_loads_on_one_process_and_onto_fsdp_x_tp_bitwise(four):
    path, ranks = four
    whole = ranks[0]["fsdp"]
    for loaded in (ft.load(path), *(r["loaded"] for r in ranks)):
        assert_trees_close(loaded, whole, 0)


def test_fsdp_over_dp_halves_the_bytes_of_each_rank(four):
    _, ranks = four
    for r in ranks:
        assert r["bytes"]["fsdp"] / r["bytes"]["ddp"] < 0.65


def test_shard_and_shard_state_over_another_mesh_than_dp_are_refused(four):
    _, ranks = four
    for case in ("wrong mesh", "wrong state mesh"):
        message = ranks[0][case]
        assert message is not None and "mesh=mesh['dp']" in message, case
    want = "ft.shard_state(tp.shard_state(state), 'zero2', mesh=mesh['dp'])"
    assert want in ranks[0]["not over dp"]


def test_adafactor_under_fsdp_over_dp_equals_one_process(four):
    _, ranks = four
    if isinstance(ranks[0]["adafactor"], str):  # the refusal a torch without the move gives
        assert "cannot move a tensor split in blocks" in ranks[0]["adafactor"]
        pytest.skip(ranks[0]["adafactor"].split(" On this torch")[0])
    assert max_tree_diff(ranks[0]["adafactor"].params, _one_process("adafactor").params) <= 1e-5
