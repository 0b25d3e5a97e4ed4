"""ftrain.models.onednn: F.linear with its CPU float32 matmuls in oneDNN, checked against F.linear
(values and every gradient), on both weight-gradient branches, and shown to step aside where
oneDNN cannot or should not run."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ftrain as ft
from ftrain.models import Linear, linear, onednn, onednn_linear_available
from ftrain.models.onednn import MATMUL_OPS, MIN_MACS, MIN_MACS_WEIGHT_GRAD, faster_linear
from ftrain.testing import assert_steps_close, max_rel_error, saved_activation_bytes

from _tiny import lm_batch, lm_loss, tiny_gpt

# torch.backends.mkldnn.flags() also sets oneDNN's TF32 switch, which warns on a CPU-only build
pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(), reason="no oneDNN linear kernel in this torch build/machine"
)


def took_onednn(y: torch.Tensor) -> bool:
    return type(y.grad_fn).__name__ == "_OneDNNLinearBackward"


def grads_of(fn, x, w, b, dy):
    inputs = [t for t in (x, w, b) if t is not None]
    y = fn(x, w, b)
    return y, torch.autograd.grad(y, inputs, dy)


@needs_onednn
@pytest.mark.parametrize(
    "x_shape, n_out, bias",
    [
        ((2048, 128), 384, False),  # wide out: weight gradient through (x.T, dy.T)
        ((16, 128, 512), 128, True),  # 3-d input, narrow out: through (dy.T, x.T)
        ((256, 64), 128, True),  # large enough for the forward, weight gradient in MKL
    ],
)
def test_linear_equals_f_linear_with_every_gradient(x_shape, n_out, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*x_shape, generator=g, requires_grad=True)
    w = torch.randn(n_out, x_shape[-1], generator=g, requires_grad=True)
    b = torch.randn(n_out, generator=g, requires_grad=True) if bias else None
    dy = torch.randn(*x_shape[:-1], n_out, generator=g)
    y, grads = grads_of(linear, x, w, b, dy)
    y_ref, grads_ref = grads_of(F.linear, x, w, b, dy)
    assert took_onednn(y)
    assert max_rel_error(y, y_ref) < 1e-5
    for got, want in zip(grads, grads_ref):
        assert got.shape == want.shape and got.is_contiguous()
        assert max_rel_error(got, want) < 1e-5
    rows = x.numel() // x.shape[-1]
    assert rows * n_out * x.shape[-1] >= MIN_MACS
    big_weight_grad = rows * n_out * x.shape[-1] >= MIN_MACS_WEIGHT_GRAD
    assert big_weight_grad == (x_shape != (256, 64))  # the three cases cover both branches


@needs_onednn
def test_linear_keeps_f_linear_where_onednn_does_not_apply():
    x, w = torch.randn(2048, 128, requires_grad=True), torch.randn(384, 128, requires_grad=True)
    assert took_onednn(linear(x, w))
    assert not took_onednn(linear(x[:4], w))  # too small to pay for the call
    assert not took_onednn(linear(x.double(), w.double()))  # float32 only
    assert not took_onednn(linear(x.bfloat16(), w.bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's own bf16 matmul
        y = linear(x, w)
    assert y.dtype == torch.bfloat16 and not took_onednn(y)
    with torch.backends.mkldnn.flags(enabled=False):  # PyTorch's switch for oneDNN
        assert not took_onednn(linear(x, w))
    # under torch.func transforms the tensors are wrappers: F.linear, same values
    per_row = torch.func.vmap(lambda r: linear(r, w))(x.detach())
    assert max_rel_error(per_row, F.linear(x, w).detach()) < 1e-6
    ensemble = torch.randn(3, 384, 128)  # vmap over the weights: a model ensemble
    outs = torch.func.vmap(lambda wi: linear(x.detach(), wi))(ensemble)
    assert max_rel_error(outs, torch.einsum("nk,eok->eno", x.detach(), ensemble)) < 1e-5


@needs_onednn
def test_matmul_ops_are_the_ops_the_onednn_path_runs():
    """MATMUL_OPS (what selective checkpointing saves) names every matmul that linear runs on the
    oneDNN path: forward, input gradient and weight gradient, and no aten matmul besides."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(2048, 128, requires_grad=True), torch.randn(384, 128, requires_grad=True)
    with Record() as record:
        linear(x, w).sum().backward()
    assert sum(op in MATMUL_OPS for op in record.ops) == 3
    aten_matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    assert not aten_matmuls & set(record.ops)


def test_linear_is_a_drop_in_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(128, 384)
    mine = Linear(128, 384)
    assert isinstance(mine, nn.Linear)
    assert mine.state_dict().keys() == ref.state_dict().keys()
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(16, 128, 128)
    assert max_rel_error(mine(x), ref(x)) < 1e-6


def test_second_derivative_through_onednn_is_refused():
    x, w = torch.randn(2048, 128, requires_grad=True), torch.randn(384, 128, requires_grad=True)
    y = linear(x, w)
    if not took_onednn(y):
        pytest.skip("F.linear path: second derivatives work there")
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice a function that was marked"):
        gx.sum().backward()


