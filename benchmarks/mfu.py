"""Model FLOP utilization of the default GPT's training step, eager and compiled, against this
machine's measured float32 matmul peak, with the imperative PyTorch step (eager and compiled)
beside it, and where the rest of the time goes.

    python benchmarks/mfu.py            # writes the "MFU" section of benchmarks/RESULTS.md

MFU = (training FLOPs per token x tokens per second) / peak FLOP/s, where FLOPs per token is the
6N + 12LdT estimate (ftrain.models.flops_per_token) and the peak is the best float32 matmul rate
measured here on large square matrices, through both matmul libraries in the torch wheel: MKL
(what ``torch.mm`` calls) and oneDNN (what ``ftrain.models.Linear`` calls). On AMD processors MKL
takes a slow path, so a peak from ``torch.mm`` alone can be half of what the machine does; the
higher of the two is the peak. The matmuls are timed before, after and between the steps, so that
a busy machine slows both sides of the ratio alike.

The breakdown times, in isolation and in the same interleaved run, the two kinds of work the FLOP
count is made of: every matmul of the step at its real shape (forward, input gradient and weight
gradient of each linear layer, through the model's own ``linear``) and the attention kernel
(forward + backward). Their sum is the step time if everything else (LayerNorm, GELU, residual
adds, loss, optimizer, framework) were free, so ``FLOPs / (matmuls + attention) / peak`` is the MFU
this model can reach with these kernels on this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.nn.functional as F
from _common import interleaved, machine, write_section

import ftrain as ft
from ftrain.app.config import TrainConfig
from ftrain.app.recipes.gpt import build_model, build_optimizer, make_loss_fn
from ftrain.models import GPT, flops_per_token, linear, onednn_linear_available

TARGET = 0.75
SIZES = (1024, 2048, 3072)


def _mkl(a, b):
    return a @ b


def _onednn(a, b):
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # a @ b.T


LIBRARIES = {"MKL (torch.mm)": _mkl}
if onednn_linear_available():
    LIBRARIES["oneDNN"] = _onednn


def matmul_peaks(seconds=1.0) -> dict[str, float]:
    """Best float32 FLOP/s of each library over square matrices of ``SIZES``."""
    best = dict.fromkeys(LIBRARIES, 0.0)
    for n in SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for name, mm in LIBRARIES.items():
            mm(a, b)
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                mm(a, b)
                reps += 1
            best[name] = max(best[name], 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


@contextlib.contextmanager
def onednn(enabled: bool):
    """Switch PyTorch's oneDNN off (``linear`` then takes F.linear, i.e. MKL) and back."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def matmuls_of(model: GPT, tokens: int):
    """A function running every matmul of one training step of ``model`` at its real shape, as the
    model runs them: ``linear`` forward, then the gradients of its input and weight."""
    shapes = [(m.out_features, m.in_features, m.bias is not None)
              for m in model.modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
    if model.lm_head is None:  # tied head: linear(x, wte.weight)
        shapes.append((*model.wte.weight.shape, False))
    ops = []
    for n_out, n_in, bias in shapes:
        x = torch.randn(tokens, n_in, requires_grad=True)
        w = torch.randn(n_out, n_in, requires_grad=True)
        b = torch.randn(n_out, requires_grad=True) if bias else None
        ops.append((x, w, b, torch.randn(tokens, n_out)))

    def run():
        for x, w, b, dy in ops:
            inputs = [x, w] if b is None else [x, w, b]
            torch.autograd.grad(linear(x, w, b), inputs, dy)

    return run


def attention_of(cfg: TrainConfig):
    """A function running the step's attention kernels (forward + backward, every layer)."""
    hs = cfg.d_model // cfg.n_head
    q, k, v = (torch.randn(cfg.batch_size, cfg.n_head, cfg.seq_len, hs, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dy = torch.randn(cfg.batch_size, cfg.n_head, cfg.seq_len, hs)

    def run():
        for _ in range(cfg.n_layer):
            torch.autograd.grad(
                F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), dy
            )

    return run


def width_sweep(cfg: TrainConfig, widths=(128, 256, 512), repeats=5) -> list[tuple]:
    """MFU of the eager ftrain step as the model widens (heads of 64, same depth, sequence and
    batch), each step timed between oneDNN peak matmuls: (d, params, ms, MFU, peak)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    mm = LIBRARIES.get("oneDNN", _mkl)
    rows = []
    for d in widths:
        wide = dataclasses.replace(cfg, d_model=d, n_head=d // 64)
        model, opt = build_model(wide), build_optimizer(wide)
        g = torch.Generator().manual_seed(0)
        toks = torch.randint(0, 257, (wide.batch_size, wide.seq_len + 1), generator=g)
        batch = {"input": toks[:, :-1], "target": toks[:, 1:]}
        state = {"s": ft.TrainState.create(ft.params_of(model), opt, seed=0)}
        step = ft.train_step(make_loss_fn(model), opt, donate=True)

        def run(step=step, state=state, batch=batch):
            state["s"], _ = step(state["s"], batch)

        def peak():
            for _ in range(4):
                mm(a, b)

        t = interleaved({"step": run, "peak": peak}, repeats=repeats)
        flops = flops_per_token(model.config) * wide.batch_size * wide.seq_len
        p = 4 * 2 * 2048**3 / t["peak"]
        rows.append(
            (d, sum(x.numel() for x in model.parameters()), t["step"], flops / t["step"] / p, p)
        )
    return rows


def main() -> None:
    cfg = TrainConfig()  # the defaults of `ftrain train`
    model = build_model(cfg)
    opt = build_optimizer(cfg)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 257, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    batch = {"input": toks[:, :-1], "target": toks[:, 1:]}
    tokens = cfg.batch_size * cfg.seq_len

    # The same width, depth and FLOPs in narrower heads (32 channels) with biases, on MKL
    # matmuls: what the default's 64-channel heads without biases on oneDNN are compared with.
    torch.manual_seed(cfg.seed)
    narrow = GPT(dataclasses.replace(model.config, n_head=cfg.d_model // 32, bias=True))
    assert flops_per_token(narrow.config) == flops_per_token(model.config)
    narrow_key = f"ftrain, d={cfg.d_model}, {narrow.config.n_head} heads of 32, biases, MKL"

    def ftrain_step_fn(compiled: bool = False, model: GPT = model, use_onednn: bool = True):
        state = {"s": ft.TrainState.create(ft.params_of(model), opt, seed=0)}
        step = ft.train_step(make_loss_fn(model), opt, donate=True)
        if compiled:
            step = ft.compile(step)

        def run():
            with onednn(use_onednn):
                state["s"], _ = step(state["s"], batch)

        return run

    def torch_step_fn(compiled: bool):
        """The imperative step on the same model; compiled as PyTorch's guides do it:
        torch.compile(model) for forward and backward, and clipping + optimizer step in a
        compiled function."""
        ref = build_model(cfg)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                    foreach=True)  # fmt: skip
        forward = torch.compile(ref) if compiled else ref

        def update():
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip_grad)
            ref_opt.step()

        update = torch.compile(update) if compiled else update

        def run():
            logits = forward(batch["input"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())
            ref_opt.zero_grad(set_to_none=True)
            loss.backward()
            update()

        return run

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak_fns = {
        name: (lambda mm=mm: [mm(a, b) for _ in range(4)]) for name, mm in LIBRARIES.items()
    }
    steps = {
        "ftrain": ftrain_step_fn(),
        "ftrain + ft.compile": ftrain_step_fn(compiled=True),
        "torch": torch_step_fn(compiled=False),
        "torch + torch.compile": torch_step_fn(compiled=True),
        "ftrain, MKL matmuls": ftrain_step_fn(use_onednn=False),
        narrow_key: ftrain_step_fn(model=narrow, use_onednn=False),
    }
    fns = {
        **steps,
        "matmuls alone": matmuls_of(model, tokens),
        "attention alone": attention_of(cfg),
        **{f"peak {k}": f for k, f in peak_fns.items()},
    }
    compile_s = {}
    for k in ("ftrain + ft.compile", "torch + torch.compile"):
        t0 = time.perf_counter()
        fns[k]()
        compile_s[k] = time.perf_counter() - t0

    peaks = matmul_peaks()
    t = interleaved(fns, repeats=25)
    after = matmul_peaks()
    for k in LIBRARIES:  # the best seen, before, after or between the steps
        peaks[k] = max(peaks[k], after[k], 4 * 2 * 2048**3 / t[f"peak {k}"])
    best_lib = max(peaks, key=peaks.get)
    peak = peaks[best_lib]
    fpt = flops_per_token(model.config)
    flops = fpt * tokens
    attn_flops = 12 * cfg.n_layer * cfg.d_model * cfg.seq_len * tokens
    mm_flops = flops - attn_flops

    rows = []
    for k in steps:
        achieved = flops / t[k]
        rows.append(f"| {k} | {t[k] * 1e3:.1f} | {tokens / t[k]:.0f} | {achieved / 1e9:.1f} | "
                    f"{achieved / peak:.2f} |")  # fmt: skip
    mfu = {k: flops / t[k] / peak for k in steps}
    best = max(mfu["ftrain"], mfu["ftrain + ft.compile"])
    t_mm, t_attn = t["matmuls alone"], t["attention alone"]
    ceiling = flops / (t_mm + t_attn) / peak
    rest = t["ftrain"] - t_mm - t_attn
    share = lambda x: f"{x / t['ftrain']:.0%}"  # noqa: E731
    met = "met" if best >= TARGET else "**not met**"
    hs = cfg.d_model // cfg.n_head
    peak_list = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items())
    body = f"""`python benchmarks/mfu.py` on {machine()}.

Default `ftrain train` model: d={cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads of {hs},
{"biases" if cfg.bias else "no biases"}, seq {cfg.seq_len}, batch {cfg.batch_size}, fp32, AdamW +
clipping. FLOPs per token (6N + 12LdT): {fpt / 1e6:.2f} M. Float32 matmul peak, measured (best of
{"/".join(map(str, SIZES))}-square matmuls, before, after and between the steps), GFLOP/s:
{peak_list}. MFU is against the higher, **{peak / 1e9:.0f} GFLOP/s** ({best_lib}).

| step | ms | tokens/s | GFLOP/s | MFU |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

MFU of the ftrain step: **{mfu["ftrain + ft.compile"]:.2f}** compiled, **{mfu["ftrain"]:.2f}** eager
(target ≥ {TARGET}: {met}). Against the MKL peak alone ({peaks["MKL (torch.mm)"] / 1e9:.0f}
GFLOP/s) the same steps would read {mfu["ftrain + ft.compile"] * peak / peaks["MKL (torch.mm)"]:.2f}
and {mfu["ftrain"] * peak / peaks["MKL (torch.mm)"]:.2f}: a peak that the step's own matmuls beat.

The default step takes {t["ftrain"] / t[narrow_key]:.2f}x the time of the last row's (the same FLOPs
in {narrow.config.n_head} heads of 32 with biases, on MKL matmuls), {t["ftrain + ft.compile"] / t[narrow_key]:.2f}x
compiled. Step time ftrain / torch on the same model: {t["ftrain"] / t["torch"]:.3f} eager,
{t["ftrain + ft.compile"] / t["torch + torch.compile"]:.3f} compiled. `ft.compile` traces the whole
step (forward, `autograd.grad`, update) as one graph; the torch row compiles the model and the
optimizer step separately, with the backward in between. First call: ft.compile
{compile_s["ftrain + ft.compile"]:.0f} s, torch.compile {compile_s["torch + torch.compile"]:.0f} s.

Where the eager ftrain step's time goes (the first two timed alone, in the same interleaved run):

| part | ms | share of the step | GFLOP/s | of peak |
| --- | ---: | ---: | ---: | ---: |
| every matmul of the step at its real shape | {t_mm * 1e3:.1f} | {share(t_mm)} | {mm_flops / t_mm / 1e9:.1f} | {mm_flops / t_mm / peak:.2f} |
| attention kernel, forward + backward | {t_attn * 1e3:.1f} | {share(t_attn)} | {attn_flops / t_attn / 1e9:.1f} | {attn_flops / t_attn / peak:.2f} |
| everything else (norms, GELU, adds, loss, optimizer, framework) | {rest * 1e3:.1f} | {share(rest)} | | |

If everything else took no time at all, the step would reach MFU **{ceiling:.2f}** = FLOPs /
(matmuls + attention) / peak: the ceiling for this model with these kernels on this machine
({"below" if ceiling < TARGET else "above"} the target). The CPU attention kernel (head size {hs}, T={cfg.seq_len}) runs its counted FLOPs at a
fraction of the matmul rate (its inner products are small, and it calls MKL), and at d={cfg.d_model}
the pointwise work (GELU, LayerNorm, residual adds, loss, optimizer), which eager PyTorch runs as one
pass over memory per op and inductor fuses, is large next to the matmuls.
"""
    sweep = width_sweep(cfg)
    sweep_rows = "\n".join(
        f"| {d} | {n / 1e6:.2f} M | {ms * 1e3:.0f} | {m:.2f} |" for d, n, ms, m, _ in sweep
    )
    body += f"""
The same step as the model widens (eager, heads of 64, {cfg.n_layer} layers, seq {cfg.seq_len},
batch {cfg.batch_size}; each step timed between 2048-square oneDNN matmuls, MFU against those):
wider matmuls run nearer the peak and attention and pointwise work weigh less.

| d_model | params | ms per step | MFU |
| ---: | ---: | ---: | ---: |
{sweep_rows}
"""
    print(body)
    write_section("MFU", body)


if __name__ == "__main__":
    main()
