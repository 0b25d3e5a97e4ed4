"""ft.tensor_parallel: tp ranks (and dp x tp ranks under ft.shard('ddp')) equal one process.

Two spawns: 4 ranks (2 dp x 2 tp: plain, composed, a sharded save) and 2 ranks (tp = 2: GPT,
Hugging Face GPT-2 and Llama, the build-time errors, and the 2 x 2 save loaded onto tp = 2 and
onto fsdp). Each rank returns whole (unsharded) states, compared here against one process.
"""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from ftrain.distributed.plans import Colwise, gpt_plan, hf_gpt2_plan, hf_llama_plan
from ftrain.testing import run_distributed
from tests._tiny import lm_batch, lm_loss, tiny_gpt

STEPS, ROWS = 3, 8


def _setup(opt, compose=False, model=None):
    model = model if model is not None else tiny_gpt(n_layer=2)
    step = ft.train_step(lm_loss(model) if not _is_hf(model) else _hf_loss(model), opt)
    if compose == "fp32":  # accumulate + checkpoint
        step = ft.accumulate(ft.checkpoint(step), 2)
    elif compose == "bf16":
        step = ft.accumulate(ft.checkpoint(ft.autocast(step, dtype=torch.bfloat16)), 2)
    return model, step, ft.TrainState.create(ft.params_of(model), opt)


def _opt(compose):
    if compose == "muon":  # Newton-Schulz on each whole matrix: gathered per matrix
        return ft.optim.muon_adamw(0.02, 1e-3, weight_decay=0.1, mask=ft.optim.decay_mask)
    # adamw's update is near +-lr for any gradient, so a k-projection bias (its gradient is zero
    # up to rounding: softmax ignores a shift of every key) moves by rounding noise; a small lr
    # keeps that below the tolerance. sgd for bf16, whose rounding adamw would amplify the same way.
    return ft.optim.sgd(0.1) if compose == "bf16" else ft.optim.adamw(1e-3)


def _one_process(compose=False, model=None, rows=ROWS):
    _, step, state = _setup(_opt(compose), compose, model)
    for i in range(STEPS):
        state, _ = step(state, lm_batch(rows, seed=i, **({} if model is None else {"vocab": 50})))
    return state


def _train_tp(compose, path=None, model=None, plan=None, rows=ROWS):
    vocab = {} if model is None else {"vocab": 50}  # the Hugging Face models' vocabulary
    model, step, state = _setup(_opt(compose), compose, model)
    mesh = ft.distributed.tp_mesh(2)
    tp = ft.tensor_parallel(model, plan or gpt_plan(), mesh)
    dp = mesh["dp"]
    step = tp(step) if dp.size() == 1 else ft.shard(tp(step), "ddp", mesh=dp)
    state = tp.shard_state(state)
    share = rows // dp.size()
    for i in range(STEPS):
        batch = lm_batch(rows, seed=i, **vocab)
        mine = {k: v[dp.get_local_rank() * share :][:share] for k, v in batch.items()}
        state, metrics = step(state, mine)
    if path is not None:
        ft.save(state, path)
    return ft.unshard_state(state), float(metrics["loss"])


def _four_ranks(path):
    out = {"plain": _train_tp(False, path), "fp32": _train_tp("fp32"), "bf16": _train_tp("bf16")}
    try:  # a mesh over 2 of the 4 processes
        ft.tensor_parallel(tiny_gpt(), gpt_plan(), ft.distributed.tp_mesh(2)["tp"])
        out["small mesh"] = None
    except ValueError as e:
        out["small mesh"] = str(e)
    return out


def _close(a, b, tol):
    for x, y in zip(ft.tree.leaves(a), ft.tree.leaves(b)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp") / "ckpt")
    return path, run_distributed(_four_ranks, 4, path)


def test_dp2_x_tp2_equals_one_process(four):
    _, ranks = four
    for r in ranks:  # every rank holds the same state
        _close(r["plain"][0].params, ranks[0]["plain"][0].params, 0)
    want = _one_process()
    _close(ranks[0]["plain"][0].params, want.params, 1e-5)
    _close(ranks[0]["plain"][0].opt_state, want.opt_state, 1e-5)


def test_dp2_x_tp2_composes_with_accumulate_checkpoint_and_bf16(four):
    _, ranks = four
    _close(ranks[0]["fp32"][0].params, _one_process("fp32").params, 1e-5)
    # bf16: the row-parallel partial sums are rounded before they are added (one process rounds
    # the whole sum once); within a few bf16 roundings of the same composition on one process
    _close(ranks[0]["bf16"][0].params, _one_process("bf16").params, 1e-3)


def test_save_under_2x2_loads_on_one_process_bitwise(four):
    path, ranks = four
    loaded = ft.load(path)
    whole = ranks[0]["plain"][0]
    for x, y in zip(ft.tree.leaves(loaded), ft.tree.leaves(whole)):
        assert torch.equal(x, y)


def _hf(kind):
    from transformers import AutoModelForCausalLM

    from tests._hf import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, 50))
    model.config.use_cache = False
    return model