# --- in a training step ---------------------------------------------------------------------------

# 512 tokens of d 64: qkv, fc, proj and the lm head are large enough for oneDNN.
CFG = dict(seq_len=64, d_model=64, n_head=1, bias=False, matmul="onednn")


def gpt_step():
    model = tiny_gpt(**CFG)
    opt = ft.optim.sgd(0.5, momentum=0.9)
    state = ft.TrainState.create(ft.params_of(model), opt)
    assert took_onednn(model.blocks[0].attn.qkv(torch.randn(8, 64, 64)))
    return ft.train_step(lm_loss(model), opt), state, lm_batch(8, seed=1, length=64)


def mkl_only(step):
    """The step with oneDNN switched off: F.linear everywhere, the reference."""

    def run(state, batch):
        with torch.backends.mkldnn.flags(enabled=False):
            return step(state, batch)

    return run


@needs_onednn
def test_gpt_step_with_onednn_matches_the_mkl_step():
    """Three steps with oneDNN matmuls agree with the same steps through F.linear to float32
    rounding. (SGD: Adam would turn the rounding noise of gradients that are near zero into
    full-size updates of either sign.)"""
    step, state, batch = gpt_step()
    assert_steps_close(step, mkl_only(step), state, batch, steps=3, rtol=1e-5, atol=1e-7)


@needs_onednn
def test_onednn_step_is_deterministic():
    """The same state and batch give bitwise the same new state (what --resume relies on)."""
    step, state, batch = gpt_step()
    a, _ = step(state, batch)
    b, _ = step(state, batch)
    for x, y in zip(ft.tree.leaves(a.params), ft.tree.leaves(b.params)):
        assert torch.equal(x, y)


@needs_onednn
@pytest.mark.parametrize("policy", ["blocks", "selective"])
def test_checkpoint_recomputes_the_onednn_matmuls_exactly(policy):
    step, state, batch = gpt_step()
    assert_steps_close(ft.checkpoint(step, policy), step, state, batch, steps=2, rtol=1e-6)


@needs_onednn
def test_selective_checkpoint_saves_the_onednn_matmuls():
    """'selective' keeps matmul outputs for backward: the oneDNN ones too, so it saves as many
    bytes as over F.linear's mm (were they not in SAVE_OPS, it would save about what 'blocks'
    saves and recompute every matmul)."""
    step, state, batch = gpt_step()
    selective = ft.checkpoint(step, "selective")
    on = saved_activation_bytes(selective, state, batch)
    with torch.backends.mkldnn.flags(enabled=False):
        off = saved_activation_bytes(selective, state, batch)
    blocks = saved_activation_bytes(ft.checkpoint(step, "blocks"), state, batch)
    assert on == off and on > 2 * blocks


@needs_onednn
@pytest.mark.slow
def test_the_compiled_step_with_onednn_equals_eager():
    """Compiled (AOT autograd), the step whose matmuls are the ftrain::onednn_linear custom op
    equals the eager one."""
    torch._dynamo.reset()
    step, state, batch = gpt_step()
    compiled = ft.compile(step, backend="aot_eager")
    assert_steps_close(compiled, step, state, batch, steps=2, rtol=1e-5, atol=1e-7)


@needs_onednn
@pytest.mark.usefixtures("whole_step_graphs")
def test_the_onednn_op_breaks_no_graph():
    """Under torch.compile the oneDNN matmuls are the ftrain::onednn_linear custom op (inductor's
    lowering of the oneDNN kernel takes only frozen weights), inside the step's one graph."""
    torch._dynamo.reset()
    step, state, batch = gpt_step()
    graph = ft.testing.assert_one_graph(step, state, batch)  # a custom op breaks no graph
    op = torch.ops.ftrain.onednn_linear.default
    assert op in MATMUL_OPS
    calls = [n for m in graph.modules() for n in m.graph.nodes if n.target is op]
    assert len(calls) >= 4  # in the autograd.Function's forward and backward subgraphs


def test_docstring_examples_run():
    import doctest

    import ftrain.models.onednn

    result = doctest.testmod(ftrain.models.onednn)
    assert result.attempted > 0 and result.failed == 0


