"""ft.tensor_parallel: tp ranks (and dp x tp ranks under ft.shard('ddp')) equal one process.

Two spawns: 4 ranks (2 dp x 2 tp: plain, composed, a sharded save, sequence parallel) and 2 ranks
(tp = 2: GPT, Hugging Face GPT-2 and Llama, sequence parallel, the build-time errors, and the
2 x 2 save loaded onto tp = 2 and onto fsdp). Each rank returns whole (unsharded) states, compared
here against one process.
"""

from __future__ import annotations

import pytest
import torch

import ftrain as ft
from ftrain.distributed.tensor_parallel.plans import Colwise, gpt_plan, hf_gpt2_plan, hf_llama_plan
from ftrain.testing import run_distributed
from ftrain.transforms.tensor_parallel import TensorParallel
from tests._tiny import assert_trees_close, lm_batch, lm_loss, max_tree_diff, tiny_gpt

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


class _NoPartialSums(TensorParallel):
    """Sequence parallelism without summing the norms' partial gradients over tp: wrong."""

    def engine(self, engine):
        return engine


def _train_tp(compose, path=None, model=None, plan=None, rows=ROWS, sp=False, cls=TensorParallel):
    vocab = {} if model is None else {"vocab": 50}  # the Hugging Face models' vocabulary
    model, step, state = _setup(_opt(compose), compose, model)
    mesh = ft.distributed.tp_mesh(2)
    tp = cls(model, plan or gpt_plan(), mesh, sequence_parallel=sp)
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
    out["sp"] = _train_tp(False, sp=True)
    out["sp fp32"] = _train_tp("fp32", sp=True)  # accumulate + checkpoint
    out["sp bf16"] = _train_tp("bf16", sp=True)  # and autocast
    try:  # a mesh over 2 of the 4 processes
        ft.tensor_parallel(tiny_gpt(), gpt_plan(), ft.distributed.tp_mesh(2)["tp"])
        out["small mesh"] = None
    except ValueError as e:
        out["small mesh"] = str(e)
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp") / "ckpt")
    return path, run_distributed(_four_ranks, 4, path)


def test_dp2_x_tp2_equals_one_process(four):
    _, ranks = four
    for r in ranks:  # every rank holds the same state
        assert_trees_close(r["plain"][0].params, ranks[0]["plain"][0].params, 0)
    want = _one_process()
    assert_trees_close(ranks[0]["plain"][0].params, want.params, 1e-5)
    assert_trees_close(ranks[0]["plain"][0].opt_state, want.opt_state, 1e-5)


def test_dp2_x_tp2_composes_with_accumulate_checkpoint_and_bf16(four):
    _, ranks = four
    assert_trees_close(ranks[0]["fp32"][0].params, _one_process("fp32").params, 1e-5)
    # bf16: the row-parallel partial sums are rounded before they are added (one process rounds
    # the whole sum once); within a few bf16 roundings of the same composition on one process
    assert_trees_close(ranks[0]["bf16"][0].params, _one_process("bf16").params, 1e-3)


def test_save_under_2x2_loads_on_one_process_bitwise(four):
    path, ranks = four
    loaded = ft.load(path)
    whole = ranks[0]["plain"][0]
    assert_trees_close(loaded, whole, 0)


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
    return _messages(cases)


def _messages(cases):
    """Each case's error as "Type: message", or None where it built without one."""
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
        "sp": _train_tp(False, sp=True),
        "sp no sums": _train_tp(False, sp=True, cls=_NoPartialSums),
        "sp gpt2": _train_tp(False, model=_hf("gpt2"), plan=hf_gpt2_plan(), rows=4, sp=True),
        "vocab": _train_vocab(sequence_parallel=False),
        "sp vocab": _train_vocab(sequence_parallel=True),
        "sp dropout": _dropout_run(sequence_parallel=True),
        "sp errors": _sp_errors(),
        "sp bytes": _sp_bytes(),
    }


