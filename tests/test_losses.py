"""ftrain.losses: cross_entropy and causal_lm as a sum and its count (against torch and Hugging
Face), what a loss function may return (as_loss, row_mean), and the warning for a plain scalar
that a step weights by rows."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ftrain as ft
from ftrain.internals import dynamo
from ftrain.losses import ScalarLossWarning, as_loss, cross_entropy
from ftrain.testing import allocator_peak, assert_no_recompile, assert_steps_close

from _tiny import lm_batch, tiny_gpt


def test_cross_entropy_is_the_sum_over_valid_tokens_and_their_number():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 7, (3, 5), generator=g)
    targets[0, 2:] = -100
    loss = cross_entropy(logits, targets)
    want = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    assert loss.total.dtype == torch.float32  # summed in fp32 whatever the logits' dtype
    torch.testing.assert_close(loss.total, want)
    assert int(loss.count) == 15 - 3
    torch.testing.assert_close(loss.value, want / 12)
    other = torch.where(targets == -100, 6, targets)  # another ignore_index
    loss = cross_entropy(logits, other, ignore_index=6)
    want = F.cross_entropy(
        logits.float().flatten(0, 1), other.flatten(), ignore_index=6, reduction="sum"
    )
    torch.testing.assert_close(loss.total, want)
    assert int(loss.count) == int((other != 6).sum()) < 12
    with pytest.raises(ValueError, match=r"logits \(3, 5, 7\) must be targets \(3, 4\) plus"):
        cross_entropy(logits, targets[:, :4])


def test_cross_entropy_in_the_logits_dtype_sums_bf16_log_probabilities_in_fp32():
    """``fp32=False``: the log-probabilities in bf16 (fp32 inside the softmax kernel), their sum
    in fp32: nll_loss of the bf16 log-softmax upcast gives the same numbers; the gradient comes
    back in bf16 and matches the fp32 loss's to bf16's rounding."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 6, 11, generator=g)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 11, (4, 6), generator=g)
    targets[1, 3:] = -100
    loss = cross_entropy(logits, targets, fp32=False)
    logp = F.log_softmax(logits.detach().flatten(0, 1), dim=-1).float()
    want = F.nll_loss(logp, targets.flatten(), reduction="sum")
    assert loss.total.dtype == torch.float32 and int(loss.count) == 24 - 3
    torch.testing.assert_close(loss.total, want, rtol=1e-6, atol=1e-5)
    exact = cross_entropy(logits, targets).total
    torch.testing.assert_close(loss.total, exact, rtol=2e-2, atol=0)  # bf16: 8 bits of mantissa
    (grad,) = torch.autograd.grad(loss.total, logits)
    (grad32,) = torch.autograd.grad(exact, logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), grad32.float(), rtol=2e-2, atol=1e-2)
    assert torch.all(grad[1, 3:] == 0)  # ignored positions get no gradient