@needs_onednn
def test_a_compiled_torch_func_transform_keeps_f_linear():
    """Under torch.compile the wrapper check cannot run: inside
    ftrain.internals.func_scope.entered() (what ft.vmap and ft.per_example_grads enter) a compiled
    vmap of grad takes F.linear and equals the eager result; outside the scope the same traced code
    would take the oneDNN path, which vmap cannot batch."""
    from ftrain.internals import func_scope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 128, generator=g)  # 3 members, 64 rows: 1M multiply-adds each
    w = torch.randn(3, 128, 128, generator=g)

    def loss(w_i, x_i):
        return linear(x_i, w_i).square().sum()

    per_member = torch.func.vmap(torch.func.grad(loss))
    want = per_member(w, x)
    with func_scope.entered():
        got = torch.compile(per_member, backend="eager", fullgraph=True)(w, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch._dynamo.reset()


# --- which kernel is faster: timing and its cache -------------------------------------------------

SHAPES = [(64, 192, 2), (64, 256, 2), (256, 64, 2)]  # at 1024 rows: 96M multiply-adds in oneDNN


def test_time_linears_times_both_kernels_and_leaves_the_random_state_alone():
    before = torch.random.get_rng_state()
    seconds = onednn.time_linears([(64, 192, 2), (256, 64, 1)], 256, repeats=2, seconds=0)
    assert set(seconds) == set(onednn.KERNELS)
    assert all(0.0 < s < 10.0 for s in seconds.values()), seconds
    assert torch.equal(torch.random.get_rng_state(), before)
    with torch.inference_mode():  # a model built under inference mode still gets a timing
        seconds = onednn.time_linears([(64, 192, 1)], 64, repeats=1, seconds=0)
        assert set(seconds) == set(onednn.KERNELS)


@pytest.fixture
def quiet(monkeypatch):
    """A machine with its cores free (no other load), whatever else runs beside the tests."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


@needs_onednn
def test_faster_linear_caches_its_answer_per_processor_torch_threads_rows_and_shapes(
    monkeypatch, tmp_path, quiet
):
    timings = []

    def time_linears(shapes, rows, **_):
        timings.append((shapes, rows))
        return {"onednn": 1.0, "torch": 2.0}

    monkeypatch.setattr(onednn, "time_linears", time_linears)
    cache = tmp_path / "kernels.json"
    assert faster_linear(SHAPES, 1024, cache=cache) == "onednn" and len(timings) == 1
    assert faster_linear(list(reversed(SHAPES)), 1024, cache=cache) == "onednn"
    assert len(timings) == 1  # the same shapes in another order: the same key
    assert faster_linear(SHAPES, 2048, cache=cache) == "onednn" and len(timings) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        faster_linear(SHAPES, 1024, cache=cache)
    finally:
        torch.set_num_threads(threads)
    assert len(timings) == 3
    (key, answer), *_ = json.loads(cache.read_text()).items()
    assert answer == {"choice": "onednn", "onednn": 1.0, "torch": 2.0}
    assert torch.__version__ in key and onednn._processor() in key
    cache.write_text("{ half a file")  # damaged: timed again and rewritten, not an error
    assert faster_linear(SHAPES, 1024, cache=cache) == "onednn" and len(timings) == 4
    assert len(json.loads(cache.read_text())) == 1
    faster_linear(SHAPES, 1024, cache=None)  # no cache: always timed
    faster_linear(SHAPES, 1024, cache=None)
    assert len(timings) == 6


@needs_onednn
def test_faster_linear_times_large_models_on_fewer_rows(quiet):
    """A GPT-2-sized head is timed on TIMING_MIN_ROWS rows, not the run's 16k, and answers."""
    shapes = [(768, 2304, 12), (768, 50304, 1)]
    rows_seen = []

    def time_linears(shapes, rows, **_):
        rows_seen.append(rows)
        return {"onednn": 1.0, "torch": 1.0}

    with pytest.MonkeyPatch.context() as m:
        m.setattr(onednn, "time_linears", time_linears)
        assert faster_linear(shapes, 16 * 1024, cache=None) == "torch"  # a tie keeps torch's
    assert rows_seen == [onednn.TIMING_MIN_ROWS]


@pytest.mark.parametrize("rows", [0, -1, 2.0, True])
def test_faster_linear_refuses_bad_rows(rows):
    with pytest.raises(ValueError, match=f"rows={rows!r} must be an int >= 1"):
        faster_linear(SHAPES, rows, cache=None)


def test_kernel_cache_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FTRAIN_CACHE_DIR", str(tmp_path / "a"))
    assert onednn.kernel_cache_path() == tmp_path / "a" / "kernels.json"
    monkeypatch.delenv("FTRAIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert onednn.kernel_cache_path() == tmp_path / "x" / "ftrain" / "kernels.json"


@needs_onednn
def test_a_busy_machine_keeps_torch_untimed_and_uncached_with_several_threads(
    monkeypatch, tmp_path
):
    """With other work on every core, several threads' timing measures the scheduler: 'torch',
    nothing timed or cached; one thread is timed (by its CPU time) whatever the load."""
    timings = []

    def time_linears(shapes, rows, **_):
        timings.append(rows)
        return {"onednn": 1.0, "torch": 2.0}

    monkeypatch.setattr(onednn, "time_linears", time_linears)
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count()), 0.0, 0.0))
    cache = tmp_path / "kernels.json"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert faster_linear(SHAPES, 1024, cache=cache) == "torch"
        assert timings == [] and not cache.exists()
        torch.set_num_threads(1)
        assert faster_linear(SHAPES, 1024, cache=cache) == "onednn" and timings == [1024]
    finally:
        torch.set_num_threads(threads)