@pytest.fixture(scope="module")
def two(four):
    return run_distributed(_two_ranks, 2, four[0])


def test_tp2_equals_one_process_for_gpt_and_hugging_face_models(two):
    assert_trees_close(two[0]["gpt"][0].params, _one_process().params, 1e-5)
    assert_trees_close(two[1]["gpt"][0].params, two[0]["gpt"][0].params, 0)
    # Muon (AdamW for the rest) on the pieces: each matrix gathered whole for Newton-Schulz. NS
    # (in bf16) maps every singular value to about 1, also the tiny ones that rounding sets, so
    # the pieces' rounding shows at a few percent of lr = 0.02; orthogonalizing each piece on its
    # own instead would differ by about lr
    assert_trees_close(two[0]["muon"][0].params, _one_process("muon").params, 2e-3)
    for kind in ("gpt2", "llama"):
        want = _one_process(model=_hf(kind), rows=4)
        assert_trees_close(two[0][kind][0].params, want.params, 1e-5)


def test_tp_saves_reshard_onto_tp_and_fsdp_layouts(two, four):
    whole = four[1][0]["plain"][0]
    for loaded in two[0]["loaded"]:
        assert_trees_close(loaded, whole, 0)


def test_bad_input_is_a_clear_error_when_the_step_is_built(two, four):
    errors = two[0]["errors"]
    assert "pattern 'blocks.*.attention.qkv' names no module" in errors["pattern"]
    assert "not divisible by" in errors["divides"] and "tp=2" in errors["divides"]
    assert "n_head = 1 is not divisible by tp=2" in errors["heads"]
    assert "tp=3 must be an int that divides the 2 processes" in errors["tp size"]
    assert "dimension named 'tp'" in errors["no mesh"]
    assert "ft.tensor_parallel needs the batch split over its mesh's 'dp' ranks" in errors["zero1"]
    assert "ft.shard(step, ..., mesh=mesh['dp'])" in errors["zero1"]
    assert errors["zero1 over dp"] is None
    assert "torch.compile" in errors["compile"]
    assert "tp.shard_state(state)" in errors["state"]
    assert "has 2 processes but the world has 4" in four[1][0]["small mesh"]


def _sp_errors():
    mesh = ft.distributed.tp_mesh(2)
    model, step, state = _setup(ft.optim.sgd(0.1))
    tp = ft.tensor_parallel(model, gpt_plan(), mesh, sequence_parallel=True)
    odd = {k: v[:, :15] for k, v in lm_batch(2).items()}  # T = 15
    cases = {
        "llama": lambda: ft.tensor_parallel(
            _hf("llama"), hf_llama_plan(), mesh, sequence_parallel=True
        ),
        "tied head": lambda: ft.tensor_parallel(model, gpt_plan(vocab_parallel=True), mesh),
        "adamw8bit": lambda: tp.shard_state(  # fc.weight: 4096 entries, moments in 8 bits
            ft.TrainState.create(ft.params_of(model), ft.optim.adamw8bit(1e-3))
        ),
        "flag": lambda: ft.tensor_parallel(model, gpt_plan(), mesh, sequence_parallel="yes"),
        "length": lambda: tp(step)(tp.shard_state(state), odd),
    }
    return _messages(cases)


def _sp_bytes():
    """Bytes the whole tp step keeps for backward on this rank, without and with sequence
    parallelism (a GPT whose blocks dominate: 4 blocks of width 64 on 64 tokens, vocabulary 64)."""
    out = {}
    for sp in (False, True):
        model = tiny_gpt(n_layer=4, d_model=64, seq_len=64)
        step = ft.train_step(lm_loss(model), ft.optim.sgd(0.1))
        tp = ft.tensor_parallel(model, gpt_plan(), ft.distributed.tp_mesh(2), sequence_parallel=sp)
        state = tp.shard_state(ft.TrainState.create(ft.params_of(model), ft.optim.sgd(0.1)))
        batch = lm_batch(4, length=64)
        out[sp] = ft.testing.saved_activation_bytes(tp(step), state, batch)
    return out


