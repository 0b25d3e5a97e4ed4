"""ft.autocast (ftrain.transforms.autocast): bf16/fp16 results close to fp32, fp16 loss scaling
that skips non-finite steps and lives in the state, TF32 for the step only; argument checks."""

import pytest
import torch

import ftrain as ft
from ftrain.testing import max_rel_error
from ftrain.transforms import DynamicLossScale

from _tiny import UNEVEN, gpt_step, lm_batch, lm_loss, tiny_gpt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_close_to_fp32(dtype):
    """The tolerance documented in ``ft.autocast``: loss within 1e-2 and gradients within 3e-2
    relative (max-norm per tensor) of fp32 on small models. Measured here: bf16 about 8e-3 on
    the gradients, fp16 about 1e-3."""
    _, step, state = gpt_step()
    batch = lm_batch(16, lengths=UNEVEN)
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
    _, step, state = gpt_step(opt=ft.optim.adamw(1e-3))
    step = ft.autocast(step, torch.float16, loss_scale=DynamicLossScale(init_scale=2.0**100))
    new, metrics = step(state, lm_batch(8, lengths=UNEVEN))
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
    _, step, state = gpt_step()
    step = ft.autocast(step, torch.float16, loss_scale=1e30)
    s = state
    for _ in range(2):
        s, metrics = step(s, lm_batch(8, lengths=UNEVEN))
        assert bool(metrics["skipped"])
        assert float(s.extra["loss_scale", "scale"]) == pytest.approx(1e30)
    for a, b in zip(ft.tree.leaves(s.params), ft.tree.leaves(state.params)):
        assert torch.equal(a, b)


def test_dynamic_scale_grows_after_growth_interval():
    _, step, state = gpt_step()
    scaler = DynamicLossScale(init_scale=2.0**10, growth_interval=2)
    step = ft.autocast(step, torch.float16, loss_scale=scaler)
    scales = []
    for _ in range(3):
        state, metrics = step(state, lm_batch(8, lengths=UNEVEN))
        assert not metrics["skipped"]
        scales.append(float(state.extra["loss_scale", "scale"]))
    assert scales == [2.0**10, 2.0**11, 2.0**11]


def test_tf32_is_set_for_the_step_only():
    seen = []
    model = tiny_gpt()

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


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "bf16"])
def test_autocast_unsupported_dtype_lists_the_legal_ones(dtype):
    _, step, _ = gpt_step()
    with pytest.raises(ValueError, match=r"torch\.bfloat16, torch\.float16 and torch\.float32"):
        ft.autocast(step, dtype)


def test_autocast_loss_scale_arguments_are_checked():
    _, step, _ = gpt_step()
    with pytest.raises(ValueError, match=r"loss_scale=-1.0\): must be > 0"):
        ft.autocast(step, torch.float16, loss_scale=-1.0)
    with pytest.raises(ValueError, match=r"loss_scale='static'\): use 'dynamic', a positive"):
        ft.autocast(step, torch.float16, loss_scale="static")
    with pytest.raises(ValueError, match=r"only applies to torch.float16; bf16 needs no"):
        ft.autocast(step, torch.bfloat16, loss_scale=1024.0)
    with pytest.raises(TypeError, match=r"tf32='yes'\): expected a bool"):
        ft.autocast(step, tf32="yes")
