"""ftrain.step.engine: the default gradient engine (AutogradEngine) gives the gradient of the summed
loss totals over micro-batches, whatever autograd hands back (shared or broadcast gradient
tensors, unused parameters) and whatever the loss's precision (fp16 loss scale, bf16 means)."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict

import ftrain as ft
from ftrain import optim, testing
from ftrain.step import AutogradEngine, backward_plan
from ftrain.step.engine import exclusive, nonzero


def linear_forward(seen=None, low_mean=False):
    """A step's forward for ``y = x @ w + b`` (``u`` unused): a squared-error Loss per piece.
    ``seen`` records the piece's ``BackwardPlan.reweight`` (captured in the forward, as fsdp does)
    when its gradient flows back; ``low_mean`` says the loss was a low-precision mean."""

    def forward(params, piece):
        x, weight = piece
        h = x @ params["w"]
        plan = backward_plan()
        if seen is not None:
            h.register_hook(lambda g: seen.append(plan.reweight))
        per_row = (h + params["b"]).pow(2).sum(-1) * weight
        aux = {"rows": torch.tensor(float(len(x)))}
        return ft.Loss(per_row.sum(), torch.tensor(len(x)), aux), low_mean

    return forward


def params_and_pieces():
    g = torch.Generator().manual_seed(0)
    params = TensorDict(
        {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g), "u": torch.ones(4)},
        [],
    )
    pieces = [(torch.randn(n, 3, generator=g), w) for n, w in ((2, 1.0), (5, 0.5), (1, 3.0))]
    return params, pieces


def test_grads_are_those_of_the_summed_totals_and_sums_add_up():
    params, pieces = params_and_pieces()
    grads, total, count, aux, _ = AutogradEngine()(linear_forward(), params, pieces, None)

    w, b = params["w"].clone().requires_grad_(), params["b"].clone().requires_grad_()
    totals = [((x @ w + b).pow(2).sum(-1) * weight).sum() for x, weight in pieces]
    want_w, want_b = torch.autograd.grad(sum(totals), (w, b))
    by_key = dict(zip(ft.tree.paths(params), grads))
    torch.testing.assert_close(by_key["w"], want_w)
    torch.testing.assert_close(by_key["b"], want_b)
    assert torch.equal(by_key["u"], torch.zeros(4))  # unused: a zero gradient, not None
    torch.testing.assert_close(total, sum(totals).detach())
    assert int(count) == 8
    torch.testing.assert_close(aux["rows"], torch.tensor(8 / 3))  # equal weight per piece


@pytest.mark.parametrize("scale", [None, 1024.0, 3.0])
def test_a_loss_scale_multiplies_the_grads_and_reweights_during_backward(scale):
    """With a scale the engine backpropagates each piece's mean times the scale and multiplies by
    the count afterwards: the grads are ``scale`` times those of the sum (to rounding), and the
    micro-batch's plan says so while that backward runs."""
    params, pieces = params_and_pieces()
    plain = AutogradEngine()(linear_forward(), params, pieces, None)
    seen = []
    s = None if scale is None else torch.tensor(scale)
    scaled = AutogradEngine()(linear_forward(seen), params, pieces, s)
    factor = 1.0 if scale is None else scale
    for a, b in zip(scaled.grads, plain.grads):
        torch.testing.assert_close(a, b * factor, rtol=1e-6, atol=0)
    assert seen == [scale is not None] * len(pieces)
    assert backward_plan() is None  # only inside the engine's forward