def _norms(params):
    return {k: v for k, v in ft.tree.to_flat(params).items() if ".ln_" in k}


def test_sequence_parallel_tp2_equals_one_process_norm_grads_summed(two):
    want = _one_process()
    got = two[0]["sp"][0]
    assert_trees_close(got.params, want.params, 1e-5)
    assert_trees_close(
        got.opt_state, want.opt_state, 1e-5
    )  # the moments: the norms' grads were whole
    assert_trees_close(two[1]["sp"][0].params, got.params, 0)
    # the check can fail: without the sum over tp each norm trains on half the positions' grads
    wrong = _norms(two[0]["sp no sums"][0].params)
    worst = max((wrong[k] - v).abs().max().item() for k, v in _norms(want.params).items())
    assert worst > 1e-3
    assert_trees_close(
        two[0]["sp gpt2"][0].params, _one_process(model=_hf("gpt2"), rows=4).params, 1e-5
    )


def test_sequence_parallel_dp2_x_tp2_with_accumulate_checkpoint_and_bf16(four):
    _, ranks = four
    assert_trees_close(ranks[0]["sp"][0].params, _one_process().params, 1e-5)
    assert_trees_close(ranks[3]["sp"][0].params, ranks[0]["sp"][0].params, 0)
    assert_trees_close(ranks[0]["sp fp32"][0].params, _one_process("fp32").params, 1e-5)
    assert_trees_close(
        ranks[0]["sp bf16"][0].params, _one_process("bf16").params, 1e-3
    )  # as plain tp's


