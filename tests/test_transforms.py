"""Each transform's invariant, checked against an independent reference, and its input checks.

Most comparisons use SGD with momentum: it is linear in the gradients, and its state (the
momentum trace) *is* the gradient after one step, so ``assert_steps_close`` compares gradients
directly. Adam is avoided where two computations differ only by rounding: it divides each
gradient by its own magnitude, so the rounding noise of a gradient that is mathematically zero
(e.g. the attention key bias, to which softmax is invariant) becomes a full-size update.
"""

import itertools

import pytest
import torch
from torch import nn

import ftrain as ft
from ftrain.models import GPT, GPTConfig
from ftrain.testing import (
    assert_no_recompile,
    assert_one_graph,
    assert_steps_close,
    max_rel_error,
    saved_activation_bytes,
)
from ftrain.transforms import DynamicLossScale

VOCAB, T = 64, 16


def gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, seq_len=T, d_model=32, n_layer=4, n_head=2, dropout=0.0)
    return GPT(GPTConfig(**{**cfg, **overrides}))


def lm_loss(model):
    def loss_fn(params, batch):
        logits = ft.apply(model, params, batch["input"])  # (B, T, V)
        return ft.losses.cross_entropy(logits, batch["target"])

    return loss_fn


# Valid tokens per row: from 1 to T, so micro-batches hold very different token counts.
LENGTHS = [T, 1, 3, T, 9, 2, T - 1, 5, 12, 1, 7, T, 2, 4, 11, 6]


