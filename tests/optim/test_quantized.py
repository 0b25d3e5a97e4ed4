"""adamw8bit (ftrain/optim/quantized.py): block-wise quantized moments keep their relative precision,
take about two bytes a parameter, and train a GPT as AdamW does."""

import math

import pytest
import torch

import ftrain as ft
from ftrain.models import GPT, GPTConfig
from ftrain.optim.quantized import adamw8bit, dequantize_blockwise, quantize_blockwise

from _tiny import lm_loss, tiny_gpt


@pytest.mark.parametrize("signed", [True, False])
def test_blockwise_quantization_keeps_relative_precision(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g) * torch.logspace(-5, 0, 5000)
    if not signed:
        x = x * x
    codes, scales = quantize_blockwise(x, 256, signed=signed)
    assert codes.dtype == (torch.int8 if signed else torch.uint8)
    assert scales.shape == (math.ceil(5000 / 256),)
    y = dequantize_blockwise(codes, scales, x, signed=signed)
    rel = (y - x).abs() / x.abs().clamp_min(1e-30)
    near = x.abs() > 0.1 * scales.repeat_interleave(256)[:5000]  # within a decade of the max
    assert rel[near].max() < 0.05
    assert rel.median() < 0.02  # the non-linear code keeps small values too (linear would not)
    assert torch.equal(
        dequantize_blockwise(*quantize_blockwise(torch.zeros(300)), torch.zeros(300)),
        torch.zeros(300),
    )


def test_adamw8bit_state_is_about_two_bytes_per_param():
    # tensors mostly >= 4096 elements (d_model 128: 128*128 = 16384 per square matrix)
    params = ft.params_of(GPT(GPTConfig(d_model=128, n_layer=2)))
    n = sum(p.numel() for p in params.values(True, True))
    bytes_8bit = ft.optim.state_bytes(adamw8bit(1e-3).init(params)) / n
    bytes_32bit = ft.optim.state_bytes(ft.optim.adamw(1e-3).init(params)) / n
    assert bytes_8bit <= 2.1, bytes_8bit
    assert bytes_32bit >= 8.0


def _stdlib_batches(tmp_path, steps, batch_size=8, seq_len=64):
    from ftrain import data

    files = sorted(data.corpora.python_stdlib())[:60]
    data.build_token_dataset(files, tmp_path / "tok", progress=False)
    ds = data.TokenDataset(tmp_path / "tok", seq_len, seed=0, split="train")
    loader = data.loader(ds, batch_size, seed=0, infinite=True)
    it = iter(loader)
    return [next(it) for _ in range(steps)]


@pytest.mark.slow(reason="200 steps of two GPT runs on real text, about 10 s")
def test_adamw8bit_tracks_adamw_on_a_gpt(tmp_path):
    """200 steps on real text: the 8-bit run's loss stays within 2% of AdamW's (averaged over the
    last 20 steps) and both fall far below the starting loss."""
    steps = 200
    batches = _stdlib_batches(tmp_path, steps)
    model = tiny_gpt(vocab_size=257, seq_len=64, d_model=64)  # byte tokens
    params = ft.params_of(model)
    loss_fn = lm_loss(model)

    curves = {}
    for name, opt in {
        "adamw": ft.optim.adamw(3e-3),
        "adamw8bit": adamw8bit(3e-3, min_8bit_size=1024),
    }.items():
        state = ft.TrainState.create(params, opt)
        step = ft.train_step(loss_fn, opt)
        curve = []
        for b in batches:
            state, m = step(state, b)
            curve.append(float(m["loss"]))
        curves[name] = curve
    tail = {k: sum(v[-20:]) / 20 for k, v in curves.items()}
    assert tail["adamw"] < curves["adamw"][0] - 2.0
    assert abs(tail["adamw8bit"] - tail["adamw"]) / tail["adamw"] < 0.02, tail


def test_adamw8bit_takes_bf16_params_and_keeps_their_dtype():
    g = torch.Generator().manual_seed(0)
    params = ft.params_of(torch.nn.Linear(64, 128)).apply(lambda t: t.to(torch.bfloat16))
    grads = params.apply(lambda t: torch.randn(t.shape, generator=g).to(torch.bfloat16))
    # the fp32 reference: the same optimizer on fp32 copies of the same numbers
    p32, g32 = params.apply(lambda t: t.float()), grads.apply(lambda t: t.float())
    opt = adamw8bit(1e-2, min_8bit_size=1024)  # the weight (8192 elements) is quantized
    state, state32 = opt.init(params), opt.init(p32)
    for _ in range(3):
        updates, state = opt.update(grads, state, params)
        ref, state32 = opt.update(g32, state32, p32)
        for k in ("weight", "bias"):
            assert updates[k].dtype == torch.bfloat16
            torch.testing.assert_close(updates[k].float(), ref[k], rtol=1e-2, atol=1e-4)
