"""The testing kit checked against expectations worked out by hand, and shown able to fail."""

import pytest
import torch

import ftrain as ft
from ftrain.internals import dynamo
from ftrain.testing import (
    allocator_peak,
    assert_no_recompile,
    assert_one_graph,
    assert_steps_close,
    max_rel_error,
    saved_activation_bytes,
    saved_bytes,
)

from _tiny import Chain, D, H, chain_step

B = 8  # rows; D, H: the width and hidden width of each block


# --- saved_bytes / saved_activation_bytes ------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_saved_bytes_of_a_chain_by_hand(n):
    """Without checkpointing each block keeps relu(fc1 x) and relu(fc2 ...) for backward: n*(H+D)
    floats a row. With "blocks" only each block's output survives (the next block's input, or the
    loss's input): n*D floats a row. Plus the 4-byte loss. Linear growth in n vs. a flat D/(H+D)."""
    step, state, _ = chain_step(n)
    x = torch.randn(B, D)
    assert saved_activation_bytes(step, state, x) == n * B * (H + D) * 4 + 4
    assert saved_activation_bytes(ft.checkpoint(step), state, x) == n * B * D * 4 + 4


def test_saved_activation_bytes_counts_the_first_micro_batch():
    step, state, _ = chain_step(2)
    x = torch.randn(B, D)
    whole = saved_activation_bytes(step, state, x)
    assert saved_activation_bytes(ft.accumulate(step, 4), state, x) == (whole - 4) // 4 + 4


def test_saved_bytes_ignores_tensors_that_existed_before():
    w, x = torch.randn(D, D, requires_grad=True), torch.randn(B, D)

    def forward():
        y = x.view(B, D).t().t() @ w.t()  # views of x and w allocate nothing; y is kept by sum
        return (y * y).sum()

    # Kept: y (B*D floats, saved by the product), and the 0-d result. w.t() and views: nothing.
    assert saved_bytes(forward) == B * D * 4 + 4
    assert saved_bytes(lambda: x.t()) == 0
    with torch.no_grad():
        assert saved_bytes(forward) == 4  # nothing saved for backward, only the result


def test_saved_bytes_sees_autocast_weight_copies():
    w, x = torch.randn(D, D, requires_grad=True), torch.randn(B, D, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w).float().sum()

    # mm keeps the bf16 copies of x and w (2 bytes an entry); the product is not kept; the result.
    assert saved_bytes(forward) == (B * D + D * D) * 2 + 4
    # Only w needs a gradient: mm keeps only the copy of x.
    x.requires_grad_(False)
    assert saved_bytes(forward) == B * D * 2 + 4


def test_saved_activation_bytes_leaves_the_random_state_alone():
    step, state, _ = chain_step(2)
    x = torch.randn(B, D)
    before = torch.random.get_rng_state()
    saved_activation_bytes(ft.checkpoint(step), state, x)
    assert torch.equal(torch.random.get_rng_state(), before)


# --- assert_steps_close ------------------------------------------------------------------------


def test_assert_steps_close_passes_and_leaves_the_state_alone():
    step, state, _ = chain_step(2)
    before = [p.clone() for p in ft.tree.leaves(state.params)]
    x = torch.randn(B, D)
    a, b = assert_steps_close(step, step, state, x, steps=2, rtol=0, atol=0)
    assert int(a.step) == int(b.step) == 2
    assert all(torch.equal(p, q) for p, q in zip(ft.tree.leaves(state.params), before))


def test_assert_steps_close_names_the_worst_key():
    step, state, _ = chain_step(2)

    def nudge(inner):  # a wrong transform: moves one bias a little
        def stepped(state, batch):
            state, metrics = inner(state, batch)
            params = state.params.clone()
            params["blocks", "1", "fc2", "bias"] = params["blocks", "1", "fc2", "bias"] * 1.01
            return state.replace(params=params), metrics

        return stepped

    with pytest.raises(AssertionError) as info:
        assert_steps_close(ft.wrap(step, nudge), step, state, torch.randn(B, D), rtol=1e-3)
    msg = str(info.value)
    assert "after step 1 of 3" in msg
    assert "'params.blocks.1.fc2.bias' has relative error 0.01" in msg
    assert "1 of " in msg


def test_assert_steps_close_judges_an_all_zero_reference_by_atol():
    step, state, _ = chain_step(1)

    def add(eps):  # a zero entry in the state that one side moves by eps
        def stepped(state, batch):
            state, metrics = step(state, batch)
            params = state.params.clone()
            params["zero"] = torch.zeros(3) + eps
            return state.replace(params=params), metrics

        return stepped

    x = torch.randn(B, D)
    assert_steps_close(add(1e-12), add(0.0), state, x, steps=1, rtol=1e-5, atol=1e-8)
    with pytest.raises(AssertionError, match="'params.zero' has relative error inf"):
        assert_steps_close(add(1e-6), add(0.0), state, x, steps=1, rtol=1e-5, atol=1e-8)


