"""ft.compile (ftrain.transforms.compile): the whole step as one graph (checkpointed blocks
included), or under ft.accumulate one micro-batch graph looped and an update graph whatever the
number of micro-batches; the same result as eager with no recompiles, and its ordering rules."""

import contextlib

import pytest
import torch

import ftrain as ft
from ftrain.internals import dynamo
from ftrain.testing import assert_no_recompile, assert_one_graph, max_rel_error

from _tiny import UNEVEN, D, chain_step, gpt_step, lm_batch, lm_loss, tiny_gpt


@pytest.mark.slow
def test_compile_matches_eager_without_recompiles():
    """Slow (about 80 s on 2 CPU cores, cold): the suite's test of torch.compile's code
    generation (inductor's C++ kernels) on a step; the others trace with the "eager" or
    "aot_eager" backends, which run the captured graphs as they are.

    The composition of the design's example, compiled: checkpoint and accumulate inside, over
    an uneven split (9 rows: micro-batches of 5 and 4, so the micro-batch compiles twice in the
    first call, the second time with a dynamic batch dimension). Dropout is off because inductor
    draws its own random numbers (compiled dropout is not eager's).
    """
    model = tiny_gpt(bias=False, n_layer=1)
    schedule = ft.optim.warmup_cosine(1e-2, warmup_steps=2, decay_steps=6)
    opt = ft.optim.sgd(schedule, momentum=0.9)
    state = ft.TrainState.create(ft.params_of(model), opt)
    eager = ft.checkpoint(ft.accumulate(ft.train_step(lm_loss(model), opt), 2))
    compiled = ft.compile(eager)
    batches = [lm_batch(9, seed=i, lengths=UNEVEN) for i in range(5)]

    # Calls 2..5 walk the schedule through warmup into the cosine: new lr values, same graphs.
    # The blocks hold scaled_dot_product_attention, which torch's compiler will not recompute
    # inside the one forward-backward graph: the backward is compiled apart, and it says so.
    # (Only where dynamo traces the whole step: torch 2.11 breaks the graph before the backward.)
    warns = pytest.warns(UserWarning, match="compiling the backward apart")
    with warns if dynamo.traces_whole_steps() else contextlib.nullcontext():
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
        lambda s: ft.autocast(s, torch.bfloat16),
        lambda s: ft.autocast(s, torch.float16),
        lambda s: ft.ema(ft.autocast(s, torch.bfloat16)),  # ema's average: eager, outside
    ],
    ids=["plain", "bf16", "fp16", "ema+bf16"],
)
@pytest.mark.usefixtures("whole_step_graphs")
def test_compile_captures_the_whole_step_as_one_graph(transform):
    """Forward, torch.autograd.grad, the count division, clipping norm and the optimizer update
    in one dynamo graph: nothing between the phases runs eagerly. (ema's average is an eager
    wrap, outside the compiled function, wherever ema was applied.)"""
    _, step, state = gpt_step(n_layer=1)
    graph = assert_one_graph(transform(step), state, lm_batch(8, lengths=UNEVEN))
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert torch.autograd.grad in targets  # the backward is inside
    assert targets & {torch._foreach_add, torch._foreach_add_}  # and so is the update (p + u)
    # the setting that lets dynamo trace autograd.grad is scoped to the compiled call
    assert torch._dynamo.config.trace_autograd_ops is False


def _traced(build, state, batches):
    """``build(ft.compile)`` compiled with a backend that records dynamo's graphs and runs them
    as traced (no code generation), over ``batches`` with no recompile after the first call.
    Returns the graphs, the final state and the metrics of the last call."""
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = build(lambda s: ft.compile(s, backend=record))
    final, history = assert_no_recompile(compiled, state, batches)
    return graphs, final, history[-1]


def _targets(graph: torch.fx.GraphModule) -> set:
    return {n.target for n in graph.graph.nodes if n.op == "call_function"}


@pytest.mark.usefixtures("whole_step_graphs")
def test_accumulate_compiles_one_micro_batch_whatever_their_number():
    """Under ft.accumulate, ft.compile traces one micro-batch's forward and backward (a graph
    with torch.autograd.grad) and the update (a graph with the optimizer's p + u), once each:
    the same graphs for 2 micro-batches as for 4, so the compile does not grow with k. The
    uneven split (10 rows in 4: 3, 3, 2, 2) traces the micro-batch once more in the first call,
    with a dynamic batch dimension, and nothing after. Each equals the eager step."""
    _, step, state = gpt_step(n_layer=1)
    nodes = {}
    for rows, k in ((8, 2), (10, 4)):
        batches = [lm_batch(rows, seed=i, lengths=UNEVEN) for i in range(2)]
        graphs, final, _ = _traced(lambda c, k=k: c(ft.accumulate(step, k)), state, batches)
        nodes[k] = [len(g.graph.nodes) for g in graphs]
        assert torch.autograd.grad in _targets(graphs[0])  # a micro-batch
        assert torch.autograd.grad not in _targets(graphs[-1])  # the update
        assert _targets(graphs[-1]) & {torch._foreach_add, torch._foreach_add_}
        s = state
        for batch in batches:
            s, _ = ft.accumulate(step, k)(s, batch)
        for a, b in zip(ft.tree.leaves(final.params), ft.tree.leaves(s.params)):
            assert max_rel_error(a, b) < 1e-6
    assert len(nodes[2]) == 2 and len(nodes[4]) == 3, nodes  # 4: static, dynamic, update
    assert nodes[2] == [nodes[4][0], nodes[4][-1]], nodes  # the same micro-batch and update