def test_sequence_parallel_keeps_fewer_activation_bytes(two):
    # between the pairs a block keeps 4 activations (B, T, C) for backward: each norm's input and
    # its output (the next column-parallel linear's input). Sequence parallelism keeps half of
    # each on each of 2 ranks; what the pairs keep inside (heads, features) is split either way
    sizes = two[0]["sp bytes"]
    btc = 4 * 64 * 64 * 4  # one (B, T, C) fp32 activation
    assert sizes[False] - sizes[True] >= 4 * (4 * btc // 2), sizes  # 4 blocks


def test_sequence_parallel_bad_input_is_a_clear_error(two):
    errors = two[0]["sp errors"]
    assert "marks no module SequenceParallel()" in errors["llama"]
    assert "sequence_parallel='yes'" in errors["flag"]
    assert "(2, 15, 32)" in errors["length"] and "divide by tp=2" in errors["length"]
    assert "GPTConfig(..., tie_weights=False)" in errors["tied head"]
    assert "8-bit moments" in errors["adamw8bit"] and "ft.optim.adamw" in errors["adamw8bit"]


def _vocab_run(tp_fn=None):
    """3 SGD steps (momentum 0.9) of an untied GPT; with ``tp_fn(model) -> TensorParallel`` its
    lm_head is split by columns and the loss is vocab_parallel_cross_entropy on the logits'
    slices. SGD, not AdamW: see test_vocab_parallel_loss_with_and_without_sequence_parallel_..."""
    from ftrain.distributed import vocab_parallel_cross_entropy

    model, opt = tiny_gpt(n_layer=2, tie_weights=False), ft.optim.sgd(0.1, momentum=0.9)
    tp = tp_fn(model) if tp_fn else None

    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])  # (B, T, V / tp) under tp
        if tp is None:
            return ft.losses.cross_entropy(logits, batch["target"])
        assert logits.shape[-1] == 64 // tp.tp  # never gathered
        return vocab_parallel_cross_entropy(logits, batch["target"], tp.group)

    step = ft.train_step(loss_fn, opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    if tp is not None:
        step, state = tp(step), tp.shard_state(state)
    for i in range(STEPS):
        state, _ = step(state, lm_batch(ROWS, seed=i))
    return ft.unshard_state(state) if tp is not None else state


def _train_vocab(sequence_parallel):
    mesh = ft.distributed.tp_mesh(2)
    plan = gpt_plan(vocab_parallel=True)
    return _vocab_run(
        lambda m: ft.tensor_parallel(m, plan, mesh, sequence_parallel=sequence_parallel)
    )


def test_vocab_parallel_loss_with_and_without_sequence_parallel_equals_one_process(two):
    """The tolerance, derived. tp = 2 computes the same loss and gradients as one process with
    its sums split differently (the vocabulary's softmax over two halves, row-split matmuls'
    partial sums all-reduced), so each gradient element differs by fp32 rounding: at most about
    2 n u max|g| with n = 128 (the longest sum: 8 x 16 tokens), u = 2^-24 and max|g| = 0.21 on
    this model: 3.2e-6. SGD passes that on linearly: lr 0.1 times the momentum sums over 3 steps
    (1 + 1.9 + 2.71 = 5.61) gives 1.8e-7, the feedback through the params being second order;
    measured 1.2e-8 (with oneDNN or one thread in the reference too), against a 6e-2 move.
    AdamW could promise no such bound: its update is about lr * sign(g) for any gradient, so an
    element whose gradient is near zero turns that rounding into a change of up to 2 lr a step;
    with AdamW(1e-3) the one-process run moved 2e-5 from itself with oneDNN switched off, and
    an Intel Xeon's tp run was 1.8e-5 off (the former bound was 1e-5)."""
    want = _vocab_run()
    assert_trees_close(two[0]["vocab"].params, want.params, 1e-6)
    assert_trees_close(two[0]["sp vocab"].params, want.params, 1e-6)
    init = ft.params_of(tiny_gpt(n_layer=2, tie_weights=False))
    assert max_tree_diff(want.params, init) > 1e-2  # the run moved: the agreement is not trivial


class _SequenceDropoutReference(ft.Transform):
    """One process: each nn.Dropout of the blocks masks as documented for sequence parallelism,
    from one draw of the step's stream and each entry's position in the whole sequence."""

    def forward(self, fn):
        from ftrain.apply import rewritten

        return rewritten(fn, self, "reference dropout")

    def rewrite(self, module):
        from ftrain.distributed import sequence_dropout
        from ftrain.internals.blocks import replace_forwards

        def make(current):
            return lambda x: sequence_dropout(x, current.p, torch.randint(0, 2**62, ()))

        drops = [m for b in module.blocks for m in b.modules() if isinstance(m, torch.nn.Dropout)]
        return replace_forwards(module, [(m, make) for m in drops])


def _dropout_run(sequence_parallel=None):
    """3 AdamW steps of a GPT with dropout 0.1 (the embeddings' and the blocks' residual
    branches; attention's own dropout off: inside a pair it matches only in distribution), on
    tp = 2 with sequence parallelism, or (None) on one process with the reference masks."""
    model, opt = tiny_gpt(n_layer=2, dropout=0.1), ft.optim.adamw(1e-3)
    for block in model.blocks:
        block.attn.dropout = 0.0
    step = ft.train_step(lm_loss(model), opt)
    state = ft.TrainState.create(ft.params_of(model), opt)
    if sequence_parallel is None:
        step = _SequenceDropoutReference()(step)
    else:
        tp = ft.tensor_parallel(
            model, gpt_plan(), ft.distributed.tp_mesh(2), sequence_parallel=True
        )
        step, state = tp(ft.checkpoint(step)), tp.shard_state(state)  # recompute: same masks
    for i in range(STEPS):
        state, metrics = step(state, lm_batch(ROWS, seed=i))
    return (ft.unshard_state(state) if sequence_parallel else state), float(metrics["loss"])


def test_sequence_parallel_dropout_masks_each_global_position_once(two):
    want, want_loss = _dropout_run()
    got, loss = two[0]["sp dropout"]
    assert_trees_close(got.params, want.params, 1e-5)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    # the check can fail: plain dropout (torch's masks) trains to different params
    plain = _one_process()
    assert max_tree_diff(plain.params, want.params) > 1e-4