def test_assert_steps_close_works_with_donated_steps():
    torch.manual_seed(0)
    model = Chain(2)
    opt = ft.optim.adamw(1e-2)
    state = ft.TrainState.create(ft.params_of(model), opt)
    loss = lambda p, x: ft.apply(model, p, x).pow(2).mean()  # noqa: E731
    donating = ft.train_step(loss, opt, donate=True)
    assert_steps_close(donating, ft.train_step(loss, opt), state, torch.randn(B, D), rtol=1e-6)


def test_max_rel_error():
    e = torch.tensor([1.0, -2.0, 0.0])
    assert max_rel_error(e, e) == 0.0
    assert max_rel_error(e + torch.tensor([0.0, 0.0, 0.02]), e) == pytest.approx(0.01)
    assert max_rel_error(torch.tensor([float("inf")]), torch.tensor([1.0])) == float("inf")
    assert max_rel_error(torch.tensor([float("inf")]), torch.tensor([float("inf")])) == 0.0
    assert max_rel_error(torch.ones(2), torch.zeros(2)) == float("inf")


# --- assert_no_recompile (dynamo's "eager" backend: traces and guards, compiles nothing) -------


@pytest.mark.slow
def test_assert_no_recompile_passes_for_a_steady_step():
    torch._dynamo.reset()
    step, state, _ = chain_step(1)
    compiled = ft.compile(step, backend="eager")
    final, history = assert_no_recompile(compiled, state, [torch.randn(B, D) for _ in range(3)])
    assert int(final.step) == 3 and len(history) == 3


@pytest.mark.slow
def test_assert_no_recompile_catches_a_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Chain(1)
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    calls = []

    def loss_fn(p, x):  # reads a Python number that changes every call: a guard fails
        calls.append(1)
        return ft.apply(model, p, x).pow(2).mean() * len(calls)

    compiled = ft.compile(ft.train_step(loss_fn, opt), backend="eager")
    with pytest.raises(AssertionError, match="call 2 recompiled the step"):
        assert_no_recompile(compiled, state, [torch.randn(B, D) for _ in range(3)])


# --- assert_one_graph -------------------------------------------------------------------------


@pytest.mark.usefixtures("whole_step_graphs")
def test_assert_one_graph_returns_the_graph_of_the_whole_step():
    step, state, _ = chain_step(2)
    before = state.clone()
    graph = assert_one_graph(step, state, torch.randn(B, D))
    ops = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert ops.count(torch._C._nn.linear) == 4  # the forward of both blocks (2 Linears each) ...
    assert torch.autograd.grad in ops  # ... its backward ...
    assert torch._foreach_add in ops  # ... and the update, params + updates
    for a, b in zip(ft.tree.leaves(state.params), ft.tree.leaves(before.params)):
        assert torch.equal(a, b)  # the state passed in is left as it was


@pytest.mark.usefixtures("whole_step_graphs")
def test_assert_one_graph_catches_a_graph_break():
    torch.manual_seed(0)
    model = Chain(1)
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)

    def loss_fn(p, x):
        loss = ft.apply(model, p, x).pow(2).mean()
        torch._dynamo.graph_break()  # e.g. a print or .item() in a user's loss
        return loss

    with pytest.raises(
        AssertionError, match=r"as [2-9] graphs, not 1\. Graph breaks: .*graph_break\(\)"
    ):
        assert_one_graph(ft.train_step(loss_fn, opt), state, torch.randn(B, D))


def test_assert_one_graph_says_when_torch_cannot_trace_a_whole_step(monkeypatch):
    monkeypatch.setattr(dynamo, "traces_whole_steps", lambda: False)
    step, state, _ = chain_step(1)
    with pytest.raises(RuntimeError, match=r"cannot capture a step as one graph.*requires_grad_"):
        assert_one_graph(step, state, torch.randn(B, D))


def test_assert_one_graph_needs_the_step_before_compile():
    step, state, _ = chain_step(1)
    with pytest.raises(TypeError, match=r"pass the step before ft\.compile"):
        assert_one_graph(ft.compile(step, backend="eager"), state, torch.randn(B, D))


def test_assert_no_recompile_needs_a_compiled_step():
    step, state, _ = chain_step(1)
    with pytest.raises(TypeError, match=r"pass ft\.compile\(step\)"):
        assert_no_recompile(step, state, [torch.randn(B, D)] * 2)


def test_allocator_peak_counts_what_is_alive_at_once_scratch_included():
    """Two 1 MiB tensors alive together, then freed: 2 MiB, whatever was allocated before; a
    kernel's own scratch buffer (torch.sort's on a large row) counts though it never reaches
    Python, where the op-level counter sees only the results."""
    mib = 2**20
    before = torch.ones(4 * mib // 4)  # held before: not counted

    def two():
        a = torch.empty(mib // 4)
        b = torch.empty_like(a)
        del a, b

    sizes: list[int] = []
    assert allocator_peak(two, buffers=sizes) == 2 * mib and sizes == [mib, mib]
    x = torch.randn(mib // 4)
    with ft.testing.track_allocations() as ops:
        torch.sort(x)
    assert allocator_peak(lambda: torch.sort(x)) > ops.peak == 3 * mib  # values + int64 indices
    del before