def lm_batch(rows=16, seed=0):
    """Random tokens; row i predicts only its first LENGTHS[i] positions (target -100 after)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (rows, T), generator=g)
    y = torch.randint(0, VOCAB, (rows, T), generator=g)
    lengths = torch.tensor(LENGTHS[:rows])
    y = torch.where(torch.arange(T) < lengths[:, None], y, -100)  # (rows, T)
    return {"input": x, "target": y}


def setup(opt=None, **model_kw):
    model = gpt(**model_kw)
    opt = opt or ft.optim.sgd(0.5, momentum=0.9)
    state = ft.TrainState.create(ft.params_of(model), opt, seed=1)
    return model, ft.train_step(lm_loss(model), opt), state


# --- accumulate ------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,k", [(16, 2), (16, 4), (16, 8), (10, 4)])
def test_accumulate_equals_one_step_on_the_whole_batch(rows, k):
    _, step, state = setup()
    batch = lm_batch(rows)
    # The reference really is token-weighted: micro-batches hold different numbers of tokens.
    counts = [int((t != -100).sum()) for t in torch.tensor_split(batch["target"], k)]
    assert len(set(counts)) > 1
    assert_steps_close(ft.accumulate(step, k), step, state, batch, steps=3, rtol=1e-5)


def test_naive_mean_of_micro_batch_means_differs():
    """The test above can fail: averaging per-micro-batch mean losses (what a loop that calls
    ``(loss / k).backward()`` does) weights tokens unequally and is caught at its tolerance."""
    model, step, state = setup()

    def mean_loss(params, batch):  # a plain scalar: a mean over its own micro-batch
        return lm_loss(model)(params, batch).value

    naive = ft.accumulate(ft.train_step(mean_loss, ft.optim.sgd(0.5, momentum=0.9)), 4)
    with pytest.raises(AssertionError, match="relative error"):
        assert_steps_close(naive, step, state, lm_batch(16), steps=1, rtol=1e-5)


def test_accumulate_loss_metric_is_the_token_weighted_mean():
    model, step, state = setup()
    batch = lm_batch(10)
    _, metrics = ft.accumulate(step, 4)(state, batch)
    expected = lm_loss(model)(state.params, batch)  # by hand, whole batch
    assert int(metrics["count"]) == int(expected.count) == sum(LENGTHS[:10])
    assert max_rel_error(metrics["loss"], expected.value) < 1e-6


# --- checkpoint ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["blocks", "selective"])
def test_checkpoint_same_result_with_dropout(policy):
    _, step, state = setup(dropout=0.2)
    batch = lm_batch(8)
    assert_steps_close(ft.checkpoint(step, policy), step, state, batch, steps=2, rtol=1e-6)


def test_checkpoint_dropout_really_draws():
    """Guards the test above: with dropout the step is random, so agreement is not trivial."""
    _, step, state = setup(dropout=0.2)
    a = step(state, lm_batch(8))[1]["loss"]
    b = step(state.replace(rng=state.rng + 1), lm_batch(8))[1]["loss"]
    assert a != b


def test_checkpoint_saves_fewer_bytes():
    _, step, state = setup(dropout=0.1, n_layer=4)
    batch = lm_batch(8)
    none = saved_activation_bytes(step, state, batch)
    assert saved_activation_bytes(ft.checkpoint(step, "none"), state, batch) == none
    blocks = saved_activation_bytes(ft.checkpoint(step, "blocks"), state, batch)
    selective = saved_activation_bytes(ft.checkpoint(step, "selective"), state, batch)
    assert blocks <= 0.35 * none, (blocks, none)
    assert blocks < selective < none, (blocks, selective, none)


def test_checkpoint_modules_argument_picks_the_blocks():
    from ftrain.models import Block

    _, step, state = setup(dropout=0.1)
    batch = lm_batch(8)
    by_class = ft.checkpoint(step, modules=[Block])
    assert_steps_close(by_class, step, state, batch, steps=1, rtol=1e-6)
    assert saved_activation_bytes(by_class, state, batch) == saved_activation_bytes(
        ft.checkpoint(step), state, batch
    )


def test_find_blocks_prefers_the_list_of_layers_over_longer_lists_of_leaves():
    from ftrain.blocks import find_blocks

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))  # 8 leaves
            self.tables = nn.ModuleList([nn.Embedding(1000, 4)])  # many params, a leaf
            # 2 layers, each a Sequential of leaves (which must not be picked itself)
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2)
            )

    net = Net()
    assert find_blocks(net) == list(net.layers)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(4, 4)
            self.mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))

    one_layer = nn.Module()
    one_layer.layers = nn.ModuleList([Layer()])
    assert find_blocks(one_layer) == list(one_layer.layers)  # not the mlp inside the layer
    leaves = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert find_blocks(leaves) == list(leaves)  # no composite children: the longest container
    assert find_blocks(nn.Linear(4, 4)) == []


# --- composition -----------------------------------------------------------------------------


def test_all_orders_of_accumulate_checkpoint_autocast_agree():
    _, step, state = setup(dropout=0.1, n_layer=2)
    batch = lm_batch(8)
    transforms = {
        "accumulate": lambda s: ft.accumulate(s, 4),
        "checkpoint": lambda s: ft.checkpoint(s, "blocks"),
        "autocast": lambda s: ft.autocast(s, torch.bfloat16),
    }
    built = {}
    for order in itertools.permutations(transforms):
        s = step
        for name in order:
            s = transforms[name](s)
        built[order] = s
    (first, reference), *others = built.items()
    for order, s in others:
        assert len(s.split(batch)) == 4
        try:
            assert_steps_close(s, reference, state, batch, steps=1, rtol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"order {order} differs from {first}: {e}") from None


# --- autocast --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_close_to_fp32(dtype):
    """The tolerance documented in ``ft.autocast``: loss within 1e-2 and gradients within 3e-2
    relative (max-norm per tensor) of fp32 on small models. Measured here: bf16 about 8e-3 on
    the gradients, fp16 about 1e-3."""
    _, step, state = setup()
    batch = lm_batch(16)
    s32, m32 = step(state, batch)
    s16, m16 = ft.autocast(step, dtype)(state, batch)
    assert max_rel_error(m16["loss"], m32["loss"]) < 1e-2
    g16, g32 = ft.tree.to_flat(s16.opt_state), ft.tree.to_flat(s32.opt_state)
    worst = max((max_rel_error(g16[k], g32[k]), k) for k in g32)
    assert worst[0] < 3e-2, worst
    if dtype is torch.float16:
        assert not m16["skipped"]
        assert float(m16["loss_scale"]) == 2.0**16


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    _, step, state = setup(opt=ft.optim.adamw(1e-3))
    step = ft.autocast(step, torch.float16, loss_scale=DynamicLossScale(init_scale=2.0**100))
    new, metrics = step(state, lm_batch(8))
    assert bool(metrics["skipped"])
    assert not torch.isfinite(metrics["grad_norm"])
    for a, b in zip(ft.tree.leaves(new.params), ft.tree.leaves(state.params)):
        assert torch.equal(a, b)
    for a, b in zip(ft.tree.leaves(new.opt_state), ft.tree.leaves(state.opt_state)):
        assert torch.equal(a, b)
    # The scale and its counter live in the state, so they are saved and resumed.
    assert float(new.extra["loss_scale", "scale"]) == 2.0**99
    assert int(new.extra["loss_scale", "good_steps"]) == 0
    assert "loss_scale" not in state.extra.keys()  # the input state is untouched


def test_fp16_static_scale_overflow_is_skipped_every_time():
    _, step, state = setup()
    step = ft.autocast(step, torch.float16, loss_scale=1e30)
    s = state
    for _ in range(2):
        s, metrics = step(s, lm_batch(8))
        assert bool(metrics["skipped"])
        assert float(s.extra["loss_scale", "scale"]) == pytest.approx(1e30)
    for a, b in zip(ft.tree.leaves(s.params), ft.tree.leaves(state.params)):
        assert torch.equal(a, b)


def test_dynamic_scale_grows_after_growth_interval():
    _, step, state = setup()
    scaler = DynamicLossScale(init_scale=2.0**10, growth_interval=2)
    step = ft.autocast(step, torch.float16, loss_scale=scaler)
    scales = []
    for _ in range(3):
        state, metrics = step(state, lm_batch(8))
        assert not metrics["skipped"]
        scales.append(float(state.extra["loss_scale", "scale"]))
    assert scales == [2.0**10, 2.0**11, 2.0**11]


def test_tf32_is_set_for_the_step_only():
    seen = []
    model = gpt()

    def loss_fn(params, batch):
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32))
        return lm_loss(model)(params, batch)

    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.autocast(ft.train_step(loss_fn, opt), torch.float32, tf32=True)
    before = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        step(state, lm_batch(4))
        assert seen == [("high", True)]
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 is False

        def broken(params, batch):
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            ft.autocast(ft.train_step(broken, opt), torch.float32, tf32=True)(state, lm_batch(4))
        assert torch.get_float32_matmul_precision() == "highest"  # restored on error too
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cuda.matmul.allow_tf32 = before[1]


# --- compile ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_compile_matches_eager_without_recompiles():
    """Slow (30-90 s on 2 CPU cores): the one test that runs torch.compile's code generation.

    The composition of the design's example, compiled: checkpoint and accumulate inside. Dropout
    is off because inductor draws its own random numbers (compiled dropout is not eager's).
    """
    model = gpt(n_layer=2, bias=False)
    schedule = ft.optim.warmup_cosine(1e-2, warmup_steps=2, decay_steps=6)
    opt = ft.optim.sgd(schedule, momentum=0.9)
    state = ft.TrainState.create(ft.params_of(model), opt)
    eager = ft.checkpoint(ft.accumulate(ft.train_step(lm_loss(model), opt), 2))
    compiled = ft.compile(eager)
    batches = [lm_batch(8, seed=i) for i in range(5)]

    # Calls 2..5 walk the schedule through warmup into the cosine: new lr values, same graphs.
    final, history = assert_no_recompile(compiled, state, batches)
    lrs = [float(m["lr"]) for m in history]
    assert all(a != b for a, b in zip(lrs, lrs[1:])), lrs

    s = state
    for batch, m_compiled in zip(batches, history):
        s, m = eager(s, batch)
        assert max_rel_error(m_compiled["loss"], m["loss"]) < 1e-5
    for key, a in ft.tree.to_flat(final.params).items():
        assert max_rel_error(a, ft.tree.to_flat(s.params)[key]) < 1e-5, key


@pytest.mark.parametrize(
    "transform",
    [
        lambda s: s,
        lambda s: ft.accumulate(s, 2),
        lambda s: ft.autocast(s, torch.bfloat16),
        lambda s: ft.autocast(s, torch.float16),
        lambda s: ft.ema(ft.accumulate(ft.autocast(s, torch.bfloat16), 2)),
    ],
    ids=["plain", "accumulate", "bf16", "fp16", "ema+accumulate+bf16"],
)
def test_compile_captures_the_whole_step_as_one_graph(transform):
    """Forward, torch.autograd.grad, the count division, clipping norm and the optimizer update
    in one dynamo graph: nothing between the phases runs eagerly (before, the step broke at
    autograd.grad into a forward graph, an eager backward and an update graph)."""
    _, step, state = setup(n_layer=2)
    graph = assert_one_graph(transform(step), state, lm_batch(8))
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert torch.autograd.grad in targets  # the backward is inside
    assert targets & {torch._foreach_add, torch._foreach_add_}  # and so is the update (p + u)
    # the setting that lets dynamo trace autograd.grad is scoped to the compiled call
    assert torch._dynamo.config.trace_autograd_ops is False


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["blocks", "selective"])
def test_checkpoint_traces_without_recompiles(policy):
    """Dynamo traces checkpointed blocks in one graph, the same on every call (the "eager"
    backend: tracing and guards only, no code generation, a few seconds)."""
    torch._dynamo.reset()
    _, step, state = setup(n_layer=2)
    step = ft.checkpoint(step, policy)
    batches = [lm_batch(8, seed=i) for i in range(3)]
    final, _ = assert_no_recompile(ft.compile(step, backend="eager"), state, batches)
    s = state
    for batch in batches:
        s, _ = step(s, batch)
    for a, b in zip(ft.tree.leaves(final.params), ft.tree.leaves(s.params)):
        assert max_rel_error(a, b) < 1e-6


# --- ema and the wrap protocol ---------------------------------------------------------------


def test_ema_matches_a_by_hand_average():
    _, step, state = setup()
    decay = 0.8
    with_ema = ft.ema(step, decay)
    s_ema, s = state, state
    by_hand = ft.tree.leaves(state.params)
    for i in range(3):
        s_ema, m_ema = with_ema(s_ema, lm_batch(8, seed=i))
        s, m = step(s, lm_batch(8, seed=i))
        by_hand = [decay * e + (1 - decay) * p for e, p in zip(by_hand, ft.tree.leaves(s.params))]
        assert torch.equal(m_ema["loss"], m["loss"])
    for a, b in zip(ft.tree.leaves(s_ema.params), ft.tree.leaves(s.params)):
        assert torch.equal(a, b)  # the params are those of the inner step
    for a, b in zip(ft.tree.leaves(s_ema.extra["ema"]), by_hand):
        assert max_rel_error(a, b) < 1e-6


def param_norm(step):
    """A user transform: report the norm of the updated params; count its calls."""
    calls = []

    def wrapper(inner):
        def new_step(state, batch):
            calls.append(1)
            state, metrics = inner(state, batch)
            norm = torch.linalg.vector_norm(
                torch.stack([p.norm() for p in ft.tree.leaves(state.params)])
            )
            return state, {**metrics, "param_norm": norm}

        return new_step

    return ft.wrap(step, wrapper, name="param_norm"), calls


def test_user_transform_stays_composable():
    _, step, state = setup(dropout=0.1)
    batch = lm_batch(16)
    mine, calls = param_norm(step)
    composed = ft.checkpoint(ft.accumulate(mine, 4))
    assert composed.names == ("param_norm", "accumulate", "checkpoint")
    reference = ft.checkpoint(ft.accumulate(step, 4))
    assert_steps_close(composed, reference, state, batch, steps=2, rtol=1e-6)
    assert len(calls) == 2  # once per step, not once per micro-batch
    new, metrics = composed(state, batch)
    expected = torch.linalg.vector_norm(
        torch.cat([p.flatten() for p in ft.tree.leaves(new.params)])
    )
    assert max_rel_error(metrics["param_norm"], expected) < 1e-5


def test_ema_after_compile_is_allowed():
    _, step, _ = setup()
    s = ft.ema(ft.compile(step))
    assert s.names == ("compile", "ema")


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_micro_batches_must_be_a_positive_int(k):
    _, step, _ = setup()
    with pytest.raises(ValueError, match=r"must be an integer >= 1"):
        ft.accumulate(step, k)


def test_micro_batches_more_than_rows():
    _, step, state = setup()
    with pytest.raises(ValueError, match=r"got a batch of 3 rows.*micro_batches <= 3"):
        ft.accumulate(step, 4)(state, lm_batch(3))


def test_checkpoint_without_blocks_says_how_to_name_them():
    model = nn.Linear(4, 1)
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.checkpoint(ft.train_step(lambda p, x: ft.apply(model, p, x).pow(2).mean(), opt))
    with pytest.raises(ValueError, match=r"found no blocks.*modules=\[MyBlock\]"):
        step(state, torch.randn(3, 4))


def test_checkpoint_bad_policy_lists_the_legal_ones():
    _, step, _ = setup()
    with pytest.raises(ValueError, match=r"legal policies are \('blocks', 'selective', 'none'\)"):
        ft.checkpoint(step, "everything")


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "bf16"])
def test_autocast_unsupported_dtype_lists_the_legal_ones(dtype):
    _, step, _ = setup()
    with pytest.raises(ValueError, match=r"torch\.bfloat16, torch\.float16 and torch\.float32"):
        ft.autocast(step, dtype)


def test_compile_twice_is_refused():
    _, step, _ = setup()
    with pytest.raises(ValueError, match="applied twice.*Apply it once, last"):
        ft.compile(ft.compile(step))


@pytest.mark.parametrize(
    "transform",
    [
        lambda s: ft.accumulate(s, 2),
        lambda s: ft.checkpoint(s),
        lambda s: ft.autocast(s),
    ],
    ids=["accumulate", "checkpoint", "autocast"],
)
def test_transform_after_compile_is_refused(transform):
    _, step, _ = setup()
    with pytest.raises(ValueError, match=r"after ft\.compile; compile must come last"):
        transform(ft.compile(step))


@pytest.mark.parametrize(
    "transform",
    [
        lambda s: ft.accumulate(s, 2),
        lambda s: ft.checkpoint(s),
        lambda s: ft.autocast(s),
        lambda s: ft.compile(s),
        lambda s: ft.ema(s),
    ],
    ids=["accumulate", "checkpoint", "autocast", "compile", "ema"],
)
def test_transform_of_a_plain_function_is_refused(transform):
    def my_step(state, batch):
        return state, {}

    with pytest.raises(TypeError, match=r"expected an ft\.Step, got function.*ft\.train_step"):
        transform(my_step)