def _is_hf(model):
    return type(model).__module__.startswith("transformers")


def _hf_loss(model):
    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"]).logits
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


def _errors():
    mesh = ft.distributed.tp_mesh(2)
    model, step, state = _setup(ft.optim.sgd(0.1))
    tp = ft.tensor_parallel(model, gpt_plan(), mesh)
    cases = {
        "pattern": lambda: ft.tensor_parallel(model, {"blocks.*.attention.qkv": Colwise()}, mesh),
        "divides": lambda: ft.tensor_parallel(tiny_gpt(d_ff=33), gpt_plan(), mesh),
        "heads": lambda: ft.tensor_parallel(tiny_gpt(n_head=1), gpt_plan(), mesh),
        "tp size": lambda: ft.distributed.tp_mesh(3),
        "no mesh": lambda: ft.tensor_parallel(model, gpt_plan(), "tp"),
        "zero1": lambda: ft.shard(tp(step), "zero1"),  # over every process, not mesh["dp"]
        "zero1 over dp": lambda: ft.shard(tp(step), "zero1", mesh=mesh["dp"]),  # accepted
        "compile": lambda: ft.compile(tp(step)),
        "state": lambda: tp(step)(state, lm_batch(2)),  # not laid out by tp.shard_state
    }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _load_onto(path):
    """The 2 x 2 save loaded onto tp = 2 and onto fsdp over 2 ranks, gathered back whole."""
    model, _, state = _setup(ft.optim.adamw(1e-3))
    tp = ft.tensor_parallel(model, gpt_plan(), ft.distributed.tp_mesh(2))
    on_tp = ft.load(path, like=tp.shard_state(state))
    on_fsdp = ft.load(path, like=ft.shard_state(state, "fsdp"))
    return ft.unshard_state(on_tp), ft.unshard_state(on_fsdp)


def _two_ranks(path):
    return {
        "gpt": _train_tp(False),
        "muon": _train_tp("muon"),
        "gpt2": _train_tp(False, model=_hf("gpt2"), plan=hf_gpt2_plan(), rows=4),
        "llama": _train_tp(False, model=_hf("llama"), plan=hf_llama_plan(), rows=4),
        "errors": _errors(),
        "loaded": _load_onto(path),
    }


@pytest.fixture(scope="module")
def two(four):
    return run_distributed(_two_ranks, 2, four[0])


def test_tp2_equals_one_process_for_gpt_and_hugging_face_models(two):
    _close(two[0]["gpt"][0].params, _one_process().params, 1e-5)
    _close(two[1]["gpt"][0].params, two[0]["gpt"][0].params, 0)
    # Muon (AdamW for the rest) on the pieces: each matrix gathered whole for Newton-Schulz. NS
    # (in bf16) maps every singular value to about 1, also the tiny ones that rounding sets, so
    # the pieces' rounding shows at a few percent of lr = 0.02; orthogonalizing each piece on its
    # own instead would differ by about lr
    _close(two[0]["muon"][0].params, _one_process("muon").params, 2e-3)
    for kind in ("gpt2", "llama"):
        want = _one_process(model=_hf(kind), rows=4)
        _close(two[0][kind][0].params, want.params, 1e-5)


def test_tp_saves_reshard_onto_tp_and_fsdp_layouts(two, four):
    whole = four[1][0]["plain"][0]
    for loaded in two[0]["loaded"]:
        for x, y in zip(ft.tree.leaves(loaded), ft.tree.leaves(whole)):
            assert torch.equal(x, y)


def test_bad_input_is_a_clear_error_when_the_step_is_built(two, four):
    errors = two[0]["errors"]
    assert "pattern 'blocks.*.attention.qkv' names no module" in errors["pattern"]
    assert "not divisible by" in errors["divides"] and "tp=2" in errors["divides"]
    assert "n_head = 1 is not divisible by tp=2" in errors["heads"]
    assert "tp=3 must be an int that divides the 2 processes" in errors["tp size"]
    assert "dimension named 'tp'" in errors["no mesh"]
    assert "ft.shard(step, 'zero1', mesh=mesh['dp'])" in errors["zero1"]
    assert errors["zero1 over dp"] is None
    assert "torch.compile" in errors["compile"]
    assert "tp.shard_state(state)" in errors["state"]
    assert "has 2 processes but the world has 4" in four[1][0]["small mesh"]