def test_cross_entropy_in_the_logits_dtype_keeps_them_under_cuda_autocast():
    """Under CUDA autocast (its policy applies to fake CUDA tensors: no GPU needed), ``fp32=False``
    computes the log-softmax on the bf16 logits and writes bf16, as ``F.cross_entropy`` does
    (nanoGPT's loss): no fp32 copy of the logits. A log_softmax without a dtype would be cast
    to fp32 there (autocast's fp32 list)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and shapes and shapes[0] == (6, 11):  # whole logits
                seen.append((func.__name__, out.dtype))
            return out

    was, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    with FakeTensorMode():
        logits = torch.empty(2, 3, 11, dtype=torch.bfloat16, device="cuda")
        targets = torch.zeros(2, 3, dtype=torch.long, device="cuda")
        torch.set_autocast_enabled("cuda", True)  # torch.autocast refuses without a GPU
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        try:
            with Ops():
                loss = cross_entropy(logits, targets, fp32=False)
        finally:
            torch.set_autocast_enabled("cuda", was)
            torch.set_autocast_dtype("cuda", dtype)
    assert loss.total.dtype == torch.float32
    assert ("_log_softmax.default", torch.bfloat16) in seen
    assert all(out == torch.bfloat16 for _, out in seen), seen


def test_cross_entropy_in_the_logits_dtype_costs_no_more_memory_than_torchs():
    """``fp32=False``'s forward and backward hold no more memory than ``F.cross_entropy`` on the
    same bf16 logits (nanoGPT's loss), kernels' scratch included: the target's log-probability
    is picked by nll_loss, whose backward writes the bf16 gradient directly (a gather's backward
    scatters into a zeroed buffer, which torch's CPU kernel does through an fp32 copy)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 4096, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 4096, (256,), generator=g)

    def ours():
        torch.autograd.grad(cross_entropy(logits, targets, fp32=False).total, logits)

    def torchs():
        torch.autograd.grad(F.cross_entropy(logits, targets, reduction="sum"), logits)

    ours(), torchs()  # warm: first calls may allocate once-only buffers
    logits_bytes = logits.numel() * logits.element_size()
    assert allocator_peak(ours) <= allocator_peak(torchs) + logits_bytes // 64


def test_a_count_of_zero_gives_a_value_of_zero():
    assert float(ft.Loss(torch.tensor(0.0), torch.tensor(0)).value) == 0.0


def test_as_loss_takes_a_loss_a_scalar_mean_or_a_pair_with_aux():
    batch = {"x": torch.zeros(4, 2), "scale": torch.tensor(2.0)}
    total, count = torch.tensor(6.0), torch.tensor(3)
    assert as_loss(ft.Loss(total, count), batch) == ft.Loss(total, count, {})
    mean = as_loss(torch.tensor(1.5), batch)  # a mean over the 4 rows
    assert (float(mean.total), int(mean.count)) == (6.0, 4)
    acc = torch.tensor(0.5)
    pair = as_loss((ft.Loss(total, count, {"a": acc}), {"b": acc}), batch)
    assert pair.aux == {"a": acc, "b": acc}
    assert as_loss((torch.tensor(1.0), {"b": acc}), batch).aux == {"b": acc}
    assert int(as_loss(ft.Loss(total, 3), batch).count) == 3  # a number becomes a tensor


def test_as_loss_refuses_what_is_not_a_loss_and_says_what_to_return():
    batch = {"x": torch.zeros(4, 2)}
    with pytest.raises(TypeError, match=r"tuple of 3 items; return a Loss, a scalar tensor"):
        as_loss((torch.tensor(1.0), {}, 0), batch)
    with pytest.raises(TypeError, match=r"returned float; return ft\.Loss\(total, count\)"):
        as_loss(1.0, batch)
    with pytest.raises(TypeError, match=r"holds no tensor with a leading batch dimension"):
        as_loss(torch.tensor(1.0), {"scale": torch.tensor(2.0)})
    with pytest.raises(TypeError, match=r"total is torch.int64; it must be floating point"):
        as_loss(ft.Loss(torch.tensor(3), torch.tensor(1)), batch)
    with pytest.raises(ValueError, match=r"count has shape \(2,\); it must be a 0-d tensor"):
        as_loss(ft.Loss(torch.tensor(3.0), torch.ones(2)), batch)


def test_loss_must_be_a_scalar():
    model = tiny_gpt()
    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)

    def per_token(params, batch):
        out = ft.apply(model, params, batch["input"])
        return F.cross_entropy(out.flatten(0, 1), batch["target"].flatten(), reduction="none")

    with pytest.raises(ValueError, match=r"scalar loss, got a tensor of shape \(64,\).*\.mean\(\)"):
        ft.train_step(per_token, opt)(state, lm_batch())


# -- Hugging Face's convention: a tiny GPT-2 on right-padded rows ---------------------------------

T = 16
LENGTHS = [16, 3, 9, 16, 5, 12, 2, 7]  # real tokens per row; the rest is right padding


def hf_model():
    pytest.importorskip("transformers")
    from ftrain.models import tiny_gpt2

    torch.manual_seed(0)
    return tiny_gpt2(n_positions=T, n_embd=32, n_layer=2, n_head=2)


def hf_batch(lengths=LENGTHS, seed=0):
    """Right-padded rows in Hugging Face's form: labels are the input ids, -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(lengths), T), generator=g)
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()  # (B, T)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, 256))  # pad with end-of-document
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def causal_lm_loss(model):
    def loss_fn(params, b):
        out = ft.apply(model, params, b["input_ids"], attention_mask=b["attention_mask"])
        return ft.losses.causal_lm(out.logits, b["labels"])

    return loss_fn


def hf_own_loss(model, declare=False):
    def loss_fn(params, b):
        out = ft.apply(model, params, **b)  # labels given: the model's own mean token loss
        return ft.losses.row_mean(out.loss) if declare else out.loss

    return loss_fn


def hf_setup():
    model = hf_model()
    opt = ft.optim.sgd(0.3, momentum=0.9)
    return model, opt, ft.TrainState.create(ft.params_of(model), opt)


# -- causal_lm ----------------------------------------------------------------------------------


def test_causal_lm_equals_hugging_face_loss_on_an_unpadded_batch():
    model = hf_model()
    b = hf_batch([T] * 4)
    params = ft.params_of(model)
    with torch.no_grad():
        out = ft.apply(model, params, **b)
        loss = ft.losses.causal_lm(out.logits, b["labels"])
    assert isinstance(loss, ft.losses.TokenLoss)
    assert int(loss.count) == 4 * (T - 1)  # the first token of each row is never a target
    torch.testing.assert_close(loss.value, out.loss, rtol=1e-6, atol=0)


def test_causal_lm_counts_the_shifted_targets_of_a_padded_batch():
    model = hf_model()
    b = hf_batch()
    with torch.no_grad():
        out = ft.apply(model, ft.params_of(model), **b)
        loss = ft.losses.causal_lm(out.logits, b["labels"])
    assert int(loss.count) == sum(n - 1 for n in LENGTHS)  # not sum(LENGTHS): one fewer per row
    # the sum, by hand: each real token after the first, predicted from the position before it
    want = sum(
        F.cross_entropy(out.logits[i, : n - 1], b["input_ids"][i, 1:n], reduction="sum")
        for i, n in enumerate(LENGTHS)
    )
    torch.testing.assert_close(loss.total, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss.value, out.loss, rtol=1e-6, atol=0)  # HF's mean agrees


def test_causal_lm_refuses_misaligned_shapes():
    with pytest.raises(ValueError, match="not shifted"):
        ft.losses.causal_lm(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))


def test_causal_lm_under_accumulate_equals_one_big_batch():
    model, opt, state = hf_setup()
    batch = hf_batch()
    step = ft.train_step(causal_lm_loss(model), opt)
    # the micro-batches really hold different numbers of predicted tokens
    counts = [int((y[:, 1:] != -100).sum()) for y in torch.tensor_split(batch["labels"], 4)]
    assert len(set(counts)) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScalarLossWarning)  # an ft.Loss is never warned about
        assert_steps_close(ft.accumulate(step, 4), step, state, batch, steps=3, rtol=1e-5)


# -- a plain scalar under a step that combines pieces --------------------------------------------


def test_scalar_hf_loss_under_accumulate_warns_and_is_not_the_whole_batch():
    model, opt, state = hf_setup()
    batch = hf_batch()
    whole = ft.train_step(causal_lm_loss(model), opt)
    naive = ft.accumulate(ft.train_step(hf_own_loss(model), opt), 4)
    with pytest.warns(ScalarLossWarning) as seen:
        # each micro-batch's token mean weighted by its rows: the gradient-accumulation bug
        with pytest.raises(AssertionError, match="relative error"):
            assert_steps_close(naive, whole, state, batch, steps=1, rtol=1e-5)
    text = str(seen[0].message)
    for part in ("splits each batch into 4 pieces (ft.accumulate)", "mean over the rows",
                 "padded rows", "ft.Loss(total, count)", "ft.losses.causal_lm",
                 "ft.losses.row_mean"):  # fmt: skip
        assert part in text, part
    assert seen[0].filename == __file__  # it points at the loss function
    assert len(seen) == 1  # once per step, not once per micro-batch


def test_row_mean_silences_the_warning_and_equals_the_whole_batch_for_a_per_row_loss():
    """On unpadded rows a token mean is a row mean: declared, it is exact under an uneven split."""
    model, opt, state = hf_setup()
    batch = hf_batch([T] * 10, seed=1)
    step = ft.train_step(hf_own_loss(model, declare=True), opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScalarLossWarning)
        assert_steps_close(ft.accumulate(step, 4), step, state, batch, steps=2, rtol=1e-5)


def linear_mse(rows):
    """A Linear(3, 2) whose loss function returns a plain scalar mean: ``(mse, opt, state, batch)``."""
    model = torch.nn.Linear(3, 2)
    batch = {"x": torch.randn(rows, 3), "y": torch.randn(rows, 2)}

    def mse(params, b):
        return ((ft.apply(model, params, b["x"]) - b["y"]) ** 2).mean()

    opt = ft.optim.sgd(0.1)
    return mse, opt, ft.TrainState.create(ft.params_of(model), opt), batch


def test_the_warning_comes_once_per_step_and_only_where_pieces_are_combined():
    mse, opt, state, batch = linear_mse(6)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ft.train_step(mse, opt)(state, batch)  # one piece: a row mean is exact, nothing to say
        assert not seen
        step = ft.accumulate(ft.train_step(mse, opt), 3)
        step(state, batch)
        step(state, batch)
        assert len(seen) == 1
        ft.accumulate(ft.train_step(mse, opt), 3)(state, batch)  # a new step tells again
        assert len(seen) == 2


class SumAcross(ft.Transform):
    """Sums across processes as ft.shard does (here with nothing to sum with): it declares that
    it adds up the losses of several groups of rows."""

    def capabilities(self):
        return {ft.step.capabilities.COMBINES_ROWS: ""}

    def reduce(self, grads, sums):
        return grads, sums


def test_a_reduce_hook_is_named_and_an_error_filter_stops_before_the_update():
    mse, opt, state, batch = linear_mse(4)
    before = state.params.clone()
    step = SumAcross()(ft.train_step(mse, opt, donate=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScalarLossWarning)
        with pytest.raises(ScalarLossWarning, match=r"sums across processes \(ft.sum_across\)"):
            step(state, batch)
    assert (state.params == before).all()  # raised in the forward: the donated state is intact


def test_row_mean_is_the_plain_scalar_declared():
    """The same numbers as a plain scalar, bf16 means included (the engine reweights them)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    batch = {"x": torch.randn(257, 3, dtype=torch.bfloat16)}  # 257 rows: not a bf16 number

    def plain(params, b):
        return ft.apply(model, params, b["x"]).pow(2).mean()

    def declared(params, b):
        return ft.losses.row_mean(plain(params, b)), {"n": torch.tensor(1.0)}

    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    (a, ma), (b, mb) = (
        ft.train_step(plain, opt)(state, batch),
        ft.train_step(declared, opt)(state, batch),
    )
    assert torch.equal(ma["loss"], mb["loss"]) and int(mb["count"]) == 257
    assert all(
        torch.equal(x, y) for x, y in zip(a.params.values(True, True), b.params.values(True, True))
    )
    with pytest.raises(ValueError, match="0-d tensor"):
        ft.losses.row_mean(torch.zeros(3))


def test_the_warning_under_compile_breaks_no_graph_and_comes_once():
    model = torch.nn.Linear(3, 2)
    batch = {"x": torch.randn(6, 3), "y": torch.randn(6, 2)}

    def mse(params, b):
        return ((ft.apply(model, params, b["x"]) - b["y"]) ** 2).mean()

    opt = ft.optim.sgd(0.1)
    state = ft.TrainState.create(ft.params_of(model), opt)
    step = ft.accumulate(ft.train_step(mse, opt), 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        breaks = dynamo.graph_breaks()
        ft.compile(step, backend="eager")(state, batch)  # a micro-batch graph and the update's
        new = [r for r, n in dynamo.graph_breaks().items() if n > breaks.get(r, 0)]
        # no graph break at the check (torch 2.11 breaks at the leaf copies' requires_grad_, and
        # ft.compile then compiles the backward apart: a break at torch.autograd.grad)
        assert not (new and dynamo.traces_whole_steps()), new
        assert all("requires_grad_" in r or "autograd" in r for r in new), new
        assert len(seen) == 1  # told after the compiled call
        compiled = ft.compile(step, backend="eager")
        assert_no_recompile(compiled, state, [batch] * 3)
        assert len(seen) == 2  # the compiled step is a new step: told once, not per call
    assert all(issubclass(w.category, ScalarLossWarning) for w in seen)