@pytest.mark.parametrize("reduces_in_backward", [False, True])
def test_a_low_precision_mean_is_reweighted_only_where_gradients_stay_local(reduces_in_backward):
    """A bf16/fp16 mean is backpropagated as a mean and reweighted afterwards, unless something
    reduces the gradients across processes during backward (fsdp, which declares
    REDUCES_IN_BACKWARD, so the step builds the engine with ``reduced_in_backward``): then the sum
    is backpropagated. Either way the gradients are those of the summed totals."""
    params, pieces = params_and_pieces()
    plain = AutogradEngine()(linear_forward(), params, pieces, None)
    seen = []
    engine = AutogradEngine(reduced_in_backward=reduces_in_backward)
    got = engine(linear_forward(seen, low_mean=True), params, pieces, None)
    assert seen == [not reduces_in_backward] * len(pieces)
    for a, b in zip(got.grads, plain.grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_nonzero_keeps_counts_and_fractions_and_turns_zero_into_one():
    counts = torch.tensor([0.0, 0.5, 3.0])
    assert torch.equal(nonzero(counts), torch.tensor([1.0, 0.5, 3.0]))
    assert int(nonzero(torch.tensor(0))) == 1


class _SharedGrad(torch.nn.Module):
    """``a`` and ``b`` enter only as ``a + b``: autograd hands both the *same* gradient tensor;
    ``c`` enters as ``c.sum()``: its gradient is a broadcast view (stride 0)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.c = torch.nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x):
        return ((x @ (self.a + self.b).T) ** 2).sum(-1) + self.c.sum()  # (N,) per-row losses


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scale"])
def test_params_sharing_one_gradient_tensor_or_a_broadcast_one_update_correctly(
    micro, donate, fp16
):
    model = _SharedGrad()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def loss_fn(params, batch):
        per_row = ft.apply(model, params, batch)
        return ft.Loss(per_row.sum(), torch.tensor(per_row.numel()))

    opt = optim.sgd(0.01)
    step = ft.train_step(loss_fn, opt, donate=donate)
    if micro > 1:
        step = ft.accumulate(step, micro)
    if fp16:
        step = ft.autocast(step, torch.float16, loss_scale=64.0)  # fp16 matmuls, scaled loss
    state = ft.TrainState.create(ft.params_of(model), opt, seed=0)
    for _ in range(3):
        state, _ = step(state, x)

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(3):
        ref_opt.zero_grad()
        ref(x).mean().backward()
        ref_opt.step()
    # a gradient applied twice (or divided twice) is off by 2x, far outside even fp16's tolerance
    tol = dict(rtol=2e-2, atol=2e-2) if fp16 else dict(rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), **tol)


def test_bf16_mean_loss_gives_the_mean_gradient_whatever_the_row_count():
    # The gradient entering a bf16 loss is O(1): a count of 257 rows is 256 in bf16, and had the
    # step backpropagated mean * 257 every gradient would be scaled by 256/257.
    lin = torch.nn.Linear(3, 1, bias=False)

    def loss_fn(params, x):
        return ft.apply(lin, params, x).pow(2).mean()  # bf16 under autocast

    opt = optim.sgd(1.0)
    x = torch.randn(257, 3, generator=torch.Generator().manual_seed(0))
    state = ft.TrainState.create(ft.params_of(lin), opt)
    new, _ = ft.autocast(ft.train_step(loss_fn, opt), torch.bfloat16)(state, x)
    w = state.params["weight"].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(x, w).pow(2).mean()
    (g,) = torch.autograd.grad(ref, w)
    torch.testing.assert_close(state.params["weight"] - new.params["weight"], g, rtol=1e-4, atol=0)


def test_fp16_mean_loss_over_many_rows_reports_a_finite_loss():
    lin = torch.nn.Linear(4, 1)
    x = 30 * torch.randn(4096, 4, generator=torch.Generator().manual_seed(0))

    def loss_fn(params, x):
        return ft.apply(lin, params, x).pow(2).mean()  # mean * 4096 overflows fp16

    opt = optim.sgd(1e-3)
    state = ft.TrainState.create(ft.params_of(lin), opt)
    _, m16 = ft.autocast(ft.train_step(loss_fn, opt), torch.float16, loss_scale=1.0)(state, x)
    _, m32 = ft.train_step(loss_fn, opt)(state, x)
    assert torch.isfinite(m16["loss"]) and not m16["skipped"]
    torch.testing.assert_close(m16["loss"], m32["loss"], rtol=1e-2, atol=0)


def test_exclusive_accepts_fresh_gradients_and_refuses_shared_or_broadcast_ones():
    model = _SharedGrad()
    leaves = [p.detach().requires_grad_(True) for p in (model.a, model.b, model.c)]
    a, b, c = leaves
    x = torch.randn(8, 4)
    shared = torch.autograd.grad(((x @ (a + b).T) ** 2).sum(), [a, b])
    assert shared[0].untyped_storage().data_ptr() == shared[1].untyped_storage().data_ptr()
    assert not exclusive(shared)
    assert not exclusive(torch.autograd.grad(c.sum(), [c]))  # a stride-0 view of one element
    fresh = torch.autograd.grad(((x @ a.T) ** 2).sum() + (c * c).sum(), [a, c])
    assert exclusive(fresh) and exclusive([fresh[0], None])


def test_a_plain_step_divides_autograds_fresh_gradients_in_place(monkeypatch):
    """No second gradient-sized buffer: a step over a 1 MiB matrix peaks at least one gradient
    lower than the same step made to treat its gradients as shared (divided out of place)."""
    w0 = torch.randn(512, 512)
    x = torch.randn(4, 512)
    opt = optim.sgd(0.1)

    def loss_fn(params, batch):
        return ft.Loss((batch @ params["w"]).square().sum(), torch.tensor(batch.shape[0]))

    def peak() -> int:
        state = ft.TrainState.create(TensorDict({"w": w0.clone()}, []), opt)
        return testing.peak_bytes(ft.train_step(loss_fn, opt, donate=True), state, x)

    in_place = peak()
    monkeypatch.setattr("ftrain.step.engine.exclusive", lambda grads: False)
    assert peak() - in_place >= 0.95 * w0.numel() * 4  # small activations come and go


class _Doubling:
    """A GradientReducer standing in for a sum over two equal ranks: each gradient it is handed,
    doubled, in a new tensor; it passes each on to ``then`` as soon as it has it."""

    def __init__(self):
        self.taken = []

    def holds(self, params):
        return True

    def laid_out(self, params):
        return list(params)

    def start(self, params, then):
        reducer, out = self, [None] * len(params)

        class Backward:
            def take(self, i, grad):
                reducer.taken.append(i)
                out[i] = grad * 2
                if then is not None:
                    then.take(i, out[i])

            def result(self, n):
                return out if then is None else then.result(n)

        return Backward()


class _Keeping:
    """A GradientSink keeping what it is handed."""

    def __init__(self):
        self.got = {}

    def holds(self, params):
        return True

    def take(self, i, grad):
        self.got[i] = grad.clone()

    def result(self, n):
        return [self.got[i] for i in range(n)]


@pytest.mark.parametrize("sink_first", [False, True])
def test_a_reducer_gets_each_final_gradient_in_the_last_backward_and_feeds_the_sink(sink_first):
    """The engine's returned gradients are the reducer's (its own, owned by the step), a sink
    given before or after the reducer gets the reduced ones; every param is handed over once, in
    the last backward only, a reweighted one (a loss scale) too."""
    params, pieces = params_and_pieces()
    plain = AutogradEngine(reduced_after=True)
    want = plain(linear_forward(), params, pieces, None).grads
    reducer, sink = _Doubling(), _Keeping()
    if sink_first:  # ft.shard(ft.offload(step)): offload's engine hook runs first
        both = plain.handing_over(sink).reducing(reducer)
    else:
        both = plain.reducing(reducer).handing_over(sink)
    assert both.adds_sink_to(plain) and not plain.adds_sink_to(both)
    alone = plain.reducing(_Doubling())
    out = alone(linear_forward(), params, pieces, None)
    assert out.owned and all(torch.equal(g, 2 * w) for g, w in zip(out.grads, want))
    got = both(linear_forward(), params, pieces, None)
    assert sorted(reducer.taken) == [0, 1, 2] and not got.owned  # the sink's buffers
    assert all(torch.equal(g, 2 * w) for g, w in zip(got.grads, want))
    scaled = both(linear_forward(), params, pieces, torch.tensor(4.0))
    assert len(reducer.taken) == 6  # reweighted (a loss scale): times the count as handed over
    assert all(torch.allclose(g, 2 * 4 * w) for g, w in zip(scaled.grads, want))
    unused = _Keeping()  # reduced after backward, no reducer: a sink alone is not used
    plain.handing_over(unused)(linear_forward(), params, pieces, None)
    assert unused.got == {}


class _Reducing(ft.Transform):
    """A transform that reduces in the engine (a :class:`_Doubling` reducer), as ``ft.shard``'s
    buckets do, and whose ``reduce`` hook then leaves the gradients as they are."""

    name = "reducing"

    def engine(self, engine):
        return engine.reducing(_Doubling())

    def reduce(self, grads, sums):
        return grads, sums


class _Yours(ft.Transform):
    """A user's transform with a ``reduce`` hook that hands back new gradients."""

    name = "yours"

    def reduce(self, grads, sums):
        return [g * 1.0 for g in grads], sums


def test_a_step_keeps_the_engines_reducer_only_where_its_reduce_hook_runs_first_and_eagerly():
    """Inside the reducer's transform, your ``reduce`` hook would get reduced gradients and hand
    back new ones, reduced a second time: the engine then reduces nothing in backward. Under
    ``ft.compile`` (a backward per compiled piece, or one left eager on one rank alone) neither
    a reducer nor a sink is used."""
    model = torch.nn.Linear(3, 2)

    def loss_fn(params, batch):
        return ft.Loss(ft.apply(model, params, batch).square().sum(), torch.tensor(1.0))

    step = ft.train_step(loss_fn, optim.sgd(0.1))
    engine = lambda s: s.resolved.gradient_engine  # noqa: E731
    assert engine(_Reducing()(step)).reducer is not None
    assert engine(_Yours()(_Reducing()(step))).reducer is not None  # yours runs after
    assert engine(_Reducing()(_Yours()(step))).reducer is None  # yours would run first
    offloaded = ft.offload(_Reducing()(step), "optimizer+gradients")
    assert engine(offloaded).sink is not None
    compiled = engine(ft.compile(offloaded))
    assert (compiled.sink, compiled.reducer) == (None, None)