@pytest.mark.usefixtures("whole_step_graphs")
def test_the_looped_micro_batches_compose_with_fp16_checkpoint_and_ema():
    """fp16 loss scaling (the scale read in each micro-batch, the skip decided in the update),
    checkpointed blocks and ema run with the two looped graphs and equal the eager step, metrics
    included; ema applied before compile too (its average is an eager wrap, outside)."""
    _, step, state = gpt_step(n_layer=1)
    batches = [lm_batch(6, seed=i, lengths=UNEVEN) for i in range(2)]

    def build(c):
        return ft.ema(c(ft.autocast(ft.checkpoint(ft.accumulate(step, 2)), torch.float16)))

    graphs, final, metrics = _traced(build, state, batches)
    assert len(graphs) == 2
    before, _, _ = _traced(
        lambda c: c(ft.ema(ft.autocast(ft.checkpoint(ft.accumulate(step, 2)), torch.float16))),
        state,
        batches,
    )
    assert len(before) == 2  # the same two graphs with ema applied before compile
    eager = build(lambda s: s)
    s = state
    for batch in batches:
        s, m = eager(s, batch)
    assert metrics.keys() == m.keys() >= {"skipped", "loss_scale"}
    for key in m:
        assert max_rel_error(metrics[key], m[key]) < 1e-6, key
    for a, b in zip(ft.tree.leaves(final), ft.tree.leaves(s)):
        assert max_rel_error(a.float(), b.float()) < 1e-6


@pytest.mark.parametrize("policy", ["blocks", "selective"])
@pytest.mark.usefixtures("whole_step_graphs")
def test_a_checkpointed_step_is_one_graph_with_a_checkpointed_region_per_block(policy):
    """ft.compile(ft.checkpoint(step)) is one graph: each block a checkpointed region (the
    higher-order op AOT autograd recomputes in backward), the backward and update inside."""
    step, state, _ = chain_step(2)
    graph = assert_one_graph(ft.checkpoint(step, policy), state, torch.randn(8, 16))
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    regions = [t for t in targets if t is torch.ops.higher_order.tag_activation_checkpoint]
    assert len(regions) == 2
    assert torch.autograd.grad in targets


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["blocks", "selective"])
def test_checkpoint_traces_without_recompiles(policy):
    """Dynamo traces checkpointed blocks in one graph, the same on every call (the "eager"
    backend: tracing and guards only, no code generation, a few seconds)."""
    torch._dynamo.reset()
    _, step, state = gpt_step(n_layer=1)
    step = ft.checkpoint(step, policy)
    batches = [lm_batch(8, seed=i, lengths=UNEVEN) for i in range(3)]
    final, _ = assert_no_recompile(ft.compile(step, backend="eager"), state, batches)
    s = state
    for batch in batches:
        s, _ = step(s, batch)
    for a, b in zip(ft.tree.leaves(final.params), ft.tree.leaves(s.params)):
        assert max_rel_error(a, b) < 1e-6


def test_where_dynamo_cannot_trace_the_whole_step_the_backward_is_compiled_apart(monkeypatch):
    """On a torch whose dynamo cannot capture the step as one graph (torch 2.11), ft.compile
    compiles the backward apart from the first call: no graph holds torch.autograd.grad (AOT
    autograd partitions forward and backward, as torch.compile of a module), nothing is said,
    and the result is the eager step's."""
    import importlib
    import warnings

    module = importlib.import_module("ftrain.transforms.compile")  # the package exports compile()
    monkeypatch.setattr(module, "traces_whole_steps", lambda: False)
    step, state, _ = chain_step(2)
    batches = [torch.randn(8, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        graphs, final, _ = _traced(lambda compile: compile(step), state, batches)
    assert not [w for w in said if "ft.compile" in str(w.message)]
    assert len(graphs) >= 2 and not any(torch.autograd.grad in _targets(g) for g in graphs)
    s = state
    for batch in batches:
        s, _ = step(s, batch)
    for a, b in zip(ft.tree.leaves(final.params), ft.tree.leaves(s.params)):
        assert max_rel_error(a, b) < 1e-6


def test_compile_twice_is_refused():
    _, step, _ = gpt_step()
    with pytest.raises(ValueError, match=r"ft\.compile was applied twice.*apply it once"):
        ft.compile(ft.compile(step))


def test_what_is_applied_after_compile_is_compiled_too():
    """Compile's place among the transforms changes nothing: accumulate, checkpoint and autocast
    applied after it act inside the compiled function (dynamo compiles new frames for them) and
    give the result of the same transforms applied before it."""
    from ftrain.internals import dynamo

    _, step, state = gpt_step(n_layer=1)
    batch = lm_batch(8)
    for transform in (
        lambda s: ft.accumulate(s, 2),
        lambda s: ft.checkpoint(s),
        lambda s: ft.autocast(s, torch.bfloat16),
    ):
        torch._dynamo.reset()
        before = dynamo.frames_compiled()
        after_compile, _ = transform(ft.compile(step, backend="eager"))(state, batch)
        assert dynamo.frames_compiled() > before
        eager, _ = transform(step)(state, batch)
        for a, b in zip(ft.tree.leaves(after_compile.params), ft.tree.leaves(eager.params)):
            assert max_rel_error(a, b) < 1e-6


def test_wrap_only_transforms_after_compile_are_allowed():
    _, step, _ = gpt_step()
    assert ft.ema(ft.compile(step)).names == ("compile", "ema")
    assert ft.wrap(ft.compile(step), lambda fn: fn).names == ("compile", "wrap")
